"""DJL workflow adapters: `workflow.json` files that name an endpoint serving base + one adapter.

The supported shape is DJL's adapter workflow (docs/adapters.md, "Workflow Adapters"):

    {"name": "wf", "version": "0.1",
     "models": {"m": "<the base model: its path or served name>"},
     "configs": {"adapters": {"a1": {"model": "m", "src": "<adapter dir>", "options": {...}}}},
     "workflow": {"out": ["adapter", "a1", "in"]}}

Loading one registers the adapter (under its configs name; an already registered adapter with the
same source is reused) and makes the workflow name an alias of it in the registry, so
`/predictions/wf`, OpenAI `model="wf"` and every other protocol resolve it alike. Relative paths
start at the workflow file's directory. A bad workflow is logged and skipped, never fatal.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.core.adapters import AdapterRegistry
from server.core.errors import GatewayError

logger = logging.getLogger("gateway.workflows")
WORKFLOW_FILE = "workflow.json"


class WorkflowError(ValueError):
    """A workflow.json this server cannot serve; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowSpec:
    name: str
    adapter: str
    src: str
    options: dict[str, str] = field(default_factory=dict)
    file: str = ""

    @property
    def resolved_src(self) -> str:
        return str(Path(self.src).resolve())


@dataclass(frozen=True, slots=True, kw_only=True)
class ServedBase:
    """What a workflow's model entry must point at: the one served base model."""

    names: frozenset[str]
    path: str


def workflow_files(entries: list[str]) -> list[Path]:
    """Each entry is a workflow.json, a directory holding one, or a directory of such
    directories."""
    found: list[Path] = []
    for entry in entries:
        path = Path(entry)
        if path.is_file():
            found.append(path)
        elif (path / WORKFLOW_FILE).is_file():
            found.append(path / WORKFLOW_FILE)
        elif path.is_dir():
            found += sorted(p for p in path.glob(f"*/{WORKFLOW_FILE}") if p.is_file())
        else:
            logger.error("workflow %s: no such file or directory", entry)
    return found


def parse_workflow(path: Path, base: ServedBase) -> WorkflowSpec:
    """Read one workflow.json. Raises WorkflowError naming the problem."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WorkflowError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise WorkflowError(f"{path}: must hold a JSON object")
    name = data.get("name") or path.parent.name
    adapter = _adapter_of(data.get("workflow"))
    config = _adapter_config(data, adapter)
    _check_model(data.get("models"), config.get("model"), path.parent, base)
    src = config.get("src")
    if not isinstance(src, str) or not src:
        raise WorkflowError(f"adapter {adapter!r} has no src")
    options = config.get("options") or {}
    if not isinstance(options, dict):
        raise WorkflowError(f"adapter {adapter!r}: options must be an object")
    return WorkflowSpec(
        name=str(name), adapter=adapter, src=_relative_to(src, path.parent),
        options={str(k): str(v) for k, v in options.items()}, file=str(path),
    )


def _adapter_of(workflow: Any) -> str:
    if not isinstance(workflow, dict) or len(workflow) != 1:
        raise WorkflowError('"workflow" must have exactly one node: ["adapter", "<a>", "in"]')
    node = next(iter(workflow.values()))
    if not (isinstance(node, list) and len(node) == 3 and node[0] == "adapter"
            and isinstance(node[1], str) and node[2] == "in"):
        raise WorkflowError('only the adapter workflow ["adapter", "<a>", "in"] is supported')
    return node[1]


def _adapter_config(data: dict[str, Any], adapter: str) -> dict[str, Any]:
    configs = data.get("configs")
    adapters = configs.get("adapters") if isinstance(configs, dict) else None
    config = adapters.get(adapter) if isinstance(adapters, dict) else None
    if not isinstance(config, dict):
        raise WorkflowError(f'"configs.adapters.{adapter}" is missing')
    return config


def _check_model(models: Any, key: Any, folder: Path, base: ServedBase) -> None:
    if not isinstance(models, dict) or key not in models:
        raise WorkflowError(f"the adapter's model {key!r} is not listed in \"models\"")
    entry = models[key]
    url = entry.get("modelUrl") if isinstance(entry, dict) else entry
    if not isinstance(url, str):
        raise WorkflowError(f"model {key!r} has no location")
    if url in base.names:
        return
    location = url.removeprefix("file://")
    if Path(_relative_to(location, folder)).resolve() != Path(base.path).resolve():
        raise WorkflowError(f"model {key!r} ({url}) is not the served base model")


def _relative_to(location: str, folder: Path) -> str:
    """`location` from `folder`, with `..` folded away (the operator wrote this file; the
    registry still resolves symlinks and checks the allowed roots)."""
    path = Path(location)
    return os.path.normpath(path if path.is_absolute() else folder / path)


async def register_workflows(registry: AdapterRegistry, specs: list[WorkflowSpec]) -> None:
    for spec in specs:
        try:
            await _register(registry, spec)
        except (GatewayError, WorkflowError) as exc:
            message = exc.message if isinstance(exc, GatewayError) else str(exc)
            logger.error("workflow %s from %s not loaded: %s", spec.name, spec.file, message)


async def _register(registry: AdapterRegistry, spec: WorkflowSpec) -> None:
    if spec.adapter in registry.names():
        existing = registry.get(spec.adapter)
        if existing.handle.path != spec.resolved_src:
            raise WorkflowError(f"adapter {spec.adapter!r} is registered with another source")
    else:
        await registry.register(spec.adapter, spec.src, options=spec.options, origin="config")
    await registry.add_alias(spec.name, spec.adapter)
    logger.info("workflow %s serves adapter %s", spec.name, spec.adapter)


def load_workflows(entries: list[str], base: ServedBase) -> list[WorkflowSpec]:
    specs = []
    for path in workflow_files(entries):
        try:
            specs.append(parse_workflow(path, base))
        except WorkflowError as exc:
            logger.error("workflow %s not loaded: %s", path, exc)
    return specs
