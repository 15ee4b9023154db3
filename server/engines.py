"""Engine factory: settings → a running engine (vLLM, or the fake for tests and benchmarks)."""

from __future__ import annotations

from server.core.engine import Engine
from server.settings import Settings, resolve_path


async def create_engine(settings: Settings) -> Engine:
    if settings.engine == "fake":
        from server.engine.fake import FakeEngine

        return FakeEngine(model_name=settings.ModelConfig.modelName)
    from server.engine.vllm_engine import VllmEngine, VllmEngineOptions

    model, lora = settings.ModelConfig, settings.LoraConfig
    options = VllmEngineOptions(
        model_path=resolve_path(settings, model.modelWeightPath),
        served_model_name=model.modelName,
        dtype=model.dtype,
        max_model_len=model.maxModelLen,
        max_num_seqs=model.maxNumSeqs,
        seed=model.seed,
        enforce_eager=model.enforceEager,
        enable_lora=lora.enabled,
        max_loras=lora.maxLoras,
        max_lora_rank=lora.maxLoraRank,
        max_cpu_loras=lora.maxCpuLoras or lora.maxLoras,
        lora_dtype=lora.loraDtype,
        fully_sharded_loras=lora.fullyShardedLoras,
        tensor_parallel_size=model.tensorParallelSize,
        pipeline_parallel_size=model.pipelineParallelSize,
        distributed_executor_backend=model.distributedExecutorBackend,
        extra=dict(model.engineOptions),
    )
    return await VllmEngine.create(options)
