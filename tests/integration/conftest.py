"""The in-process vLLM engine shared by the engine tests of this package (one start-up)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

import pytest

from server.core.engine import Engine
from server.core.types import AdapterHandle, Delta, GenerationEvent, GenerationRequest

T = TypeVar("T")

DEMO = Path(__file__).resolve().parents[2] / "build" / "demo"
MAX_MODEL_LEN = 128
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
A1 = AdapterHandle(name="a1", int_id=1, path=str(DEMO / "adapters" / "a1"))
A2 = AdapterHandle(name="a2", int_id=2, path=str(DEMO / "adapters" / "a2"))
A3 = AdapterHandle(name="a3", int_id=3, path=str(DEMO / "adapters" / "a3"))


class Harness:
    """An engine plus the one event loop it lives on."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Engine) -> None:
        self.loop = loop
        self.engine = engine
        self._ids = 0

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def events(
        self, request: GenerationRequest, adapter: AdapterHandle | None = None
    ) -> list[GenerationEvent]:
        self._ids += 1
        return self.run(collect(self.engine, request, adapter, f"engine-{self._ids}"))

    def tokens(self, request: GenerationRequest, adapter: AdapterHandle | None = None) -> list[int]:
        return generated_ids(self.events(request, adapter))


async def collect(
    engine: Engine, req: GenerationRequest, adapter: AdapterHandle | None, engine_id: str
) -> list[GenerationEvent]:
    async with aclosing(engine.generate(req, engine_id, adapter)) as stream:
        return [event async for event in stream]


def generated_ids(events: list[GenerationEvent], choice: int = 0) -> list[int]:
    return [t for e in events if isinstance(e, Delta) and e.choice == choice for t in e.token_ids]


@pytest.fixture(scope="package")
def vllm_harness() -> Iterator[Harness]:
    """vLLM on the demo model, in this process, for every engine test of the package."""
    from server.dev.demo_model import build_demo
    from server.engines.vllm import create
    from server.engines.vllm_options import VllmEngineOptions

    build_demo(DEMO)
    options = VllmEngineOptions(
        model_path=str(DEMO / "model"),
        served_model_name="demo",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=4,
    )
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENGINE_ENV.items():
            patch.setenv(name, os.environ.get(name, value))
        loop = asyncio.new_event_loop()
        engine = loop.run_until_complete(create(options))
        try:
            loop.run_until_complete(engine.add_adapter(A1))
            loop.run_until_complete(engine.add_adapter(A2))
            yield Harness(loop, engine)
        finally:
            loop.run_until_complete(engine.shutdown())
            loop.close()
