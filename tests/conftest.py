"""Shared fixtures: one real gateway process on the real vLLM engine per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serverproc import RunningServer, demo_workflow, running_server


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The gateway on the demo model with the real vLLM engine, shared by the whole session.
    It also serves the DJL workflow `tiny-a2` (base + a2)."""
    folder = tmp_path_factory.mktemp("live")
    workflows = {"LoraConfig": {"workflows": [str(demo_workflow(folder / "workflow"))]}}
    with running_server(folder, overrides=workflows) as server:
        yield server


# DJL's own switches, set as a DJL user sets them: LMI's legacy rolling-batch schema and TGI's
# answer on SageMaker's /invocations.
DJL_OPTIONS = {"OPTION_ROLLING_BATCH": "vllm", "OPTION_TGI_COMPAT": "true"}


@pytest.fixture(scope="session")
def djl_options_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A second gateway on the real engine, started with DJL_OPTIONS in its environment."""
    with running_server(tmp_path_factory.mktemp("djl-options"), environ=DJL_OPTIONS) as server:
        yield server


@pytest.fixture(scope="session")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The same process on the fake engine (fast start), for transport-level tests."""
    with running_server(tmp_path_factory.mktemp("fake"), engine="fake") as server:
        yield server


@pytest.fixture(scope="session", autouse=True)
def hub_clients_reach_loopback() -> None:
    """HF_HUB_OFFLINE=1 (these machines have no model hub) would also stop huggingface_hub's
    InferenceClient from calling our own server on 127.0.0.1; the tests only talk to loopback."""
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = False


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
