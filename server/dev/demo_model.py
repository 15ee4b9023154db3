"""Build the gateway's embedded default model: a tiny random Llama, its tokenizer and LoRA adapters.

Everything is produced locally, offline and deterministically (fixed seeds), in a few seconds:

* ``<out>/model/``          tiny Llama (fp32 safetensors) + byte-level BPE tokenizer + chat template
* ``<out>/adapters/``       ``a1`` (q,v), ``a2`` (all 7 projections), ``a3`` (a2 with lora_B x3)
* ``<out>/test-adapters/``  ``big16`` (rank 16), ``corrupt``, ``noconfig``, ``pickle_only``,
                            ``a4``..``a12`` (nine more rank-8 q,v adapters)

The model is nonsense by design; it exists so the serving stack (vLLM with LoRA) can run on a
2-core CPU box without any download. The build is cached: when ``<out>/.complete`` holds
:data:`BUILD_VERSION`, :func:`build_demo` returns at once without importing torch. A build
happens in a temporary directory beside ``<out>`` which is renamed into place when finished.

Usage: ``python -m server.dev.demo_model [--out build/demo] [--force]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

BUILD_VERSION = "llm-gateway-demo-model/3"
"""Changing anything that alters the built files must bump this string (it invalidates caches)."""

MARKER = ".complete"
DEFAULT_OUT = Path("build/demo")

SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
)
# Added after BPE training, so the ids of everything else stay as they were: the tool role is
# special; the markup tokens are not (as in Qwen's and Hermes' tokenizers), so they survive
# decoding and vLLM's parsers see them in the text.
ADDED_SPECIAL_TOKENS: tuple[str, ...] = ("<|tool|>",)
MARKUP_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<think>", "</think>")
# Hermes-style tool calling: the tools in a system turn (name and parameter names only: the
# context is 512 tokens), calls as <tool_call> JSON, results as tool turns. `reasoning_effort`
# gets a system line; `enable_thinking` opens a <think> block.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>Tools:{% for tool in tools %}{% set f = tool['function'] %}"
    " {{ f['name'] }}({{ ((f['parameters'] or {})['properties'] or {}) | join(', ') }})"
    "{% endfor %}{{ eos_token }}{% endif %}"
    "{% if reasoning_effort %}<|system|>Reasoning: {{ reasoning_effort }}{{ eos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|tool|><tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}<|{{ m['role'] }}|>"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] or '' }}"
    "{% for call in m.get('tool_calls') or [] %}<tool_call>{\"name\": "
    "{{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>{% endif %}"
    "{% endif %}"
)
# The model's own sampling defaults (generation_config.json): what vLLM applies to a request
# that omits a field (`generation_config="auto"`), and the gateway on every protocol.
GENERATION_DEFAULTS: dict[str, float | int] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "repetition_penalty": 1.05,
    "max_new_tokens": 64,
}
VOCAB_SIZE = 1024
MAX_POSITIONS = 512
MODEL_SEED = 0
CORPUS_SEED = 0
CORPUS_SENTENCES = 4000
LORA_ALPHA = 16

QV: tuple[str, ...] = ("q_proj", "v_proj")
ALL_PROJ: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

_WORD_TEXT = (
    "the a model gateway token stream adapter request server client cat dog river mountain "
    "city data engine answer question hello world fast slow small large red blue green runs "
    "reads writes sends returns loads is was and or but with from to of in on for json http "
    "lora rank cpu memory queue batch prompt completion chat user system assistant why how "
    "what when where"
)
_WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
_PUNCT: tuple[str, ...] = (".", "!", "?", ",", ";", ":")


@dataclass(frozen=True)
class DemoPaths:
    """Where a demo build lives: the base model dir and the two adapter roots."""

    model: Path
    adapters_dir: Path
    test_adapters_dir: Path


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter to generate; ``seed`` fixes its random weights."""

    name: str
    rank: int
    targets: tuple[str, ...]
    seed: int
    b_scale: float = 1.0
    safetensors: bool = True


SERVED_ADAPTERS: tuple[AdapterSpec, ...] = (
    AdapterSpec("a1", 8, QV, seed=1),
    AdapterSpec("a2", 8, ALL_PROJ, seed=2),
    AdapterSpec("a3", 8, ALL_PROJ, seed=2, b_scale=3.0),
)
TEST_ADAPTERS: tuple[AdapterSpec, ...] = (
    AdapterSpec("big16", 16, QV, seed=16),
    AdapterSpec("pickle_only", 8, QV, seed=13, safetensors=False),
    AdapterSpec("corrupt", 8, QV, seed=14),
    AdapterSpec("noconfig", 8, QV, seed=15),
    *(AdapterSpec(f"a{i}", 8, QV, seed=i) for i in range(4, 13)),
)


def demo_paths(out_dir: Path) -> DemoPaths:
    """Return the layout of a build rooted at ``out_dir`` (nothing is checked or created)."""
    return DemoPaths(
        model=out_dir / "model",
        adapters_dir=out_dir / "adapters",
        test_adapters_dir=out_dir / "test-adapters",
    )


