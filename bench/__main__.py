"""`python -m bench …`: the load generator and the benchmark scenarios.

  python -m bench all [--quick]            every scenario (A, B, C, D, G, W, L), then the report
  python -m bench a|as|b|c|d|g|w|h|l [--quick]
                                           one scenario (appends to --run, default a new run;
                                           A includes AS, A's workloads on the shipped
                                           config.json; H, adapter affinity at HAProxy, runs
                                           only so)
  python -m bench l --l-adapters 2,32 --l-mixes uniform --l-arms vllm,fair,fifo --l-rounds 1
                                           a short L (any --l-* option; `all` runs L with
                                           one round unless --l-rounds says otherwise)
  python -m bench b --b-arms gateway,gateway-granian,bare,bare-granian --b-wrk-only
                                           B's wrk windows on both HTTP runners
  python -m bench report [--run NAME]      regenerate bench/README.md and the plots
  python -m bench run --url URL ...        the load generator alone against any server

Results go to bench/results/<run>/ (JSON lines, gitignored); the report to bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from bench.http import Target, client_tls
from bench.load import Workload, run_window
from bench.protocols import PROTOCOLS
from bench.record import RESULTS, Run, git_commit, machine
from bench.stats import summarize

if TYPE_CHECKING:
    from bench.scenarios import Plan


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("all", "a", "as", "b", "c", "d", "g", "w", "h", "l"):
        scenario = sub.add_parser(name, help=f"run scenario {name}")
        scenario.add_argument("--quick", action="store_true", help="tiny windows, for development")
        scenario.add_argument("--run", default=None, help="run name (default: a timestamp)")
        scenario.add_argument("--no-report", action="store_true")
        if name in ("all", "l"):
            _l_args(scenario)
        if name == "b":
            scenario.add_argument(
                "--b-arms", dest="b_arms", type=_names, default=None,
                help="B: arms, comma-separated, of gateway, bare, gateway-tls, bare-tls, "
                "gateway-nometrics, gateway-granian, bare-granian (default: the first five)",
            )
            scenario.add_argument(
                "--b-wrk-only", dest="b_python", action="store_false", default=True,
                help="B: only the wrk windows (no Python-client windows, profiles, batch)",
            )
    report = sub.add_parser("report", help="tables and plots from a run")
    report.add_argument("--run", default=None, help="run name (default: the latest full run)")
    load = sub.add_parser("run", help="the load generator alone")
    _load_args(load)
    return parser.parse_args(argv)


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in _names(text))


L_OPTIONS: dict[str, tuple[str, Callable[[str], Any], str]] = {  # option: (Plan field, type, help)
    "--l-rounds": ("l_rounds", int, "rounds of sessions of every arm"),
    "--l-requests": ("l_requests", int, "requests per window"),
    "--l-concurrency": ("l_concurrency", int, "requests in flight"),
    "--l-adapters": ("l_adapters", _counts, "K values, comma-separated (e.g. 2,8,32,128)"),
    "--l-mixes": ("l_mixes", _names, "uniform,zipf"),
    "--l-arms": ("l_arms", _names,
                 "vllm,slots,strict,spare,fair,fifo (default: vllm,slots,strict,fair)"),
    "--l-zipf-s": ("l_zipf_s", float, "the Zipf exponent"),
    "--l-cycle": ("l_cycle_s", float, "the slots arm's adapterCycleTime, seconds"),
    "--l-limit": ("l_gateway_limit", int, "the gateway arms' maxConcurrentRequests"),
}


def _l_args(parser: argparse.ArgumentParser) -> None:
    for option, (field, kind, text) in L_OPTIONS.items():
        parser.add_argument(option, dest=field, type=kind, default=None, help=f"L: {text}")


def _plan_with_l(plan: Plan, args: argparse.Namespace) -> Plan:
    """The plan with the --l-* options given; `all` runs L's rounds for `all` unless told."""
    given = {field: getattr(args, field, None) for field, _, _ in L_OPTIONS.values()}
    changes = {field: value for field, value in given.items() if value is not None}
    if args.command == "all" and "l_rounds" not in changes:
        changes["l_rounds"] = plan.l_rounds_in_all
    if getattr(args, "b_arms", None):
        changes["b_arms"] = args.b_arms
    if not getattr(args, "b_python", True):
        changes["b_python"] = False
    return dataclasses.replace(plan, **changes)


