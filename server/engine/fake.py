"""FakeEngine: deterministic, dependency-free, scriptable. For unit and timing tests only.

Token i of choice c is the ((i + c) mod len)-th word of the rendered prompt, each followed by a
space; with an adapter active, the first token is "[<adapter>]". Stop strings, max_new_tokens and
n are honoured. Every request and abort is recorded for assertions.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from server.core.errors import (
    AdapterInvalid,
    ContextLengthExceeded,
    EngineError,
    GatewayError,
    ServiceUnavailable,
)
from server.core.types import (
    AdapterHandle,
    ChatPrompt,
    ChoiceEnd,
    Delta,
    Done,
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    Started,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    Usage,
)

VOCAB = 1000


@dataclass(kw_only=True)
class FakeScript:
    token_delay_s: float = 0.0
    fail_after: int | None = None  # raise EngineError after N tokens
    reject_with: GatewayError | None = None  # raise before the first token
    hang_after: int | None = None  # block after N tokens until aborted
    bad_adapter_paths: set[str] = field(default_factory=set)
    dead_flag_path: str | None = None  # check_health fails while this file exists


def render(prompt: TextPrompt | ChatPrompt | TokenPrompt) -> str:
    if isinstance(prompt, TextPrompt):
        return prompt.text
    if isinstance(prompt, ChatPrompt):
        return " ".join(f"{m.role}: {m.content}" for m in prompt.messages)
    return " ".join(f"t{t}" for t in prompt.token_ids)


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % VOCAB


class FakeEngine:
    def __init__(self, script: FakeScript | None = None, *, model_name: str = "fake") -> None:
        self.script = script or FakeScript()
        self.model_name = model_name
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.adapters: dict[int, AdapterHandle] = {}
        self.pinned: set[int] = set()
        self.running = 0
        self._aborts: dict[str, asyncio.Event] = {}

    async def generate(
        self, request: GenerationRequest, engine_request_id: str, adapter: AdapterHandle | None
    ) -> AsyncGenerator[GenerationEvent, None]:
        self.requests.append(request)
        if self.script.reject_with is not None:
            raise self.script.reject_with
        words = (render(request.prompt).split() or ["empty"])[:4096]
        if len(words) >= self.info().max_model_len:
            raise ContextLengthExceeded("prompt is longer than the context")
        abort = self._aborts.setdefault(engine_request_id, asyncio.Event())
        self.running += 1
        try:
            yield Started(prompt_token_ids=tuple(token_id(w) for w in words))
            completion = 0
            for choice in range(request.sampling.n):
                async for event in self._choice(request, words, choice, adapter, abort):
                    completion += isinstance(event, Delta)
                    yield event
            yield Done(usage=Usage(prompt_tokens=len(words), completion_tokens=completion))
        finally:
            self.running -= 1
            self._aborts.pop(engine_request_id, None)

    async def _choice(
        self,
        request: GenerationRequest,
        words: list[str],
        choice: int,
        adapter: AdapterHandle | None,
        abort: asyncio.Event,
    ) -> AsyncIterator[GenerationEvent]:
        limit = request.sampling.max_new_tokens or 16
        text = ""
        for i in range(limit):
            await self._pace(i, abort)
            if abort.is_set():
                yield ChoiceEnd(choice=choice, reason=FinishReason.ABORT)
                return
            word = f"[{adapter.name}]" if adapter and i == 0 else words[(i + choice) % len(words)]
            piece = word + " "
            stop = next((s for s in request.sampling.stop if s in text + piece), None)
            if stop is not None:
                yield ChoiceEnd(choice=choice, reason=FinishReason.STOP, matched_stop=stop)
                return
            text += piece
            yield _delta(choice, piece, request.output.logprobs)
        yield ChoiceEnd(choice=choice, reason=FinishReason.LENGTH)

    async def _pace(self, index: int, abort: asyncio.Event) -> None:
        script = self.script
        if script.fail_after is not None and index >= script.fail_after:
            raise EngineError("scripted failure")
        if script.hang_after is not None and index >= script.hang_after:
            await abort.wait()
        elif script.token_delay_s:
            try:
                await asyncio.wait_for(abort.wait(), script.token_delay_s)
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(0)

    async def abort(self, engine_request_id: str) -> None:
        self.aborted.append(engine_request_id)
        event = self._aborts.get(engine_request_id)
        if event is not None:
            event.set()

    async def check_health(self) -> None:
        flag = self.script.dead_flag_path
        if flag is not None and os.path.exists(flag):  # noqa: ASYNC240 (a stat, test only)
            raise ServiceUnavailable("engine is dead: scripted failure")

    async def add_adapter(self, adapter: AdapterHandle) -> None:
        if adapter.path in self.script.bad_adapter_paths:
            raise AdapterInvalid(f"Loading lora {adapter.name} failed")
        self.adapters[adapter.int_id] = adapter

    async def remove_adapter(self, adapter: AdapterHandle) -> None:
        self.adapters.pop(adapter.int_id, None)
        self.pinned.discard(adapter.int_id)

    async def pin_adapter(self, adapter: AdapterHandle) -> None:
        self.pinned.add(adapter.int_id)

    async def resident_adapters(self) -> set[int]:
        return set(self.adapters)

    async def tokenize(self, text: str | ChatPrompt, *, add_special_tokens: bool) -> list[int]:
        rendered = text if isinstance(text, str) else render(text)
        return [token_id(w) for w in rendered.split()]

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [f"t{t}" for t in token_ids]

    def info(self) -> EngineInfo:
        return EngineInfo(
            model_name=self.model_name,
            model_path=f"/models/{self.model_name}",
            max_model_len=512,
            vocab_size=VOCAB,
            dtype="float32",
            version="fake",
            max_lora_rank=8,
            max_loras=2,
            max_cpu_loras=4,
            max_num_seqs=32,
            block_size=16,
            eos_token_id=2,
        )

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, waiting=0, total_blocks=1024, free_blocks=1024)

    async def shutdown(self) -> None:
        for event in self._aborts.values():
            event.set()


def _delta(choice: int, piece: str, logprobs: int | None) -> Delta:
    tid = token_id(piece.strip())
    lp = (TokenLogprob(token_id=tid, token=piece, logprob=-0.5),) if logprobs is not None else ()
    return Delta(choice=choice, text=piece, token_ids=(tid,), logprobs=lp)
