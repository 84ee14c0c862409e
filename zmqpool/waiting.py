"""Newcomers told nothing yet: remote workers waiting for slots that live workers hold.

A remote worker whose REGISTER finds too few slots free, while live remote
workers hold slots it may take, gets no answer for a while: the worker it
replaces (a host that died, not yet found silent) may be one of them. It asks
again with backoff, and :class:`WaitingRoom` says how long it may go on
waiting: ``window_s`` (two heartbeat timeouts) from its first try. By then a
worker it replaces has been found silent; those still live are others, and
the newcomer is refused "no room".

Its tables are keyed by what a peer cannot choose first (its CURVE key, one
of the authorized ones) and only then by the routing identity it chose, so
that one key's newcomers cannot crowd out another's, nor take an identity
another key's replacement will use and start its clock early.
"""

from __future__ import annotations

#: Newcomers of one key remembered at most (identities its peers chose).
MAX_WAITING_PER_KEY = 1024
#: A waiting newcomer asks again at least this often (a worker's backoff caps at
#: 5 s, plus 1 s to reconnect): one not heard from for longer gave up, and its
#: next try is a new start.
WAITING_GAP_S = 30.0


class WaitingRoom:
    """When each waiting newcomer first and last asked, by key, then identity.

    Args:
        window_s: how long a newcomer may wait from its first try.
        cap: newcomers of one key remembered at most; past it, that key's are
            forgotten (their clocks start again), no other key's.
        gap_s: a newcomer not heard from for longer than this (or ``window_s``,
            if longer) starts afresh.
    """

    def __init__(
        self, window_s: float, cap: int = MAX_WAITING_PER_KEY, gap_s: float = WAITING_GAP_S
    ) -> None:
        self.window_s, self.cap = window_s, cap
        self.gap_s = max(window_s, gap_s)
        self._by_key: dict[str | None, dict[bytes, tuple[float, float]]] = {}

    def may_wait(self, key: str | None, identity: bytes, now: float) -> bool:
        """Whether this newcomer may go on waiting (else it is refused, and forgotten)."""
        waiting = self._by_key.setdefault(key, {})  # keys: the authorized ones
        if len(waiting) >= self.cap and identity not in waiting:
            waiting.clear()  # identities this key's peers chose: never an unbounded table
        first, last = waiting.get(identity, (now, now))
        if now - last > self.gap_s:  # not heard from for long: a new start
            first = now
        if now - first < self.window_s:
            waiting[identity] = (first, now)
            return True
        waiting.pop(identity, None)  # refused now: a later try is a new start
        return False

    def admitted(self, key: str | None, identity: bytes) -> None:
        """The newcomer got its slots: no longer waiting."""
        waiting = self._by_key.get(key)
        if waiting is not None:
            waiting.pop(identity, None)

    def waiting(self, key: str | None) -> int:
        """How many of ``key``'s newcomers are remembered as waiting."""
        return len(self._by_key.get(key, ()))
