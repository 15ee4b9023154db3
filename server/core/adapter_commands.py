"""The registry's command set: every operation that changes adapters or asks the engine.

Each is a frozen value naming the `AdapterRegistry` method it stands for (`method`), so it can
travel: with several workers, a mirror's registry sends its commands to the owner's, which runs
them through its one dispatch table (`AdapterRegistry.execute`). A public registry method is a
query, a command, or a composition of commands (tests/unit/test_adapter_commands.py holds every
method to that, so a new change cannot run locally on a mirror by omission).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar

from server.core.adapter_records import AdapterRecord, RegistryView, SyncReport
from server.core.types import AdapterHandle, AdapterMerge

T = TypeVar("T")


class Command(Generic[T]):
    """A command whose answer is a T."""

    __slots__ = ()
    method: ClassVar[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Register(Command[AdapterRecord]):
    method = "register"
    name: object
    src: object
    preload: bool = True
    pin: bool = False
    options: dict[str, str] | None = None
    alias: str | None = None
    origin: str = "api"


@dataclass(frozen=True, slots=True, kw_only=True)
class Update(Command[AdapterRecord]):
    method = "update"
    name: str
    src: object = None
    preload: bool | None = None
    pin: bool | None = None
    options: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Unregister(Command[AdapterRecord]):
    method = "unregister"
    name: str


@dataclass(frozen=True, slots=True)
class Resave(Command[None]):
    method = "resave"
    name: str


@dataclass(frozen=True, slots=True)
class AddAlias(Command[None]):
    method = "add_alias"
    alias: str
    target: str


@dataclass(frozen=True, slots=True)
class ReloadChanged(Command[AdapterRecord]):
    method = "reload_changed"
    name: str


@dataclass(frozen=True, slots=True)
class SyncFolders(Command[SyncReport]):
    method = "sync_folders"


@dataclass(frozen=True, slots=True)
class Ensure(Command[AdapterRecord]):
    method = "ensure"
    name: str


@dataclass(frozen=True, slots=True)
class Compose(Command[str]):
    method = "compose"
    merge: AdapterMerge


@dataclass(frozen=True, slots=True)
class Acquire(Command[AdapterHandle]):
    method = "acquire"
    name: str


@dataclass(frozen=True, slots=True)
class Prefetch(Command[bool]):
    method = "prefetch"
    name: str


@dataclass(frozen=True, slots=True)
class EngineResident(Command[set[str]]):
    method = "engine_resident"


@dataclass(frozen=True, slots=True)
class Refresh(Command[RegistryView]):
    """The owner's records now, with their numbers and residency (pushed views carry names)."""

    method = "refresh"


AdapterCommand = (
    Register | Update | Unregister | Resave | AddAlias | ReloadChanged | SyncFolders | Ensure
    | Compose | Acquire | Prefetch | EngineResident | Refresh
)


class RegistryOwnerPort(Protocol):
    """How a registry that does not own the adapters (another worker's mirror) reaches the one
    that does: its commands run there, and the adapters it acquired are released there."""

    async def run(self, command: Command[T]) -> T: ...

    def release(self, handle: AdapterHandle, generated_tokens: int) -> None: ...
