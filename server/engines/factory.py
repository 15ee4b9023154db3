"""Engine factory: settings → a running engine (vLLM, or the fake for tests and benchmarks)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from server.core.engine import Engine
from server.core.errors import GatewayError
from server.core.lifecycle import log_phase
from server.core.types import GenerationRequest, OutputOptions, Sampling, TextPrompt
from server.settings import Settings, SettingsError, resolve_path

if TYPE_CHECKING:
    from server.engines.fake import FakeScript
    from server.engines.vllm_launch import ClientPlace, CoreLaunch
    from server.engines.vllm_options import VllmEngineOptions

logger = logging.getLogger("gateway")

# ModelConfig.engineOptions the fake engine understands (FakeScript fields), for tests and benches.
FAKE_OPTIONS = frozenset({"token_delay_s", "fail_after", "hang_after", "dead_flag_path"})


async def create_engine(settings: Settings, client: ClientPlace | None = None) -> Engine:
    """The engine of this process; with `client`, a front end of the engine core the
    supervisor launched (`launch_core`) instead of an engine of its own."""
    if settings.engine == "fake":
        from server.engines.fake import FakeEngine

        script = fake_script(settings.model.engine_options)
        since = time.monotonic()
        fake = FakeEngine(
            script,
            model_name=settings.model.name,
            model_path=resolve_path(settings, settings.model.weight_path),
            tool_call_parser=settings.model.tool_call_parser,
            reasoning_parser=settings.model.reasoning_parser,
            remember=0,  # nothing in a server process reads the records
        )
        log_phase(logger, "engine start", since, "fake engine")
        return fake
    from server.engines.vllm import create

    engine = await create(vllm_options(settings), client)
    since = time.monotonic()
    await warm_up(engine)
    log_phase(logger, "warm-up", since)
    return engine


def launch_core(settings: Settings, workers: int) -> CoreLaunch | None:
    """vLLM's engine core for `workers` front-end processes (None with the fake engine: each
    worker then runs its own, which keeps no state a request could see)."""
    if settings.engine == "fake":
        return None
    from server.engines.vllm_launch import CoreLaunch

    return CoreLaunch(vllm_options(settings), workers)


def vllm_options(settings: Settings) -> VllmEngineOptions:
    from server.engines.vllm_options import VllmEngineOptions

    model, lora = settings.model, settings.lora
    return VllmEngineOptions(
        model_path=resolve_path(settings, model.weight_path),
        served_model_name=model.name,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        max_num_seqs=model.max_num_seqs,
        seed=model.seed,
        enforce_eager=model.enforce_eager,
        enable_lora=lora.enabled,
        max_loras=lora.max_loras,
        max_lora_rank=lora.max_lora_rank,
        max_cpu_loras=lora.max_cpu_loras or lora.max_loras,
        lora_dtype=lora.lora_dtype,
        fully_sharded_loras=lora.fully_sharded_loras,
        tensor_parallel_size=model.tensor_parallel_size,
        pipeline_parallel_size=model.pipeline_parallel_size,
        data_parallel_size=model.data_parallel_size,
        distributed_executor_backend=model.distributed_executor_backend,
        tool_call_parser=model.tool_call_parser,
        reasoning_parser=model.reasoning_parser,
        extra=dict(model.engine_options),
    )


async def warm_up(engine: Engine) -> None:
    """One short generation with logprobs before READY: vLLM compiles its logprobs kernel on first
    use (2-6 s on these CPUs), which would otherwise stall every stream in that first batch."""
    request = GenerationRequest(
        request_id="warm-up",
        model="",
        prompt=TextPrompt("warm up"),
        sampling=Sampling(max_new_tokens=2, temperature=0.0),
        output=OutputOptions(logprobs=1),
        protocol="warm-up",
    )
    try:
        async for _ in engine.generate(request, "warm-up-0", None):
            pass
    except GatewayError as exc:
        logger.warning("engine warm-up failed: %s", exc.message)
        await _alive_or_stopped(engine)


async def _alive_or_stopped(engine: Engine) -> None:
    """After a failed warm-up: a dead engine stops the start here (never turning ready), a
    live one serves on."""
    try:
        await engine.check_health()
    except GatewayError:
        await engine.shutdown()
        raise


def fake_script(options: dict[str, Any]) -> FakeScript:
    """The fake engine's script from `ModelConfig.engineOptions` (e.g. a per-token delay)."""
    from server.engines.fake import FakeScript

    unknown = sorted(set(options) - FAKE_OPTIONS)
    if unknown:
        raise SettingsError(
            f"ModelConfig.engineOptions: {unknown} are not fake-engine options. "
            f"Fix: use only {sorted(FAKE_OPTIONS)} with engine=fake"
        )
    return FakeScript(**options)
