"""Results in: each one checked against the roster and the ledger, decoded, and made a reply.

A result counts only if it comes on the side its worker registered on, for
an env that worker hosts now, with the token it was given, for the oldest
request in flight on that env. Anything else is counted (by reason) and
dropped, with a log line that does not flood.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from zmqpool.admission import peer_key
from zmqpool.codec import Decoder
from zmqpool.errors import EnvError, ProtocolError
from zmqpool.policy import Liveness
from zmqpool.protocol import Failed, FailureKind
from zmqpool.roster import Roster
from zmqpool.state import Ledger, Pending, Reply
from zmqpool.wire import Command, Header

log = logging.getLogger("zmqpool")

#: ``on_env_error="restart"``: takes an env's error, returns whether it is handled as a crash.
EnvErrorHook = Callable[[int, Pending, EnvError], bool]


class Intake:
    """The results socket's reader; see the module docstring."""

    def __init__(self, roster: Roster, ledger: Ledger, liveness: Liveness) -> None:
        self.roster = roster
        self.ledger = ledger
        self.liveness = liveness
        self.on_env_error: EnvErrorHook | None = None

    def on_result(self, frames: list[zmq.Frame], remote: bool) -> None:
        try:
            header = Header.decode(frames[0].buffer)
        except ProtocolError as err:
            self.ledger.drop(f"malformed result header: {type(err).__name__}")
            return
        command = header.command
        if command is not Command.RESULT and command is not Command.ERROR:
            self.ledger.drop("not a result on the results socket")
            return
        if not 0 <= header.env < len(self.roster.envs):
            self.ledger.drop("env index out of range")
            return
        record = self.roster.envs[header.env]
        link = record.link
        if link is None or header.token != link.token or link.remote != remote:
            self.ledger.drop("wrong token for env")
            return
        if remote and peer_key(frames[0]) != link.key:
            self.ledger.drop("a result from another key than its worker's")
            return
        now = time.monotonic()
        pending = self.ledger.match(header.env, header.seq, now)
        if pending is None:
            return
        self.liveness.heard(link.identity, now)
        if command is Command.ERROR:
            error, kind = _env_error(header)
            reply = Reply(header.env, pending, error=error)
            if kind is FailureKind.ENV and self._handled_as_crash(header.env, reply):
                return
        else:
            reply = self._reply(header, pending, frames[1:], link.decoder, record.check)
        self.ledger.deliver(reply)

    def _handled_as_crash(self, env: int, reply: Reply) -> bool:
        if self.on_env_error is None or not isinstance(reply.error, EnvError):
            return False
        return self.on_env_error(env, reply.pending, reply.error)

    @staticmethod
    def _reply(
        header: Header, pending: Pending, frames: list[zmq.Frame], decoder: Decoder, check: Any
    ) -> Reply:
        """The reply to ``pending``: its parts decoded and held to the env's specs (``check``)."""
        try:
            parts = decoder.decode(header, frames)
        except ProtocolError as err:
            # The request was real; its reply is broken: answer it with the error.
            return Reply(header.env, pending, error=EnvError(header.env, f"malformed reply: {err}"))
        for part in parts:
            wrong = check(part.layout)
            if wrong:  # it would break the stack of the whole batch: this env's error alone
                return Reply(header.env, pending, error=EnvError(header.env, wrong))
        return Reply(header.env, pending, parts=parts, synthesized=pending.synth)


def _env_error(header: Header) -> tuple[EnvError, FailureKind | None]:
    """An ERROR reply as the caller's error, and what kind of failure it reports."""
    try:
        failed = Failed.from_body(header.body)
    except ProtocolError as err:  # the request was real; answer it with what is wrong
        return EnvError(header.env, f"malformed error reply: {err}"), None
    return EnvError(header.env, failed.err, failed.tb), failed.kind
