"""The pool's bookkeeping, apart from sockets: who hosts which env, what is in flight, what is done.

- :class:`EnvSlot`: one env index: its worker, its sequence counter and its
  requests in flight, oldest first (a worker answers one env's commands in
  order).
- :class:`Reply`: a request answered (or failed), waiting in a channel until
  a recv takes it. A channel is ``(kind, None)`` for batch requests and
  ``(kind, env)`` for an env's own channel, as in torchrl's pool.
- :class:`Ledger`: all of it, with the rules: a reply is accepted only from
  the worker registered for that env, with the token it was given, for the
  oldest request in flight; anything else is counted and dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDictBase

from zmqpool.codec import DecodedPart
from zmqpool.wire import Command

log = logging.getLogger("zmqpool")


class Kind(enum.Enum):
    """Which recv collects a request's reply."""

    STEP = "step"
    RESET = "reset"
    STEP_RESET = "step_and_maybe_reset"


KIND_OF: dict[Command, Kind] = {
    Command.STEP: Kind.STEP,
    Command.STEP_RAW: Kind.STEP,
    Command.RESET: Kind.RESET,
    Command.RESET_RAW: Kind.RESET,
    Command.STEP_AND_MAYBE_RESET: Kind.STEP_RESET,
    Command.SEED: Kind.RESET,
}

Channel = tuple[Kind, int | None]

#: Commands that step an env (a fresh env's first one becomes its reset).
_STEPS = (Command.STEP, Command.STEP_RAW, Command.STEP_AND_MAYBE_RESET)


@dataclasses.dataclass
class Pending:
    """A request in flight, with what it takes to send it again after a restart."""

    seq: int
    command: Command
    channel: Channel
    inputs: TensorDictBase | None  # the caller's tensordict for this env
    payload: TensorDictBase | None  # what goes on the wire
    body: dict[str, Any] | None
    sent_at: float
    synth: bool = False  # sent as a reset to a restarted env: answer with a truncation


@dataclasses.dataclass
class Reply:
    """An answered request: its parts, or the error to raise for it."""

    env: int
    pending: Pending
    parts: list[DecodedPart] = dataclasses.field(default_factory=list)
    error: Exception | None = None
    synthesized: bool = False
    ready_at: float = 0.0  # when it reached the trainer (monotonic), for pool.stats()


@dataclasses.dataclass
class WorkerRecord:
    """A registered worker connection."""

    identity: bytes
    token: bytes
    envs: tuple[int, ...]
    pid: int
    decoder: Any
    encoder: Any


@dataclasses.dataclass
class EnvSlot:
    index: int
    worker: WorkerRecord | None = None
    next_seq: int = 1
    in_flight: deque[Pending] = dataclasses.field(default_factory=deque)
    steps: int = 0
    restarts: int = 0
    last_restart_cause: str | None = None
    fresh: bool = False  # rebuilt by a restart and not yet reset
    lost: Exception | None = None  # a crash loop: every request raises this
    latencies_s: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=1024))


