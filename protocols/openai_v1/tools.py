"""Tool calling for chat completions, as vLLM checks it: `tools` and `tool_choice` into a
`ToolPlan`, and the assistant turns' earlier calls. What the plan means and how answers are read
is shared with the other protocols (protocols/common/tools.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from protocols.common.tools import (
    PARSER_SETTING,
    Function,
    Mode,
    ToolPlan,
    check_parameters,
    new_call_id,
)
from protocols.openai_v1 import schema
from server.core.errors import InvalidRequest
from server.core.types import ToolCall
from server.http import jsonio

NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


# ---- planning: chat completions ---------------------------------------------------------------


def chat_plan(
    body: schema.ChatCompletionRequest, *, tool_call_parser: str | None
) -> ToolPlan:
    """vLLM's checks of `tools` and `tool_choice` (its messages), then ours: parameters must be
    JSON schemas, and `auto` needs a configured parser. An absent or null `tool_choice` with
    tools is `auto` (vLLM drops the calls of a null one; OpenAI treats it as the default)."""
    tools = body.tools
    if tools is not None and not tools:
        raise InvalidRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            param="tools",
        )
    choice = body.tool_choice
    if tools and (choice is None or "tool_choice" not in body.model_fields_set):
        choice = "auto"
    if choice is None or choice == "none":
        return ToolPlan(functions=_functions(tools or []))
    if not tools:
        raise InvalidRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    functions = _functions(tools)
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, dict):
        name = _named_choice(choice, functions)
        return ToolPlan(mode="named", functions=functions, function=name, parallel=parallel)
    if choice != "auto" and choice != "required":
        raise InvalidRequest(
            f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
            "\"required\" are supported.",
            param="tool_choice",
        )
    if choice == "auto" and tool_call_parser is None:
        raise InvalidRequest(
            f'"auto" tool choice requires {PARSER_SETTING} to be set in the server '
            "configuration (vLLM: --enable-auto-tool-choice --tool-call-parser).",
            param="tool_choice",
        )
    mode: Mode = "auto" if choice == "auto" else "required"
    return ToolPlan(mode=mode, functions=functions, parallel=parallel)


def _named_choice(choice: dict[str, Any], functions: Sequence[Function]) -> str:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {NAMED_USAGE}",
            param="tool_choice.function",
        )
    if "name" not in function:
        raise InvalidRequest(
            f"Expected field `name` in `function` in `tool_choice`! {NAMED_USAGE}",
            param="tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise InvalidRequest(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {NAMED_USAGE}",
            param="tool_choice.function.name",
        )
    if name not in {f.name for f in functions}:
        raise InvalidRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )
    return name


def _functions(tools: Sequence[schema.ToolParam]) -> tuple[Function, ...]:
    if not tools:  # most requests
        return ()
    for index, tool in enumerate(tools):
        check_parameters(tool.function.parameters, f"tools.{index}.function.parameters")
    return tuple(
        Function(
            name=tool.function.name,
            description=tool.function.description,
            parameters=tool.function.parameters,
            strict=tool.function.strict,
        )
        for tool in tools
    )


# ---- history ------------------------------------------------------------------------------------


def history_calls(message: schema.ChatMessageIn, index: int) -> tuple[ToolCall, ...]:
    """An assistant turn's earlier calls; arguments given as an object become JSON text."""
    calls = []
    for number, call in enumerate(message.tool_calls or ()):
        if call.type != "function":
            raise InvalidRequest(
                "chat completions only support assistant tool_calls of type 'function'.",
                param=f"messages.{index}.tool_calls.{number}.type",
            )
        arguments = call.function.arguments
        text = arguments if isinstance(arguments, str) else jsonio.dumps(arguments or {}).decode()
        calls.append(ToolCall(id=call.id or new_call_id(), name=call.function.name, arguments=text))
    return tuple(calls)


def check_tool_message(message: schema.ChatMessageIn, index: int) -> None:
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequest(
            "A message with role 'tool' must have a `tool_call_id`: the id of the call it "
            "answers.",
            param=f"messages.{index}.tool_call_id",
        )
