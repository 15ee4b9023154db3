"""The vLLM engine: `VllmEngine` runs `GenerationRequest`s on vLLM's `AsyncLLM`, with LoRA.

This is the only module of the project that imports vLLM, and it does so lazily (in `create` and
inside methods), so importing it loads neither vLLM nor torch. It owns:

- prompt preparation: text, chat and token prompts all become token ids here, are checked against
  the context length, and reach vLLM pre-tokenized (no second tokenization inside vLLM);
- `Sampling` → `SamplingParams`: delta outputs for streamed requests, final-only outputs for the
  others (as vLLM's own server does: no per-token work in this process for them);
- `RequestOutput` → `Started`, `Delta` (the last one of a choice carrying its finish), `Done`;
- vLLM exceptions → `GatewayError`s (nothing else escapes);
- live scheduler stats, from a stat logger added next to vLLM's own Prometheus logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import multiprocessing
import re
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from server.core.engine import OutputParser
from server.core.errors import (
    AdapterCapacity,
    AdapterInvalid,
    AdapterNotFound,
    ContextLengthExceeded,
    EngineError,
    GatewayError,
    InvalidRequest,
    LoraDisabled,
    Overloaded,
    ServiceUnavailable,
    Unsupported,
)
from server.core.lifecycle import log_phase
from server.core.types import (
    AdapterHandle,
    AdapterLoad,
    ChatMessage,
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
    Sampling,
    SamplingDefaults,
    Started,
    StructuredOutput,
    TokenLogprob,
    TokenPrompt,
    TokenTiming,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.inputs import TokensInput
    from vllm.logprobs import Logprob
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase, StatLoggerFactory
    from vllm.v1.metrics.stats import RequestStateStats, SchedulerStats

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Prompts longer than this (characters, or token ids to decode) are processed in a worker
# thread so that one huge prompt does not stall every other stream on the event loop.
_OFF_LOOP_SIZE = 2000

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "repetition": FinishReason.STOP,
}

# vLLM wraps worker failures as "Call to add_lora method failed: Worker failed with error
# '<root cause>', please check the stack trace above for the root cause".
_WORKER_ERROR = re.compile(r"error '(?P<cause>.*)', please check", re.DOTALL)

_DEAD_MESSAGE = "engine is dead: the vLLM engine core stopped and the server must be restarted"


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmEngineOptions:
    """How to start vLLM. Names and meanings follow vLLM's `AsyncEngineArgs`.

    `extra` is passed to `AsyncEngineArgs` as further keyword arguments (and wins over the
    named fields). `max_num_seqs=None` and `max_cpu_loras=None` keep vLLM's defaults.
    """

    model_path: str
    served_model_name: str
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser names
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser names
    extra: dict[str, object] = field(default_factory=dict)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `AsyncEngineArgs`, stats always on (vLLM's `vllm:` metrics)."""
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "served_model_name": self.served_model_name,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            "enable_lora": self.enable_lora,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
            "lora_dtype": self.lora_dtype,
            "fully_sharded_loras": self.fully_sharded_loras,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "distributed_executor_backend": self.distributed_executor_backend,
            "disable_log_stats": False,
        }
        if self.enable_lora:  # base tokens in mixed LoRA batches on CPU: see vllm_cpu_fix.py
            kwargs["worker_extension_cls"] = "server.engines.vllm_cpu_fix.CpuLoraFix"
        kwargs.update(self.extra)
        return kwargs


async def create(options: VllmEngineOptions, client: ClientPlace | None = None) -> VllmEngine:
    """Start vLLM and wrap it. Raises `EngineError` if vLLM cannot start.

    With `client`, no engine is started: this process becomes one front end (client) of the
    engine core `launch_core` started in the supervisor, as each of vLLM's API servers does.

    Importing vLLM (5-10 s) happens in a worker thread; the engine start-up itself (10-25 s
    on the CPU) runs on the event loop, as vLLM's async client must be built there.
    """
    since = time.monotonic()
    await asyncio.to_thread(_import_vllm)
    since = log_phase(logger, "engine import", since)
    snapshot = _SchedulerSnapshot(client.stats, client.index) if client else _SchedulerSnapshot()
    try:
        llm = _start(options, snapshot, client)
    except Exception as exc:
        logger.exception("the vLLM engine failed to start")
        raise EngineError(f"the vLLM engine failed to start: {_first_line(exc)}") from exc
    what = "client" if client else "start"
    log_phase(logger, f"engine {what}", since, f"vLLM {_vllm_version()}")
    return VllmEngine(llm, options, snapshot)


