"""The registry's command set covers every change: a public registry method is a query, a
command (run where the adapters are owned), or a composition of commands, and a mirror's
registry runs every command in the owner (so a new change cannot run locally by omission)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, TypeVar, get_args

import pytest

from server.core.adapter_commands import AdapterCommand, Command, Refresh
from server.core.adapter_files import AdapterRules
from server.core.adapters import AdapterLimits, AdapterRegistry, RegistryView
from server.core.types import AdapterHandle
from server.engines.fake import FakeEngine
from server.runtime.worker_link import MirrorRegistry
from tests.unit.demo_kit import SHAPE

pytestmark = pytest.mark.anyio
T = TypeVar("T")

# read the registry's own state, never change it, never wait (a mirror answers them from its view)
QUERIES = frozenset({
    "names", "records", "merged_records", "is_merged", "paths_in_use", "get", "resolve", "found",
    "failures", "canonical", "aliases", "snapshots", "view", "show", "is_resident",
})
COMPOSED = frozenset({"acquire_merged", "watch_folders"})  # call only commands
PORT = frozenset({"run", "execute", "release"})  # the command entry, its table, the lease's end
COMMAND_METHODS = {command.method: command for command in get_args(AdapterCommand)}


def _public_methods(cls: type) -> dict[str, Any]:
    return {
        name: value for name, value in vars(cls).items()
        if callable(value) and not name.startswith("_")
    }


def test_every_public_method_is_a_query_a_command_or_a_composition_of_commands() -> None:
    methods = _public_methods(AdapterRegistry)
    unclassified = set(methods) - QUERIES - COMPOSED - PORT - set(COMMAND_METHODS)
    assert not unclassified, f"add a command to server/core/adapter_commands.py: {unclassified}"
    assert set(COMMAND_METHODS) <= set(methods)  # each command names the method it stands for
    asynchronous = {n for n, m in methods.items() if inspect.iscoroutinefunction(m)}
    assert not asynchronous & QUERIES, "a query answers from the registry's state, at once"
    assert asynchronous - COMPOSED - PORT == set(COMMAND_METHODS)


def test_the_mirror_overrides_nothing_it_only_builds_its_link() -> None:
    own = {n for n, v in vars(MirrorRegistry).items() if callable(v)}
    assert own == {"__init__"}


class RecordingOwner:
    """An owner port that records the commands it is sent (and answers nothing useful)."""

    def __init__(self) -> None:
        self.commands: list[Command[Any]] = []
        self.released: list[AdapterHandle] = []

    async def run(self, command: Command[T]) -> T:
        self.commands.append(command)
        if isinstance(command, Refresh):  # the one answer the registry itself reads
            return RegistryView(records=(), aliases={}, failed={})  # type: ignore[return-value]
        return None  # type: ignore[return-value]

    def release(self, handle: AdapterHandle, generated_tokens: int) -> None:
        self.released.append(handle)


def _placeholders(method: Any) -> list[object]:
    parameters = inspect.signature(method).parameters.values()
    return [
        "x" for p in parameters
        if p.name != "self" and p.default is inspect.Parameter.empty
        and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]


@pytest.mark.parametrize("method", sorted(COMMAND_METHODS))
async def test_a_registry_that_does_not_own_the_adapters_sends_every_command_to_the_owner(
    method: str, tmp_path: Path
) -> None:
    owner = RecordingOwner()
    engine = FakeEngine(model_name="tiny")
    rules = AdapterRules(roots=(str(tmp_path),), max_rank=8, base_names=frozenset({"tiny"}),
                         base_shape=SHAPE)
    limits = AdapterLimits(enabled=True, max_loras=1, max_cpu_loras=2,
                           discovery_dirs=(str(tmp_path),))
    registry = AdapterRegistry(engine=engine, rules=rules, limits=limits, owner=owner)
    bound = getattr(registry, method)
    await bound(*_placeholders(bound))
    assert [type(c) for c in owner.commands] == [COMMAND_METHODS[method]]
    assert registry.names() == [] and engine.adapters == {}  # nothing ran here
    handle = AdapterHandle(name="x", int_id=1, path=str(tmp_path))
    registry.release(handle)
    assert owner.released == [handle]
