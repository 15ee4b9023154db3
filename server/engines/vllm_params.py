"""`Sampling` → vLLM's `SamplingParams`: delta outputs for streamed requests, final-only outputs
for the others (as vLLM's own server does: no per-token work in this process for them), and
structured output (a JSON schema bounded to the request's token budget)."""

from __future__ import annotations

import functools
import json
import logging
from typing import TYPE_CHECKING, Any

from server.core.errors import InvalidRequest, Unsupported
from server.core.types import GenerationRequest, Sampling, StructuredOutput
from server.engines.vllm_errors import first_line, to_gateway_error

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("server.engines.vllm")


def sampling_params(
    request: GenerationRequest, max_tokens: int, skip_special_tokens: bool
) -> SamplingParams:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    sampling = request.sampling
    if sampling.best_of is not None and sampling.best_of != sampling.n:
        raise Unsupported("best_of is not supported by this engine.", param="best_of")
    kwargs = _sampling_kwargs(sampling, max_tokens)
    kwargs["skip_special_tokens"] = skip_special_tokens
    try:
        return SamplingParams(
            **kwargs,
            logprobs=request.output.logprobs,
            prompt_logprobs=request.output.prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        )
    except Exception as exc:  # vLLM validates in the constructor (VLLMValidationError)
        raise to_gateway_error(exc) from exc


def _sampling_kwargs(sampling: Sampling, max_tokens: int) -> dict[str, Any]:
    allowed = sampling.allowed_token_ids
    return {
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": _top_k(sampling.top_k),
        "min_p": sampling.min_p,
        "seed": sampling.seed,
        "repetition_penalty": sampling.repetition_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": sampling.min_new_tokens,
        "include_stop_str_in_output": sampling.include_stop_str_in_output,
        "skip_special_tokens": sampling.skip_special_tokens,
        "spaces_between_special_tokens": sampling.spaces_between_special_tokens,
        "logit_bias": dict(sampling.logit_bias) or None,
        "allowed_token_ids": None if allowed is None else list(allowed),
        "bad_words": list(sampling.bad_words) or None,
        "thinking_token_budget": sampling.thinking_token_budget,
        "structured_outputs": _structured_outputs(sampling.structured, max_tokens),
    }


NO_VOCABULARY_THIS_LARGE = 2**31  # a top_k at least this is every token: no top-k at all


def _top_k(top_k: int) -> int:
    """vLLM 0.32: 0 disables top-k, and the engine treats a top_k past the vocabulary so too;
    one of 2**64 or more would not even reach it (the engine core's msgpack stops at 64 bits:
    the request failed with a 500)."""
    return top_k if 0 < top_k < NO_VOCABULARY_THIS_LARGE else 0


def _structured_outputs(
    structured: StructuredOutput | None, max_tokens: int
) -> StructuredOutputsParams | None:
    if structured is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if structured.fit_budget and structured.json_schema is not None:
        return StructuredOutputsParams(grammar=_fitted_grammar(structured.json_schema, max_tokens))
    return StructuredOutputsParams(
        json=structured.json_schema,
        json_object=structured.json_object or None,
        regex=structured.regex,
        choice=None if structured.choice is None else list(structured.choice),
        grammar=structured.grammar,
    )


@functools.lru_cache(maxsize=256)
def _fitted_grammar(schema_text: str, max_tokens: int) -> str:
    """The schema bounded to `max_tokens` (see `json_budget`), as a grammar without any optional
    whitespace: xgrammar's JSON-schema converter with compact separators, so the bound holds."""
    import xgrammar

    from server.core.json_budget import fit_schema

    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"The JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest("The JSON schema must be a JSON object.")
    bounded, fits = fit_schema(schema, max_tokens)
    if not fits:
        logger.info("a JSON schema does not fit in %d tokens: decoded at its tightest", max_tokens)
    try:
        grammar = xgrammar.Grammar.from_json_schema(
            json.dumps(bounded), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )
    except Exception as exc:  # the converter's own message says what is wrong in the schema
        raise InvalidRequest(f"The JSON schema cannot be used: {first_line(exc)}") from exc
    return str(grammar)
