"""FakeEngine: deterministic, dependency-free, scriptable. For unit and timing tests only.

Token i of choice c is the ((i + c) mod len)-th word of the rendered prompt, each followed by a
space; with an adapter active, the first token is "[<adapter>]". Each word of the prompt is a
token: the request's prompt budget (server/core/budget.py) fits them to the 512-token context as
on vLLM, truncation and refusals included. Stop strings, max_new_tokens and n are honoured.
Streamed requests get one delta per token (yielding to the event loop between tokens, as a real
engine's output handler does); others get each choice in one delta, as vLLM's final-only
outputs, with the token times in `Done.timing`. The latest requests and aborts are recorded for
tests' assertions; a server process (`create_engine`) records none, as no test can read them
there and keeping them costs the process garbage-collector passes under load (requests that
outlive hundreds of others: 7-11 µs per non-streamed request measured).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
import zlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Sequence
from dataclasses import dataclass, field, replace

from server.core.engine import fit_prompt
from server.core.errors import (
    AdapterInvalid,
    EngineError,
    GatewayError,
    InvalidRequest,
    ServiceUnavailable,
)
from server.core.types import (
    AdapterHandle,
    AdapterLoad,
    ChatPrompt,
    Delta,
    Done,
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    ParseSpec,
    Prompt,
    SamplingDefaults,
    Started,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    TokenTiming,
    Usage,
)
from server.engines.fake_parsing import FakeOutputParser, example_json

VOCAB = 1000
REMEMBERED = 1000
DEFAULT_MAX_TOKENS = 16  # for a request and a model without a limit (vLLM's: the whole room)


@dataclass(kw_only=True)
class FakeScript:
    token_delay_s: float = 0.0
    fail_after: int | None = None  # raise `fail_with` (default EngineError) after N tokens
    fail_with: Exception | None = None
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


@functools.lru_cache(maxsize=65536)
def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % VOCAB


@functools.lru_cache(maxsize=4096)
def _words_of(prompt: Prompt) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The prompt's words (at most 4096) and their token ids; prompts repeat in benchmarks."""
    words = tuple((render(prompt).split() or ["empty"])[:4096])
    return words, tuple(token_id(w) for w in words)