def _import_vllm() -> None:
    import vllm.v1.engine.async_llm  # noqa: F401


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _start(
    options: VllmEngineOptions, snapshot: _SchedulerSnapshot, client: ClientPlace | None
) -> AsyncLLM:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(**options.engine_kwargs())
    # A custom per-engine logger is added to vLLM's defaults, so its Prometheus logger
    # (the `vllm:` families in prometheus_client's REGISTRY) stays active.
    loggers: list[StatLoggerFactory] = [_snapshot_logger(snapshot)]
    if client is None:
        return AsyncLLM.from_engine_args(args, stat_loggers=loggers)
    # as vLLM's build_async_engine_client does for each of its API servers
    args._api_process_count = client.count
    args._api_process_rank = client.index
    return AsyncLLM.from_vllm_config(
        args.create_engine_config(),
        stat_loggers=loggers,
        client_addresses=dict(client.addresses),
        client_count=client.count,
        client_index=client.index,
    )


@dataclass(frozen=True, slots=True)
class ClientPlace:
    """One front end's place among `count` clients of an engine core started elsewhere: the
    ZMQ listeners and addresses vLLM's launcher made for it (passed to a spawned process)."""

    addresses: Mapping[str, Any]
    count: int
    index: int
    stats: Any  # a multiprocessing RawArray all front ends share (_SchedulerSnapshot)


class CoreLaunch:
    """The engine core (and vLLM's DP coordinator when data parallel) started once, in the
    supervisor, for `count` front ends: vLLM's own multi-API-server launch
    (`vllm serve --api-server-count`, vllm/entrypoints/cli/serve.py), driven from our options."""

    def __init__(self, options: VllmEngineOptions, count: int) -> None:
        from vllm import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.utils import bind_engine_zmq_listeners

        args = AsyncEngineArgs(**options.engine_kwargs())
        args._api_process_count = count
        args._api_process_rank = -1
        self._config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self._log_stats = not args.disable_log_stats
        self._listeners: Any = bind_engine_zmq_listeners(self._config, count)
        self.engine_manager: Any = None
        self.coordinator: Any = None
        self._launch: Any = None

    @contextlib.contextmanager
    def start(self) -> Iterator[list[ClientPlace]]:
        """Start the engine core; the body starts the front ends with the places it gets
        (each listener goes to one process). Leaving the body waits until the engine is up."""
        from vllm.v1.engine.utils import launch_core_engines
        from vllm.v1.executor import Executor

        listeners = self._listeners
        with launch_core_engines(
            self._config, Executor.get_class(self._config), self._log_stats, listeners.addresses
        ) as launch:
            self._launch = launch
            self.engine_manager, self.coordinator = launch.engine_manager, launch.coordinator
            stats = self.coordinator.get_stats_publish_address() if self.coordinator else None
            count = len(listeners.inputs)
            shared = multiprocessing.get_context("spawn").RawArray("d", _STATS + count)
            places = [
                ClientPlace(_client_addresses(inp, out, stats), count, index, shared)
                for index, (inp, out) in enumerate(zip(listeners.inputs, listeners.outputs,
                                                       strict=True))
            ]
            yield places
            for listener in (*listeners.inputs, *listeners.outputs):
                listener.close()  # the front ends hold them now

    def watch(self, processes: Sequence[Any]) -> None:
        """Front ends whose death while the engine starts aborts the start (as vLLM's)."""
        self._launch.watched_frontend_processes = processes

    def sentinels(self) -> list[int]:
        """Process sentinels of the engine core(s) and the coordinator, to watch for death."""
        procs = list(getattr(self.engine_manager, "processes", []) or [])
        if self.coordinator is not None:
            procs.append(self.coordinator.proc)
        return [proc.sentinel for proc in procs]

    def shutdown(self, timeout: float | None) -> None:
        self._listeners.cleanup()  # ipc:// files
        self._listeners = None  # its __del__ cleans up again: now, not at interpreter exit
        if self.engine_manager is not None:
            self.engine_manager.shutdown(timeout=timeout)
        if self.coordinator is not None:
            self.coordinator.shutdown(timeout=timeout)


