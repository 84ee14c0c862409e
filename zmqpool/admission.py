"""Who may register, for which env slots, with which specs.

- A local worker registers under the identity the pool spawned it with
  (``w<index>.<secret>``: a remote peer cannot guess it and take over its
  routing) and gets exactly the envs it was spawned for.
- A remote worker gets free remote slots from :class:`~zmqpool.remote.RemoteSlots`.
- Specs must match: an env coming back must bring the specs it had; with a
  dense stack, every env must bring the pool's specs (those of the first env
  registered). A mismatch is refused with the first differing field.
"""

from __future__ import annotations

import os
from typing import Any

from zmqpool.broker import Admission
from zmqpool.errors import RegistrationError
from zmqpool.protocol import Register
from zmqpool.remote import RemoteSlots
from zmqpool.specs import spec_from_data
from zmqpool.state import Ledger


def first_difference(a: Any, b: Any, path: str = "specs") -> str | None:
    """Where two plain-data trees first differ, as a readable path, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{path}/{key} (present on one side only)"
            found = first_difference(a[key], b[key], f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r:.60} here, {b!r:.60} expected"


class Registrar:
    """Decides REGISTER messages for a pool; keeps each env's registered specs."""

    def __init__(
        self,
        ledger: Ledger,
        worker_envs: list[tuple[int, ...]],
        remote: RemoteSlots | None,
        same_specs: bool,
    ) -> None:
        self.ledger = ledger
        self.worker_envs = worker_envs
        self.remote = remote
        self.same_specs = same_specs
        secret = os.urandom(6).hex()
        self.local_identities = {f"w{i}.{secret}".encode(): i for i in range(len(worker_envs))}
        self.specs: dict[int, Any] = {}
        self.incarnations: dict[bytes, Any] = {}

    def identity(self, worker_index: int) -> bytes:
        return next(k for k, v in self.local_identities.items() if v == worker_index)

    def admit(self, identity: bytes, reg: Register) -> Admission:
        """Admit a REGISTER (its fields checked by :meth:`Register.from_body`) or raise."""
        if identity in self.local_identities:
            admission = self._admit_local(identity, reg)
        else:
            admission = self._admit_remote(identity, reg)
        for env, spec in zip(admission.envs, reg.specs, strict=True):
            self.specs[env] = spec
        return admission

    def _admit_local(self, identity: bytes, reg: Register) -> Admission:
        envs = list(self.worker_envs[self.local_identities[identity]])
        incarnation = reg.incarnation
        if self.incarnations.get(identity) == incarnation:
            return Admission(envs, duplicate=True)  # it asked twice: answer, change nothing
        if list(reg.envs) != envs:  # Register.from_body: as many specs as envs
            raise RegistrationError(f"worker {identity!r} offers envs {list(reg.envs)}, not {envs}")
        live = [env for env in envs if self.ledger.slots[env].worker is not None]
        if live:  # a restart registers only after the death was seen (slot.worker = None)
            raise RegistrationError(
                f"worker {identity!r} of envs {live} is registered and alive: refused"
            )
        for env, spec in zip(envs, reg.specs, strict=True):
            self._check_spec(env, spec)
        self.incarnations[identity] = incarnation
        rejoin = any(self.ledger.slots[e].restarts for e in envs)
        return Admission(envs, rejoin=rejoin)

    def _admit_remote(self, identity: bytes, reg: Register) -> Admission:
        if self.remote is None:
            raise RegistrationError("this pool has no remote env slots (remote_envs=0)")
        specs, incarnation = reg.specs, reg.incarnation
        for spec in specs:
            self._check_spec(None, spec)  # a wrong spec says more than "no free slot"
        wanted = None if reg.slots is None else list(reg.slots)
        claim = self.remote.plan(identity, incarnation, len(specs), wanted)
        for env, spec in zip(claim.envs, specs, strict=True):
            self._check_spec(env, spec)  # refuse before taking any slot
        self.remote.take(identity, incarnation, claim)
        for env in claim.envs:
            if claim.rejoin and self.ledger.slots[env].worker is not None:  # died unnoticed
                self.ledger.note_restart(env, "its remote worker came back as a new process")
        self.ledger.revive(claim.envs)
        return Admission(claim.envs, rejoin=claim.rejoin, duplicate=claim.duplicate)

    def _check_spec(self, env: int | None, spec: Any) -> None:
        """Against the env's own earlier specs, and with a dense stack against the pool's."""
        reference = None if env is None else self.specs.get(env)
        if reference is None and self.same_specs and self.specs:
            reference = next(iter(self.specs.values()))
        if reference is not None:
            where = first_difference(spec, reference)
            if where:
                slot = "a new env" if env is None else f"env {env}"
                raise RegistrationError(f"spec mismatch for {slot}: {where}")
        spec_from_data(spec)  # validate before accepting
