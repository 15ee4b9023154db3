"""SchedulerSnapshot: the numbers several front ends share about one vLLM engine core."""

from __future__ import annotations

from server.engines.vllm_stats import SchedulerSnapshot, size


def test_each_front_end_counts_the_steps_it_was_told_of_and_all_see_the_sum() -> None:
    shared = [0.0] * size(2)
    first, second = SchedulerSnapshot(shared, 0), SchedulerSnapshot(shared, 1)
    first.stepped()
    second.stepped()
    second.stepped()
    assert first.steps == second.steps == 3


def test_steps_and_requests_in_the_engine_are_kept_apart() -> None:
    shared = [0.0] * size(2)
    first, second = SchedulerSnapshot(shared, 0), SchedulerSnapshot(shared, 1)
    first.entered(1)
    second.stepped()
    assert (first.steps, first.idle()) == (1, False)
    first.entered(-1)
    assert (second.steps, second.idle()) == (1, True)


def test_a_single_front_end_starts_at_no_steps() -> None:
    snapshot = SchedulerSnapshot()
    assert (snapshot.steps, snapshot.idle()) == (0, True)
    snapshot.stepped()
    assert snapshot.steps == 1
