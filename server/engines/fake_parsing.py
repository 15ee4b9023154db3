"""The fake engine's output parsers and structured output, for unit tests only.

Parsers read Hermes-style markup whatever name is configured: `<think>…</think>` is reasoning
(when a reasoning parser is configured), each `<tool_call>{"name": …, "arguments": …}</tool_call>`
a tool call (when a tool-call parser is configured and the spec asks for auto tool calls).
Structured JSON output is a fixed example value of the schema, so translators can be tested on
what a constrained engine returns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from server.core.types import ParsedOutput, ParseSpec, ToolCallPiece

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_MARKERS = (THINK_START, THINK_END, CALL_START, CALL_END)


class FakeOutputParser:
    def __init__(self, spec: ParseSpec, *, reasoning: bool, tools: bool) -> None:
        self._spec = spec
        self._reasoning = reasoning and spec.reasoning
        self._split_reasoning = reasoning
        self._tools = tools and spec.auto_tools
        self._pending = ""  # streamed text not parsed yet (may hold the start of a marker)
        self._in_think = False
        self._calls = 0
        self._called = False  # streamed text after a call is dropped, as Hermes does

    def parse(
        self, text: str, token_ids: Sequence[int], *, prompt_token_ids: Sequence[int] = ()
    ) -> ParsedOutput:
        """A whole answer reads as the same text streamed in one piece (so they agree)."""
        fresh = FakeOutputParser(self._spec, reasoning=self._split_reasoning, tools=self._tools)
        parsed = fresh.parse_delta(text, token_ids, prompt_token_ids=None, finished=True)
        return parsed or ParsedOutput()

    def parse_delta(
        self,
        text: str,
        token_ids: Sequence[int],
        *,
        prompt_token_ids: Sequence[int] | None,
        finished: bool,
    ) -> ParsedOutput | None:
        self._pending += text
        reasoning, content, calls = "", "", []
        while self._pending:
            progressed, r, c, call = self._step(finished)
            reasoning, content = reasoning + r, content + ("" if self._called else c)
            if call is not None:
                calls.append(call)
            if not progressed:
                break
        if not (reasoning or content or calls):
            return None
        return ParsedOutput(
            reasoning=(reasoning or None) if self._reasoning else None,
            content=content or None,
            tool_calls=tuple(calls),
        )

    def _step(self, finished: bool) -> tuple[bool, str, str, ToolCallPiece | None]:
        """Consume what can be decided from the pending text: (progressed, reasoning, content,
        tool call)."""
        text = self._pending
        if self._split_reasoning and text.startswith(THINK_START):
            self._in_think, self._pending = True, text[len(THINK_START) :]
            return True, "", "", None
        if self._in_think:
            return self._think_step(text, finished)
        if self._tools and text.startswith(CALL_START):
            return self._call_step(text, finished)
        enabled = [THINK_START] if self._split_reasoning else []
        enabled += [CALL_START] if self._tools else []
        starts = [text.find(marker) for marker in enabled if marker in text]
        if starts:
            cut = min(starts)
            self._pending = text[cut:]
            return cut > 0, "", text[:cut], None
        keep = 0 if finished else _partial_marker(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return False, "", text[: len(text) - keep], None

    def _think_step(self, text: str, finished: bool) -> tuple[bool, str, str, None]:
        end = text.find(THINK_END)
        if end >= 0:
            self._in_think, self._pending = False, text[end + len(THINK_END) :]
            return True, text[:end], "", None
        keep = 0 if finished else _partial_marker(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return False, text[: len(text) - keep], "", None

    def _call_step(self, text: str, finished: bool) -> tuple[bool, str, str, ToolCallPiece | None]:
        end = text.find(CALL_END)
        if end < 0:
            if finished:
                self._pending = ""
            return False, "", (text if finished else ""), None
        self._pending = text[end + len(CALL_END) :]
        call = self._call(text[len(CALL_START) : end])
        self._called = self._called or call is not None
        return True, "", ("" if call else text[: end + len(CALL_END)]), call

    def _call(self, body: str) -> ToolCallPiece | None:
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = json.dumps(data.get("arguments", {}), ensure_ascii=False)
        self._calls += 1
        return ToolCallPiece(
            index=self._calls - 1, id=f"fake-call-{self._calls}", name=data["name"],
            arguments=arguments,
        )


def _partial_marker(text: str) -> int:
    """How many trailing characters could begin a marker (held back until decided)."""
    for size in range(min(len(text), max(map(len, _MARKERS)) - 1), 0, -1):
        tail = text[-size:]
        if any(marker.startswith(tail) for marker in _MARKERS):
            return size
    return 0


def example_json(schema_text: str) -> str:
    """A fixed value of the schema, written without whitespace."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return "{}"
    return json.dumps(_example(schema), ensure_ascii=False, separators=(",", ":"))


def _example(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return _example(schema[key][0])
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    return _example_of_type(str(kind), schema)


def _example_of_type(kind: str, schema: dict[str, Any]) -> Any:
    if kind == "string":
        return "text"[: schema.get("maxLength", 4)].ljust(schema.get("minLength", 0), "x")
    if kind in ("integer", "number"):
        value = max(int(schema.get("minimum", 1)), min(1, int(schema.get("maximum", 1))))
        return value if kind == "integer" else value + 0.5
    if kind == "boolean":
        return True
    if kind == "array":
        return [_example(schema.get("items", {}))] * max(1, schema.get("minItems", 1))
    if kind == "object":
        return {key: _example(value) for key, value in schema.get("properties", {}).items()}
    return None
