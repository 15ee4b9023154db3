"""The adapter state file (`LoraConfig.stateFile`): runtime registrations that survive a restart.

Only adapters registered through a management API are kept (the config file and `adapterDir`
bring theirs back by themselves): name, src, pin, preload and options. The file is rewritten
whole after every change, atomically (a temporary file in the same folder, flushed, then
renamed over the old one), so a crash leaves the old state or the new one, never half of one.
A file that cannot be read as this state fails start-up: losing registrations silently would be
worse than stopping.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

VERSION = 1


class StateFileError(ValueError):
    """The state file exists but is not a state this server wrote."""


@dataclass(frozen=True, slots=True)
class SavedAdapter:
    name: str
    src: str
    pin: bool = False
    preload: bool = True
    options: dict[str, str] = field(default_factory=dict)


def read_state(path: Path) -> list[SavedAdapter]:
    """The saved registrations; [] when the file does not exist yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise _damaged(path, f"cannot be read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _damaged(path, f"is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise _damaged(path, f'is not a version {VERSION} state ({{"version": 1, "adapters": []}})')
    entries = data.get("adapters")
    if not isinstance(entries, list):
        raise _damaged(path, "has no 'adapters' list")
    return [_entry(path, index, item) for index, item in enumerate(entries)]


def _entry(path: Path, index: int, item: object) -> SavedAdapter:
    if not isinstance(item, dict):
        raise _damaged(path, f"adapters[{index}] is not an object")
    name, src = item.get("name"), item.get("src")
    pin, preload = item.get("pin", False), item.get("preload", True)
    options = item.get("options", {})
    valid = (
        isinstance(name, str) and isinstance(src, str) and isinstance(pin, bool)
        and isinstance(preload, bool) and isinstance(options, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in options.items())
    )  # fmt: skip
    if not valid:
        raise _damaged(
            path, f"adapters[{index}] needs name and src strings, pin and preload booleans, "
            "options of strings",
        )  # fmt: skip
    return SavedAdapter(str(name), str(src), bool(pin), bool(preload), dict(options))


def _damaged(path: Path, problem: str) -> StateFileError:
    return StateFileError(
        f"LoraConfig.stateFile: {path} {problem}. Fix: repair the file, or move it away to start "
        "without the runtime adapter registrations it held"
    )


def write_state(path: Path, adapters: Iterable[SavedAdapter]) -> None:
    data = {"version": VERSION, "adapters": [asdict(a) for a in adapters]}
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(data, out, indent=2)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise

