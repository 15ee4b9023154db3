"""Every benchmark client speaks its protocol to the real gateway process (fake engine): no
failures, and the token counts it reads back are the ones asked for."""

from __future__ import annotations

import pytest
import uvloop

from bench.http import Target
from bench.load import Workload, run_window
from bench.protocols import PROTOCOLS
from bench.stats import summarize
from tests.serverproc import RunningServer


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_bench_client_reads_its_protocol_from_the_gateway(
    fake_server: RunningServer, protocol: str, stream: bool
) -> None:
    workload = Workload(
        protocol=protocol,
        stream=stream,
        max_tokens=7,
        prompts=("one two three four five",),
        concurrency=2,
        requests=6,
        duration_s=30.0,
    )
    window = uvloop.run(run_window(Target.parse(fake_server.url), workload))
    summary = summarize(window.records, window.duration_s)
    assert summary["failed"] == 0, summary["errors"]
    assert summary["completed"] == 6
    assert summary["tokens_mean"] == 7
    if stream:
        assert summary["ttft_ms"] is not None and summary["itl_ms"] is not None