def _client_addresses(inp: Any, out: Any, stats: str | None) -> dict[str, Any]:
    """What vLLM's APIServerProcessManager hands each API server (vllm/v1/utils.py)."""
    addresses: dict[str, Any] = {
        "input_address": inp.address,
        "output_address": out.address,
        "input_listener": inp.socket,
        "output_listener": out.socket,
    }
    if stats is not None:
        addresses["stats_update_address"] = stats
    return addresses


class _SchedulerSnapshot:
    """The latest scheduler numbers vLLM reported (updated on the event loop after each step),
    and the requests each front end has in the engine. With several front ends `values` is
    memory they share: vLLM reports scheduler numbers to one front end per step."""

    __slots__ = ("_mine", "_values")

    def __init__(self, values: Any = None, index: int = 0) -> None:
        self._values = values if values is not None else [0.0] * (_STATS + 1)
        self._mine = _STATS + index  # this front end's count of requests in the engine

    @property
    def running(self) -> int:
        return int(self._values[0])

    @property
    def waiting(self) -> int:
        return int(self._values[1])

    @property
    def kv_cache_usage(self) -> float:
        return float(self._values[2])

    def update(self, stats: SchedulerStats) -> None:
        values = self._values
        values[0] = stats.num_running_reqs
        values[1] = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
        values[2] = stats.kv_cache_usage

    def entered(self, count: int) -> None:
        self._values[self._mine] += count

    def idle(self) -> bool:
        """No front end has a request in the engine. The engine reports numbers only after a
        step; after an abort it goes idle without one, so the last numbers would still count
        the aborted request."""
        return sum(self._values[_STATS:]) <= 0


_STATS = 3  # running, waiting, KV cache usage; then one count per front end


