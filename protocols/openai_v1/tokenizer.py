"""The body of vLLM's `/tokenize` answer."""

from __future__ import annotations

from typing import Any

JSON = dict[str, Any]


def tokenize_response(
    token_ids: list[int], *, max_model_len: int, token_strs: list[str] | None
) -> JSON:
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
    }
