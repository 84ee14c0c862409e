"""The pool's requests, apart from sockets: what is in flight, what is done, what a recv awaits.

Who hosts an env, and in which phase of its life it is, is the
:class:`~zmqpool.roster.Roster`'s; this module only counts requests.

- :class:`EnvRequests`: one env's sequence counter and requests in flight,
  oldest first (a worker answers one env's commands in order).
- :class:`Reply`: a request answered (or failed), waiting in a channel until
  a recv takes it. A channel is ``(kind, None)`` for batch requests and
  ``(kind, env)`` for an env's own channel, as in torchrl's pool.
- :class:`Ledger`: all of it, with the rule that a reply (whose sender the
  intake checked against the roster) is accepted only for the oldest request
  in flight; anything else is counted and dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import operator
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDictBase

from zmqpool.codec import DecodedPart
from zmqpool.throttle import log_throttled
from zmqpool.wire import Command

log = logging.getLogger("zmqpool")


class Kind(enum.Enum):
    """Which recv collects a request's reply."""

    STEP = "step"
    RESET = "reset"
    STEP_RESET = "step_and_maybe_reset"

    # Channels (tuples holding a Kind) key the ledger's dicts on every request and
    # reply; Enum's own __hash__ is Python code (hash of the name). Members are
    # singletons compared by identity, so the identity hash is as good, in C.
    __hash__ = object.__hash__


KIND_OF: dict[Command, Kind] = {
    Command.STEP: Kind.STEP,
    Command.STEP_RAW: Kind.STEP,
    Command.RESET: Kind.RESET,
    Command.RESET_RAW: Kind.RESET,
    Command.STEP_AND_MAYBE_RESET: Kind.STEP_RESET,
    Command.SEED: Kind.RESET,
}

Channel = tuple[Kind, int | None]

#: Each command's batch channel, one tuple for all its requests (see ``Ledger.open_request``).
BATCH_CHANNEL: dict[Command, Channel] = {command: (kind, None) for command, kind in KIND_OF.items()}

#: Commands that step an env (a fresh env's first one becomes its reset).
STEPS = frozenset((Command.STEP, Command.STEP_RAW, Command.STEP_AND_MAYBE_RESET))


@dataclasses.dataclass(slots=True)
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
    #: Never sent (it cannot be): the error it is answered with, in its turn.
    held_error: Exception | None = None
    #: Its caller gave up on it (a seed past its deadline): its reply is dropped.
    abandoned: bool = False


@dataclasses.dataclass(slots=True)
class Reply:
    """An answered request: its parts, or the error to raise for it."""

    env: int
    pending: Pending
    parts: list[DecodedPart] = dataclasses.field(default_factory=list)
    error: Exception | None = None
    synthesized: bool = False
    ready_at: float = 0.0  # when it reached the trainer (monotonic), for pool.stats()


@dataclasses.dataclass
class EnvRequests:
    """One env's requests: its sequence counter, what is in flight (oldest first), its figures."""

    index: int
    next_seq: int = 1
    in_flight: deque[Pending] = dataclasses.field(default_factory=deque)
    steps: int = 0
    latencies_s: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=1024))
    #: When its latest reply came, and when the request it answered was sent (a
    #: worker's progress, for one that steps its envs in turn: see
    #: ``Supervisor._late_in_turn_at``).
    answered_at: float = float("-inf")
    answered_sent_at: float = float("-inf")


