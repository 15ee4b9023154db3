"""TGI wire models (pydantic, at the edge only): the body of `/generate`, `/generate_stream`,
`POST /` and `/tokenize`.

Types follow TGI's serde structs (`router/src/lib.rs`: `GenerateParameters`,
`CompatGenerateRequest`):
unsigned fields refuse negatives, booleans refuse numbers, unknown keys are ignored and every field
may be `null` (clients send all keys). Value bounds that TGI checks in its validation step (with
its own messages) live in `translate.py`, not here.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

Unsigned = Annotated[int, Field(strict=True, ge=0)]
U64 = Annotated[int, Field(strict=True, ge=0, le=2**64 - 1)]
Signed = Annotated[int, Field(strict=True)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class Parameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    best_of: Unsigned | None = None
    temperature: Number | None = None
    repetition_penalty: Number | None = None
    frequency_penalty: Number | None = None
    top_k: Signed | None = None
    top_p: Number | None = None
    typical_p: Number | None = None
    do_sample: StrictBool | None = None
    max_new_tokens: Unsigned | None = None
    return_full_text: StrictBool | None = None
    stop: list[StrictStr] | None = None
    truncate: Unsigned | None = None
    watermark: StrictBool | None = None
    details: StrictBool | None = None
    decoder_input_details: StrictBool | None = None
    seed: U64 | None = None
    top_n_tokens: Unsigned | None = None
    grammar: dict[str, Any] | None = None
    adapter_id: StrictStr | None = None
    merged_adapters: Any = None  # LoRAX's: checked by server.core.composition.merge_from_wire


class GenerateRequest(BaseModel):
    """`parameters` absent (or null) means TGI's built-in defaults, where `do_sample` is true."""

    model_config = ConfigDict(extra="ignore")

    inputs: StrictStr
    parameters: Parameters | None = None
    stream: StrictBool | None = None  # read by `POST /` only
