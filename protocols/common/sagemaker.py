"""DJL / SageMaker adapter selectors on the paths every body shape shares (SageMaker's
`/invocations`, DJL's `/predictions/{model}`): read here once, whichever protocol answers the
body (DJL for LMI `inputs`, OpenAI for `messages` and `prompt`, TGI for `inputs` with tgiCompat).

Precedence, lowest first; a later selector that is present wins, as DJL reads them (djl-serving
@ d21927c: `engines/python/setup/djl_python/input_parser.py` `_fetch_adapters_from_input`, body
`adapters` < Input content `adapter` < header; `serving/.../http/RequestParser.java` puts query
parameters into the content before the workflow's `adapter` and Custom-Attributes pairs into the
properties, which djl_python read last until the Identifier header took their place):
  the body's own field (OpenAI `model`, TGI `parameters.adapter_id`) < body `adapters` <
  the workflow `{model}` or `?model_name=` names < `?adapter=` (its first value) <
  `X-Amzn-SageMaker-Custom-Attributes: adapter=<name>` < `X-Amzn-SageMaker-Adapter-Identifier`.
`""` names the base model, except in `?adapter=`, where DJL's front refuses it (`ModelInfo.java`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request

from server.core.errors import AdapterNotFound, InvalidRequest, ModelNotFound
from server.core.frozen import quick_init
from server.core.service import InferenceService

ADAPTER_IDENTIFIER = "x-amzn-sagemaker-adapter-identifier"
CUSTOM_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"
COUNT_MISMATCH = "Number of adapters is not equal to the number of inputs"  # djl_python's words


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Selectors:
    """What a request names outside its body, lowest precedence first."""

    workflow: str | None = None
    query: str | None = None
    custom_attributes: str | None = None
    header: str | None = None

    def names(self, count: int, adapters: object = None) -> list[str] | None:
        """One adapter name per input ("" = base) from the body's `adapters` and these, or None
        when nothing names one (the body's own field decides). A single name applies to every
        input; a list needs one entry per input, else `InvalidRequest` (DJL's message)."""
        chosen = _adapters_field(adapters)
        for name in (self.workflow, self.query, self.custom_attributes, self.header):
            if name is not None:
                chosen = name
        if chosen is None:
            return None
        if isinstance(chosen, str):
            return [chosen] * count
        if len(chosen) != count:
            raise InvalidRequest(COUNT_MISMATCH, param="adapters")
        return list(chosen)


def selectors(request: Request, service: InferenceService) -> Selectors:
    """The request's selectors; raises `ModelNotFound` for a model that is neither the base
    model nor a workflow (DJL's front refuses it before the body is read) and `AdapterNotFound`
    for an empty `?adapter=`."""
    query = request.query_params if request.scope["query_string"] else None
    queried = query.getlist("adapter") if query is not None else []
    if queried and not queried[0]:
        raise AdapterNotFound("The adapter named by ?adapter= is empty", param="adapter")
    headers = request.headers
    return Selectors(
        workflow=workflow(service, request.path_params.get("model")
                          or (query.get("model_name") if query is not None else None)),
        query=queried[0] if queried else None,
        custom_attributes=custom_attribute_adapter(headers.get(CUSTOM_ATTRIBUTES)),
        header=headers.get(ADAPTER_IDENTIFIER),
    )


def workflow(service: InferenceService, model: str | None) -> str | None:
    """The workflow a model name targets: None for none or a served base-model name."""
    if not model or model in service.base_names:
        return None
    if model in service.adapters.aliases():
        return model
    raise ModelNotFound(f"Model or workflow not found: {model}", param=None)


def custom_attribute_adapter(header: str | None) -> str | None:
    """`adapter=<name>` in `X-Amzn-SageMaker-Custom-Attributes`, split as DJL's RequestParser
    does (`k=v;k2=v2`, each pair at its first `=`, trimmed; a repeated key: the last)."""
    found = None
    for part in (header or "").split(";"):
        key, sep, value = part.partition("=")
        if sep and key.strip().lower() == "adapter":
            found = value.strip()
    return found


def _adapters_field(value: object) -> str | list[str] | None:
    """The body's `adapters`: absent, one name, or a list of names."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(name, str) for name in value):
        return list(value)
    raise InvalidRequest("adapters must be a string or a list of strings", param="adapters")