class Ledger:
    """Slots, requests in flight and ready replies; see the module docstring."""

    def __init__(self, num_envs: int) -> None:
        self.slots = [EnvSlot(i) for i in range(num_envs)]
        self.ready: dict[Channel, list[Reply]] = {}
        self.dropped: dict[str, int] = {}
        # Requests opened on each channel and not yet taken by a recv (in flight or
        # ready): the one count behind torchrl's ``_current_step`` and friends.
        self._awaiting: dict[Channel, int] = {}

    def open_request(
        self,
        env: int,
        command: Command,
        per_env: bool,
        inputs: TensorDictBase | None,
        payload: TensorDictBase | None,
        body: dict[str, Any] | None,
        now: float,
    ) -> Pending:
        slot = self.slots[env]
        channel: Channel = (KIND_OF[command], env if per_env else None)
        pending = Pending(slot.next_seq, command, channel, inputs, payload, body, now)
        slot.next_seq += 1
        slot.in_flight.append(pending)
        self._awaiting[channel] = self._awaiting.get(channel, 0) + 1
        return pending

    def restamp(self, env: int, pending: Pending) -> None:
        """A new sequence number, so a reply to the old one can never be taken for it."""
        slot = self.slots[env]
        pending.seq = slot.next_seq
        slot.next_seq += 1

    def drop(self, reason: str) -> None:
        count = self.dropped.get(reason, 0) + 1
        self.dropped[reason] = count
        # A flood must not flood the log: a warning at the 1st, 2nd, 4th, 8th... of a reason.
        level = logging.WARNING if count & (count - 1) == 0 else logging.DEBUG
        log.log(level, "dropped a message: %s (%d so far)", reason, count)

    # ---------------------------------------------------------------- env slots
    # The only code that changes who hosts an env and in which state it is.

    def attach(self, envs: Sequence[int], worker: WorkerRecord) -> None:
        """``worker`` registered for ``envs``: their requests go to it from now on."""
        for env in envs:
            self.slots[env].worker = worker

    def detach(self, envs: Sequence[int], cause: str) -> None:
        """The worker of ``envs`` is gone (``cause``); their requests wait for a new one."""
        for env in envs:
            self.note_restart(env, cause)
            self.slots[env].worker = None

    def note_restart(self, env: int, cause: str) -> None:
        slot = self.slots[env]
        slot.restarts += 1
        slot.last_restart_cause = cause

    def revive(self, envs: Sequence[int]) -> None:
        """``envs`` were claimed by a (remote) worker: no longer lost."""
        for env in envs:
            self.slots[env].lost = None

    def mark_fresh(self, envs: Sequence[int]) -> None:
        """``envs`` run in a new process: each awaits a reset before its next step."""
        for env in envs:
            self.slots[env].fresh = True

    def fail(self, envs: Sequence[int], error: Exception) -> None:
        """Answer every request in flight on ``envs`` with ``error``, and refuse new ones."""
        for env in envs:
            slot = self.slots[env]
            slot.lost = error
            while slot.in_flight:
                self.deliver(Reply(env, slot.in_flight.popleft(), error=error))

    def requeue(self, env: int, pending: Pending) -> None:
        """Put a request answered with an error back in front: it is sent again after a restart."""
        self.slots[env].in_flight.appendleft(pending)

    def clear_latencies(self) -> None:
        for slot in self.slots:
            slot.latencies_s.clear()

    def command_to_send(self, env: int, pending: Pending) -> tuple[Command, Any]:
        """What goes on the wire for ``pending``: a step to a fresh env is sent as its reset.

        A restarted env was rebuilt but not reset; stepping it would step an env
        that never began an episode, so its first step becomes a reset, answered
        to the caller as a truncation (``pending.synth``).
        """
        slot = self.slots[env]
        command, payload = pending.command, pending.payload
        if slot.fresh and command in _STEPS:
            command, payload, pending.synth = Command.RESET, None, True
        if command != Command.SEED:
            slot.fresh = False
        return command, payload

    # ---------------------------------------------------------------- replies

    def match(self, env: int, seq: int, token: bytes, now: float) -> Pending | None:
        """The request a reply answers, if the reply is legitimate; counts what it drops."""
        if not 0 <= env < len(self.slots):
            self.drop("env index out of range")
            return None
        slot = self.slots[env]
        if slot.worker is None or token != slot.worker.token:
            self.drop("wrong token for env")
            return None
        if not slot.in_flight or slot.in_flight[0].seq != seq:
            self.drop("stale or unexpected sequence number")
            return None
        pending = slot.in_flight.popleft()
        if slot.in_flight:  # the worker starts on the next one now
            slot.in_flight[0].sent_at = max(slot.in_flight[0].sent_at, now)
        slot.latencies_s.append(now - pending.sent_at)
        return pending

    def deliver(self, reply: Reply) -> None:
        stepped = reply.pending.command in (
            Command.STEP,
            Command.STEP_AND_MAYBE_RESET,
            Command.STEP_RAW,
        )
        if stepped and reply.error is None:
            self.slots[reply.env].steps += 1
        reply.ready_at = time.monotonic()
        self.ready.setdefault(reply.pending.channel, []).append(reply)

    def take(self, channel: Channel, max_get: int | None) -> list[Reply]:
        """Up to ``max_get`` ready replies of a channel, oldest first."""
        ready = self.ready.get(channel, [])
        count = len(ready) if max_get is None else min(max_get, len(ready))
        taken, self.ready[channel] = ready[:count], ready[count:]
        self._awaiting[channel] -= len(taken)
        return taken

    def count_ready(self, channel: Channel) -> int:
        return len(self.ready.get(channel, ()))

    def first_error(self, channel: Channel) -> Reply | None:
        for reply in self.ready.get(channel, ()):
            if reply.error is not None:
                return reply
        return None

    def remove(self, channel: Channel, reply: Reply) -> None:
        """Take one ready reply out (an error, raised by the recv instead of returned)."""
        self.ready[channel].remove(reply)
        self._awaiting[channel] -= 1

    def awaiting(self, channel: Channel) -> int:
        """Requests opened on ``channel`` that no recv has taken yet (in flight or ready)."""
        return self._awaiting.get(channel, 0)
