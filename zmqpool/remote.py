"""Remote env slots: which worker holds which, who may take a free one, and when a vacancy is lost.

A plain object with a clock, apart from sockets. A remote worker registers
with a stable identity and a fresh *incarnation* id per process:

- a new identity takes free slots (never-filled ones, or ones vacated by a
  worker that went silent);
- a known identity gets its own slots back; with a new incarnation it is a
  rejoin (its envs were rebuilt), with the same incarnation a duplicate
  REGISTER, answered again without disturbing anything;
- a slot vacated for longer than ``rejoin_timeout_s`` is lost: the pool
  answers its requests with :class:`~zmqpool.errors.EnvLostError` until some
  worker takes it again.
"""

from __future__ import annotations

import dataclasses

from zmqpool.errors import RegistrationError


@dataclasses.dataclass(frozen=True)
class Claim:
    envs: list[int]
    rejoin: bool  # the envs were rebuilt: requests in flight get truncations
    duplicate: bool  # the same process registering again


class RemoteSlots:
    """Slot bookkeeping for remote workers; see the module docstring."""

    def __init__(self, indices: list[int], rejoin_timeout_s: float) -> None:
        self.indices = list(indices)
        self.rejoin_timeout_s = rejoin_timeout_s
        self.holder: dict[int, bytes | None] = dict.fromkeys(self.indices)
        self.incarnation: dict[bytes, bytes] = {}
        self.vacated_at: dict[int, float] = {}
        self._owned: dict[bytes, list[int]] = {}

    def plan(
        self, identity: bytes, incarnation: bytes, count: int, wanted: list[int] | None = None
    ) -> Claim:
        """Which slots a REGISTER would get (changes nothing; :meth:`take` commits).

        ``wanted``: the slots the worker asks for (``--slots``); granted only if all are free.
        """
        owned = self._owned.get(identity)
        if owned is not None:
            return self._replan(identity, incarnation, count, owned)
        free = [env for env in self.indices if self.holder[env] is None]
        if wanted is not None:
            if len(wanted) != count or not set(wanted) <= set(free):
                raise RegistrationError(
                    f"slots {wanted} asked for are not {count} free remote slots (free: {free})"
                )
            free = list(wanted)
        if count < 1 or len(free) < count:
            raise RegistrationError(
                f"no room: asked for {count} env slots, {len(free)} of the pool's "
                f"{len(self.indices)} remote slots are free"
            )
        taken = free[:count]
        return Claim(taken, any(env in self.vacated_at for env in taken), duplicate=False)

    def _replan(self, identity: bytes, incarnation: bytes, count: int, owned: list[int]) -> Claim:
        if count != len(owned):
            raise RegistrationError(
                f"worker {identity!r} held {len(owned)} env slots and now offers {count}"
            )
        duplicate = self.incarnation.get(identity) == incarnation and not any(
            env in self.vacated_at for env in owned
        )
        return Claim(list(owned), rejoin=not duplicate, duplicate=duplicate)

    def take(self, identity: bytes, incarnation: bytes, claim: Claim) -> None:
        self._hold(identity, incarnation, claim.envs)

    def _hold(self, identity: bytes, incarnation: bytes, envs: list[int]) -> None:
        for env in envs:
            previous = self.holder[env]
            if previous is not None and previous != identity:
                self._owned.pop(previous, None)
            self.holder[env] = identity
            self.vacated_at.pop(env, None)
        self._owned[identity] = list(envs)
        self.incarnation[identity] = incarnation

    def holds(self, identity: bytes) -> list[int]:
        return list(self._owned.get(identity, []))

    def vacate(self, identity: bytes, now: float) -> list[int]:
        """The worker went silent: its slots wait ``rejoin_timeout_s`` for it or a replacement."""
        envs = self.holds(identity)
        for env in envs:
            self.holder[env] = None
            self.vacated_at[env] = now
        return envs

    def expired(self, now: float) -> list[int]:
        """Vacant slots whose rejoin deadline just passed (each reported once)."""
        late = [e for e, t in self.vacated_at.items() if now - t > self.rejoin_timeout_s]
        for env in late:
            del self.vacated_at[env]
            self.vacated_at[env] = float("inf")  # still vacant, no longer reported
        return late
