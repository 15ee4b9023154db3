"""The served models as Triton sees them: tensor signature, metadata, config, path resolution.

Every model is the Triton vLLM backend's shape (§4.3 of PROTOCOLS.md): BYTES `text_input` plus
optional BOOL/JSON control inputs, BYTES `text_output` plus optional extras. The base model and
each registered LoRA adapter are separate Triton models (one model per adapter), all version "1".
The backend's optional `image` input is not advertised: the served models are text-only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from protocols.kserve_v2 import tensors
from server.core.errors import InvalidRequest, ModelNotFound
from server.core.frozen import quick_init
from server.core.service import InferenceService

MODEL_VERSION = "1"
PLATFORM = "vllm"
EXTENSIONS = ("binary_tensor_data", "parameters", "statistics", "model_configuration", "generate")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = True


INPUTS = (
    TensorSpec("text_input", "BYTES", (1,), optional=False),
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("sampling_parameters", "BYTES", (1,)),
    TensorSpec("exclude_input_in_output", "BOOL", (1,)),
    TensorSpec("return_finish_reason", "BOOL", (1,)),
    TensorSpec("return_cumulative_logprob", "BOOL", (1,)),
    TensorSpec("return_logprobs", "BOOL", (1,)),
    TensorSpec("return_num_input_tokens", "BOOL", (1,)),
    TensorSpec("return_num_output_tokens", "BOOL", (1,)),
)
OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("cumulative_logprob", "FP32", (-1,)),
    TensorSpec("logprobs", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)
INPUT_SPECS = {spec.name: spec for spec in INPUTS}
OUTPUT_NAMES = tuple(spec.name for spec in OUTPUTS)
EXTRA_FLAGS = {name: f"return_{name}" for name in OUTPUT_NAMES[1:]}


@quick_init
@dataclass(frozen=True, slots=True)
class ModelRef:
    """The Triton model named in the path: the base model or an adapter (one model per LoRA)."""

    name: str
    adapter: str | None = None


def resolve_model(
    name: str, version: str | None, *, base_names: frozenset[str], adapters: Collection[str]
) -> ModelRef:
    """The model a path names, or Triton's errors (unknown model or version → 404).
    `adapters` may be the registry itself: it also knows adapterDir folders not loaded yet."""
    if version and not version.isdigit():
        raise InvalidRequest(
            f"failed to get model version from specified version string '{version}'"
        )
    if name not in base_names and name not in adapters:
        raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
    if version and int(version) != int(MODEL_VERSION):
        raise ModelNotFound(f"Request for unknown model: '{name}' version {version} is not found")
    return ModelRef(name, None if name in base_names else name)


def served_model_names(service: InferenceService) -> list[str]:
    """Every Triton model served: the base model, then each registered adapter."""
    return [service.served_name, *service.adapters.names()]


def repository_index(
    names: Sequence[str], *, accepting: bool, ready_only: bool = False
) -> list[dict[str, str]]:
    """Triton's repository index (HTTP `POST /v2/repository/index`, gRPC `RepositoryIndex`):
    every served model at version "1", READY while the server takes requests, else
    UNAVAILABLE; `ready_only` (the request's `ready`) lists only the READY ones."""
    if ready_only and not accepting:
        return []
    state = "READY" if accepting else "UNAVAILABLE"
    return [{"name": name, "version": MODEL_VERSION, "state": state} for name in names]


def server_metadata(version: str) -> dict[str, Any]:
    """`GET /v2`: only what is implemented, plus the generate extension."""
    return {"name": "llm-gateway", "version": version, "extensions": list(EXTENSIONS)}


def model_metadata(model: ModelRef) -> dict[str, Any]:
    def entry(spec: TensorSpec) -> dict[str, Any]:
        return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.dims)}

    return {
        "name": model.name, "versions": [MODEL_VERSION], "platform": PLATFORM,
        "inputs": [entry(s) for s in INPUTS], "outputs": [entry(s) for s in OUTPUTS],
    }


def model_config(model: ModelRef, base_name: str) -> dict[str, Any]:
    """Triton's JSON `ModelConfig` for a vLLM-backend model (decoupled, no Triton batching)."""

    def config_type(spec: TensorSpec) -> str:
        return tensors.DATATYPES[spec.datatype].config_name

    parameters = {"base_model": {"string_value": base_name}} if model.adapter else {}
    return {
        "name": model.name, "platform": "", "backend": PLATFORM, "runtime": "",
        "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": 0,
        "input": [
            {"name": s.name, "data_type": config_type(s), "format": "FORMAT_NONE",
             "dims": list(s.dims), "is_shape_tensor": False, "allow_ragged_batch": False,
             "optional": s.optional}
            for s in INPUTS
        ],
        "output": [
            {"name": s.name, "data_type": config_type(s), "dims": list(s.dims),
             "label_filename": "", "is_shape_tensor": False}
            for s in OUTPUTS
        ],
        "batch_input": [], "batch_output": [],
        "instance_group": [{"name": f"{model.name}_0", "kind": "KIND_MODEL", "count": 1,
                            "gpus": [], "secondary_devices": [], "profile": [],
                            "passive": False, "host_policy": ""}],
        "default_model_filename": "", "cc_model_filenames": {}, "metric_tags": {},
        "parameters": parameters, "model_warmup": [],
        "model_transaction_policy": {"decoupled": True},
    }
