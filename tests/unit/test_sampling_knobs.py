"""Every sampling knob applied or refused, never dropped (issue 19): OpenAI's `best_of`, which
vLLM 0.32 ignores, is bounded by `LimitsConfig.maxBestOf` and refused beyond `n`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    gateway = make_gateway(overrides={"LimitsConfig": {"maxBestOf": 4}})
    async with client(gateway, "data") as http:
        yield http


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION),
                                       ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize(
    "fields,message",
    [
        ({"best_of": 1_000_000}, "best_of must be between 1 and 4, got 1000000."),
        ({"best_of": 0}, "best_of must be between 1 and 4, got 0."),
        ({"best_of": 1, "n": 2},
         "best_of must be greater than or equal to n, got n=2 and best_of=1."),
        ({"best_of": 3, "n": 2}, "best_of > n is not supported by this server"),
        ({"best_of": "x"}, "best_of"),
    ],
)
async def test_best_of_is_bounded_and_refused_beyond_n(
    http: httpx.AsyncClient, path: str, base: dict[str, Any], fields: dict[str, Any], message: str
) -> None:
    response = await http.post(path, json={**base, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["param"].endswith("best_of")  # validation errors: "body.best_of", as vLLM
    assert error["type"] in ("BadRequestError", "Bad Request")  # ours, and vLLM's 422 → 400


@pytest.mark.parametrize("fields,choices", [({"best_of": None}, 1), ({"best_of": 1}, 1),
                                            ({"best_of": 2, "n": 2}, 2)])
async def test_best_of_that_asks_for_nothing_beyond_n_is_served(
    http: httpx.AsyncClient, fields: dict[str, Any], choices: int
) -> None:
    response = await http.post("/v1/completions", json={**COMPLETION, **fields})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == choices