def _snapshot_logger(snapshot: _SchedulerSnapshot) -> type[StatLoggerBase]:
    """A vLLM per-engine stat logger class that copies scheduler stats into `snapshot`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: object,
            mm_cache_stats: object = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                snapshot.update(scheduler_stats)

        def log_engine_initialized(self) -> None:
            return None

    return SnapshotStatLogger


@dataclass(frozen=True, slots=True)
class _PreparedPrompt:
    token_ids: list[int]
    text: str | None


class VllmEngine:
    """The `Engine` port on vLLM's `AsyncLLM`. Build it with `await create(options)`."""

    def __init__(
        self, llm: AsyncLLM, options: VllmEngineOptions, snapshot: _SchedulerSnapshot
    ) -> None:
        from server.engines.vllm_parsing import ParserFactory

        self._llm = llm
        self._snapshot = snapshot
        self._tokenizer: TokenizerLike = llm.get_tokenizer()
        self._parsers = ParserFactory(
            tool_call_parser=options.tool_call_parser,
            reasoning_parser=options.reasoning_parser,
            tokenizer=self._tokenizer,
            model_config=llm.model_config,
        )
        self._info = _engine_info(llm, options, self._tokenizer)
        self._vocab_end = max(self._info.vocab_size, self._tokenizer.max_token_id + 1)
        self._lora_enabled = llm.vllm_config.lora_config is not None
        self._in_engine: dict[str, int] = {}  # this front end's requests per adapter name
        self._prompt_logprobs_unsafe = (
            self._lora_enabled and llm.vllm_config.device_config.device_type == "cpu"
        )
        self._closed = False

    # -- generation ------------------------------------------------------------------------

    async def generate(
        self, request: GenerationRequest, engine_request_id: str, adapter: AdapterHandle | None
    ) -> AsyncGenerator[GenerationEvent, None]:
        if self._closed:
            raise ServiceUnavailable("the engine is shut down")
        self._check_prompt_logprobs(request)
        prompt = await self._prepare(request)
        params = _sampling_params(
            request, self._max_tokens(request.sampling, prompt), self._skips_special(request)
        )
        lora = self._lora_request(adapter)
        folder = _EventFolder(prompt, request)
        completed = False
        self._snapshot.entered(1)
        self._count_adapter(adapter, 1)
        try:
            outputs = self._llm.generate(
                _engine_input(prompt),
                params,
                engine_request_id,
                lora_request=lora,
                priority=request.priority,
            )
            async with aclosing(outputs):
                async for output in outputs:
                    for event in folder.fold(output):
                        yield event
            completed = True
        except GatewayError:
            raise
        except Exception as exc:
            raise _to_gateway_error(exc) from exc
        finally:
            if not completed:
                await self.abort(engine_request_id)
            self._snapshot.entered(-1)
            self._count_adapter(adapter, -1)
        for event in folder.closing():
            yield event

    def _count_adapter(self, adapter: AdapterHandle | None, change: int) -> None:
        if adapter is None:
            return
        count = self._in_engine.get(adapter.name, 0) + change
        if count > 0:
            self._in_engine[adapter.name] = count
        else:
            self._in_engine.pop(adapter.name, None)

    async def abort(self, engine_request_id: str) -> None:
        try:
            await self._llm.abort(engine_request_id)
        except Exception:  # best effort: a dead engine has nothing left to abort
            logger.debug("abort of %s failed", engine_request_id, exc_info=True)

    def _check_prompt_logprobs(self, request: GenerationRequest) -> None:
        # vLLM 0.32's CPU LoRA logits path applies the batch's per-request adapter indices to
        # the per-token prompt hidden states: as soon as another request shares the batch the
        # worker raises and the whole engine core dies (measured), so refuse up front.
        if request.output.prompt_logprobs is not None and self._prompt_logprobs_unsafe:
            raise Unsupported(
                "Prompt logprobs are not available on this server while LoRA is enabled.",
                param="prompt_logprobs",
            )

    async def _prepare(self, request: GenerationRequest) -> _PreparedPrompt:
        prompt = await self._render(request.prompt)
        prompt = self._truncate(prompt, request.sampling.truncate_prompt_tokens)
        self._check_prompt_length(len(prompt.token_ids), request.sampling.cut_to_context)
        if prompt.text is None:
            text = await _off_loop(len(prompt.token_ids), self._decode, prompt.token_ids)
            prompt = _PreparedPrompt(prompt.token_ids, text)
        return prompt

    async def _render(self, prompt: Prompt) -> _PreparedPrompt:
        if isinstance(prompt, TokenPrompt):
            token_ids = list(prompt.token_ids)
            self._check_token_ids(token_ids)
            return _PreparedPrompt(token_ids, None)
        if isinstance(prompt, ChatPrompt):
            text = await _off_loop(_chat_size(prompt), self._render_chat, prompt)
            add_special_tokens = False  # the chat template already placed them
        else:
            text, add_special_tokens = prompt.text, prompt.add_special_tokens
        token_ids = await _off_loop(len(text), self._encode, text, add_special_tokens)
        return _PreparedPrompt(token_ids, text)

    def _render_chat(self, prompt: ChatPrompt) -> str:
        messages: list[Any] = [_chat_message(m) for m in prompt.messages]
        kwargs: dict[str, Any] = dict(prompt.chat_template_kwargs)
        if prompt.tools:
            kwargs["tools"] = json.loads(prompt.tools)
        kwargs.update(
            tokenize=False,
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
        )
        try:
            rendered = self._tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # template code can raise anything; the request caused it
            raise InvalidRequest(f"the chat template failed: {_first_line(exc)}") from exc
        if not isinstance(rendered, str):
            raise InvalidRequest("the chat template did not render text")
        return rendered

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def _check_token_ids(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self._vocab_end:
                raise InvalidRequest(
                    f"Token id {token_id} is out of vocabulary (valid ids are 0 to "
                    f"{self._vocab_end - 1}).",
                    param="prompt",
                )

    def _truncate(self, prompt: _PreparedPrompt, limit: int | None) -> _PreparedPrompt:
        """Keep the last `limit` tokens (vLLM truncates generation prompts from the left)."""
        max_len = self._info.max_model_len
        if limit is None:
            return prompt
        if limit > max_len:
            raise InvalidRequest(
                f"truncate_prompt_tokens={limit} cannot be greater than max_model_len = "
                f"{max_len}. Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        keep = max_len - 1 if limit < 0 else limit
        if keep >= len(prompt.token_ids):
            return prompt
        return _PreparedPrompt(prompt.token_ids[len(prompt.token_ids) - keep :], None)

    def _check_prompt_length(self, prompt_len: int, cut_to_context: bool) -> None:
        max_len = self._info.max_model_len
        if prompt_len == 0:
            raise InvalidRequest("The prompt cannot be empty.", param="prompt")
        if prompt_len > max_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt contains {prompt_len} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt."
            )
        if prompt_len < max_len:
            return
        if cut_to_context:  # vLLM's words: no room is a limit of 0
            raise ContextLengthExceeded("max_tokens must be at least 1, got 0.", param="max_tokens")
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens. However, your prompt "
            f"contains {prompt_len} input tokens, which leaves no room for any output tokens. "
            "Please reduce the length of the input prompt."
        )

    def _max_tokens(self, sampling: Sampling, prompt: _PreparedPrompt) -> int:
        """The request's limit, else the model's default, cut to the room the prompt leaves.
        vLLM's OpenAI server refuses only a limit beyond the whole context; the other
        protocols refuse any limit the prompt leaves no room for."""
        max_len, prompt_len = self._info.max_model_len, len(prompt.token_ids)
        room = max_len - prompt_len
        wanted = sampling.max_new_tokens
        if wanted is None:
            default = self._info.defaults.max_new_tokens
            return room if default is None else min(room, default)
        if sampling.cut_to_context and wanted > max_len:
            raise InvalidRequest(
                f"max_tokens={wanted} cannot be greater than max_model_len={max_len}. Please "
                "request fewer output tokens.",
                param="max_tokens",
            )
        if not sampling.cut_to_context and wanted > room:
            raise InvalidRequest(
                f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. This model's "
                f"maximum context length is {max_len} tokens and your request has {prompt_len} "
                f"input tokens ({wanted} > {max_len} - {prompt_len}).",
                param="max_tokens",
            )
        return min(wanted, room)

    def _lora_request(self, adapter: AdapterHandle | None) -> LoRARequest | None:
        if adapter is None:
            return None
        if not self._lora_enabled:
            raise LoraDisabled("LoRA adapters are not enabled on this server.", param="model")
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=adapter.name, lora_int_id=adapter.int_id, lora_path=adapter.path
        )

    # -- adapters --------------------------------------------------------------------------

    async def add_adapter(self, adapter: AdapterHandle) -> None:
        try:
            lora = self._lora_request(adapter)
        except ValueError as exc:  # LoRARequest refuses int ids below 1
            raise AdapterInvalid(str(exc), param="model") from exc
        assert lora is not None
        try:
            loaded = await self._llm.add_lora(lora)
        except Exception as exc:
            raise _adapter_error(exc, adapter) from exc
        if not loaded:
            raise AdapterInvalid(f"LoRA adapter '{adapter.name}' could not be loaded.")

    async def remove_adapter(self, adapter: AdapterHandle) -> None:
        if self._lora_enabled:
            await self._call(self._llm.remove_lora(adapter.int_id))

    async def pin_adapter(self, adapter: AdapterHandle) -> None:
        if not self._lora_enabled:
            raise LoraDisabled("LoRA adapters are not enabled on this server.", param="model")
        try:
            await self._llm.pin_lora(adapter.int_id)
        except Exception as exc:
            raise _pin_error(exc, adapter) from exc

    async def resident_adapters(self) -> set[int]:
        if not self._lora_enabled:
            return set()
        return set(await self._call(self._llm.list_loras()))

    def _skips_special(self, request: GenerationRequest) -> bool:
        default = request.sampling.skip_special_tokens
        if request.parse is None:
            return default
        return self._parsers.skips_special_tokens(request.parse, default)

    # -- output parsers --------------------------------------------------------------------

    def output_parser(self, spec: ParseSpec) -> OutputParser | None:
        return self._parsers.parser(spec)

    # -- tokenizer -------------------------------------------------------------------------

    async def tokenize(self, text: str | ChatPrompt, *, add_special_tokens: bool) -> list[int]:
        if isinstance(text, ChatPrompt):
            text = await _off_loop(_chat_size(text), self._render_chat, text)
        return await _off_loop(len(text), self._encode, text, add_special_tokens)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [self._tokenizer.decode([token_id]) for token_id in token_ids]

    # -- state -----------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        return self._info

    def stats(self) -> EngineStats:
        total = self._llm.vllm_config.cache_config.num_gpu_blocks or 0
        adapters = self._adapter_loads()
        if self._snapshot.idle():
            return EngineStats(
                running=0, waiting=0, total_blocks=total, free_blocks=total, adapters=adapters
            )
        snap = self._snapshot
        used = min(total, round(snap.kv_cache_usage * total))
        return EngineStats(
            running=snap.running, waiting=snap.waiting, total_blocks=total,
            free_blocks=total - used, adapters=adapters,
        )

    def _adapter_loads(self) -> dict[str, AdapterLoad]:
        """This front end's requests per adapter, split by vLLM's own per-request events
        (`LoRARequestStates`: SCHEDULED makes a request running, PREEMPTED waiting again, and
        the engine reports them with the request's outputs, so a request not scheduled yet is
        known to it only as submitted: waiting). vLLM's `vllm:lora_requests_info` reads the
        same states but lists every adapter in both of its labels (vllm #54830)."""
        states = getattr(getattr(self._llm, "output_processor", None), "lora_states", None)
        known = getattr(states, "requests", {})
        loads = {}
        for name, submitted in self._in_engine.items():
            state = known.get(name)
            running = min(submitted, len(state.running)) if state is not None else 0
            loads[name] = AdapterLoad(running=running, waiting=submitted - running)
        return loads

    async def check_health(self) -> None:
        if self._closed:
            raise ServiceUnavailable("the engine is shut down")
        await self._call(self._llm.check_health())

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Stopping the engine processes takes seconds; vLLM supports a call from another
        # thread (it hands socket and task cleanup back to the loop), so the loop stays live.
        await asyncio.to_thread(self._llm.shutdown)
        await asyncio.sleep(0)

    async def _call(self, awaitable: Any) -> Any:
        """Await a vLLM control call, translating its exceptions."""
        try:
            return await awaitable
        except Exception as exc:
            raise _to_gateway_error(exc) from exc


