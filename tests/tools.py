"""Programs the tests drive (HAProxy, Prometheus, kubectl): the machine's, or Debian's package
installed on first use; the test is skipped, saying why, only if neither can be had."""

from __future__ import annotations

import shutil

import pytest

from bench.wrk import _apt_install


def debian_tool(command: str, package: str) -> str:
    """The path of `command`, installing Debian's `package` if it is missing."""
    found = shutil.which(command)
    if found is None:
        installed, how = _apt_install(package)
        found = shutil.which(command) if installed else None
        if found is None:
            pytest.skip(f"{command} is not available: {how}")
    return found
