"""The vLLM engine: `VllmEngine` runs `GenerationRequest`s on vLLM's `AsyncLLM`, with LoRA.

The `server.engines.vllm*` modules are the only ones of the project that import vLLM, and they do
so lazily (inside functions, or for types only), so importing them loads neither vLLM nor torch.
The engine is assembled from them, each named after what it owns:

- `vllm_options`: how to start vLLM; `vllm_launch`: starting it (here, or once for several front
  ends); `vllm_stats`: live scheduler stats, from a stat logger added next to vLLM's own;
- `vllm_prompts`: text, chat and token prompts become token ids, reaching vLLM pre-tokenized;
- `vllm_params`: `Sampling` → `SamplingParams`; `vllm_outputs`: `RequestOutput` → `Started`,
  `Delta`, `Done`; `vllm_errors`: vLLM exceptions → `GatewayError`s (nothing else escapes);
- `vllm_info`: what vLLM says about the model; `vllm_parsing`: vLLM's output parsers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from server.core.budget import Budget
from server.core.engine import OutputParser, fit_prompt
from server.core.errors import (
    AdapterInvalid,
    EngineError,
    GatewayError,
    LoraDisabled,
    ServiceUnavailable,
    Unsupported,
)
from server.core.lifecycle import log_phase
from server.core.types import (
    AdapterHandle,
    AdapterLoad,
    ChatPrompt,
    EngineInfo,
    EngineStats,
    GenerationEvent,
    GenerationRequest,
    ParseSpec,
)
from server.engines.vllm_errors import adapter_error, first_line, pin_error, to_gateway_error
from server.engines.vllm_info import engine_info
from server.engines.vllm_launch import ClientPlace, import_vllm, start_llm, vllm_version
from server.engines.vllm_options import VllmEngineOptions
from server.engines.vllm_outputs import EventFolder
from server.engines.vllm_params import sampling_params
from server.engines.vllm_prompts import PreparedPrompt, PromptRenderer, engine_input
from server.engines.vllm_stats import SchedulerSnapshot

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


async def create(options: VllmEngineOptions, client: ClientPlace | None = None) -> VllmEngine:
    """Start vLLM and wrap it. Raises `EngineError` if vLLM cannot start.

    With `client`, no engine is started: this process becomes one front end (client) of the
    engine core `launch_core` started in the supervisor, as each of vLLM's API servers does.

    Importing vLLM (5-10 s) happens in a worker thread; the engine start-up itself (10-25 s
    on the CPU) runs on the event loop, as vLLM's async client must be built there.
    """
    since = time.monotonic()
    await asyncio.to_thread(import_vllm)
    since = log_phase(logger, "engine import", since)
    snapshot = SchedulerSnapshot(client.stats, client.index) if client else SchedulerSnapshot()
    try:
        llm = start_llm(options, snapshot, client)
    except Exception as exc:
        logger.exception("the vLLM engine failed to start")
        raise EngineError(f"the vLLM engine failed to start: {first_line(exc)}") from exc
    # vLLM reads its environment variables on every access (a request's sampling parameters,
    # each output step's statistics); its engine core and workers cache them once started, as
    # this front end now does too
    from vllm.envs import enable_envs_cache

    enable_envs_cache()
    what = "client" if client else "start"
    log_phase(logger, f"engine {what}", since, f"vLLM {vllm_version()}")
    return VllmEngine(llm, options, snapshot)


class VllmEngine:
    """The `Engine` port on vLLM's `AsyncLLM`. Build it with `await create(options)`."""

    def __init__(
        self, llm: AsyncLLM, options: VllmEngineOptions, snapshot: SchedulerSnapshot
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
        self._info = engine_info(llm, options, self._tokenizer)
        self._prompts = PromptRenderer(
            self._tokenizer, max(self._info.vocab_size, self._tokenizer.max_token_id + 1)
        )
        self._lora_enabled = llm.vllm_config.lora_config is not None
        self._in_engine: dict[AdapterHandle, int] = {}  # this front end's requests per adapter
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
        prompt, budget = await self._prepare(request)
        params = sampling_params(request, budget.max_tokens, self._skips_special(request))
        lora = self._lora_request(adapter)
        folder = EventFolder(prompt, request, budget.max_tokens)
        completed = False
        self._snapshot.entered(1)
        self._count_adapter(adapter, 1)
        try:
            outputs = self._llm.generate(
                engine_input(prompt),
                params,
                engine_request_id,
                lora_request=lora,
                priority=request.priority,
                **self._reasoning_state(request),
            )
            async with aclosing(outputs):
                async for output in outputs:
                    for event in folder.fold(output):
                        yield event
            completed = True
        except GatewayError:
            raise
        except Exception as exc:
            raise to_gateway_error(exc) from exc
        finally:
            if not completed:
                await self.abort(engine_request_id)
            self._snapshot.entered(-1)
            self._count_adapter(adapter, -1)
        for event in folder.closing():
            yield event

    def _reasoning_state(self, request: GenerationRequest) -> dict[str, Any]:
        """What vLLM's chat serving tells the engine about reasoning: with a reasoning parser
        the engine applies structured output only once the reasoning has ended. Hidden
        reasoning (`include_reasoning` false) counts as ended from the first token; otherwise
        the engine reads the prompt with its own parser, given the template's variables."""
        spec = request.parse
        if self._parsers.reasoning_parser is None or spec is None:
            return {}
        return {
            "reasoning_ended": None if spec.reasoning else True,
            "reasoning_parser_kwargs": {"chat_template_kwargs": dict(spec.chat_template_kwargs)},
        }

    def _count_adapter(self, adapter: AdapterHandle | None, change: int) -> None:
        if adapter is None:
            return
        count = self._in_engine.get(adapter, 0) + change
        if count > 0:
            self._in_engine[adapter] = count
        else:
            self._in_engine.pop(adapter, None)

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

    async def _prepare(self, request: GenerationRequest) -> tuple[PreparedPrompt, Budget]:
        """The prompt as token ids fitted to the context (with its text), and its budget."""
        prompt = await self._prompts.render(request.prompt)
        budget = fit_prompt(request, self._info, len(prompt.token_ids))
        if budget.keep < len(prompt.token_ids):  # truncated: the kept tail's text is decoded
            prompt = PreparedPrompt(prompt.token_ids[len(prompt.token_ids) - budget.keep :], None)
        return await self._prompts.with_text(prompt), budget

    def _lora_request(self, adapter: AdapterHandle | None) -> LoRARequest | None:
        if adapter is None:
            return None
        if not self._lora_enabled:
            raise LoraDisabled("LoRA adapters are not enabled on this server.", param="model")
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=engine_lora_name(adapter), lora_int_id=adapter.int_id,
            lora_path=adapter.path,
        )

    # -- adapters --------------------------------------------------------------------------

    async def add_adapter(
        self, adapter: AdapterHandle, *, evicting: AdapterHandle | None = None
    ) -> None:
        try:
            lora = self._lora_request(adapter)
        except ValueError as exc:  # LoRARequest refuses int ids below 1
            raise AdapterInvalid(str(exc), param="model") from exc
        assert lora is not None
        removal = None if evicting is None else await self._start_removal(evicting)
        try:
            loaded = await self._llm.add_lora(lora)
        except Exception as exc:
            raise adapter_error(exc, adapter, engine_lora_name(adapter)) from exc
        finally:
            if removal is not None:
                await removal
        if not loaded:
            raise AdapterInvalid(f"LoRA adapter '{adapter.name}' could not be loaded.")

    async def _start_removal(self, adapter: AdapterHandle) -> asyncio.Task[None]:
        """Send the removal of `adapter` without waiting for its answer. The engine core takes
        its input in order and answers control calls only between two steps: sent one after the
        other, a removal and the load that follows it share one wait for a step's end instead of
        two."""
        removal = asyncio.ensure_future(self._remove_logged(adapter))
        await asyncio.sleep(0)  # the removal runs up to its (synchronous) send before the load's
        return removal

    async def _remove_logged(self, adapter: AdapterHandle) -> None:
        try:
            await self.remove_adapter(adapter)
        except GatewayError:
            logger.warning("the engine failed to remove adapter %s", adapter.name, exc_info=True)

    async def remove_adapter(self, adapter: AdapterHandle) -> None:
        if self._lora_enabled:
            await self._call(self._llm.remove_lora(adapter.int_id))

    async def pin_adapter(self, adapter: AdapterHandle) -> None:
        if not self._lora_enabled:
            raise LoraDisabled("LoRA adapters are not enabled on this server.", param="model")
        try:
            await self._llm.pin_lora(adapter.int_id)
        except Exception as exc:
            raise pin_error(exc, adapter) from exc

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
        return await self._prompts.tokenize(text, add_special_tokens=add_special_tokens)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return self._prompts.token_texts(token_ids)

    async def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return await self._prompts.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # -- state -----------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        return self._info

    def steps(self) -> int:
        return self._snapshot.steps

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
        return adapter_loads(self._in_engine, getattr(states, "requests", {}))

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
            raise to_gateway_error(exc) from exc


def engine_lora_name(adapter: AdapterHandle) -> str:
    """The name vLLM knows one engine identity of `adapter` by: the adapter's name and its int
    id. vLLM tells `LoRARequest`s apart by name alone (its `__eq__` and `__hash__`), and its
    worker takes the set of a step's requests to choose which adapters to load into the
    step's slots: two ids under one name in a step (requests on the old and the new weights
    after an update or a change of the files on disk) became one, the other id was never put
    in a slot, and the step raised `KeyError` in `convert_mapping`, killing the engine core.
    The name also keys vLLM's prefix cache (with the path, which files changed in place keep;
    vllm #27211, #30931), so cached blocks of the old weights are not reused for the new
    ones."""
    return f"{adapter.name}/{adapter.int_id}"


def adapter_loads(in_engine: dict[AdapterHandle, int], known: Any) -> dict[str, AdapterLoad]:
    """Requests per adapter name: `in_engine` submitted per engine identity, running as many
    as vLLM's request states (`known`, by engine name) say run (every other one is waiting)."""
    loads: dict[str, AdapterLoad] = {}
    for adapter, submitted in in_engine.items():
        state = known.get(engine_lora_name(adapter))
        running = min(submitted, len(state.running)) if state is not None else 0
        before = loads.get(adapter.name, AdapterLoad(running=0, waiting=0))
        loads[adapter.name] = AdapterLoad(
            running=before.running + running, waiting=before.waiting + submitted - running
        )
    return loads
