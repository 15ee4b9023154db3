"""DJL wire models (pydantic, at the edge only).

- `LmiRequest`: the LMI inference schema of `/invocations` and `/predictions/{m}`
  (`{"inputs", "parameters", "stream", "adapters"}`, djl_python `input_parser`). LMI ignores
  generation parameters it does not know (with a warning); so do we. Known ones are type-checked.
  Structured output as LMI's vLLM path takes it (`structured_outputs`, `response_format`), plus
  `json_schema`, the gateway's alias of `structured_outputs.json`.
- `AdapterForm`: the adapter registration fields, from query parameters (DJL) or a JSON body
  (vLLM's SageMaker `POST /adapters`). Query values are strings; booleans parse like Java's
  `Boolean.parseBoolean` (only "true", any case, is true).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

Count = Annotated[int, Field(strict=True, ge=1)]
Unsigned = Annotated[int, Field(strict=True, ge=0)]
Signed = Annotated[int, Field(strict=True)]
Positive = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(strict=True, ge=-2, le=2)]


class LmiParameters(BaseModel):
    """LMI (vLLM rolling batch) generation parameters; vLLM's own names are accepted too."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: Count | None = None
    min_new_tokens: Unsigned | None = None
    do_sample: StrictBool | None = None
    temperature: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0, le=1)] | None = None
    top_k: Signed | None = None
    min_p: Annotated[float, Field(strict=True, ge=0, le=1)] | None = None
    repetition_penalty: Positive | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Signed | None = None
    stop_sequences: list[StrictStr] | StrictStr | None = None
    stop: list[StrictStr] | StrictStr | None = None
    stop_token_ids: list[Unsigned] | None = None
    ignore_eos_token: StrictBool | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    details: StrictBool | None = None
    decoder_input_details: StrictBool | None = None
    return_full_text: StrictBool | None = None
    n: Count | None = None
    best_of: Count | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams
    response_format: dict[str, Any] | None = None  # OpenAI's json_object / json_schema
    json_schema: dict[str, Any] | StrictStr | None = None  # gateway alias: structured_outputs.json
    include_stop_str_in_output: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    # LMI's vLLM parameters the engine port does not carry: refused unless at LMI's default
    num_beams: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    logprobs: Any = None
    prompt_logprobs: Any = None


class LmiRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: StrictStr | list[StrictStr]
    parameters: LmiParameters | None = None
    stream: StrictBool | None = None
    adapters: StrictStr | list[StrictStr] | None = None


class AdapterForm(BaseModel):
    """Register/update fields. Everything not named here is an adapter option (DJL)."""

    model_config = ConfigDict(extra="allow")

    name: StrictStr | None = None
    src: StrictStr | None = None
    preload: StrictBool | StrictStr | None = None
    pin: StrictBool | StrictStr | None = None
