"""Figures from per-request records, with vLLM's definitions (vllm/benchmarks/serve.py).

- request throughput = completed / duration; output tokens/s = sum(tokens) / duration;
- TTFT per request; TPOT = (latency - TTFT) / (tokens - 1) for requests with more than one
  token; ITL = every gap between successive text events; E2EL = latency;
- events/s = text events / duration (the SSE ceiling figure of scenario B).
Percentiles use numpy's linear interpolation, as vLLM does.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from bench.load import Record


def _dist(values: Sequence[float], scale: float = 1000.0) -> dict[str, float] | None:
    if not values:
        return None
    data = np.asarray(values, dtype=float) * scale
    return {
        "mean": float(data.mean()),
        "median": float(np.median(data)),
        "p90": float(np.percentile(data, 90)),
        "p99": float(np.percentile(data, 99)),
        "min": float(data.min()),
        "max": float(data.max()),
    }


def summarize(records: Iterable[Record | dict[str, Any]], duration_s: float) -> dict[str, Any]:
    rows = [r if isinstance(r, dict) else _as_dict(r) for r in records]
    done = [r for r in rows if r["ok"]]
    failed = [r for r in rows if not r["ok"]]
    tokens = sum(r["tokens"] for r in done)
    prompt = sum(r["prompt_tokens"] or 0 for r in done)
    tpots = [
        (r["latency"] - r["ttft"]) / (r["tokens"] - 1)
        for r in done
        if r["tokens"] > 1
        and r["text_events"] > 1
        and r["latency"] is not None
        and r["ttft"] is not None
    ]
    itls = [gap for r in done for gap in r["itl"]]
    duration = max(duration_s, 1e-9)
    return {
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({str(r["error"])[:120] for r in failed})[:3],
        "duration_s": duration_s,
        "req_per_s": len(done) / duration,
        "out_tok_per_s": tokens / duration,
        "total_tok_per_s": (tokens + prompt) / duration,
        "events_per_s": sum(r["text_events"] for r in done) / duration,
        "tokens_mean": tokens / len(done) if done else 0.0,
        "tokens_reported": all(r["tokens_reported"] for r in done),
        "prompt_tokens_mean": prompt / len(done) if done else 0.0,
        "ttft_ms": _dist([r["ttft"] for r in done if r["ttft"] is not None]),
        "tpot_ms": _dist(tpots),
        "itl_ms": _dist(itls),
        "e2el_ms": _dist([r["latency"] for r in done if r["latency"] is not None]),
    }


def _as_dict(record: Record) -> dict[str, Any]:
    return {
        "ok": record.ok,
        "error": record.error,
        "tokens": record.tokens,
        "tokens_reported": record.tokens_reported,
        "prompt_tokens": record.prompt_tokens,
        "latency": record.latency,
        "ttft": record.ttft,
        "itl": record.itl,
        "text_events": record.text_events,
    }


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def spread(values: Iterable[float | None]) -> tuple[float, float] | None:
    present = [v for v in values if v is not None]
    return (min(present), max(present)) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def pick(summary: dict[str, Any], path: str) -> float | None:
    """`pick(s, "ttft_ms.median")` -> the number, or None when absent."""
    node: Any = summary
    for part in path.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return None
        node = node[part]
    return float(node)
