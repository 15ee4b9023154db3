"""Prompts of an exact token length under the demo model's tokenizer, identical for every arm.

Built from seeded random words, cut to the wanted number of tokens and checked by re-encoding,
so both servers see the same text and the same prompt length.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from tokenizers import Tokenizer

WORDS = [
    "model",
    "server",
    "token",
    "request",
    "stream",
    "adapter",
    "engine",
    "batch",
    "latency",
    "prompt",
    "answer",
    "cache",
    "memory",
    "core",
    "thread",
    "queue",
    "socket",
    "header",
    "chunk",
    "event",
    "client",
    "gateway",
    "protocol",
    "route",
    "vector",
    "matrix",
    "layer",
    "weight",
    "tensor",
    "kernel",
    "signal",
    "packet",
    "window",
    "buffer",
    "record",
    "metric",
    "river",
    "mountain",
    "garden",
    "window",
    "yellow",
    "quiet",
    "simple",
    "market",
    "letter",
    "number",
    "system",
    "travel",
    "morning",
    "evening",
    "family",
    "history",
    "science",
    "nature",
    "picture",
    "country",
    "student",
    "teacher",
    "table",
]


@functools.cache
def tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def prompt_of(length: int, seed: int, model_dir: str) -> str:
    """Text that encodes to exactly `length` tokens (without special tokens)."""
    tok = tokenizer(model_dir)
    rng = random.Random(seed)
    words: list[str] = []
    while len(tok.encode(" ".join(words), add_special_tokens=False).ids) < length + 8:
        words += rng.choices(WORDS, k=max(8, length // 2))
    ids = tok.encode(" ".join(words), add_special_tokens=False).ids
    for cut in range(length, length + 16):
        text = tok.decode(ids[:cut]).strip()
        if len(tok.encode(text, add_special_tokens=False).ids) == length:
            return text
    return tok.decode(ids[:length]).strip()


def prompt_set(length: int, count: int, model_dir: str, seed: int = 0) -> tuple[str, ...]:
    """`count` distinct prompts of `length` tokens."""
    return tuple(prompt_of(length, seed * 100_003 + i, model_dir) for i in range(count))
