"""How to start vLLM: `VllmEngineOptions`, named after vLLM's `AsyncEngineArgs`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmEngineOptions:
    """How to start vLLM. Names and meanings follow vLLM's `AsyncEngineArgs`.

    `extra` is passed to `AsyncEngineArgs` as further keyword arguments (and wins over the
    named fields). `max_num_seqs=None` and `max_cpu_loras=None` keep vLLM's defaults.
    """

    model_path: str
    served_model_name: str
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser names
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser names
    extra: dict[str, object] = field(default_factory=dict)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `AsyncEngineArgs`, stats always on (vLLM's `vllm:` metrics)."""
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "served_model_name": self.served_model_name,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            "enable_lora": self.enable_lora,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
            "lora_dtype": self.lora_dtype,
            "fully_sharded_loras": self.fully_sharded_loras,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "distributed_executor_backend": self.distributed_executor_backend,
            "disable_log_stats": False,
        }
        if self.reasoning_parser:  # as `vllm serve --reasoning-parser`: structured output
            kwargs["reasoning_parser"] = self.reasoning_parser  # waits for reasoning to end
        if self.enable_lora:  # base tokens in mixed LoRA batches on CPU: see vllm_cpu_fix.py
            kwargs["worker_extension_cls"] = "server.engines.vllm_cpu_fix.CpuLoraFix"
        kwargs.update(self.extra)
        return kwargs
