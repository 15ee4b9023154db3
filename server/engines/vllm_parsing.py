"""vLLM's own output parsers (reasoning, tool calls) behind the `OutputParser` port.

vLLM composes the configured tool-call parser (`--tool-call-parser`) and reasoning parser
(`--reasoning-parser`) into one `Parser` class; its API server builds one per request (and per
choice) and calls `parse` on a whole answer or `parse_delta` on each streamed piece, handing it
its own `ChatCompletionRequest`. This module does the same with a minimal request carrying what
the parsers read: the tools, the tool choice, `include_reasoning` and the template variables.

Imported only by `server.engines.vllm`, after vLLM itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from server.core.errors import EngineError
from server.core.types import ParsedOutput, ParseSpec, ToolCallPiece

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.abstract_parser import Parser
    from vllm.tokenizers import TokenizerLike

logger = logging.getLogger(__name__)


class ParserFactory:
    """The composed parser class of the configured names, checked against the tokenizer once."""

    def __init__(
        self,
        *,
        tool_call_parser: str | None,
        reasoning_parser: str | None,
        tokenizer: TokenizerLike,
        model_config: ModelConfig,
    ) -> None:
        from vllm.parser import ParserManager

        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self._tokenizer = tokenizer
        self._model_config = model_config
        self._cls: type[Parser] | None = None
        if tool_call_parser or reasoning_parser:
            try:
                self._cls = ParserManager.get_parser(
                    tool_parser_name=tool_call_parser,
                    reasoning_parser_name=reasoning_parser,
                    enable_auto_tools=bool(tool_call_parser),
                    model_name=model_config.model,
                    tokenizer=tokenizer,
                )
            except Exception as exc:
                raise EngineError(
                    f"the output parsers (tool calls {tool_call_parser!r}, reasoning "
                    f"{reasoning_parser!r}) cannot work with this model: {exc}"
                ) from exc

    def applies(self, spec: ParseSpec) -> bool:
        return self._cls is not None and (
            self.reasoning_parser is not None
            or (spec.auto_tools and self.tool_call_parser is not None)
        )

    def parser(self, spec: ParseSpec) -> VllmOutputParser | None:
        if self._cls is None or not self.applies(spec):
            return None
        request = self._request(spec)
        parser = self._new(request, spec)
        return VllmOutputParser(parser, request, auto_tools=spec.auto_tools)

    def skips_special_tokens(self, spec: ParseSpec, default: bool) -> bool:
        """What the parsers' `adjust_request` makes of `skip_special_tokens` (Hermes keeps
        special tokens when tools may be called: its markers may be special tokens)."""
        if self._cls is None or not self.applies(spec):
            return default
        request = self._request(spec)
        request.skip_special_tokens = default
        parser = self._new(request, spec)
        try:
            adjusted = parser.adjust_request(request)
        except Exception:  # an adjustment we cannot take leaves decoding as it is
            logger.debug("adjust_request of the output parser failed", exc_info=True)
            return default
        return bool(adjusted.skip_special_tokens)

    def _new(self, request: ChatCompletionRequest, spec: ParseSpec) -> Parser:
        assert self._cls is not None
        tools: Any = request.tools
        return self._cls(
            self._tokenizer, tools, chat_template_kwargs=dict(spec.chat_template_kwargs),
            model_config=self._model_config,
        )

    def _request(self, spec: ParseSpec) -> ChatCompletionRequest:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        tools = json.loads(spec.tools) if spec.tools else None
        return ChatCompletionRequest(
            model=self._model_config.served_model_name or "",
            messages=[{"role": "user", "content": ""}],
            tools=tools or None,
            tool_choice="auto" if spec.auto_tools and tools else "none",
            include_reasoning=spec.reasoning,
            chat_template_kwargs=dict(spec.chat_template_kwargs) or None,
        )


class VllmOutputParser:
    """One choice's parser. vLLM's parsers may raise on odd output: the text then passes as
    content, as a parser that found nothing would leave it."""

    def __init__(self, parser: Parser, request: ChatCompletionRequest, *, auto_tools: bool):
        self._parser = parser
        self._request = request
        self._auto_tools = auto_tools

    def parse(
        self, text: str, token_ids: Sequence[int], *, prompt_token_ids: Sequence[int] = ()
    ) -> ParsedOutput:
        try:
            if prompt_token_ids:
                self._parser.set_prompt_token_ids(list(prompt_token_ids))
            reasoning, content, calls = self._parser.parse(
                text, self._request, enable_auto_tools=self._auto_tools,
                model_output_token_ids=list(token_ids),
            )
        except Exception:
            logger.warning("the output parser failed on a whole answer", exc_info=True)
            return ParsedOutput(content=text)
        pieces = tuple(
            ToolCallPiece(index=i, id=call.id, name=call.name, arguments=call.arguments)
            for i, call in enumerate(calls or ())
        )
        if not self._request.include_reasoning:  # vLLM's serving layer drops it
            reasoning = None
        return ParsedOutput(reasoning=reasoning, content=content, tool_calls=pieces)

    def parse_delta(
        self,
        text: str,
        token_ids: Sequence[int],
        *,
        prompt_token_ids: Sequence[int] | None,
        finished: bool,
    ) -> ParsedOutput | None:
        try:
            delta = self._parser.parse_delta(
                text, list(token_ids), self._request,
                prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
                finished=finished,
            )
        except Exception:
            logger.warning("the output parser failed on a streamed piece", exc_info=True)
            return ParsedOutput(content=text) if text else None
        return None if delta is None else _from_delta(delta)


def _from_delta(delta: DeltaMessage) -> ParsedOutput:
    pieces = []
    for call in delta.tool_calls:
        function: Any = call.function
        pieces.append(
            ToolCallPiece(
                index=call.index,
                id=call.id,
                name=function.name if function is not None else None,
                arguments=(function.arguments or "") if function is not None else "",
            )
        )
    return ParsedOutput(reasoning=delta.reasoning, content=delta.content, tool_calls=tuple(pieces))
