"""Tool calling as vLLM serves it, made reliable: what every protocol with tools shares (OpenAI's
chat completions and Responses API, Anthropic's Messages API).

- `auto`: the model writes freely and the configured tool-call parser (vLLM's own classes,
  through the engine) finds the calls in its text.
- `required` (Anthropic's `any`) and a named function (Anthropic's `tool`): decoding is
  constrained to JSON, vLLM's "JSON schema" way: the named function's `parameters`, or an array
  of `{"name", "parameters"}` objects. The engine also bounds the schema to the token budget
  (`fit_budget`), so the arguments are always complete JSON that validates against the schema,
  whatever the model (vLLM's own server returns truncated or non-object arguments on a model
  that never closes a string). Neither needs a tool-call parser. Arguments are the model's JSON
  text as written, streamed or not, so the streamed pieces always join to the non-streamed
  arguments.
- `none`: tools are still rendered into the prompt (as vLLM does); the answer is text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from server.core.engine import OutputParser
from server.core.errors import InvalidRequest
from server.core.frozen import quick_init
from server.core.types import ParsedOutput, ParseSpec, StructuredOutput, ToolCallPiece
from server.http import jsonio

Mode = Literal["none", "auto", "required", "named"]
PARSER_SETTING = "ModelConfig.toolCallParser"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def new_call_id() -> str:
    """vLLM's tool-call id: `chatcmpl-tool-` and 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None

    def as_chat_tool(self) -> dict[str, Any]:
        """The tool as chat templates receive it (vLLM: `description` and `parameters` always
        present, `strict` only when set)."""
        function: dict[str, Any] = {
            "name": self.name, "description": self.description, "parameters": self.parameters,
        }
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ToolPlan:
    """What a request asks of tools, validated."""

    mode: Mode = "none"
    functions: tuple[Function, ...] = ()
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def tools_json(self) -> str | None:
        """The tool list for the chat template, as JSON text."""
        if not self.functions:
            return None
        return jsonio.dumps([f.as_chat_tool() for f in self.functions]).decode()

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def structured(self) -> StructuredOutput | None:
        """Constrained decoding for a forced call (vLLM's `get_json_schema_from_tools`)."""
        if self.mode == "named":
            chosen = next(f for f in self.functions if f.name == self.function)
            return _fitted(chosen.parameters or EMPTY_PARAMETERS)
        if self.mode == "required":
            calls: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": {"type": "object", "anyOf": [_call_schema(f) for f in self.functions]},
            }
            if not self.parallel:
                calls["maxItems"] = 1
            if defs := _shared_definitions(self.functions):
                calls["$defs"] = defs  # where the tools' `#/$defs/...` references now point
            return _fitted(calls)
        return None

    def parse_spec(self, *, reasoning: bool, template_kwargs: tuple[Any, ...]) -> ParseSpec:
        """How the engine's parsers read the answer: auto tool calls only in `auto` mode (a
        forced answer is JSON, read here); reasoning as the request wants it."""
        return ParseSpec(
            tools=self.tools_json,
            auto_tools=self.mode == "auto",
            reasoning=reasoning and not self.forced,
            chat_template_kwargs=template_kwargs,
        )


def _call_schema(function: Function) -> dict[str, Any]:
    parameters = {k: v for k, v in (function.parameters or EMPTY_PARAMETERS).items() if k != DEFS}
    return {
        "properties": {
            "name": {"type": "string", "enum": [function.name]},
            "parameters": parameters,
        },
        "required": ["name", "parameters"],
    }


DEFS = "$defs"


def _shared_definitions(functions: Sequence[Function]) -> dict[str, Any]:
    """Every tool's `$defs`, for the top of the calls' schema (vLLM's `_get_tool_schema_defs`):
    nested in `anyOf`, a tool's `#/$defs/...` references would not resolve."""
    shared: dict[str, Any] = {}
    for function in functions:
        defs = (function.parameters or {}).get(DEFS, {})
        if not isinstance(defs, dict):
            raise InvalidRequest(
                f"`$defs` in the parameters of tool '{function.name}' must be an object, got "
                f"{type(defs).__name__}.",
                param="tools",
            )
        for name, schema in defs.items():
            if name in shared and shared[name] != schema:
                raise InvalidRequest(
                    f"Tool definition '{name}' has multiple schemas, which is not supported.",
                    param="tools",
                )
            shared[name] = schema
    return shared


