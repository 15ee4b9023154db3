"""The admission layer's own cost per request, by the number of adapters waiting, for
bench/ANALYSIS.md ("Admission's cost with many adapters waiting"). `python -m
bench.admission_loop [ADAPTERS ...]` prints µs of CPU per request (run it pinned, e.g.
`taskset -c 1`, and alternate it with the code it is compared to: single runs vary).

Closed loop on `Admission` alone, no HTTP and no engine: 256 tasks, each taking a slot for an
adapter drawn uniformly from ADAPTERS, yielding once to the loop and releasing it; 32 slots,
4 adapter slots, a 2 ms cycle, 2 adapters loaded ahead (the loads answer at once).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

from server.core.admission import Admission, Limits

TASKS, REQUESTS = 256, 40_000


async def cost_per_request(adapters: int) -> float:
    """µs of this process's CPU per admitted and released request."""
    limits = Limits(max_concurrent=32, max_queue=4096, adapter_slots=4, cycle_s=0.002,
                    prefetch=2)
    admission = Admission(limits, prefetch=_loaded, resident=lambda key: False)
    draw = random.Random(1)
    done = 0

    async def client() -> None:
        nonlocal done
        while done < REQUESTS:
            key = f"a{draw.randrange(adapters)}"
            if not admission.try_acquire(1, key):
                await admission.acquire(1, key)
            await asyncio.sleep(0)
            admission.release(1, key)
            done += 1

    started = time.process_time()
    await asyncio.gather(*(client() for _ in range(TASKS)))
    return (time.process_time() - started) / done * 1e6


async def _loaded(key: str) -> bool:
    return True


def main(argv: list[str]) -> None:
    for adapters in [int(a) for a in argv] or [2, 32, 128]:
        print(f"{adapters} adapters: {asyncio.run(cost_per_request(adapters)):.1f} µs per request")


if __name__ == "__main__":
    main(sys.argv[1:])
