"""What the pool counts: torchrl's batch figures, and zmqpool's per-env ones.

- :class:`BatchStats`: ``pool.stats()``, torchrl's keys with torchrl's meanings.
- :func:`env_stats` and :func:`stats_table`: ``pool.env_stats()`` (steps,
  restarts, the last restart's cause, step latency per env) and the table
  people read (``pool.stats_table()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from zmqpool.roster import EnvRecord
from zmqpool.state import EnvRequests


def _percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def env_stats(slot: EnvRequests, record: EnvRecord) -> dict[str, Any]:
    latencies = list(slot.latencies_s)
    return {
        "steps": slot.steps,
        "restarts": record.restarts,
        "last_restart_cause": record.last_restart_cause,
        "latency_ms_p50": _percentile_ms(latencies, 0.5),
        "latency_ms_p99": _percentile_ms(latencies, 0.99),
        "in_flight": len(slot.in_flight),
        "lost": record.lost is not None,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def stats_table(stats: dict[int, dict[str, Any]]) -> str:
    """A fixed-width table, one line per env.

    Example:
        >>> print(stats_table({0: {"steps": 3, "restarts": 0, "last_restart_cause": None,
        ...     "latency_ms_p50": 0.5, "latency_ms_p99": 1.25, "in_flight": 0, "lost": False}}))
        env    steps  restarts  p50 ms  p99 ms  last restart
          0        3         0    0.50    1.25  -
    """
    lines = [
        f"{'env':>3}  {'steps':>7}  {'restarts':>8}  {'p50 ms':>6}  {'p99 ms':>6}  last restart"
    ]
    for env, s in sorted(stats.items()):
        cause = s["last_restart_cause"] or "-"
        if s["lost"]:
            cause = f"LOST ({cause})"
        lines.append(
            f"{env:>3}  {s['steps']:>7}  {s['restarts']:>8}  {_ms(s['latency_ms_p50']):>6}  "
            f"{_ms(s['latency_ms_p99']):>6}  {cause}"
        )
    return "\n".join(lines)


class BatchStats:
    """The batch figures of torchrl's ``AsyncEnvPool.stats()``, with torchrl's meanings.

    torchrl's shared-memory exchange keeps these (its threading and queue
    pools return ``{}``); zmqpool keeps them for every pool:

    - ``batches``: recvs that returned results (an env's own channel counts,
      as a batch of one, and a sync ``step``, ``reset`` or
      ``step_and_maybe_reset`` as one of every env it stepped, as torchrl's
      sync calls are its async recvs); ``items``: results they returned;
    - ``avg_batch_size``: ``items / batches``;
    - ``batch_fill_ratio``: ``items`` over the capacity asked for (``max_get``
      per recv, or what it returned when ``max_get`` was None);
    - ``partial_batch_fraction``: the share of recvs with a ``max_get`` that
      returned fewer;
    - ``avg_observation_to_batch_ms``: from a result's arrival in the trainer
      to the recv that returned it;
    - ``avg_batch_to_action_ms``: from a step result's return to the send of
      that env's next action;
    - ``consumer_busy_fraction``: the share of the time since the first batch
      during which the trainer held at least one env's step result without
      having sent its next action (the policy's time).

    Example:
        >>> stats = BatchStats(clock=iter([0.0, 1.0, 2.0]).__next__)
        >>> stats.record_batch([(0, 0.0), (1, 0.0)], max_get=4, track_action=True)
        >>> stats.snapshot()["batch_fill_ratio"]
        0.5
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._clear(None)

    def _clear(self, now: float | None) -> None:
        self.batches = self.items = self.capacity = self.partial = 0
        self.ready_dwell_s, self.ready_count = 0.0, 0
        self.action_dwell_s, self.action_count = 0.0, 0
        self.busy_s = 0.0
        # torchrl restarts the clocks of results still held at a reset.
        self.leased_at: dict[int, float] = {}
        self.started_s: float | None = None
        self.busy_started_s: float | None = None

    def record_batch(
        self, ready_at: list[tuple[int, float]], max_get: int | None, track_action: bool
    ) -> None:
        """A recv returned results ``(env, arrival time)``; step results await an action."""
        now = self._clock()
        if self.started_s is None:
            self.started_s = now
        self.batches += 1
        self.items += len(ready_at)
        self.capacity += len(ready_at) if max_get is None else max_get
        if max_get is not None and len(ready_at) < max_get:
            self.partial += 1
        if track_action and not self.leased_at:
            self.busy_started_s = now
        for env, arrived in ready_at:
            if track_action:
                self.leased_at[env] = now
            self.ready_dwell_s += now - arrived
            self.ready_count += 1

    def record_actions(self, envs: list[int]) -> None:
        """Actions were sent to ``envs`` (one call's): each ends the wait its last result began."""
        if not self.leased_at:
            return
        now = self._clock()
        for env in envs:
            leased_at = self.leased_at.pop(env, None)
            if leased_at is not None:
                self.action_dwell_s += now - leased_at
                self.action_count += 1
        if not self.leased_at and self.busy_started_s is not None:
            self.busy_s += now - self.busy_started_s
            self.busy_started_s = None

    def snapshot(self, reset: bool = False) -> dict[str, float | int]:
        """torchrl's dict; ``reset=True`` clears the counters after taking it."""
        now = self._clock()
        busy_s = self.busy_s
        if self.busy_started_s is not None:
            busy_s += now - self.busy_started_s
        elapsed_s = now - self.started_s if self.started_s is not None else 0.0
        metrics = {
            "batches": self.batches,
            "items": self.items,
            "avg_batch_size": _ratio(self.items, self.batches),
            "batch_fill_ratio": _ratio(self.items, self.capacity),
            "partial_batch_fraction": _ratio(self.partial, self.batches),
            "avg_observation_to_batch_ms": _ratio(self.ready_dwell_s * 1e3, self.ready_count),
            "avg_batch_to_action_ms": _ratio(self.action_dwell_s * 1e3, self.action_count),
            "consumer_busy_fraction": _ratio(busy_s, elapsed_s),
        }
        if reset:
            self._reset_at(now)
        return metrics

    def _reset_at(self, now: float) -> None:
        held = list(self.leased_at)
        self._clear(None)
        if held:
            self.started_s = self.busy_started_s = now
            self.leased_at = dict.fromkeys(held, now)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0