def _fitted(json_schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(json_schema=jsonio.dumps(json_schema).decode(), fit_budget=True)


def check_parameters(parameters: dict[str, Any] | None, param: str) -> None:
    """`parameters` must be a JSON schema (the OpenAI API's rule; vLLM only fails later, with
    an unhelpful grammar error)."""
    if parameters is None:
        return
    try:
        validator_for(parameters).check_schema(parameters)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise InvalidRequest(
            f"`parameters` is not a valid JSON schema: {exc.message} (at {where}).", param=param
        ) from None
    if parameters.get("type", "object") != "object":
        raise InvalidRequest("`parameters` must describe a JSON object.", param=param)


# ---- reading the answer --------------------------------------------------------------------------


class ChoiceReader:
    """One choice's answer split into reasoning, content and tool calls, whole or streamed."""

    def __init__(self, plan: ToolPlan, parser: OutputParser | None) -> None:
        self._plan = plan
        self._parser = parser
        self._text = ""  # a forced answer so far
        self._sent: dict[int, int] = {}  # forced calls: argument characters sent per call
        self._ids: dict[int, str] = {}  # call index → id
        self.called = False

    # -- whole answers --

    def whole(
        self, text: str, token_ids: Sequence[int], prompt_token_ids: Sequence[int] = (),
        *, unfinished: bool = False,
    ) -> ParsedOutput:
        """`unfinished`: keep a forced call the token limit cut off (as a stream shows it)."""
        plan = self._plan
        if plan.mode == "named":
            calls = [(plan.function or "", text)] if text.strip() else []
            return self._with_calls(ParsedOutput(content=""), calls)
        if plan.mode == "required":
            kept = [(name, args) for name, args, done in scan_calls(text) if done or unfinished]
            return self._with_calls(ParsedOutput(content=""), kept)
        parsed = (
            self._parser.parse(text, token_ids, prompt_token_ids=prompt_token_ids)
            if self._parser
            else ParsedOutput(content=text)
        )
        pieces = tuple(
            ToolCallPiece(index=i, id=p.id or new_call_id(), name=p.name, arguments=p.arguments)
            for i, p in enumerate(parsed.tool_calls[: 1 if not plan.parallel else None])
        )
        self.called = bool(pieces)
        return ParsedOutput(reasoning=parsed.reasoning, content=parsed.content, tool_calls=pieces)

    def _with_calls(self, parsed: ParsedOutput, calls: list[tuple[str, str]]) -> ParsedOutput:
        pieces = tuple(
            ToolCallPiece(index=i, id=new_call_id(), name=name, arguments=args)
            for i, (name, args) in enumerate(calls)
        )
        self.called = bool(pieces)
        return ParsedOutput(reasoning=parsed.reasoning, content=parsed.content, tool_calls=pieces)

    # -- streamed answers --

    @property
    def passes_text(self) -> bool:
        """`piece` gives a delta's text as the content, nothing else (no parser, no forced
        call): a stream may skip it for deltas with text."""
        return self._parser is None and not self._plan.forced

    def piece(
        self,
        text: str,
        token_ids: Sequence[int],
        *,
        prompt_token_ids: Sequence[int] | None,
        finished: bool,
    ) -> ParsedOutput | None:
        if self._plan.forced:
            return self._forced_piece(text)
        if self._parser is None:
            return ParsedOutput(content=text) if text else None
        parsed = self._parser.parse_delta(
            text, token_ids, prompt_token_ids=prompt_token_ids, finished=finished
        )
        if parsed is None or not parsed.tool_calls:
            return parsed
        kept = [p for p in parsed.tool_calls if self._plan.parallel or p.index == 0]
        calls = tuple(self._stamp(p) for p in kept)
        if not (calls or parsed.content or parsed.reasoning):
            return None
        self.called = self.called or bool(calls)
        return ParsedOutput(reasoning=parsed.reasoning, content=parsed.content, tool_calls=calls)

    def _stamp(self, piece: ToolCallPiece) -> ToolCallPiece:
        """The first piece of each call carries its id (the parser's, else a new one)."""
        if piece.index in self._ids or piece.name is None:
            return piece
        self._ids[piece.index] = piece.id or new_call_id()
        return ToolCallPiece(
            index=piece.index, id=self._ids[piece.index], name=piece.name,
            arguments=piece.arguments,
        )

    def _forced_piece(self, text: str) -> ParsedOutput | None:
        self._text += text
        if self._plan.mode == "named":
            found = [(self._plan.function or "", self._text, False)] if self._text.strip() else []
        else:
            found = scan_calls(self._text)
        pieces = []
        for index, (name, arguments, _) in enumerate(found):
            sent = self._sent.get(index)
            if sent is None:
                self._ids[index] = new_call_id()
                pieces.append(
                    ToolCallPiece(index=index, id=self._ids[index], name=name, arguments=arguments)
                )
            elif len(arguments) > sent:
                pieces.append(ToolCallPiece(index=index, arguments=arguments[sent:]))
            self._sent[index] = len(arguments)
        if not pieces:
            return None
        self.called = True
        return ParsedOutput(tool_calls=tuple(pieces))


def finish_reason(reader: ChoiceReader, plan: ToolPlan, engine_reason: str) -> str:
    """vLLM's rule: "tool_calls" when calls were made and the model stopped by itself, except
    for a named function ("stop", as OpenAI)."""
    if reader.called and plan.mode in ("auto", "required") and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


# ---- the forced-call JSON -----------------------------------------------------------------------


def scan_calls(text: str) -> list[tuple[str, str, bool]]:
    """The calls of a (possibly unfinished) `required` answer, `[{"name": …, "parameters": …}, …]`:
    (name, arguments text so far, whether the call is complete), for every call whose name is
    known and whose arguments have begun. Arguments are the text of the `parameters` value as
    the model wrote it."""
    scanner = _Scanner(text)
    calls: list[tuple[str, str, bool]] = []
    if not scanner.expect("["):
        return calls
    while True:
        scanner.skip(",")
        if not scanner.expect("{"):
            return calls
        call = scanner.call()
        if call is None:
            return calls
        calls.append(call)
        if not call[2]:
            return calls


class _Scanner:
    """Just enough of a JSON reader for the forced-call array (compact or not)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def skip(self, extra: str = "") -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n" + extra:
            self.at += 1

    def expect(self, char: str) -> bool:
        self.skip()
        if self.text.startswith(char, self.at):
            self.at += 1
            return True
        return False

    def call(self) -> tuple[str, str, bool] | None:
        """The members of one call object; the scanner is inside its `{`."""
        name: str | None = None
        arguments: str | None = None
        while True:
            self.skip(",")
            key = self.string()
            if key is None or not self.expect(":"):
                return _partial(name, arguments)
            self.skip()
            start = self.at
            end = self.value_end(start)
            if key == "name":
                name = _decoded(self.text[start:end]) if end is not None else None
            elif key == "parameters":
                arguments = self.text[start : end if end is not None else len(self.text)]
            if end is None:
                return _partial(name, arguments)
            self.at = end
            self.skip()
            if self.expect("}"):
                if name is None or arguments is None:
                    return None
                return name, arguments, True

    def string(self) -> str | None:
        self.skip()
        start = self.at
        end = self.value_end(start)
        if end is None or not self.text.startswith('"', start):
            return None
        self.at = end
        return _decoded(self.text[start:end])

    def value_end(self, start: int) -> int | None:
        """Where the JSON value starting at `start` ends, None if it has not ended yet."""
        depth, i, text = 0, start, self.text
        while i < len(text):
            char = text[i]
            if char == '"':
                i = _string_end(text, i)
                if i < 0:
                    return None
                if depth == 0:
                    return i
                continue
            if char in "[{":
                depth += 1
            elif char in "]}":
                depth -= 1
                if depth <= 0:
                    return i + 1 if depth == 0 else i
            elif char in ", \t\r\n" and depth == 0 and i > start:
                return i
            i += 1
        return None


def _string_end(text: str, start: int) -> int:
    """The index after the string that opens at `start`, -1 if it is not closed yet."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return -1


def _partial(name: str | None, arguments: str | None) -> tuple[str, str, bool] | None:
    if name is None or arguments is None:
        return None
    return name, arguments, False


def _decoded(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None
