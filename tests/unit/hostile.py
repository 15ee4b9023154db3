"""Hostile JSON for every protocol's routes: deep nesting, huge numbers, NaN/Infinity, lone
surrogates, very long strings and wrong types, spliced as raw text into an otherwise valid body
at a documented field. Shared by the unit tier (fake engine, broad) and the real-server tests
(focused). Each case is a (path, body bytes) pair; the property is "never a 5xx"."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from protocols.djl.schema import LmiParameters
from protocols.kserve_v2.sampling import KNOBS
from protocols.mindie.schema import InferParameters, VllmGenerateRequest
from protocols.openai_v1.schema import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from protocols.tgi.schema import Parameters
from server.core.json_limits import MAX_JSON_DEPTH, MAX_SCHEMA_DEPTH
from server.http import jsonio

Path = tuple[str | int, ...]
SENTINEL = "\u0001hostile\u0001"


def deep(levels: int, leaf: str = "1") -> str:
    return "[" * levels + leaf + "]" * levels


def _deep_object(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


def deep_schema(levels: int) -> dict[str, Any]:
    """A schema whose JSON nests `levels` levels (objects in properties, two levels each)."""
    schema: dict[str, Any] = {"type": "string"}
    depth = 1
    while depth + 2 <= levels:
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        depth += 2
    return schema


# Raw JSON text put where a value goes. Lone surrogates as escapes and as raw UTF-8 bytes.
HOSTILE: tuple[str, ...] = (
    deep(MAX_JSON_DEPTH), deep(MAX_JSON_DEPTH + 1), deep(200), deep(256), deep(1100),
    _deep_object(MAX_JSON_DEPTH + 1), _deep_object(300),
    "123456789012345678901234567890", "-123456789012345678901234567890", "18446744073709551615",
    "18446744073709551616", "-9223372036854775809", "1e308", "-1e308", "1e400", "1e-400",
    "4.9e-324", "-0", "0.5", "NaN", "Infinity", "-Infinity",
    '"\\ud800"', '"a\\udfffb"', '"\\udc00\\ud800"', '"\xed\xa0\x80"',
    '"' + "x" * 100_000 + '"', '"' + "\\u00e9" * 20_000 + '"', '["' + "y" * 5000 + '"]',
    "[]", "{}", '""', '"text"', "true", "false", "null", "0", "-1", "2", '[1,"a",{}]',
    '{"type":"json","value":{}}', '[[1,2],[3]]',
)


def deep_schemas() -> list[str]:
    """Schemas around the schema depth limit (as raw JSON text)."""
    levels = (MAX_SCHEMA_DEPTH - 1, MAX_SCHEMA_DEPTH + 1, MAX_JSON_DEPTH - 8)
    return [jsonio.dumps(deep_schema(n)).decode() for n in levels]


def _fields(model: Any, *prefix: str | int) -> list[Path]:
    return [(*prefix, name) for name in model.model_fields]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
TEXT_PARAMS = {"inputs": "hi", "parameters": {"max_new_tokens": 4}}
TRITON_INFER = {
    "inputs": [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
        {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
         "data": ['{"max_tokens": 4}']},
    ],
}
TRITON_GENERATE = {"text_input": "hi", "max_tokens": 4}
CHAT_EXTRA: list[Path] = [
    ("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0),
    ("messages", 1, "tool_calls", 0, "function", "arguments"),
    ("response_format", "json_schema", "schema"), ("response_format", "type"),
    ("tools", 0, "function", "parameters"), ("tools", 0, "function", "name"),
    ("tool_choice", "function", "name"), ("structured_outputs", "json"),
    ("structured_outputs", "grammar"), ("logit_bias", "5"), ("chat_template_kwargs", "x"),
]

# (path, base body, attacked fields)
ROUTES: list[tuple[str, dict[str, Any], list[Path]]] = [
    ("/v1/chat/completions", CHAT, _fields(ChatCompletionRequest) + CHAT_EXTRA),
    ("/v1/completions", COMPLETION,
     [*_fields(CompletionRequest), ("best_of",), ("prompt", 0), ("structured_outputs", "json")]),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4},
     [*_fields(ResponsesRequest), ("text", "format", "schema"), ("input", 0, "content")]),
    ("/tokenize", {"model": "tiny", "prompt": "hi"}, [("prompt",), ("messages",), ("model",)]),
    ("/detokenize", {"model": "tiny", "tokens": [1, 2]}, [("tokens",), ("tokens", 0)]),
    ("/generate", TEXT_PARAMS,
     [("inputs",), *_fields(Parameters, "parameters"), ("parameters", "grammar", "value"),
      ("parameters", "grammar", "type")]),
    ("/generate_stream", TEXT_PARAMS, [("inputs",), *_fields(Parameters, "parameters")]),
    ("/", TEXT_PARAMS, [("inputs",), ("stream",), *_fields(Parameters, "parameters")]),
    ("/v2/models/tiny/infer", TRITON_INFER,
     [("id",), ("parameters",), ("outputs",), ("inputs", 0, "data"), ("inputs", 0, "data", 0),
      ("inputs", 0, "shape"), ("inputs", 0, "datatype"), ("inputs", 1, "data", 0),
      ("inputs", 2), *[("parameters", knob) for knob in KNOBS]]),
    ("/v2/models/tiny/generate", TRITON_GENERATE,
     [("text_input",), ("parameters",), *[(knob,) for knob in KNOBS]]),
    ("/v2/models/tiny/generate_stream", TRITON_GENERATE, [("text_input",), ("stream",),
     ("max_tokens",), ("sampling_parameters",), ("structured_outputs",)]),
    ("/infer", TEXT_PARAMS,
     [("inputs",), ("input_id",), ("stream",), ("id",), *_fields(InferParameters, "parameters")]),
    ("/infer_token", {"input_id": [1, 2], "parameters": {"max_new_tokens": 4}},
     [("input_id",), ("input_id", 0), *_fields(InferParameters, "parameters")]),
    ("/v1/tokenizer", {"inputs": "hi"}, [("inputs",)]),
    ("/generate", {"prompt": "hi", "max_tokens": 4}, _fields(VllmGenerateRequest)),
    ("/invocations", TEXT_PARAMS,
     [("inputs",), ("inputs", 0), ("adapters",), ("stream",), *_fields(LmiParameters, "parameters"),
      ("parameters", "structured_outputs", "json")]),
    ("/invocations", CHAT, [("messages",), ("messages", 0, "content"), ("max_tokens",),
                            ("response_format", "json_schema", "schema")]),
    ("/predictions/tiny", TEXT_PARAMS, [("inputs",), *_fields(LmiParameters, "parameters")]),
]
TARGETS = [(path, base, field) for path, base, fields in ROUTES for field in fields]


def spliced(base: dict[str, Any], field: Path, raw: str) -> bytes:
    """`base` with the value at `field` replaced by the raw JSON text `raw`."""
    body = copy.deepcopy(base)
    _put(body, field, SENTINEL)
    text = jsonio.dumps(body).decode()
    return text.replace(jsonio.dumps(SENTINEL).decode(), raw, 1).encode(errors="surrogatepass")


def _put(node: Any, field: Path, value: object) -> None:
    *parents, last = field
    for step, following in zip(parents, field[1:], strict=True):
        node = _child(node, step, following)
    if isinstance(node, list) and isinstance(last, int):
        while len(node) <= last:
            node.append({})
        node[last] = value
    elif isinstance(node, dict):
        node[last] = value


def _child(node: Any, step: str | int, following: str | int) -> Any:
    fresh: Any = [] if isinstance(following, int) else {}
    if isinstance(node, list) and isinstance(step, int):
        while len(node) <= step:
            node.append(copy.deepcopy(fresh))
        if not isinstance(node[step], list | dict):
            node[step] = fresh
        return node[step]
    if isinstance(node, dict):
        if not isinstance(node.get(step), list | dict):
            node[step] = fresh
        return node[step]
    return fresh  # the base has a scalar here: the splice lands in a throw-away node


def cases() -> st.SearchStrategy[tuple[str, bytes]]:
    """One hostile value at one documented field of one route (drawn by index: the values are
    too large for hypothesis' strategy reprs)."""
    values = [*HOSTILE, *deep_schemas()]
    return st.builds(
        lambda target, value: (TARGETS[target][0], spliced(*TARGETS[target][1:], values[value])),
        st.integers(0, len(TARGETS) - 1), st.integers(0, len(values) - 1),
    )


def _string_holding(schema_text: str) -> str:
    return jsonio.dumps(schema_text).decode()


def _triton_sampling(schema_text: str) -> str:
    return _string_holding('{"max_tokens":4,"structured_outputs":{"json":' + schema_text + "}}")


# (path, base body, where the schema goes, how the schema text is written there)
SCHEMA_TARGETS: list[tuple[str, dict[str, Any], Path, Any]] = [
    ("/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     ("response_format", "json_schema", "schema"), str),
    ("/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"},
     ("tools", 0, "function", "parameters"), str),
    ("/v1/chat/completions", CHAT, ("structured_outputs", "json"), _string_holding),
    ("/v1/completions", COMPLETION, ("structured_outputs", "json"), str),
    ("/v1/responses",
     {"model": "tiny", "input": "hi", "max_output_tokens": 4,
      "text": {"format": {"type": "json_schema", "name": "x"}}},
     ("text", "format", "schema"), str),
    ("/generate",
     {"inputs": "hi", "parameters": {"max_new_tokens": 4, "grammar": {"type": "json"}}},
     ("parameters", "grammar", "value"), _string_holding),
    ("/generate_stream",
     {"inputs": "hi", "parameters": {"max_new_tokens": 4, "grammar": {"type": "json"}}},
     ("parameters", "grammar", "value"), str),
    ("/v2/models/tiny/generate", TRITON_GENERATE, ("structured_outputs",),
     lambda text: _string_holding('{"json":' + text + "}")),
    ("/v2/models/tiny/infer", TRITON_INFER, ("inputs", 1, "data", 0), _triton_sampling),
    ("/invocations", TEXT_PARAMS, ("parameters", "json_schema"), str),
    ("/invocations", TEXT_PARAMS, ("parameters", "structured_outputs", "json"), _string_holding),
]


def schema_cases() -> list[tuple[str, bytes, int]]:
    """Every way a JSON schema reaches the engine, with schemas around the schema depth limit:
    (path, body, levels of the schema). The limit counts the schema the engine gets: tool
    parameters are wrapped a few levels deeper (tool_choice "required": an array of calls),
    as vLLM does; a margin of 8 levels below the limit passes everywhere."""
    levels = (MAX_SCHEMA_DEPTH - 9, MAX_SCHEMA_DEPTH + 1, MAX_JSON_DEPTH - 8)
    return [
        (path, spliced(base, slot, write(jsonio.dumps(deep_schema(n)).decode())), n)
        for path, base, slot, write in SCHEMA_TARGETS
        for n in levels
    ]
