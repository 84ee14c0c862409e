"""Results in: each one checked against the roster and the ledger, decoded, and made a reply.

A result counts only if it comes on the side its worker registered on, for
an env that worker hosts now (every env of a RESULTS, rows joined, too), with
the token it was given, for the oldest request in flight on that env.
Anything else is counted (by reason) and dropped, with a log line that does
not flood.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from zmqpool.admission import peer_key
from zmqpool.codec import DecodedPart
from zmqpool.conformity import ReplyCheck
from zmqpool.errors import EnvError, ProtocolError, env_error
from zmqpool.policy import Liveness
from zmqpool.protocol import Failed, FailureKind
from zmqpool.roster import EnvRecord, Roster
from zmqpool.state import Ledger, Pending, Reply
from zmqpool.wire import Command, Header, peek_sender, results_rows, split_batch

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
            self._on_message(frames, remote)
        except RecursionError:  # a peer's data nested deeper than Python recurses: dropped
            self.ledger.drop("a message nested too deep")

    def _on_message(self, frames: list[zmq.Frame], remote: bool) -> None:
        data = frames[0].buffer
        unchecked = MAX_UNCHECKED_REMOTE_HEADER_BYTES if remote else MAX_UNCHECKED_HEADER_BYTES
        large = len(data) > unchecked
        if large and not self._from_a_worker(data, frames[0], remote):
            return
        header = self._header(data)
        if header is None:
            return
        command = header.command
        if command is Command.RESULT or command is Command.ERROR:
            record = self._sender(header, remote, frames[0])
            if record is not None:
                self._on_reply(header, frames, record)
        elif command is Command.RESULTS:
            record = self._sender(header, remote, frames[0])
            if record is not None:
                self._on_results(header, frames[1:], record)
        elif command is Command.BATCH:
            self._on_batch(header, frames, remote)
        else:
            self.ledger.drop("not a result on the results socket")

    def _header(self, data: Any) -> Header | None:
        try:
            return Header.decode(data)
        except ProtocolError as err:
            self.ledger.drop(f"malformed result header: {type(err).__name__}")
            return None

    def _from_a_worker(self, data: Any, first: zmq.Frame, remote: bool) -> bool:
        """Whether a large header names an env and token its sender may use (else dropped).

        Read before the header is unpacked: a header is up to one Python object
        per byte, and a key that holds no env (or a stranger's token) would
        make the trainer build them for nothing, as fast as it can send.
        """
        peeked = peek_sender(data)
        if peeked is None:
            self.ledger.drop("malformed result header: ProtocolError")
            return False
        env, token = peeked
        return self._sender_of(env, token, remote, first) is not None

    def _sender(self, header: Header, remote: bool, first: zmq.Frame | None) -> EnvRecord | None:
        """The record of the env ``header`` is about, if its worker sent it; else None (dropped).

        ``first``: the message's first frame, whose CURVE key is the sender's
        (None inside a batch, whose own first frame was checked).
        """
        return self._sender_of(header.env, header.token, remote, first)

    def _sender_of(
        self, env: int, token: bytes, remote: bool, first: zmq.Frame | None
    ) -> EnvRecord | None:
        if not 0 <= env < len(self.roster.envs):
            self.ledger.drop("env index out of range")
            return None
        record = self.roster.envs[env]
        link = record.link
        if link is None or token != link.token or link.remote != remote:
            self.ledger.drop("wrong token for env")
            return None
        if remote and first is not None and peer_key(first) != link.key:
            self.ledger.drop("a result from another key than its worker's")
            return None
        return record

    def _on_batch(self, header: Header, frames: list[zmq.Frame], remote: bool) -> None:
        """A worker's batch of replies (or one reply in pieces): each checked and taken as if it
        had come alone."""
        record = self._sender(header, remote, frames[0])
        if record is None:
            return
        link = record.link
        assert link is not None
        # A remote worker's reply with a frame over the port's limit comes in pieces.
        max_frame = link.decoder.max_frame_bytes if remote else None
        try:
            messages = split_batch(header, frames[1:], len(link.envs), max_frame)
        except ProtocolError as err:
            self.ledger.drop("malformed batch", err)
            return
        for message in messages:
            inner = self._header(message[0])
            if inner is None:
                continue
            if inner.command not in _BATCHABLE:
                self.ledger.drop("a batch may carry results and errors only")
                continue
            record = self._sender(inner, remote, None)
            if record is None:
                continue
            if record.link is not link:
                self.ledger.drop("a batched result for another worker's env")
                continue
            if inner.command is Command.RESULTS:
                self._on_results(inner, message[1:], record)
            else:
                self._on_reply(inner, message, record)

    def _on_results(self, header: Header, frames: list[Any], record: EnvRecord) -> None:
        """Several envs' results, rows joined (wire: rows joined): each taken as its own RESULT.

        Refused whole (dropped, counted) unless every env listed is the
        sender's; broken frames answer each listed env's request with the error.
        """
        link = record.link
        assert link is not None
        try:
            envs, seqs = results_rows(header, len(link.envs))
        except ProtocolError as err:
            self.ledger.drop("malformed results", err)
            return
        records = self.roster.envs
        if any(not 0 <= env < len(records) or records[env].link is not link for env in envs):
            self.ledger.drop("results for an env that is not the sender's")
            return
        try:
            rows: Sequence[list[DecodedPart] | ProtocolError] = link.decoder.decode_rows(
                header, frames, len(envs)
            )
        except ProtocolError as err:  # the requests were real: answer each with the error
            rows = [err] * len(envs)
        now = time.monotonic()
        self.liveness.heard(link.identity, now)
        match, deliver = self.ledger.match, self.ledger.deliver
        for env, seq, parts in zip(envs, seqs, rows, strict=True):  # every env-step: lean
            pending = match(env, seq, now)
            if pending is None:
                continue
            if (
                type(parts) is list
                and len(parts) == 1
                and not records[env].check(parts[0].layout, pending)
            ):
                deliver(Reply(env, pending, parts, None, pending.synth), now)  # the usual reply
            else:
                reply = _checked_reply(env, pending, parts, records[env].check)
                if reply.error is not None:
                    self._owing(reply)
                deliver(reply, now)

    def _on_reply(self, header: Header, frames: list[Any], record: EnvRecord) -> None:
        """A result or error from the worker of ``record``: the answer to its oldest request."""
        command = header.command
        link = record.link
        assert link is not None
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
            try:
                parts: list[DecodedPart] | ProtocolError = link.decoder.decode(header, frames[1:])
            except ProtocolError as err:  # the request was real: answer it with the error
                parts = err
            reply = _checked_reply(header.env, pending, parts, record.check)
        if reply.error is not None:  # a call per error only: this runs for every reply
            self._owing(reply)
        self.ledger.deliver(reply, now)

    def _owing(self, reply: Reply) -> None:
        """A restart's truncation that ``reply`` (an error) answers instead is owed again.

        The reset sent in place of a request cut short by a restart (``synth``)
        raised in the rebuilt env: the caller gets that error, and the env goes
        back to ``FRESH``, so its next step is a reset again, answered as the
        truncation. Else that step would step an env never reset. Not when a
        reset is in flight behind it (:meth:`_resets_queued`).
        """
        assert reply.error is not None
        if reply.pending.synth and not self._resets_queued(reply.env):
            self.roster.owe_truncation(reply.env)
            cause = self.roster.envs[reply.env].last_restart_cause
            reply.error.add_note(
                f"env {reply.env} was restarted ({cause}); "
                "this is its rebuilt env's reset, sent in place of the request: its next "
                "step is sent as a reset again, answered as the restart's truncation"
            )

    def _resets_queued(self, env: int) -> bool:
        """Whether a reset is in flight on ``env`` behind the one that failed: another
        request cut short by the restart (its truncation then), or the caller's own reset
        (a new episode: no truncation is owed)."""
        return any(
            p.synth or p.command is Command.RESET or p.command is Command.RESET_RAW
            for p in self.ledger.slots[env].in_flight
        )

    def _handled_as_crash(self, env: int, reply: Reply) -> bool:
        if self.on_env_error is None or not isinstance(reply.error, EnvError):
            return False
        return self.on_env_error(env, reply.pending, reply.error)


#: What a batch of replies may carry.
_BATCHABLE = (Command.RESULT, Command.ERROR, Command.RESULTS)
#: Headers up to this size are unpacked at once (a cheap step's is under 1 KiB); a
#: larger one's sender is checked first (:meth:`Intake._from_a_worker`).
MAX_UNCHECKED_HEADER_BYTES = 4 << 10
#: The same on the remote side, where any authorized key may send: 4 KiB of empty
#: arrays cost 80 us to unpack (1-1.5 ms with the cyclic collector on), so a key
#: holding no env made 200 local steps take 28 s instead of 0.1 s. The sender
#: check (a peek of a few scalars) costs microseconds.
MAX_UNCHECKED_REMOTE_HEADER_BYTES = 256


def _checked_reply(
    env: int, pending: Pending, parts: list[DecodedPart] | ProtocolError, check: ReplyCheck
) -> Reply:
    """The reply to ``pending``: its parts held to the env's specs (``check``), or the error."""
    if type(parts) is not list:  # the ProtocolError decoding raised
        return Reply(env, pending, error=EnvError(env, f"malformed reply: {parts}"))
    for index, part in enumerate(parts):
        wrong = check.part(part.layout, pending, index)
        if wrong:  # it would break the stack of the whole batch: this env's error alone
            return Reply(env, pending, error=EnvError(env, wrong))
    return Reply(env, pending, parts, None, pending.synth)  # positional: every env-step


def _env_error(header: Header) -> tuple[EnvError, FailureKind | None]:
    """An ERROR reply as the caller's error, and what kind of failure it reports."""
    try:
        failed = Failed.from_body(header.body)
    except ProtocolError as err:  # the request was real; answer it with what is wrong
        return EnvError(header.env, f"malformed error reply: {err}"), None
    return env_error(header.env, failed.err, failed.tb, failed.base), failed.kind
