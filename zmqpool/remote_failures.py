"""Why remote workers could not start: logged, and named in the errors of the envs waiting for one.

A remote worker whose env maker raises (or whose REGISTER would not fit)
sends a FAILED before it exits; its own host restarts it or gives up. The pool
has nothing to restart, but without this note its trainer heard only that no
worker registered in time, the reason in a log on another machine.

Such a worker never registered, so it is known by its CURVE key alone (the
ZAP handler let it in; without CURVE every worker shares the key ``None``).
What is kept is bounded: the last failure of at most :data:`MAX_KEYS` keys,
each clipped by :class:`~zmqpool.protocol.Failed` (the registrar rations the
log lines, so a key that floods FAILEDs costs neither memory nor the log).
"""

from __future__ import annotations

from zmqpool.protocol import Failed

#: Keys whose last failure is remembered (the oldest is forgotten first).
MAX_KEYS = 64
#: Failures an error message names, the latest first.
NAMED_IN_ERRORS = 3


class RemoteFailures:
    """The last start failure each remote worker's key reported."""

    def __init__(self) -> None:
        self._last: dict[str | None, Failed] = {}

    def note(self, key: str | None, failed: Failed) -> str:
        """Remember ``failed`` as ``key``'s latest; what it says, for a log line."""
        self._last.pop(key, None)  # re-inserted last: dict order is recency
        if len(self._last) >= MAX_KEYS:
            del self._last[next(iter(self._last))]
        self._last[key] = failed
        return self.describe(key, failed)

    def __len__(self) -> int:
        return len(self._last)

    def summary(self) -> str:
        """The latest failures as one clause of an error message ("" if none)."""
        latest = list(self._last.items())[-NAMED_IN_ERRORS:][::-1]
        return "; ".join(self.describe(key, failed) for key, failed in latest)

    @staticmethod
    def describe(key: str | None, failed: Failed) -> str:
        # The whole public key: what its file in authorized/ holds, to grep for.
        what = "a remote worker " + ("(no CURVE)" if key is None else f"of key {key}")
        what += " could not start"
        return f"{what} ({failed.kind.value}): {failed.err}"
