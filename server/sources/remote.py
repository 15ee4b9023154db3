"""What every remote source shares: the time bound, transient failures, the stats, and the
interface one scheme implements."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from server.core.adapter_sources import AdapterSourceFailed

T = TypeVar("T")

# Upper bounds (seconds) of the fetch-latency histogram (download, check, cache).
FETCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
_FIRST_BACKOFF_S = 0.25
_MAX_BACKOFF_S = 2.0


class Transient(Exception):
    """A failure worth another attempt (connection refused or cut, timeouts, 5xx, throttling)."""


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # time.monotonic()
    timeout_s: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def check(self, src: str) -> None:
        if self.remaining() <= 0:
            raise AdapterSourceFailed(
                f"The adapter source {src} did not answer within {self.timeout_s:g} s "
                "(LoraConfig.adapterSourceTimeout)", param="src"
            )

    def io_timeout(self, longest: float = 10.0) -> float:
        """A timeout for one network operation: what is left, at most `longest`."""
        return max(0.05, min(longest, self.remaining()))


class Remote(Protocol):
    """One scheme's way of reading an adapter's files."""

    scheme: str

    def version(self, location: str, deadline: Deadline) -> str | None:
        """What identifies the contents now (cheap; None: always download). Raises
        AdapterSourceMissing when nothing is there."""
        ...

    def download(self, location: str, dest: Path, deadline: Deadline) -> int:
        """Write the adapter's files into the empty folder `dest`; returns the bytes read."""
        ...


def retrying(src: str, deadline: Deadline, attempt: Callable[[], T]) -> T:
    """`attempt()` again after a growing pause while it fails transiently and time is left."""
    pause = _FIRST_BACKOFF_S
    while True:
        try:
            return attempt()
        except Transient as exc:
            if deadline.remaining() <= pause:
                raise AdapterSourceFailed(
                    f"The adapter source {src} could not be read within "
                    f"{deadline.timeout_s:g} s: {exc}", param="src",
                ) from None
            time.sleep(pause)
            pause = min(pause * 2, _MAX_BACKOFF_S)


class FetchObserver(Protocol):
    """Told of each fetch's outcome, on the event loop (the metrics)."""

    def fetched(self, scheme: str, seconds: float, size: int) -> None: ...

    def cached(self, scheme: str) -> None: ...

    def failed(self, scheme: str, outcome: str) -> None: ...


class NoObserver:
    def fetched(self, scheme: str, seconds: float, size: int) -> None:
        return None

    def cached(self, scheme: str) -> None:
        return None

    def failed(self, scheme: str, outcome: str) -> None:
        return None
