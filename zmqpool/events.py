"""What the registrar and the pidfd watch report, for the supervisor (or the set-up) to decide.

Typed, frozen events: a death, a failed start, an admitted worker.
"""

from __future__ import annotations

import dataclasses

from zmqpool.protocol import FailureKind, Register


@dataclasses.dataclass(frozen=True)
class ProcessExited:
    """A watched local worker process died (its pidfd said so)."""

    identity: bytes
    pid: int
    status: int | None  # None: unknown (it died with its fork server)
    cause: str | None  # what the launcher knows of why, if anything


@dataclasses.dataclass(frozen=True)
class WorkerFailed:
    """A worker could not come up: its env maker raised, its REGISTER would not fit, it
    speaks another protocol version, or the pool refused the worker it started."""

    identity: bytes
    kind: FailureKind
    err: str
    tb: str = ""
    env: int = -1  # the env it names, if one
    base: str | None = None  # the builtin its env maker raised (ENV_ERROR_BASES), if one


@dataclasses.dataclass(frozen=True)
class WorkerRegistered:
    """A worker was admitted for ``envs``; ``rejoin``: they were hosted before and are rebuilt."""

    identity: bytes
    envs: list[int]
    reg: Register
    rejoin: bool


Event = ProcessExited | WorkerFailed | WorkerRegistered