class _EventFolder:
    """Folds vLLM's `RequestOutput`s of one request into the port's events."""

    def __init__(self, prompt: _PreparedPrompt, request: GenerationRequest) -> None:
        self._prompt = prompt
        self._choices = request.sampling.n
        self._top = request.output.logprobs
        self._prompt_top = request.output.prompt_logprobs
        self._final_only = not request.stream
        self._started = False
        self._ended: set[int] = set()
        self._generated = 0
        self._timing: TokenTiming | None = None

    def fold(self, output: RequestOutput) -> Iterator[GenerationEvent]:
        """The events of one output; the first output also brings `Started`.

        Waiting for it means vLLM has accepted the request (its validation errors come before
        any event) and prompt logprobs are known.
        """
        if not self._started:
            yield self._start(output.prompt_logprobs)
        for completion in output.outputs:
            delta = self._delta(completion)
            if delta is not None:
                yield delta
        if self._final_only and output.finished:
            self._timing = _token_timing(output.metrics)

    def closing(self) -> Iterator[GenerationEvent]:
        if not self._started:
            yield self._start(None)
        for index in range(self._choices):
            if index not in self._ended:
                yield Delta(choice=index, text="", finish=FinishReason.ABORT)
        usage = Usage(prompt_tokens=len(self._prompt.token_ids), completion_tokens=self._generated)
        yield Done(usage=usage, timing=self._timing)

    def _start(self, prompt_logprobs: Sequence[Mapping[int, Logprob] | None] | None) -> Started:
        self._started = True
        return Started(
            prompt_token_ids=tuple(self._prompt.token_ids),
            prompt_text=self._prompt.text,
            prompt_logprobs=_prompt_logprobs(
                self._prompt.token_ids, prompt_logprobs, self._prompt_top
            ),
        )

    def _delta(self, completion: CompletionOutput) -> Delta | None:
        token_ids = tuple(completion.token_ids)
        reason = completion.finish_reason
        ends = reason is not None and completion.index not in self._ended
        if not (completion.text or token_ids or ends):
            return None
        self._generated += len(token_ids)
        finish = None
        if ends:
            assert reason is not None
            finish = _finish_reason(reason)
            self._ended.add(completion.index)
        return Delta(
            choice=completion.index,
            text=completion.text,
            token_ids=token_ids,
            logprobs=_sample_logprobs(token_ids, completion.logprobs, self._top),
            finish=finish,
            matched_stop=completion.stop_reason if ends else None,
        )


