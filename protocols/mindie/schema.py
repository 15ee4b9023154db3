"""MindIE native wire models (pydantic, at the edge only).

`InferRequest` is the body of `/infer` and `/infer_token` (the prompt, `inputs` or `input_id`, is
checked by `translate.infer_prompt` on the raw body, with MindIE's own messages)
and `VllmGenerateRequest` is the vLLM flavour of MindIE's `/generate` (a body with `prompt`).
A key MindIE's handlers do not read (`SetupInferParams` of `single_req_self_develop_*` and
`single_req_vllm_infer_interface.cpp`) is ignored, as MindIE ignores it: `/infer` reads only the
`parameters` below, so TGI's `stop`, `truncate`, `top_n_tokens` or `decoder_input_details` have no
effect there, nor vLLM's `logprobs`, `prompt_logprobs`, `logit_bias`, `allowed_token_ids`,
`min_tokens` or `use_beam_search` on the vLLM flavour (docs/protocols.md, MindIE).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from protocols.common.request_id import CLIENT_REQUEST_ID
from server.http.routes import EMBEDS

Unsigned = Annotated[int, Field(strict=True, ge=0)]
Signed = Annotated[int, Field(strict=True)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class InferParameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    temperature: Number | None = None
    top_k: Signed | None = None
    top_p: Number | None = None
    typical_p: Number | None = None
    do_sample: StrictBool | None = None
    seed: Unsigned | None = None
    repetition_penalty: Number | None = None
    watermark: StrictBool | None = None
    priority: Signed | None = None
    max_new_tokens: Signed | None = None
    timeout: Signed | None = None
    details: StrictBool | None = None


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: Annotated[StrictStr, Field(pattern=CLIENT_REQUEST_ID)] | None = None
    stream: StrictBool | None = None
    parameters: InferParameters | None = None


class VllmGenerateRequest(BaseModel):
    """vLLM's legacy `/generate` body as MindIE reads it: sampling fields at the top level."""

    model_config = ConfigDict(extra="ignore")

    prompt: StrictStr | list[dict[str, Any]]
    stream: StrictBool | None = None
    model: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    max_tokens: Signed | None = None
    temperature: Number | None = None
    top_k: Signed | None = None
    top_p: Number | None = None
    seed: Unsigned | None = None
    n: Unsigned | None = None
    best_of: Unsigned | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[int, Field(strict=True)]] | None = None
    ignore_eos: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None


# OpenAPI bodies of the routes that read their JSON by hand (prompt forms are exclusive).
INFER_BODY: dict[str, Any] = {
    EMBEDS: [InferParameters],
    "type": "object",
    "properties": {
        "inputs": {"type": "string"},
        "stream": {"type": "boolean"},
        "parameters": {"$ref": "#/components/schemas/mindie.InferParameters"},
    },
    "required": ["inputs"],
}
INFER_TOKEN_BODY: dict[str, Any] = {
    EMBEDS: [InferParameters],
    "type": "object",
    "properties": {
        "input_id": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "stream": {"type": "boolean"},
        "parameters": {"$ref": "#/components/schemas/mindie.InferParameters"},
    },
    "required": ["input_id"],
}
TOKENIZER_BODY: dict[str, Any] = {
    "type": "object",
    "properties": {"inputs": {"type": "string"}, "do_decode": {"type": "boolean"}},
    "required": ["inputs"],
}