class Ledger:
    """Slots, requests in flight and ready replies; see the module docstring."""

    def __init__(self, num_envs: int) -> None:
        self.slots = [EnvRequests(i) for i in range(num_envs)]
        self.ready: dict[Channel, list[Reply]] = {}
        self.dropped: dict[str, int] = {}
        self.refused = 0
        #: REGISTERs refused, by (kind, the worker's key): what rations their log lines.
        self.refusals: dict[tuple[str, str | None], int] = {}
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
        # A shared batch channel: a tuple per request would outlive young collections
        # with its request and, promoted, bring full ones sooner.
        channel = (KIND_OF[command], env) if per_env else BATCH_CHANNEL[command]
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

    def drop(self, reason: str, detail: object = None) -> None:
        """Count a message dropped for ``reason``, and log it without flooding.

        ``reason`` must be a fixed phrase: it keys the counts, so text a peer
        chooses (sizes, ids: ``detail``'s) would make every message a new key,
        a new entry and a first-time log line. ``detail`` is only logged.
        """
        count = self.dropped.get(reason, 0) + 1
        self.dropped[reason] = count
        if detail is None:
            log_throttled(log, count, "dropped a message: %s (%d so far)", reason, count)
        else:
            log_throttled(
                log, count, "dropped a message: %s: %s (%d so far)", reason, detail, count
            )

    def refuse(self, who: bytes, reason: str, kind: str, key: str | None) -> None:
        """Count a REGISTER refused (answered with REFUSE), and say why, without flooding.

        Logged at the 1st, 2nd, 4th... refusal of each ``kind`` (a fixed name:
        the error's class) for each worker ``key`` (None: keyless), so that one
        key's refusals do not hide another's reasons. Keys are the pool's
        authorized ones (CURVE) or None: the table is as bounded as they are.
        """
        self.refused += 1
        count = self.refusals[kind, key] = self.refusals.get((kind, key), 0) + 1
        log_throttled(
            log, count, "refused worker %r: %s (%d of this kind so far)", who, reason, count
        )

    def fail(self, envs: Sequence[int], error: Exception) -> None:
        """Answer every request in flight on ``envs`` with ``error``."""
        for env in envs:
            slot = self.slots[env]
            while slot.in_flight:
                self.deliver(Reply(env, slot.in_flight.popleft(), error=error))

    def answer_now(self, env: int, pending: Pending, error: Exception) -> None:
        """Answer a request in flight with ``error`` without sending it (it cannot be sent).

        On an env's own channel, requests are answered in order: behind others
        still in flight, it waits for theirs (:meth:`deliver` then gives it).
        """
        in_flight = self.slots[env].in_flight
        if pending.channel[1] is not None and in_flight[0] is not pending:
            pending.held_error = error
            return
        in_flight.remove(pending)
        self.deliver(Reply(env, pending, error=error))

    def requeue(self, env: int, pending: Pending) -> None:
        """Put a request answered with an error back in front: it is sent again after a restart."""
        self.slots[env].in_flight.appendleft(pending)

    def clear_latencies(self) -> None:
        for slot in self.slots:
            slot.latencies_s.clear()

    # ---------------------------------------------------------------- replies

    def match(self, env: int, seq: int, now: float) -> Pending | None:
        """The request a reply answers (its sender was checked by the caller), or None."""
        slot = self.slots[env]
        in_flight = slot.in_flight
        if not in_flight or in_flight[0].seq != seq:
            self.drop("stale or unexpected sequence number")
            return None
        pending = in_flight.popleft()
        if in_flight:  # the worker starts on the next one now
            following = in_flight[0]
            if following.sent_at < now:
                following.sent_at = now
        slot.latencies_s.append(now - pending.sent_at)
        slot.answered_at, slot.answered_sent_at = now, pending.sent_at
        return pending

    def abandon(self, channel: Channel, env: int) -> None:
        """Give up on ``env``'s requests on ``channel``: no recv waits for them, those in
        flight have their replies dropped when they come (the env answers in order), and
        any that came just now are dropped too."""
        for pending in self.slots[env].in_flight:
            if pending.channel == channel and not pending.abandoned:
                pending.abandoned = True
                self._awaiting[channel] -= 1
        ready = self.ready.get(channel, [])
        for reply in [r for r in ready if r.env == env]:
            ready.remove(reply)
            self._awaiting[channel] -= 1
            self.drop("the reply to a request its caller gave up on")

    def deliver(self, reply: Reply, now: float | None = None) -> None:
        """Make ``reply`` ready on its channel; ``now``: when it arrived (default: now).

        The reply to an abandoned request is dropped instead (counted).
        """
        pending = reply.pending
        if pending.abandoned:
            self.drop("the reply to a request its caller gave up on")
            self._deliver_held(reply.env, now)
            return
        if reply.error is None and pending.command in STEPS:
            self.slots[reply.env].steps += 1
        reply.ready_at = time.monotonic() if now is None else now
        ready = self.ready.get(pending.channel)
        if ready is None:  # not setdefault: that builds a list for every reply
            self.ready[pending.channel] = [reply]
        else:
            ready.append(reply)
        self._deliver_held(reply.env, now)

    def _deliver_held(self, env: int, now: float | None) -> None:
        """The env's next request, if answered with an error already: its turn has come."""
        in_flight = self.slots[env].in_flight
        if in_flight and in_flight[0].held_error is not None:
            held = in_flight.popleft()
            self.deliver(Reply(env, held, error=held.held_error), now)

    def take(self, channel: Channel, max_get: int | None) -> list[Reply]:
        """Up to ``max_get`` ready replies of a channel, oldest first."""
        ready = self.ready.get(channel, [])
        count = len(ready) if max_get is None else min(max_get, len(ready))
        taken, self.ready[channel] = ready[:count], ready[count:]
        self._awaiting[channel] -= len(taken)
        return taken

    def give_back(self, channel: Channel, replies: list[Reply]) -> None:
        """Replies a recv took but did not return (interrupted): ready again, first in line."""
        ready = sorted(replies, key=_BY_ARRIVAL)
        ready.extend(self.ready.get(channel, ()))
        self.ready[channel] = ready
        self._awaiting[channel] = self._awaiting.get(channel, 0) + len(replies)

    def count_ready(self, channel: Channel) -> int:
        return len(self.ready.get(channel, ()))

    def first_error(self, channel: Channel) -> Reply | None:
        """The ready error a recv on ``channel`` raises now, if any.

        On an env's own channel, the oldest reply only: its requests are answered
        in order, one recv each, so an error waits behind the results before it.
        """
        ready = self.ready.get(channel, ())
        if channel[1] is not None:
            return ready[0] if ready and ready[0].error is not None else None
        for reply in ready:
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


_BY_ARRIVAL = operator.attrgetter("ready_at")