def _token_timing(stats: RequestStateStats | object) -> TokenTiming | None:
    """The engine's token times of a finished request (`RequestOutput.metrics`), if it kept them."""
    first_latency = getattr(stats, "first_token_latency", 0.0)
    first, last = getattr(stats, "first_token_ts", 0.0), getattr(stats, "last_token_ts", 0.0)
    if not first_latency or not first:
        return None
    return TokenTiming(first_token_s=first_latency, decode_s=max(last - first, 0.0))


def _finish_reason(reason: str) -> FinishReason:
    if reason == "error":
        raise EngineError("the engine failed while generating this request")
    return _FINISH_REASONS.get(reason, FinishReason.STOP)


def _sample_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[Mapping[int, Logprob] | None] | None,
    top_n: int | None,
) -> tuple[TokenLogprob, ...]:
    if positions is None or top_n is None:
        return ()
    return tuple(
        _token_logprob(token_id, position, top_n)
        for token_id, position in zip(token_ids, positions, strict=False)
        if position is not None
    )


def _prompt_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[Mapping[int, Logprob] | None] | None,
    top_n: int | None,
) -> tuple[TokenLogprob | None, ...]:
    if positions is None or top_n is None:
        return ()
    return tuple(
        None if position is None else _token_logprob(token_id, position, top_n)
        for token_id, position in zip(token_ids, positions, strict=False)
    )


