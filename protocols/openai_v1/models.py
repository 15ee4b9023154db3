"""Model cards: `/v1/models` and `/v1/models/{model}`."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

JSON = dict[str, Any]


def _permission(created: int) -> JSON:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def model_card(
    name: str,
    *,
    created: int,
    parent: str | None = None,
    max_model_len: int | None = None,
    root: str | None = None,
) -> JSON:
    """vLLM's `ModelCard`. `root` is the weights' or adapter's path as vLLM shows it, but only
    to admin callers; others see the served name (RELIABILITY_PERF.md B.5: /v1/models must not
    reveal where weights live to every client)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root or name,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [_permission(created)],
    }


def model_list(
    base_names: Sequence[str],
    adapters: Sequence[str],
    *,
    created: int,
    max_model_len: int,
    roots: Mapping[str, str] | None = None,
) -> JSON:
    """Base models first (`parent` null), then every loaded adapter (`parent` = first base).
    `roots` (name → path) is given for admin callers only."""
    shown = roots or {}
    data = [
        model_card(name, created=created, max_model_len=max_model_len, root=shown.get(name))
        for name in base_names
    ]
    data += [
        model_card(name, created=created, parent=base_names[0], root=shown.get(name))
        for name in adapters
    ]
    return {"object": "list", "data": data}


def model_object(name: str, *, created: int, parent: str | None) -> JSON:
    """`GET /v1/models/{model}` in MindIE's shape (`parent` only for adapters)."""
    card: JSON = {"id": name, "object": "model", "created": created, "owned_by": "vllm"}
    if parent is not None:
        card["parent"] = parent
    return card