def _load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="http(s)://127.0.0.1:PORT")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="openai-chat")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--concurrency", type=int, default=16, help="closed loop (or open-loop cap)"
    )
    parser.add_argument("--rate", type=float, default=None, help="open loop: Poisson requests/s")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--duration", type=float, default=60.0, help="hard time bound, seconds")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens (demo tokenizer)")
    parser.add_argument("--model", action="append", default=None, help="repeat: round-robin")
    parser.add_argument("--base", default="tiny", help="served base model name")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--tokenizer-dir", default="build/demo/model")
    parser.add_argument("--cacert", type=Path, default=None)
    parser.add_argument("--cert", type=Path, default=None)
    parser.add_argument("--key", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file to append to")


def load_command(args: argparse.Namespace) -> int:
    from bench.prompts import prompt_set

    tls = client_tls(args.cacert, args.cert, args.key) if args.cacert else None
    target = Target.parse(args.url, tls)
    workload = Workload(
        protocol=args.protocol,
        stream=args.stream,
        max_tokens=args.max_tokens,
        prompts=prompt_set(args.prompt_len, 64, args.tokenizer_dir),
        models=tuple(args.model or [args.base]),
        base=args.base,
        ignore_eos=args.ignore_eos,
        concurrency=args.concurrency,
        rate=args.rate,
        requests=args.requests,
        duration_s=args.duration,
        warmup=args.warmup,
        prompt_len=args.prompt_len,
    )
    window = uvloop.run(run_window(target, workload))
    summary = summarize(window.records, window.duration_s)
    row: dict[str, Any] = {
        "kind": "window",
        "url": args.url,
        "time": window.wall_start,
        "workload": workload.settings(),
        "duration_s": window.duration_s,
        "client_cpu_s": window.client_cpu_s,
        "summary": summary,
        **git_commit(),
        "machine": machine(),
    }
    print(json.dumps({k: row[k] for k in ("workload", "client_cpu_s", "summary")}, indent=1))
    out = args.out or RESULTS / "adhoc" / f"{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as sink:
        sink.write(json.dumps(row) + "\n")
        for record in window.records:
            sink.write(json.dumps({"kind": "request", **dataclasses.asdict(record)}) + "\n")
    print(f"results: {out}", file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1


def scenario_command(args: argparse.Namespace) -> int:
    from bench.report import write_report
    from bench.scenarios import ALL, QUICK, SCENARIOS, Plan

    plan = _plan_with_l(QUICK if args.quick else Plan(), args)
    names = list(ALL) if args.command == "all" else [args.command]
    run = Run(args.run, settings={"plan": dataclasses.asdict(plan), "quick": args.quick})
    print(f"run {run.name} -> {run.dir}", flush=True)
    t0 = time.monotonic()
    for name in names:
        started = time.monotonic()
        print(f"== scenario {name.upper()}", flush=True)
        SCENARIOS[name](run, plan)
        run.note("timing", scenario=name, seconds=time.monotonic() - started)
        print(f"== scenario {name.upper()} done in {time.monotonic() - started:.0f}s", flush=True)
    run.note("timing", scenario="total", seconds=time.monotonic() - t0)
    if not args.no_report:
        write_report(run.name)
    print(f"total {time.monotonic() - t0:.0f}s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command == "run":
        return load_command(args)
    if args.command == "report":
        from bench.report import write_report

        write_report(args.run)
        return 0
    return scenario_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