class FakeEngine:
    def __init__(
        self,
        script: FakeScript | None = None,
        *,
        model_name: str = "fake",
        model_path: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        remember: int = REMEMBERED,
    ) -> None:
        self.script = script or FakeScript()
        self.model_name = model_name
        self._info = replace(
            _info(model_name),
            defaults=_generation_defaults(model_path),
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        # the latest requests and aborts, for assertions (bounded: benchmarks run millions)
        self.requests: deque[GenerationRequest] = deque(maxlen=remember)
        self.aborted: deque[str] = deque(maxlen=remember)
        self.adapters: dict[int, AdapterHandle] = {}
        self.pinned: set[int] = set()
        self.running = 0
        self.step_count = 0  # requests started and ended: this engine's steps (tests add some)
        self._running_on: dict[str, int] = {}  # running requests per adapter name
        self._aborts: dict[str, asyncio.Event] = {}

    async def generate(
        self, request: GenerationRequest, engine_request_id: str, adapter: AdapterHandle | None
    ) -> AsyncGenerator[GenerationEvent, None]:
        self.requests.append(request)
        if self.script.reject_with is not None:
            raise self.script.reject_with
        _check_vocabulary(request.prompt)
        words, prompt_ids = _words_of(request.prompt)
        budget = fit_prompt(request, self._info, len(words), engine_default=DEFAULT_MAX_TOKENS)
        if budget.keep < len(words):  # truncated: the last words stay
            words, prompt_ids = words[-budget.keep :], prompt_ids[-budget.keep :]
        abort = self._aborts[engine_request_id] = asyncio.Event()
        self.running += 1
        self._count(adapter, 1)
        clock = _TokenClock()
        try:
            yield Started(
                prompt_token_ids=prompt_ids,
                prompt_logprobs=_prompt_logprobs(words, prompt_ids, request),
                max_tokens=budget.max_tokens,
            )
            if not request.stream:
                await _NEXT_TURN  # one turn of the loop per request, as one final output
            completion = 0
            for choice in range(request.sampling.n):
                tokens = _Tokens(request, words, prompt_ids, choice, adapter, budget.max_tokens)
                if request.stream and self._scripted():
                    async for delta in self._choice(tokens, abort, clock, streaming=True):
                        completion += len(delta.token_ids)
                        yield delta
                    continue
                if request.stream:  # unscripted: deltas computed once per distinct request
                    for delta in tokens.deltas():
                        await _NEXT_TURN  # as an output handler wakes its consumer once per step
                        if abort.is_set():
                            yield Delta(choice=choice, text="", finish=FinishReason.ABORT)
                            break
                        completion += len(delta.token_ids)
                        yield delta
                    continue
                whole = await self._whole(tokens, abort, clock)
                completion += len(whole.token_ids)
                yield whole
            usage = Usage(prompt_tokens=len(words), completion_tokens=completion)
            yield Done(usage=usage, timing=None if request.stream else clock.timing())
        finally:
            self.running -= 1
            self._count(adapter, -1)
            self._aborts.pop(engine_request_id, None)

    async def _whole(self, tokens: _Tokens, abort: asyncio.Event, clock: _TokenClock) -> Delta:
        """A choice in one delta (final-only output). Unscripted, without per-token work."""
        if not self._scripted():
            return tokens.whole(clock)
        deltas = self._choice(tokens, abort, clock, streaming=False)
        return _joined([delta async for delta in deltas])

    async def _choice(
        self, tokens: _Tokens, abort: asyncio.Event, clock: _TokenClock, *, streaming: bool
    ) -> AsyncIterator[Delta]:
        limit, choice, logprobs = tokens.limit, tokens.choice, tokens.logprobs is not None
        paced = self._scripted()
        for i in range(limit):
            if paced:
                await self._pace(i, abort, streaming)
            else:
                await _NEXT_TURN  # as an output handler wakes its consumer once per step
            if abort.is_set():
                yield Delta(choice=choice, text="", finish=FinishReason.ABORT)
                return
            piece, tid, stop = tokens.next(i)
            if stop is not None:
                yield Delta(
                    choice=choice, text="", finish=FinishReason.STOP, matched_stop=stop or None
                )
                return
            if not streaming:
                clock.tick()
            finish = FinishReason.LENGTH if i == limit - 1 else None
            yield _delta(choice, piece, tid, logprobs, finish)

    def _scripted(self) -> bool:
        script = self.script
        return bool(
            script.fail_after is not None or script.hang_after is not None or script.token_delay_s
        )

    async def _pace(self, index: int, abort: asyncio.Event, streaming: bool) -> None:
        script = self.script
        if script.fail_after is not None and index >= script.fail_after:
            raise script.fail_with or EngineError("scripted failure")
        if script.hang_after is not None and index >= script.hang_after:
            await abort.wait()
        elif script.token_delay_s:
            try:
                await asyncio.wait_for(abort.wait(), script.token_delay_s)
            except TimeoutError:
                pass
        elif streaming:
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

    async def add_adapter(
        self, adapter: AdapterHandle, *, evicting: AdapterHandle | None = None
    ) -> None:
        if evicting is not None:
            await self.remove_adapter(evicting)
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

    async def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        eos = self._info.eos_token_id
        kept = [t for t in token_ids if not (skip_special_tokens and t == eos)]
        return " ".join(self.token_texts(kept))

    def info(self) -> EngineInfo:
        return self._info

    def output_parser(self, spec: ParseSpec) -> FakeOutputParser | None:
        tools = self._info.tool_call_parser is not None and spec.auto_tools
        reasoning = self._info.reasoning_parser is not None
        if not (tools or reasoning):
            return None
        return FakeOutputParser(spec, reasoning=reasoning, tools=tools)

    def _count(self, adapter: AdapterHandle | None, change: int) -> None:
        self.step_count += 1  # a request entered or left the batch: a step in a real engine
        if adapter is not None:
            count = self._running_on.get(adapter.name, 0) + change
            self._running_on[adapter.name] = count
            if count <= 0:
                del self._running_on[adapter.name]

    def steps(self) -> int:
        return self.step_count

    def stats(self) -> EngineStats:
        """Every request runs at once here: nothing waits in this engine."""
        adapters = {name: AdapterLoad(running=n, waiting=0) for name, n in self._running_on.items()}
        return EngineStats(
            running=self.running, waiting=0, total_blocks=1024, free_blocks=1024,
            adapters=adapters,
        )

    async def shutdown(self) -> None:
        for event in self._aborts.values():
            event.set()




def _check_vocabulary(prompt: TextPrompt | ChatPrompt | TokenPrompt) -> None:
    ids = prompt.token_ids if isinstance(prompt, TokenPrompt) else ()
    if ids and (min(ids) < 0 or max(ids) >= VOCAB):
        raise InvalidRequest(f"Token ids are out of vocabulary (valid ids are 0 to {VOCAB - 1}).")


class _Tokens:
    """The words one choice produces, and where a stop string ends it."""

    def __init__(
        self,
        request: GenerationRequest,
        words: tuple[str, ...],
        word_ids: tuple[int, ...],
        choice: int,
        adapter: AdapterHandle | None,
        limit: int,
    ) -> None:
        self.choice = choice
        self.limit = limit  # the prompt budget's: never past the context
        self.logprobs = request.output.logprobs
        self._stops = request.sampling.stop
        self._words = words
        self._ids = word_ids
        self._first = f"[{adapter.name}]" if adapter else None
        self._text = ""
        structured = request.sampling.structured
        # constrained JSON: a fixed value of the schema, ended as by EOS
        self.exact = structured is not None and structured.json_schema is not None
        if self.exact:
            assert structured is not None and structured.json_schema is not None
            self._words, self._ids = _json_pieces(structured.json_schema)
            self._first = None

    def next(self, i: int) -> tuple[str, int, str | None]:
        """Token i's text and id, and the stop string it completes (the choice then ends
        without it)."""
        if self.exact:
            if i >= len(self._words):
                return "", 0, ""  # the value is complete: ends as by EOS
            word, tid = self._words[i], self._ids[i]
        elif i == 0 and self._first is not None:
            word, tid = self._first, token_id(self._first)
        else:
            index = (i + self.choice) % len(self._words)
            word, tid = self._words[index], self._ids[index]
        piece = word if self.exact else word + " "
        if not self._stops:
            return piece, tid, None
        stop = next((s for s in self._stops if s in self._text + piece), None)
        if stop is None:
            self._text += piece
        return piece, tid, stop

    def deltas(self) -> tuple[Delta, ...]:
        """One delta per token, the last carrying the finish."""
        return _choice_deltas(
            self._words, self._ids, self.choice, self._first, self.limit, self._stops,
            self.logprobs is not None, self.exact,
        )

    def whole(self, clock: _TokenClock) -> Delta:
        """Every token at once (computed once per distinct request: the engine is
        deterministic)."""
        delta = _whole_choice(
            self._words, self._ids, self.choice, self._first, self.limit, self._stops,
            self.logprobs is not None, self.exact,
        )
        if delta.token_ids:
            clock.tick()
        return delta


@functools.lru_cache(maxsize=4096)
def _choice_tokens(  # noqa: PLR0913 - everything a choice depends on, as the cache key
    words: tuple[str, ...],
    ids: tuple[int, ...],
    choice: int,
    first: str | None,
    limit: int,
    stops: tuple[str, ...],
    exact: bool = False,
) -> tuple[tuple[str, ...], tuple[int, ...], FinishReason, str | None]:
    """A choice's token texts and ids, how it ends, and the stop string that ended it.
    `exact`: the words are the whole output as it is (no spaces), ended as by EOS."""
    pieces: list[str] = []
    token_ids: list[int] = []
    text = ""
    for i in range(limit):
        if exact:
            if i >= len(words):
                return tuple(pieces), tuple(token_ids), FinishReason.STOP, None
            word, tid = words[i], ids[i]
        elif i == 0 and first is not None:
            word, tid = first, token_id(first)
        else:
            word, tid = words[(i + choice) % len(words)], ids[(i + choice) % len(words)]
        piece = word if exact else word + " "
        stop = next((s for s in stops if s in text + piece), None) if stops else None
        if stop is not None:
            return tuple(pieces), tuple(token_ids), FinishReason.STOP, stop
        text += piece
        pieces.append(piece)
        token_ids.append(tid)
    return tuple(pieces), tuple(token_ids), FinishReason.LENGTH, None


@functools.lru_cache(maxsize=4096)
def _whole_choice(  # noqa: PLR0913 - everything a choice depends on, as the cache key
    words: tuple[str, ...],
    ids: tuple[int, ...],
    choice: int,
    first: str | None,
    limit: int,
    stops: tuple[str, ...],
    logprobs: bool,
    exact: bool = False,
) -> Delta:
    pieces, token_ids, finish, matched = _choice_tokens(
        words, ids, choice, first, limit, stops, exact
    )
    top = () if not logprobs else tuple(
        TokenLogprob(token_id=t, token=p, logprob=-0.5)
        for t, p in zip(token_ids, pieces, strict=True)
    )
    return Delta(
        choice=choice, text="".join(pieces), token_ids=token_ids, logprobs=top, finish=finish,
        matched_stop=matched,
    )


@functools.lru_cache(maxsize=4096)
def _choice_deltas(  # noqa: PLR0913 - everything a choice depends on, as the cache key
    words: tuple[str, ...],
    ids: tuple[int, ...],
    choice: int,
    first: str | None,
    limit: int,
    stops: tuple[str, ...],
    logprobs: bool,
    exact: bool = False,
) -> tuple[Delta, ...]:
    """One delta per token; a length end rides on the last token, a stop string ends with a
    delta of its own (the token that completed it is not sent), an exact output's end too."""
    pieces, token_ids, finish, matched = _choice_tokens(
        words, ids, choice, first, limit, stops, exact
    )
    own_end = matched is not None or (exact and finish is FinishReason.STOP)
    last = len(token_ids) - 1
    deltas = [
        _delta(choice, piece, tid, logprobs, finish if i == last and not own_end else None)
        for i, (piece, tid) in enumerate(zip(pieces, token_ids, strict=True))
    ]
    if own_end:
        deltas.append(Delta(choice=choice, text="", finish=finish, matched_stop=matched))
    return tuple(deltas)


def _prompt_logprobs(
    words: tuple[str, ...], ids: tuple[int, ...], request: GenerationRequest
) -> tuple[TokenLogprob | None, ...]:
    """Every prompt word ranked first at -1.0 (the first has none), when asked for."""
    if request.output.prompt_logprobs is None:
        return ()
    rest = (
        TokenLogprob(token_id=t, token=w, logprob=-1.0, rank=1)
        for w, t in zip(words[1:], ids[1:], strict=True)
    )
    return (None, *rest)


@functools.lru_cache(maxsize=256)
def _json_pieces(schema_text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A fixed value of the schema in pieces of up to four characters (its "tokens")."""
    text = example_json(schema_text)
    pieces = tuple(text[i : i + 4] for i in range(0, len(text), 4))
    return pieces, tuple(token_id(p) for p in pieces)


def _generation_defaults(model_path: str | None) -> SamplingDefaults:
    """The model folder's generation_config.json, read as vLLM reads it (`max_new_tokens` is the
    default output limit)."""
    if model_path is None:
        return SamplingDefaults()
    try:
        with open(os.path.join(model_path, "generation_config.json")) as file:
            config = json.load(file)
    except (OSError, ValueError):
        return SamplingDefaults()
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "max_new_tokens")
    given = {k: config[k] for k in names if isinstance(config.get(k), int | float)}
    return SamplingDefaults(**given)


class _TokenClock:
    """When the first and the last token of a request were produced."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._first: float | None = None
        self._last = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
        self._last = now

    def timing(self) -> TokenTiming | None:
        if self._first is None:
            return None
        return TokenTiming(
            first_token_s=self._first - self._start, decode_s=self._last - self._first
        )


@functools.lru_cache(maxsize=65536)
def _delta(
    choice: int, piece: str, tid: int, logprobs: bool, finish: FinishReason | None
) -> Delta:
    """One token's delta (immutable, so the same token's delta is built once)."""
    lp = (TokenLogprob(token_id=tid, token=piece, logprob=-0.5),) if logprobs else ()
    return Delta(choice=choice, text=piece, token_ids=(tid,), logprobs=lp, finish=finish)


class _Turn:
    """`await _NEXT_TURN` lets the event loop run once (what `asyncio.sleep(0)` does, without
    building a coroutine per token)."""

    def __await__(self) -> Generator[None, None, None]:
        yield


_NEXT_TURN = _Turn()


def _joined(deltas: list[Delta]) -> Delta:
    """A choice's deltas as one (final-only output)."""
    last = deltas[-1]
    return Delta(
        choice=last.choice,
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        logprobs=tuple(lp for d in deltas for lp in d.logprobs),
        finish=last.finish,
        matched_stop=last.matched_stop,
    )


@functools.lru_cache(maxsize=16)
def _info(model_name: str) -> EngineInfo:
    return EngineInfo(
        model_name=model_name,
        model_path=f"/models/{model_name}",
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
