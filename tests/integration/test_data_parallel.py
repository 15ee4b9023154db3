"""Distributed serving passes through to vLLM: the settings as operators write them (config.json,
DJL's serving.properties, the environment) become vLLM's own engine configuration, which is what
decides tensor, pipeline and data parallelism. No engine is started: this machine has 2 cores and
one NUMA node, and data-parallel engines on it would only compete for them (README, Scaling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server.engines.factory import vllm_options
from server.settings import load_settings

pytestmark = pytest.mark.engine


def vllm_config(
    cli: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    properties: Path | None = None,
) -> Any:
    from vllm import AsyncEngineArgs

    settings = load_settings(
        config_path=None, properties_path=properties, environ=environ or {}, cli=cli or {}
    ).settings
    return AsyncEngineArgs(**vllm_options(settings).engine_kwargs()).create_engine_config()


def test_data_parallel_size_from_config_json_is_vllms() -> None:
    parallel = vllm_config(cli={"ModelConfig": {"dataParallelSize": 2}}).parallel_config
    assert parallel.data_parallel_size == 2
    assert parallel.data_parallel_size_local == 2  # both engines on this host
    assert parallel.data_parallel_backend == "mp"
    assert parallel.world_size == 1  # per engine: data parallel is beside TP x PP


def test_data_parallel_beside_tensor_and_pipeline_parallel_from_the_environment() -> None:
    config = vllm_config(environ={"GATEWAY__MODELCONFIG__DATAPARALLELSIZE": "2",
                                  "GATEWAY__MODELCONFIG__PIPELINEPARALLELSIZE": "1"})
    assert config.parallel_config.data_parallel_size == 2


def test_djl_options_reach_vllm(tmp_path: Path) -> None:
    properties = tmp_path / "serving.properties"
    properties.write_text("option.tensor_parallel_degree=1\noption.data_parallel_size=2\n")
    parallel = vllm_config(properties=properties).parallel_config
    assert parallel.data_parallel_size == 2  # an option DJL does not name: engineOptions
    assert parallel.tensor_parallel_size == 1


def test_one_engine_by_default() -> None:
    parallel = vllm_config().parallel_config
    assert (parallel.data_parallel_size, parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size) == (1, 1, 1)
