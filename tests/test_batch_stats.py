"""BatchStats by hand: torchrl's batch figures from a clock the test sets.

The live comparison with torchrl's shared-memory pool is in
``tests/test_conformance.py`` (``TestStats``); this pins each figure's arithmetic,
as the recv and send paths feed it.
"""

from __future__ import annotations

import pytest

from zmqpool.stats import BatchStats


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_figure_from_two_recvs_and_their_actions():
    clock = Clock()
    stats = BatchStats(clock)
    clock.now = 10.0
    stats.record_batch([(0, 9.0), (1, 8.0)], max_get=4, track_action=True)  # waited 1 s and 2 s
    clock.now = 10.5
    stats.record_actions([1])  # env 1 acted on after 0.5 s; env 0 still held
    clock.now = 12.0
    stats.record_batch([(2, 11.0)], max_get=None, track_action=True)
    clock.now = 13.0
    stats.record_actions([0, 2, 3])  # 3 s and 1 s; env 3 held no result
    clock.now = 14.0
    figures = stats.snapshot()
    assert figures["batches"] == 2 and figures["items"] == 3
    assert figures["avg_batch_size"] == 1.5
    assert figures["batch_fill_ratio"] == pytest.approx(3 / 5)  # max_get 4, then what came: 1
    assert figures["partial_batch_fraction"] == 0.5
    assert figures["avg_observation_to_batch_ms"] == pytest.approx((1 + 2 + 1) / 3 * 1e3)
    assert figures["avg_batch_to_action_ms"] == pytest.approx((0.5 + 3 + 1) / 3 * 1e3)
    # Busy from 10 (first result held) to 13 (none held), over 4 s since the first batch.
    assert figures["consumer_busy_fraction"] == pytest.approx(3 / 4)


def test_reset_results_await_no_action_and_a_result_returned_twice_restarts_its_wait():
    clock = Clock()
    stats = BatchStats(clock)
    clock.now = 1.0
    stats.record_batch([(0, 1.0)], max_get=None, track_action=False)  # a reset
    stats.record_actions([0])
    assert stats.snapshot()["avg_batch_to_action_ms"] == 0.0
    stats.record_batch([(0, 1.0)], max_get=None, track_action=True)
    clock.now = 2.0
    stats.record_batch([(0, 2.0)], max_get=None, track_action=True)  # held again: from now
    clock.now = 2.25
    stats.record_actions([0])
    assert stats.snapshot()["avg_batch_to_action_ms"] == pytest.approx(250.0)
