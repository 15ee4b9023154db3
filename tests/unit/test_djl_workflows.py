"""DJL workflow.json loading (protocols/djl/workflows.py) on the fake engine and temp dirs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from protocols.djl.workflows import (
    ServedBase,
    WorkflowError,
    load_workflows,
    parse_workflow,
    register_workflows,
)
from server.core.adapter_files import AdapterRules
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.engines.fake import FakeEngine
from tests.unit.demo_kit import write_adapter

pytestmark = pytest.mark.anyio


def workflow(folder: Path, **changes: Any) -> Path:
    data: dict[str, Any] = {
        "name": "wf", "version": "0.1", "models": {"m": "../model"},
        "configs": {"adapters": {"a1": {"model": "m", "src": "../adapters/a1",
                                        "options": {"k": 1}}}},
        "workflow": {"out": ["adapter", "a1", "in"]},
    }
    data.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "workflow.json").write_text(json.dumps(data))
    return folder / "workflow.json"


@pytest.fixture
def base(tmp_path: Path) -> ServedBase:
    (tmp_path / "model").mkdir()
    write_adapter(tmp_path / "adapters" / "a1")
    write_adapter(tmp_path / "adapters" / "a2")
    return ServedBase(names=frozenset({"tiny"}), path=str(tmp_path / "model"))


def registry(root: Path) -> AdapterRegistry:
    rules = AdapterRules(roots=(str(root),), max_rank=8, base_names=frozenset({"tiny"}))
    limits = AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4)
    return AdapterRegistry(engine=FakeEngine(), rules=rules, limits=limits)


def test_paths_are_relative_to_the_workflow_file(tmp_path: Path, base: ServedBase) -> None:
    spec = parse_workflow(workflow(tmp_path / "wf"), base)
    assert (spec.name, spec.adapter, spec.options) == ("wf", "a1", {"k": "1"})
    assert spec.resolved_src == str(tmp_path / "adapters" / "a1")


def test_model_may_be_named_by_the_served_name(tmp_path: Path, base: ServedBase) -> None:
    assert parse_workflow(workflow(tmp_path / "wf", models={"m": "tiny"}), base).adapter == "a1"


@pytest.mark.parametrize(
    ("changes", "words"),
    [({"workflow": {"out": ["adapter", "a1", "in"], "x": ["adapter", "a1", "in"]}}, "one node"),
     ({"workflow": {"out": ["lambda", "a1", "in"]}}, "only the adapter workflow"),
     ({"configs": {}}, "configs.adapters.a1"),
     ({"models": {"m": "/elsewhere/model"}}, "not the served base model"),
     ({"models": {"other": "tiny"}}, "not listed"),
     ({"configs": {"adapters": {"a1": {"model": "m"}}}}, "has no src")],
)
def test_unsupported_workflows_are_refused_with_the_reason(
    tmp_path: Path, base: ServedBase, changes: dict[str, Any], words: str
) -> None:
    with pytest.raises(WorkflowError, match=words):
        parse_workflow(workflow(tmp_path / "wf", **changes), base)


async def test_workflow_name_selects_its_adapter_everywhere(
    tmp_path: Path, base: ServedBase
) -> None:
    reg = registry(tmp_path)
    await register_workflows(reg, load_workflows([str(workflow(tmp_path / "wf"))], base))
    assert "wf" in reg and reg.names() == ["a1"]
    assert (await reg.acquire("wf")).name == "a1"


async def test_an_adapter_already_registered_from_the_same_source_is_reused(
    tmp_path: Path, base: ServedBase
) -> None:
    reg = registry(tmp_path)
    await reg.register("a1", str(tmp_path / "adapters" / "a1"))
    await register_workflows(reg, load_workflows([str(workflow(tmp_path / "wf"))], base))
    assert reg.aliases() == {"wf": "a1"}


async def test_bad_workflows_are_skipped_and_others_load(
    tmp_path: Path, base: ServedBase, caplog: pytest.LogCaptureFixture
) -> None:
    reg = registry(tmp_path)
    await reg.register("a1", str(tmp_path / "adapters" / "a2"))  # a1 with another source
    clash = {"a1": {"model": "m", "src": "../../adapters/a1"}}
    workflow(tmp_path / "flows" / "clash", models={"m": "tiny"}, configs={"adapters": clash})
    workflow(tmp_path / "flows" / "broken", workflow={})
    good = {"a2": {"model": "m", "src": "../../adapters/a2"}}
    workflow(tmp_path / "flows" / "good", name="ok", models={"m": "tiny"},
             configs={"adapters": good}, workflow={"out": ["adapter", "a2", "in"]})
    await register_workflows(reg, load_workflows([str(tmp_path / "flows")], base))
    assert reg.aliases() == {"ok": "a2"}
    assert "registered with another source" in caplog.text
