"""The `system_fingerprint` vLLM 0.32's server answers in its default mode (`full`,
vllm/entrypoints/serve/utils/fingerprint.py): version, parallelism beyond one, the config's
hash cut to 8 characters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from server.engines.vllm_info import system_fingerprint


def _config(
    tp: int = 1, pp: int = 1, dp: int = 1, ep: bool = False, digest: Any = "0123456789abcdef"
) -> Any:
    def compute_hash() -> str:
        if isinstance(digest, Exception):
            raise digest
        return str(digest)

    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                               data_parallel_size=dp, enable_expert_parallel=ep)
    return SimpleNamespace(parallel_config=parallel, compute_hash=compute_hash)


@pytest.mark.parametrize(
    ("config", "fingerprint"),
    [
        (_config(), "vllm-0.32.0-01234567"),
        (_config(tp=2, dp=4), "vllm-0.32.0-tp2-dp4-01234567"),
        (_config(tp=2, pp=2, dp=2, ep=True), "vllm-0.32.0-tp2-pp2-dp2-ep-01234567"),
        (_config(digest=RuntimeError("unhashable")), "vllm-0.32.0-nohash"),
    ],
)
def test_the_fingerprint_is_vllms(config: Any, fingerprint: str) -> None:
    assert system_fingerprint(config, "0.32.0") == fingerprint
