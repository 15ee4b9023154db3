"""A model of the engine's adapter slots, for the bound in bench/ANALYSIS.md ("Adapter slots"):
how many requests a step can run when requests in flight spread over more adapters than the
engine runs per step. `python -m bench.slot_model` prints the table.

Closed loop: `in_flight` requests, each needs `steps` engine steps; a step runs every request of
the (at most `slots`) active adapters; when an active adapter has nothing left it leaves and a
waiting adapter takes its slot with all its waiting requests (`most`: the one with the most
waiting, else the first to arrive); a finished request is replaced by one for an adapter drawn
uniformly from `adapters`. A step runs at most `max_seqs` requests (the engine's
`max_num_seqs`), the oldest first. Loads cost nothing here, so this is an upper bound.
"""

from __future__ import annotations

import random


def mean_running(
    adapters: int, *, in_flight: int = 16, steps: int = 17, slots: int = 2,
    most: bool = True, length: int = 200_000, seed: int = 1, max_seqs: int = 32,
) -> float:
    draw = random.Random(seed)
    waiting: dict[int, int] = {}
    running: list[list[int]] = []  # [adapter, steps left]
    active: set[int] = set()

    def arrive() -> None:
        adapter = draw.randrange(adapters)
        if adapter in active:
            running.append([adapter, steps])
        else:
            waiting[adapter] = waiting.get(adapter, 0) + 1

    for _ in range(in_flight):
        arrive()
    total = 0
    for _ in range(length):
        while len(active) < slots and waiting:
            adapter = max(waiting, key=waiting.__getitem__) if most else next(iter(waiting))
            active.add(adapter)
            running.extend([adapter, steps] for _ in range(waiting.pop(adapter)))
        total += min(len(running), max_seqs)
        for request in running[:max_seqs]:
            request[1] -= 1
        ended = [r for r in running if r[1] == 0]
        running = [r for r in running if r[1] > 0]
        for adapter, _ in ended:
            if all(r[0] != adapter for r in running):
                active.discard(adapter)
        for _ in ended:
            arrive()
    return total / length


if __name__ == "__main__":
    for count in (2, 8, 32, 128):
        most, fifo = mean_running(count), mean_running(count, most=False)
        print(f"{count:4d} adapters: {most:5.2f} running (most waiting first), {fifo:5.2f} (FIFO)")
    print("32 adapters, more requests in flight (the base model runs min(in flight, 32)):")
    for in_flight in (16, 64, 256, 512, 1024, 2048):
        running = mean_running(32, in_flight=in_flight, length=20_000)
        of_base = running / min(in_flight, 32)
        print(f"{in_flight:5d} in flight: {running:5.2f} running, {of_base:4.2f} of base")