def _token_logprob(token_id: int, position: Mapping[int, Logprob], top_n: int) -> TokenLogprob:
    """vLLM gives the chosen token plus the `top_n` best by rank (which may include it)."""
    ranked = sorted(position.items(), key=lambda item: _rank(item[1]))[:top_n]
    top = tuple(
        TopLogprob(token_id=tid, token=lp.decoded_token or "", logprob=lp.logprob, rank=lp.rank)
        for tid, lp in ranked
    )
    own = position.get(token_id)
    if own is None:
        return TokenLogprob(token_id=token_id, token="", logprob=float("-inf"), top=top)
    return TokenLogprob(
        token_id=token_id, token=own.decoded_token or "", logprob=own.logprob, top=top,
        rank=own.rank,
    )


def _rank(logprob: Logprob) -> int:
    return logprob.rank if logprob.rank is not None else 1 << 62


def _sampling_params(
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
        raise _to_gateway_error(exc) from exc


def _sampling_kwargs(sampling: Sampling, max_tokens: int) -> dict[str, Any]:
    allowed = sampling.allowed_token_ids
    return {
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(sampling.top_k, 0),  # vLLM 0.32: 0 disables top-k
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
        "structured_outputs": _structured_outputs(sampling.structured, max_tokens),
    }


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


def _engine_input(prompt: _PreparedPrompt) -> TokensInput:
    from vllm.inputs import tokens_input

    return tokens_input(prompt.token_ids, prompt=prompt.text)


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
        raise InvalidRequest(f"The JSON schema cannot be used: {_first_line(exc)}") from exc
    return str(grammar)


def _chat_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (vLLM's shape: tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    return out


def _arguments(text: str) -> object:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def _chat_size(prompt: ChatPrompt) -> int:
    return sum(len(message.content) for message in prompt.messages) + len(prompt.tools or "")


async def _off_loop(size: int, func: Callable[..., _T], *args: Any) -> _T:
    if size > _OFF_LOOP_SIZE:
        return await asyncio.to_thread(func, *args)
    return func(*args)


def _engine_info(llm: AsyncLLM, options: VllmEngineOptions, tokenizer: TokenizerLike) -> EngineInfo:
    import vllm

    config = llm.vllm_config
    lora = config.lora_config
    return EngineInfo(
        model_name=options.served_model_name,
        model_path=options.model_path,
        max_model_len=config.model_config.max_model_len,
        vocab_size=config.model_config.get_vocab_size(),
        dtype=str(config.model_config.dtype).removeprefix("torch."),
        version=vllm.__version__,
        max_lora_rank=lora.max_lora_rank if lora else 0,
        max_loras=lora.max_loras if lora else 0,
        max_cpu_loras=(lora.max_cpu_loras or lora.max_loras) if lora else 0,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        block_size=config.cache_config.block_size,
        eos_token_id=tokenizer.eos_token_id,
        defaults=model_defaults(config.model_config),
        tool_call_parser=options.tool_call_parser,
        reasoning_parser=options.reasoning_parser,
    )


def model_defaults(model_config: ModelConfig) -> SamplingDefaults:
    """The model's generation-config defaults as vLLM reads them (`generation_config="auto"`)."""
    diff = model_config.get_diff_sampling_param()
    if diff:
        logger.info("the model's generation config sets sampling defaults: %s", diff)
    return SamplingDefaults(
        temperature=_number(diff.get("temperature")),
        top_p=_number(diff.get("top_p")),
        top_k=_integer(diff.get("top_k")),
        min_p=_number(diff.get("min_p")),
        repetition_penalty=_number(diff.get("repetition_penalty")),
        presence_penalty=_number(diff.get("presence_penalty")),
        frequency_penalty=_number(diff.get("frequency_penalty")),
        max_new_tokens=_integer(diff.get("max_tokens")),
    )


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _integer(value: object) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _to_gateway_error(exc: Exception) -> GatewayError:
    from vllm.exceptions import GracefulHTTPError, VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailable(_DEAD_MESSAGE)
    if isinstance(exc, GracefulHTTPError):
        return Overloaded(exc.message)
    if isinstance(exc, VLLMClientError | ValueError | TypeError):
        return InvalidRequest(_message(exc), param=getattr(exc, "parameter", None))
    logger.error("vLLM failed", exc_info=exc)
    return EngineError(f"the engine failed: {type(exc).__name__}")


def _adapter_error(exc: Exception, adapter: AdapterHandle) -> GatewayError:
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):
        return ServiceUnavailable(_DEAD_MESSAGE)
    logger.info("adapter %s refused by vLLM: %s", adapter.name, exc)
    text = str(exc)
    match = _WORKER_ERROR.search(text)
    cause = match.group("cause") if match else text.removeprefix("Call to add_lora method failed: ")
    if adapter.path:
        cause = cause.replace(adapter.path, f"'{adapter.name}'")
    return AdapterInvalid(cause, param="model")


def _pin_error(exc: Exception, adapter: AdapterHandle) -> GatewayError:
    text = str(exc)
    if "No free" in text:
        return AdapterCapacity(f"no engine slot is left to pin LoRA adapter '{adapter.name}'.")
    if "not registered" in text or "not loaded" in text:
        return AdapterNotFound(f"LoRA adapter '{adapter.name}' is not loaded in the engine.")
    return _to_gateway_error(exc)


def _message(exc: BaseException) -> str:
    """The message without vLLM's "(parameter=..., value=...)" suffix."""
    first = exc.args[0] if exc.args else ""
    return first if isinstance(first, str) and first else str(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
