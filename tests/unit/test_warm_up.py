"""The engine warm-up before READY: a failed warm-up on a live engine is only logged; on a dead
engine it stops the start (the server never turns ready with an engine that cannot serve)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.core.errors import EngineError, ServiceUnavailable
from server.engines.factory import warm_up
from server.engines.fake import FakeEngine, FakeScript

pytestmark = pytest.mark.anyio


async def test_a_failed_warm_up_on_a_live_engine_is_only_logged() -> None:
    engine = FakeEngine(FakeScript(reject_with=EngineError("scripted warm-up failure")))
    await warm_up(engine)
    await engine.check_health()


async def test_a_failed_warm_up_on_a_dead_engine_stops_the_start(tmp_path: Path) -> None:
    dead = tmp_path / "dead"
    dead.touch()
    engine = FakeEngine(FakeScript(reject_with=EngineError("engine is dead"),
                                   dead_flag_path=str(dead)))
    with pytest.raises(ServiceUnavailable):
        await warm_up(engine)
