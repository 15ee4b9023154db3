"""The adapter state journal (`LoraConfig.stateFile`): every change durable before it is
answered, a refused one leaves file and memory as they were, a crash at any point of a write
loads as the state before or after that change (never a failed start), compaction keeps the
file bounded and never loses a change, the version 1 file is still read. A file that is not a
journal (no header line) stops the start and is never overwritten; blank lines at the end do
not.

Faults are injected into the writer (`os.write`, `os.fsync`, `os.replace`, `mkstemp`) to stand
for a full disk, a read-only one, or the process dying at that point.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from server.core import adapter_state
from server.core.adapter_files import AdapterRules
from server.core.adapter_state import (
    COMPACT_SLACK,
    AdapterJournal,
    SavedAdapter,
    StateFileError,
    read_state,
)
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.errors import AdapterInvalid, StateNotSaved
from server.engines.fake import FakeEngine
from tests.unit.demo_kit import SHAPE, write_adapter

A = SavedAdapter("a", "/x/a", pin=True, options={"k": "v"})
B = SavedAdapter("b", "/x/b")
C = SavedAdapter("c", "/x/c", preload=False)


class Crash(BaseException):
    """The process dies here (SIGKILL): nothing after this point runs, no cleanup."""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "adapters.json"


def journal_at(path: Path) -> AdapterJournal:
    journal = AdapterJournal(path)
    journal.load()
    return journal


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def fail_with(code: int) -> Callable[..., Any]:
    def fail(*_: Any, **__: Any) -> Any:
        raise OSError(code, os.strerror(code))

    return fail


# ---- the format --------------------------------------------------------------------------------
def test_changes_are_appended_one_checksummed_line_each_and_read_back(path: Path) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    journal.set("b", B)
    journal.set("a", None)
    journal.set("b", B)  # unchanged: nothing written
    written = lines(path)
    assert len(written) == 4  # the header, two puts, one delete
    checksum, _, payload = written[3].partition(b" ")
    assert json.loads(payload) == {"delete": "a"} and len(checksum) == 8
    assert read_state(path) == [B]
    assert [p.name for p in path.parent.iterdir()] == ["adapters.json"]  # no temporary left


def test_a_missing_file_is_an_empty_state_and_its_folder_is_made(path: Path) -> None:
    assert read_state(path) == []
    assert path.parent.is_dir() and not path.exists()


def test_a_version_1_file_is_read_and_rewritten_as_a_journal_by_the_first_change(
    path: Path,
) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "adapters": [
        {"name": "a", "src": "/x/a", "pin": True, "preload": True, "options": {"k": "v"}},
        {"name": "b", "src": "/x/b"},
    ]}, indent=2))
    journal = journal_at(path)
    assert journal.saved() == [A, B]
    journal.set("c", C)
    assert lines(path)[0].endswith(b'"version":2}')
    assert read_state(path) == [A, B, C]


# ---- torn and damaged files --------------------------------------------------------------------
@pytest.mark.parametrize(
    "tail", [b'1234abcd {"put":{"name":"c"', b"\0" * 4096, b"zz\n", b'1234abcd {"pu\n\n  \n']
)
def test_a_torn_last_change_is_ignored_with_a_warning_and_rewritten_away(
    path: Path, tail: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    with path.open("ab") as out:
        out.write(tail)
    with caplog.at_level(logging.WARNING, "gateway.adapters"):
        again = journal_at(path)
    assert again.saved() == [A]
    assert caplog.text.count("torn change") == 1 and str(path) in caplog.text
    again.set("b", B)  # not glued to the torn bytes: the file is rewritten whole
    assert tail.strip(b"\n") not in path.read_bytes()
    assert read_state(path) == [A, B]


@pytest.mark.parametrize("problem", ["torn change", "folder"])
def test_the_start_reads_the_file_twice_and_warns_once(
    failing_registry: tuple[AdapterRegistry, FakeEngine, Path],
    path: Path,
    problem: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry, engine, _ = failing_registry
    if problem == "torn change":
        journal_at(path).set("a", A)
        with path.open("ab") as out:
            out.write(b'1234abcd {"put":{"na')
    else:
        path = path.parent.parent / "elsewhere" / "adapters.json"
        monkeypatch.setattr(Path, "mkdir", fail_with(errno.EACCES))
    with caplog.at_level(logging.WARNING, "gateway.adapters"):
        read_state(path)  # server.gateway.saved_adapters, before the engine starts
        AdapterRegistry(engine=engine, rules=registry.rules, limits=registry.limits,
                        state_file=path)  # the registry's journal, once it has
    assert caplog.text.count(problem) == 1 and str(path.parent) in caplog.text


@pytest.mark.parametrize(
    "foreign",
    [
        b"my-host-name\n",
        b"my-host-name",
        b"\x00\x01\xff garbage \n",
        b"\0" * 4096,
        b"first\nsecond\n",
        b'1234abcd {"put":{"name":"c"',  # a torn line is torn only after a journal header
    ],
)
def test_a_file_that_is_not_a_journal_stops_the_start_and_is_left_as_it_is(
    path: Path, foreign: bytes
) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(foreign)
    with pytest.raises(StateFileError) as caught:
        AdapterJournal(path).load()
    message = str(caught.value)
    assert str(path) in message and "is not an adapter state journal" in message
    assert "Fix: point LoraConfig.stateFile at a file of its own" in message
    assert path.read_bytes() == foreign


@pytest.mark.parametrize("end", [b"\n", b"\n\n", b"  \n", b" \t\r\n\n  ", b"\n\n\n \n"])
def test_blank_lines_and_whitespace_at_the_end_are_no_change(
    path: Path, end: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    journal.set("b", B)
    path.write_bytes(path.read_bytes() + end)  # an editor's save, an `echo >>`
    with caplog.at_level(logging.WARNING, "gateway.adapters"):
        again = journal_at(path)
    assert again.saved() == [A, B] and caplog.text == ""
    again.set("c", C)  # the file is written again as this server writes it
    assert read_state(path) == [A, B, C] and b"\n\n" not in path.read_bytes()
    assert path.read_bytes().endswith(b"}\n")


def test_a_whole_last_change_without_its_newline_is_kept(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    journal.set("b", B)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # an editor that drops the last newline
    with caplog.at_level(logging.WARNING, "gateway.adapters"):
        again = journal_at(path)
    assert again.saved() == [A, B] and caplog.text == ""  # acknowledged: never dropped
    again.set("c", C)  # not glued to the last line
    assert read_state(path) == [A, B, C]


def test_a_journal_with_crlf_line_ends_is_read(path: Path) -> None:
    journal_at(path).set("a", A)
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    again = journal_at(path)
    assert again.saved() == [A]
    again.set("b", B)
    assert read_state(path) == [A, B] and b"\r" not in path.read_bytes()


@pytest.mark.parametrize("blank", [b"", b"\n", b" \n\n"])
def test_an_empty_or_blank_file_is_an_empty_state(path: Path, blank: bytes) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(blank)
    journal = journal_at(path)
    assert journal.saved() == []
    journal.set("a", A)
    assert read_state(path) == [A] and lines(path)[0].endswith(b'"version":2}')


def test_a_blank_line_before_the_last_change_is_damage(path: Path) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    journal.set("b", B)
    written = lines(path)
    path.write_bytes(b"\n".join([*written[:2], b"", written[2]]) + b"\n")
    with pytest.raises(StateFileError, match="line 3 is damaged"):
        read_state(path)


def test_damage_before_the_last_line_stops_the_start_naming_the_file_and_the_fix(
    path: Path,
) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    journal.set("b", B)
    damaged = lines(path)
    damaged[1] = damaged[1].replace(b"/x/a", b"/x/z")  # the checksum no longer matches
    path.write_bytes(b"\n".join(damaged) + b"\n")
    with pytest.raises(StateFileError) as caught:
        read_state(path)
    message = str(caught.value)
    assert str(path) in message and "line 2 is damaged" in message and "Fix:" in message


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"move": "a"}, "line 3 is neither a put nor a delete"),
        ({"put": {"name": 5, "src": "x"}}, "line 3 needs name and src strings"),
    ],
)
def test_a_well_formed_line_that_is_no_change_is_damage(
    path: Path, change: dict[str, Any], problem: str
) -> None:
    journal_at(path).set("a", A)
    with path.open("ab") as out:
        out.write(adapter_state._line(change))
        out.write(adapter_state._line({"delete": "a"}))
    with pytest.raises(StateFileError, match=problem):
        read_state(path)


# ---- refused changes -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "code", "reason"),
    [
        ("write", errno.ENOSPC, "no space left on device"),
        ("fsync", errno.EIO, "input/output error"),
        ("open", errno.EROFS, "read-only file system"),
        ("open", errno.EACCES, "permission denied"),
    ],
)
def test_a_change_that_cannot_be_written_is_refused_and_leaves_everything_as_it_was(
    path: Path, monkeypatch: pytest.MonkeyPatch, target: str, code: int, reason: str
) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    before = path.read_bytes()
    with monkeypatch.context() as patch:
        patch.setattr(os, target, fail_with(code))
        with pytest.raises(StateNotSaved, match=reason):
            journal.set("b", B)
        with pytest.raises(StateNotSaved):
            journal.set("a", None)
    assert journal.saved() == [A]
    assert path.read_bytes() == before and read_state(path) == [A]
    journal.set("c", C)  # the storage is back: the next change is written
    assert read_state(path) == [A, C]


def test_a_partly_written_line_is_cut_back_when_the_disk_fills(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    before = path.read_bytes()
    real_write = os.write
    calls = iter(range(2))

    def half_then_full(fd: int, data: Any) -> int:
        if next(calls, 1) == 0:
            return real_write(fd, bytes(data)[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(StateNotSaved):
        journal.set("b", B)
    assert path.read_bytes() == before


def test_a_vanished_folder_refuses_the_change(path: Path) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    path.unlink()
    path.parent.rmdir()
    with pytest.raises(StateNotSaved, match="its folder does not exist"):
        journal.set("b", B)
    assert journal.saved() == [A] and not path.parent.exists()


def test_a_removed_file_is_written_again_whole_by_the_next_change(path: Path) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    path.unlink()
    journal.set("b", B)
    assert read_state(path) == [A, B]


def test_an_undo_that_cannot_be_written_is_taken_and_rewritten_by_the_next_change(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", fail_with(errno.EIO))
        journal.set("a", None, strict=False)  # no exception: the registry has undone it
    assert journal.saved() == []
    journal.set("b", B)
    assert read_state(path) == [B]


# ---- crashes -----------------------------------------------------------------------------------
def crash_at(monkeypatch: pytest.MonkeyPatch, name: str, *, after: bool = False) -> None:
    """Die at the first call of os.<name> (or of mkstemp), before it or once it returned."""
    owner = tempfile if name == "mkstemp" else os
    real = getattr(owner, name)

    def dying(*args: Any, **kwargs: Any) -> Any:
        if name == "write":  # a torn write: half of it reaches the file
            real(args[0], bytes(args[1])[: len(args[1]) // 2])
            raise Crash
        if after:
            real(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(owner, name, dying)


APPEND_POINTS = [(False, "write", False), (False, "fsync", False), (False, "fsync", True)]
REWRITE_POINTS = [
    (True, "mkstemp", False), (True, "write", False), (True, "fsync", False),
    (True, "replace", False), (True, "replace", True), (True, "fsync", True),
]


@pytest.mark.parametrize(("rewrite", "name", "after"), APPEND_POINTS + REWRITE_POINTS)
def test_a_crash_at_any_point_loads_the_state_before_or_after_the_change(
    path: Path, monkeypatch: pytest.MonkeyPatch, name: str, after: bool, rewrite: bool
) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    journal.set("b", B)
    if rewrite:
        path.unlink()  # the next change writes the whole file: temporary, fsync, rename
    with monkeypatch.context() as patch:
        crash_at(patch, name, after=after)
        with pytest.raises(Crash):
            journal.set("c", C)
    state = read_state(path) if path.exists() else None
    if rewrite:
        assert state in (None, [A, B, C])  # nothing on disk yet, or all of it
    else:
        assert state in ([A, B], [A, B, C])
    restarted = journal_at(path)
    restarted.set("d", SavedAdapter("d", "/x/d"))  # and the file takes changes again
    assert read_state(path) == [*(state or []), SavedAdapter("d", "/x/d")]
    assert [p.name for p in path.parent.iterdir()] == ["adapters.json"]  # temporaries gone


# ---- compaction --------------------------------------------------------------------------------
def test_the_file_is_compacted_when_it_holds_twice_the_live_set(path: Path) -> None:
    journal = journal_at(path)
    journal.set("a", A)
    for round_ in range(3 * COMPACT_SLACK):
        journal.set("b", SavedAdapter("b", f"/x/b{round_}"))
        assert len(lines(path)) - 1 <= 2 * len(journal.saved()) + COMPACT_SLACK
    assert read_state(path) == journal.saved()
    assert [p.name for p in path.parent.iterdir()] == ["adapters.json"]


@pytest.mark.parametrize("fault", ["mkstemp", "replace"])
def test_a_failed_compaction_loses_nothing_and_fails_no_call(
    path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    journal = journal_at(path)
    owner = tempfile if fault == "mkstemp" else os
    monkeypatch.setattr(owner, fault, fail_with(errno.ENOSPC))
    with caplog.at_level(logging.WARNING, "gateway.adapters"):
        journal._rewrite = False  # the file exists (written below before the fault matters)
        path.write_bytes(adapter_state._line(adapter_state.HEADER))
        for round_ in range(2 * COMPACT_SLACK):
            journal.set("a", SavedAdapter("a", f"/x/a{round_}"))
    assert "could not be compacted" in caplog.text
    assert read_state(path) == [SavedAdapter("a", f"/x/a{2 * COMPACT_SLACK - 1}")]
    assert [p.name for p in path.parent.iterdir()] == ["adapters.json"]


# ---- the registry refuses what it cannot save ----------------------------------------------------
@pytest.fixture
def failing_registry(tmp_path: Path) -> Iterator[tuple[AdapterRegistry, FakeEngine, Path]]:
    folder = tmp_path / "adapters"
    write_adapter(folder / "a1")
    engine = FakeEngine(model_name="tiny")
    rules = AdapterRules(roots=(str(folder),), max_rank=8, base_names=frozenset({"tiny"}),
                         base_shape=SHAPE)
    limits = AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4, wait_s=5.0, settle_s=0.0)
    state = tmp_path / "state" / "adapters.json"
    registry = AdapterRegistry(engine=engine, rules=rules, limits=limits, state_file=state)
    yield registry, engine, folder / "a1"


@pytest.mark.anyio
async def test_the_registry_changes_nothing_it_cannot_save(
    failing_registry: tuple[AdapterRegistry, FakeEngine, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, engine, src = failing_registry
    await registry.register("kept", str(src), pin=True)
    resident = await engine.resident_adapters()
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", fail_with(errno.EROFS))
        with pytest.raises(StateNotSaved):
            await registry.register("new", str(src))
        with pytest.raises(StateNotSaved):
            await registry.update("kept", pin=False)
        with pytest.raises(StateNotSaved):
            await registry.unregister("kept")
    assert registry.names() == ["kept"] and registry.get("kept").pin is True
    assert await engine.resident_adapters() == resident


@pytest.mark.anyio
async def test_a_registration_the_engine_refuses_after_it_was_saved_is_unsaved(
    failing_registry: tuple[AdapterRegistry, FakeEngine, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, engine, src = failing_registry

    async def refuse(*_: Any, **__: Any) -> None:
        raise AdapterInvalid("the engine refused it")

    monkeypatch.setattr(engine, "add_adapter", refuse)
    with pytest.raises(AdapterInvalid):
        await registry.register("refused", str(src))
    assert registry.names() == []
    assert journal_at(registry._changes.journal.path).saved() == []  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_adapters_the_state_file_does_not_keep_register_on_a_read_only_disk(
    failing_registry: tuple[AdapterRegistry, FakeEngine, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, _, src = failing_registry
    monkeypatch.setattr(os, "open", fail_with(errno.EROFS))
    await registry.register("from-config", str(src), origin="config")
    await registry.register("from-folder", str(src), origin="folder")
    await registry.unregister("from-folder")
    assert registry.names() == ["from-config"]
