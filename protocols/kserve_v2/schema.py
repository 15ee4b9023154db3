"""KServe v2 / Triton wire models (pydantic, at the edge only).

`InferRequest` is the JSON header of `POST …/infer` (KServe "Open Inference Protocol" REST, with
Triton's binary tensor data extension: an input carries either `data` or
`parameters.binary_data_size`). The generate extension's body has dynamic top-level keys (each
one names an input tensor or a request parameter), so it is read by `translate.generate_fields`
rather than a fixed model. `StopInferRequest` is MindIE's `…/stopInfer` body.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from protocols.common.request_id import CLIENT_REQUEST_ID

Dim = Annotated[int, Field(strict=True, ge=0)]


class InferInput(BaseModel):
    """One input tensor. `data` is JSON (nested or flat, row-major); absent when binary."""

    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    shape: list[Dim]
    datatype: StrictStr
    parameters: dict[str, Any] | None = None
    data: Any = None

    @property
    def has_data(self) -> bool:
        return "data" in self.model_fields_set

    @property
    def binary_size(self) -> Any:
        return (self.parameters or {}).get("binary_data_size")


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = Field(default=None, max_length=256)
    parameters: dict[str, Any] | None = None
    inputs: list[InferInput]
    outputs: list[RequestedOutput] | None = None


class StopInferRequest(BaseModel):
    """MindIE: the id a running Triton/MindIE request was given (documents the body;
    `translate.stop_infer_id` checks it with MindIE's messages)."""

    model_config = ConfigDict(extra="allow")

    id: StrictStr = Field(pattern=CLIENT_REQUEST_ID)


# OpenAPI body of the generate extension: inputs by name at the top level, dynamic keys.
GENERATE_BODY: dict[str, Any] = {
    "type": "object",
    "description": "Triton generate extension: inputs by name at the top level; other keys "
    "are request parameters (scalars or lists of scalars).",
    "properties": {
        "id": {"type": "string", "maxLength": 256},
        "text_input": {"type": "string"},
        "stream": {"type": "boolean"},
        "sampling_parameters": {"type": "string"},
        "exclude_input_in_output": {"type": "boolean"},
        "return_finish_reason": {"type": "boolean"},
        "return_cumulative_logprob": {"type": "boolean"},
        "return_logprobs": {"type": "boolean"},
        "return_num_input_tokens": {"type": "boolean"},
        "return_num_output_tokens": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0},
        "parameters": {"type": "object"},
    },
    "required": ["text_input"],
}
