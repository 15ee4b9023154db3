"""vLLM 0.32's top_k: 0 disables it, a value past the vocabulary means the same, and one that
does not fit the engine core's 64-bit msgpack integers must never be sent."""

from __future__ import annotations

import pytest

from server.engines.vllm_params import _top_k


@pytest.mark.parametrize(
    ("given", "sent"),
    [(-1, 0), (0, 0), (1, 1), (50, 50), (2**31 - 1, 2**31 - 1), (2**31, 0), (2**64, 0)],
)
def test_top_k_sent_to_the_engine(given: int, sent: int) -> None:
    assert _top_k(given) == sent