def is_complete(out_dir: Path) -> bool:
    """True when ``out_dir`` holds a finished build of the current :data:`BUILD_VERSION`."""
    try:
        return (out_dir / MARKER).read_text(encoding="utf-8").strip() == BUILD_VERSION
    except OSError:
        return False


def build_demo(out_dir: Path, *, force: bool = False) -> DemoPaths:
    """Build the demo model and adapters into ``out_dir`` unless a current build is there.

    The returned paths refer to ``out_dir`` exactly as given (relative stays relative).
    ``force`` rebuilds even when the cached build is current.
    """
    out_dir = Path(out_dir)
    paths = demo_paths(out_dir)
    if not force and is_complete(out_dir):
        return paths
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        _build_into(staging, final=paths)
        (staging / MARKER).write_text(BUILD_VERSION + "\n", encoding="utf-8")
        _publish(staging, out_dir, force=force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths


def _publish(staging: Path, out_dir: Path, *, force: bool) -> None:
    """Rename ``staging`` to ``out_dir``, replacing an older build.

    If another process published a current build meanwhile (and ``force`` is off), keep theirs.
    """
    old: Path | None = None
    if out_dir.exists():
        if not force and is_complete(out_dir):
            return
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except OSError:
        if not is_complete(out_dir):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _build_into(root: Path, *, final: DemoPaths) -> None:
    """Write model, tokenizer and adapters under ``root``; adapter configs name ``final.model``.

    Torch's global RNG is seeded per artefact, inside a fork so the caller's RNG is untouched.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        _build_artefacts(root, final=final)
    _make_world_readable(root)


def _build_artefacts(root: Path, *, final: DemoPaths) -> None:
    staged = demo_paths(root)
    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(str(staged.model))
    model = _make_model(tokenizer)
    _save_model(model, staged.model)
    base_ref = str(final.model)
    for spec in SERVED_ADAPTERS:
        _save_adapter(model, spec, staged.adapters_dir / spec.name, base_ref)
    for spec in TEST_ADAPTERS:
        _save_adapter(model, spec, staged.test_adapters_dir / spec.name, base_ref)
    _break_adapter(staged.test_adapters_dir / "corrupt", staged.test_adapters_dir / "noconfig")


def _make_world_readable(root: Path) -> None:
    """Give every dir 0755 and file 0644 (mkdtemp and safetensors create them private)."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _corpus(rng: random.Random) -> Iterator[str]:
    """Yield deterministic pseudo-English sentences, then every printable ASCII character."""
    for _ in range(CORPUS_SENTENCES):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words).capitalize() + rng.choice(_PUNCT)
        yield sentence
    yield string.printable
    yield from string.printable


def _train_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the generated corpus; BOS is prepended on encode."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors, trainers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(random.Random(CORPUS_SEED)), trainer=trainer)
    bos_id = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in ADDED_SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )


def _make_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Create the tiny Llama with seeded random weights and matching special-token ids."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.2,
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=True, **GENERATION_DEFAULTS, **ids
    )
    if model.dtype != torch.float32:
        raise RuntimeError(f"expected a float32 model, got {model.dtype}")
    return model


def _save_model(model: LlamaForCausalLM, out: Path) -> None:
    """Save fp32 safetensors + config + generation config, without a progress bar."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _save_adapter(base: LlamaForCausalLM, spec: AdapterSpec, out: Path, base_ref: str) -> None:
    """Attach a seeded random LoRA to a copy of ``base`` and save it with peft."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=list(spec.targets),
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    torch.manual_seed(spec.seed)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    if spec.b_scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if ".lora_B." in name:
                    param.mul_(spec.b_scale)
    saved_config = peft_model.peft_config["default"]
    if not isinstance(saved_config, LoraConfig):
        raise TypeError(f"unexpected peft config {type(saved_config).__name__}")
    saved_config.base_model_name_or_path = base_ref
    saved_config.target_modules = sorted(spec.targets)  # peft holds a set: hash-seed order
    # save_embedding_layers=False: "auto" probes base_ref (not yet in place) and even the Hub.
    peft_model.save_pretrained(
        str(out), safe_serialization=spec.safetensors, save_embedding_layers=False
    )
    (out / "README.md").unlink(missing_ok=True)


def _break_adapter(corrupt: Path, noconfig: Path) -> None:
    """Make ``corrupt`` hold garbage weights and ``noconfig`` lose its adapter_config.json."""
    garbage = random.Random(14).randbytes(4096)
    (corrupt / "adapter_model.safetensors").write_bytes(garbage)
    (noconfig / "adapter_config.json").unlink()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m server.dev.demo_model",
        description="Build the tiny offline demo model, tokenizer and LoRA adapters.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output dir (build/demo)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: build (or reuse) and print where things are."""
    args = _parse_args(argv)
    out_dir: Path = args.out
    cached = not args.force and is_complete(out_dir)
    started = time.perf_counter()
    paths = build_demo(out_dir, force=args.force)
    elapsed = time.perf_counter() - started
    state = "cached" if cached else f"built in {elapsed:.1f}s"
    sys.stdout.write(
        f"demo model {state}: {paths.model}\n"
        f"adapters: {paths.adapters_dir}  test adapters: {paths.test_adapters_dir}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
