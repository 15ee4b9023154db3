"""What vLLM says about the model it serves: `EngineInfo` and the generation-config defaults."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from server.core.types import EngineInfo, SamplingDefaults
from server.engines.vllm_options import VllmEngineOptions

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("server.engines.vllm")


def engine_info(llm: AsyncLLM, options: VllmEngineOptions, tokenizer: TokenizerLike) -> EngineInfo:
    import vllm

    config = llm.vllm_config
    lora = config.lora_config
    return EngineInfo(
        model_name=options.served_model_name,
        model_path=options.model_path,
        max_model_len=config.model_config.max_model_len,
        vocab_size=config.model_config.get_vocab_size(),
        dtype=str(config.model_config.dtype).removeprefix("torch."),
        version=vllm.__version__,
        max_lora_rank=lora.max_lora_rank if lora else 0,
        max_loras=lora.max_loras if lora else 0,
        max_cpu_loras=(lora.max_cpu_loras or lora.max_loras) if lora else 0,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        block_size=config.cache_config.block_size,
        eos_token_id=tokenizer.eos_token_id,
        defaults=model_defaults(config.model_config),
        tool_call_parser=options.tool_call_parser,
        reasoning_parser=options.reasoning_parser,
        fingerprint=system_fingerprint(config, vllm.__version__),
    )


def system_fingerprint(config: VllmConfig, version: str) -> str:
    """`vllm-<version>[-tp<n>][-pp<n>][-dp<n>][-ep]-<hash8>`: what vLLM 0.32's server answers in
    its default `--fingerprint-mode full` (vllm/entrypoints/serve/utils/fingerprint.py), so a
    client that tracks the serving configuration sees the same value through the gateway."""
    parts = [f"vllm-{version}"]
    parallel = config.parallel_config
    sizes = {"tp": parallel.tensor_parallel_size, "pp": parallel.pipeline_parallel_size,
             "dp": parallel.data_parallel_size}
    for tag, size in sizes.items():
        if size > 1:
            parts.append(f"{tag}{size}")
    if parallel.enable_expert_parallel:
        parts.append("ep")
    try:
        parts.append(config.compute_hash()[:8])
    except Exception:  # vLLM's own fallback: a config it cannot hash
        parts.append("nohash")
    return "-".join(parts)


def model_defaults(model_config: ModelConfig) -> SamplingDefaults:
    """The model's generation-config defaults as vLLM reads them (`generation_config="auto"`)."""
    diff = model_config.get_diff_sampling_param()
    if diff:
        logger.info("the model's generation config sets sampling defaults: %s", diff)
    return SamplingDefaults(
        temperature=_number(diff.get("temperature")),
        top_p=_number(diff.get("top_p")),
        top_k=_integer(diff.get("top_k")),
        min_p=_number(diff.get("min_p")),
        repetition_penalty=_number(diff.get("repetition_penalty")),
        presence_penalty=_number(diff.get("presence_penalty")),
        frequency_penalty=_number(diff.get("frequency_penalty")),
        max_new_tokens=_integer(diff.get("max_tokens")),
    )


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _integer(value: object) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
