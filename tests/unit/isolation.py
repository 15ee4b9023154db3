"""A pytest plugin for the unit tier: torch, vllm and transformers cannot be imported, so a unit
test (or the code it reaches) that needs one fails at the import instead of passing slowly.

`make test` runs the unit tier with `-p tests.unit.isolation` before the rest of the suite.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

import pytest

BLOCKED = frozenset({"torch", "vllm", "transformers"})


class Unimportable(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] in BLOCKED:
            raise ImportError(f"{fullname} is not importable in the unit tier")
        return None


def pytest_configure(config: pytest.Config) -> None:
    loaded = sorted(name for name in BLOCKED if name in sys.modules)
    if loaded:
        raise pytest.UsageError(f"{loaded} were imported before the unit tier started")
    sys.meta_path.insert(0, Unimportable())
