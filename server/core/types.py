"""Protocol-neutral generation types: the one request every protocol becomes, and the events back.

Imports nothing outside the standard library, and from this project only the prompt budget's
policy (server/core/budget.py), which a request carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from server.core.budget import REFUSE, BudgetPolicy
from server.core.frozen import quick_init


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutput:
    """Constrained decoding: exactly one of the fields is set. `json_schema` is JSON text.

    `fit_budget` (with `json_schema`): the engine bounds every string, array and number the
    schema leaves unbounded so that the whole value, written without whitespace, fits in the
    request's token budget: the output is then always complete JSON valid against the schema
    (tool-call arguments), even from a model that would never close a string by itself.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    fit_budget: bool = False


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """Sampling knobs, already validated by the protocol that produced them.

    `max_new_tokens=None` means the model's default, else as many as the context allows;
    `truncate_prompt_tokens` keeps the prompt's last tokens (server/core/budget.py).
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    best_of: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    thinking_token_budget: int | None = None  # reasoning tokens before `</think>` is forced
    truncate_prompt_tokens: int | None = None
    structured: StructuredOutput | None = None
    # vLLM's beam search (server/core/beam_search.py): `n` beams, ranked by the cumulative
    # logprob over the sequence's length to the power `length_penalty`
    beam_search: bool = False
    length_penalty: float = 1.0
    budget: BudgetPolicy = REFUSE  # the protocol's prompt budget rules and words (core/budget.py)


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class OutputOptions:
    """What the client wants back besides text."""

    logprobs: int | None = (
        None  # top-N alternatives per generated token; None = off, 0 = sampled only
    )
    prompt_logprobs: int | None = None  # same for prompt tokens (TGI decoder_input_details)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A function call: one the assistant made earlier (chat history) or one parsed from output.
    `arguments` is JSON text, as the model wrote it."""

    id: str
    name: str
    arguments: str


@quick_init
@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn that called tools
    tool_call_id: str | None = None  # a `tool` message: the call it answers
    reasoning: str | None = None  # an assistant turn's reasoning, for templates that show it


@quick_init
@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: tuple[tuple[str, str | int | float | bool | None], ...] = ()
    tools: str | None = None  # JSON text of the tool list the template renders (`tools=`)


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    token_ids: tuple[int, ...]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


@dataclass(frozen=True, slots=True, kw_only=True)
class ParseSpec:
    """How a chat answer is read back: which parts of the model's text are reasoning and which
    are tool calls, by the parsers the server is configured with (vLLM's parser names).

    `tools` is the request's tool list as JSON text; `auto_tools` asks the tool-call parser to
    find calls in free text (`tool_choice: "auto"`); `reasoning` splits reasoning from content
    when a reasoning parser is configured (else everything is content).
    """

    tools: str | None = None
    auto_tools: bool = False
    reasoning: bool = True
    chat_template_kwargs: tuple[tuple[str, str | int | float | bool | None], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterMerge:
    """Adapters composed for one request (LoRAX's `merged_adapters`): `ids` weighted by
    `weights`, combined by `strategy`. `density` and `majority_sign_method` are LoRAX's knobs
    of its other strategies, checked and kept as sent."""

    ids: tuple[str, ...]
    weights: tuple[float, ...]
    strategy: str = "linear"
    density: float = 0.0
    majority_sign_method: str = "total"


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One generation, whatever protocol asked for it.

    `request_id` is the id the client sees (X-Request-Id, Triton/MindIE `id`); the service
    derives a unique engine id from it. `model` is the name the client asked for: the base
    model's served name, an adapter name, or "" for the base model. `adapter` is set by the
    service after resolution, never by translators.
    """

    request_id: str
    model: str
    prompt: Prompt
    sampling: Sampling
    output: OutputOptions = field(default_factory=OutputOptions)
    stream: bool = False  # False: the engine may deliver each choice's output in one piece
    protocol: str = "unknown"  # metrics/log label only, never branched on
    adapter: str | None = None
    priority: int = 0
    timeout_s: float | None = None
    parse: ParseSpec | None = None  # the answer will be parsed (engines may adjust decoding)
    merge: AdapterMerge | None = None  # an adapter composed for this request (model = base)


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, stop string or stop token; see Delta.matched_stop
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True, kw_only=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    rank: int | None = None  # 1 = the most likely token


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    rank: int | None = None  # 1 = the most likely token


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """What the engine made of a prompt: first event of every request. In a batch every
    request's `Started` is forwarded, `prompt_index` saying which prompt it describes."""

    prompt_token_ids: tuple[int, ...]
    prompt_text: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    prompt_index: int = 0
    max_tokens: int | None = None  # the output limit the prompt budget set (server/core/budget.py)


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Delta:
    """New output for one choice. `text` may be "" while a multi-byte character is incomplete.

    The last delta of a choice carries `finish` (and `matched_stop`: the stop string or token id
    that ended it, None for EOS or length); a choice that ends without new output (an abort)
    ends with a delta that has no text and no tokens.
    """

    choice: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish: FinishReason | None = None
    matched_stop: str | int | None = None


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class TokenTiming:
    """When an engine that delivered a request's output in one piece produced its tokens:
    seconds from receiving the request to its first token, and from the first to the last."""

    first_token_s: float
    decode_s: float


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Done:
    usage: Usage
    timing: TokenTiming | None = None  # set by engines for output delivered in one piece


GenerationEvent = Started | Delta | Done


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    index: int
    text: str
    finish_reason: FinishReason
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    matched_stop: str | int | None = None


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationResult:
    request_id: str
    model: str
    prompts: tuple[Started, ...]  # one per prompt of the request, in prompt order
    choices: tuple[Choice, ...]
    usage: Usage

    @property
    def prompt(self) -> Started:
        return self.prompts[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterHandle:
    """What the engine needs to run a LoRA adapter. `int_id` is stable for the name's lifetime."""

    name: str
    int_id: int
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingDefaults:
    """The model's own defaults (its `generation_config.json`, as vLLM's `generation_config=
    "auto"`): what a request that omits a field gets instead of the neutral value."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallPiece:
    """A tool call, whole or as one streamed piece of it: the first piece of call `index` has
    its `id` and `name`, later pieces only more `arguments` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedOutput:
    """Model text split by the output parsers: reasoning, content (None when there is none) and
    tool calls. For a whole answer each call is one piece; for a streamed delta, pieces."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: tuple[ToolCallPiece, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineInfo:
    model_name: str  # served name of the base model
    model_path: str
    max_model_len: int
    vocab_size: int
    dtype: str
    version: str
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int
    max_num_seqs: int
    block_size: int
    eos_token_id: int | None = None
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    tool_call_parser: str | None = None  # vLLM's parser names; None: not configured
    reasoning_parser: str | None = None
    fingerprint: str | None = None  # OpenAI `system_fingerprint`, as vLLM's server writes it


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    """One adapter's requests in the engine: executing (scheduled in a batch) and waiting in
    the engine's own queue (submitted, not scheduled yet, or preempted)."""

    running: int
    waiting: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    running: int
    waiting: int
    total_blocks: int
    free_blocks: int
    # this front end's requests per adapter name (only adapters with requests in the engine)
    adapters: dict[str, AdapterLoad] = field(default_factory=dict)
