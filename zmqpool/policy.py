"""Liveness and restart decisions, as plain objects that take a clock. No sockets, no processes.

- :class:`RestartPolicy`: when a worker dies, restart it after a backoff, or
  declare a crash loop (more than ``max_restarts`` deaths within
  ``restart_window_s``, as jupyter_client's ``restart_limit``).
- :class:`Liveness`: the Paranoid Pirate's counter: any message from a worker
  counts as a beat; silence is only judged while the pool is listening, so a
  trainer that spends minutes in a training step declares nobody dead.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Hashable


@dataclasses.dataclass(frozen=True)
class RestartDecision:
    """What to do about a death: restart at ``restart_at``, or give up (``crash_loop``)."""

    restart_at: float
    crash_loop: bool
    deaths_in_window: int


class RestartPolicy:
    """Backoff and crash-loop limit per worker.

    Example:
        >>> policy = RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.1, backoff_max_s=1)
        >>> [policy.on_death("w0", now=t).crash_loop for t in (0, 1, 2)]
        [False, False, True]
    """

    def __init__(
        self, max_restarts: int, window_s: float, backoff_s: float, backoff_max_s: float
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._deaths: dict[Hashable, deque[float]] = {}

    def on_death(self, key: Hashable, now: float) -> RestartDecision:
        deaths = self._deaths.setdefault(key, deque())
        deaths.append(now)
        while deaths and deaths[0] < now - self.window_s:
            deaths.popleft()  # a worker that stayed up a whole window starts afresh
        count = len(deaths)
        delay = min(self.backoff_s * 2 ** (count - 1), self.backoff_max_s)
        return RestartDecision(now + delay, count > self.max_restarts, count)


class Liveness:
    """Who has been silent too long, counting only time the pool spent listening.

    A gap of more than ``pause_s`` between two ``listening`` calls is the
    trainer away (its own work between recvs): it is not counted, and every
    worker's silence resumes after it where it was. Silence adds up across
    pauses, so a worker that stopped is found however the trainer's recvs
    and pauses alternate (a fresh start at each pause never found one whose
    trainer paused more often than the timeout).

    Example:
        >>> live = Liveness(timeout_s=3.0, pause_s=1.0)
        >>> live.heard("w0", now=0.0); live.listening(now=0.5)
        >>> live.listening(now=100.0)  # the trainer was away: nobody is judged on that
        >>> live.silent(now=101.0)  # 0.5 s before the pause, 1 s after it
        []
        >>> live.silent(now=103.0)
        ['w0']
    """

    def __init__(self, timeout_s: float, pause_s: float) -> None:
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        # Least recently heard first (each key moved to the end when heard, its time never
        # before the previous one's), so silent() stops at the first one still within time:
        # it runs at every pump, and need not look at every worker.
        self._last_heard: dict[Hashable, float] = {}
        self._newest = float("-inf")
        self._last_listened: float | None = None

    def heard(self, key: Hashable, now: float) -> None:
        # Callers pass a time read a little earlier (a drain's): never before the newest, so
        # the order holds; the difference is microseconds against a timeout of seconds.
        now = self._newest = max(now, self._newest)
        last_heard = self._last_heard
        last_heard.pop(key, None)
        last_heard[key] = now

    def forget(self, key: Hashable) -> None:
        self._last_heard.pop(key, None)

    def listening(self, now: float) -> None:
        """The pool is polling (called as a poll begins and as it ends); a pause since the
        last call is taken out of every worker's silence."""
        if self._last_listened is not None and now - self._last_listened > self.pause_s:
            away = now - self._last_listened
            for key, heard_at in self._last_heard.items():  # one shift for all: in order
                self._last_heard[key] = min(heard_at + away, now)
            self._newest = min(self._newest + away, now)
        self._last_listened = now

    def silent(self, now: float) -> list[Hashable]:
        """The keys not heard for more than ``timeout_s``, least recently heard first."""
        silent = []
        for key, heard_at in self._last_heard.items():
            if now - heard_at <= self.timeout_s:
                break  # every later key was heard after this one
            silent.append(key)
        return silent
