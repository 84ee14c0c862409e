"""A worker's sockets: register with the pool, then answer commands until told to stop.

The worker's DEALER connects to the pool's ROUTER (registration, commands,
heartbeats); its PUSH connects to the pool's results PULL. One command in,
one reply out, in order, for each env. A BATCH from the pool (the commands of
one call for this worker's envs) is taken apart and each command handled in
turn, and so is a COMMANDS (commands of one kind and layout, rows joined: one
command per row; wire: rows joined). When the envs run in this thread (no env
threads, or one env), their replies go back as a BATCH too, once the last has
run (wire: batches), those of one layout as one RESULTS. With env threads,
a reply that finds another thread sending is left to it and goes with its
reply, joined the same way (:mod:`workers.replies`); none waits for company.
The loop only moves frames: what a command does to an env is
:mod:`workers.hosting`'s business.

A remote worker also asks the pool for heartbeats (a DEALER of the
heartbeat thread, to the pool's beacon, :mod:`zmqpool.beacon`). When they
stop, or come from a new pool (another epoch: a restarted trainer), it
registers again, retrying with backoff: ZeroMQ reconnects the TCP
connections by itself, so a restarted trainer at the same address picks its
workers up again.

Limits. A worker trusts no more bytes than its envs need: every socket
it connects gets a ``MAXMSGSIZE`` and a short ``HANDSHAKE_IVL`` before it
connects, whatever the transport (libzmq reads the CURVE handshake with the
socket's frame decoder before the peer is authenticated, so without a limit
any peer that can reach the socket, holding no keys, can make it allocate a
frame of gigabytes; and the results and heartbeat endpoints are the pool's
word, in its WELCOME, which names them in the transport the worker reached
the pool by or is refused: :func:`pool_endpoint`). Over TCP the DEALER's limit is
the one the pool holds this worker's replies to, derived from the same specs
(:func:`command_frame_limit`; over ipc the trainer is its only peer and the
limit is :data:`~zmqpool.limits.MAX_FRAME_BYTES`), and its decoder refuses
layouts above it; the DEALER that asks the beacon and the PUSH get
:data:`~zmqpool.limits.MAX_BEAT_BYTES`, the heartbeat DEALER
:data:`~zmqpool.limits.MAX_HEADER_BYTES`. A malformed
heartbeat is counted, logged (throttled) and ignored. A frame over a limit
makes libzmq drop the connection, and after such a protocol error it never
connects again by itself: each TCP socket's :class:`_DropWatch` does, so
neither an oversized command nor a peer posing as the pool cuts a worker off
for good.

``MAXMSGSIZE`` bounds frames, not messages: libzmq takes in every frame of a
multipart message before the first can be read, so a pool (or anyone holding
its key) can still make a worker hold one message of many frames, each within
the DEALER's limit, in libzmq's memory (not bounded here: libzmq has no limit
per message). What the worker itself does with a message is bounded: frames
past :data:`~zmqpool.limits.MAX_MESSAGE_FRAMES` are let go as they are read,
nothing is copied before the header and the layouts it names have been
checked against the frames (count and exact sizes), and what an env gets is
then copied once (:meth:`Worker._decoded`; a COMMANDS' joined frames, at
most :data:`~zmqpool.limits.MAX_BATCH_BYTES` as the pool joins them, are
checked against that before their copy).

Threads and sockets: the main thread owns the DEALER, the heartbeat thread
its own two DEALERs (its heartbeats, and the pool's), and the PUSH is shared
under the reply queue's lock (the encoder under a lock of its own). Closing stops the threads
first (each closes its own sockets), then closes the main thread's, then
ends the context: never ``Context.destroy()``, which closes
every socket from one thread while the others may still use theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from workers.defaults import REGISTER_TIMEOUT_S
from workers.hosting import EnvHost
from workers.inline import PROBE_WAIT_S, SHORT_WAIT_S, InlineJudge, StepTimes
from workers.replies import ReplyQueue
from workers.reports import oversized_registration
from workers.threads import EnvRunners
from zmqpool.codec import DecodedPart, Decoder, EncodedPart, Encoder, frame_buffer, layout_of
from zmqpool.conformity import SpecDtypes
from zmqpool.errors import (
    EnvMakerError,
    ProtocolError,
    RegistrationError,
    VersionMismatchError,
    builtin_base,
)
from zmqpool.launcher import ENV_THREAD_DIED
from zmqpool.layout import max_message_bytes
from zmqpool.limits import (
    CURVE_FRAME_OVERHEAD,
    MAX_BATCH_BYTES,
    MAX_BEAT_BYTES,
    MAX_CONTROL_BYTES,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_PIECES,
    MAX_REMOTE_CONTROL_BYTES,
    TCP_HANDSHAKE_MS,
    max_pieced_bytes,
)
from zmqpool.protocol import (
    MAX_HOST_CHARS,
    Failed,
    FailureKind,
    Ping,
    Refuse,
    Register,
    Welcome,
    recv_frames,
    send_frames,
)
from zmqpool.security import ClientKeys, make_client
from zmqpool.specs import spec_to_data
from zmqpool.throttle import log_throttled
from zmqpool.wire import (
    Command,
    Header,
    Row,
    batch_messages,
    check_header_room,
    command_rows,
    holds_replies,
    joined_messages,
    pieced_message,
    split_batch,
)

log = logging.getLogger("workers")

#: A batch run inline keeps its replies to send them together, but not past a
#: command whose env took longer than this last time: a reply then goes before
#: that env runs, so it never waits on a slow env. Cheap envs' replies (tens to
#: hundreds of us a step) still go as one message. A COMMANDS that asks for its
#: replies to be held (the pool waits for several: wire.holds_replies) passes an
#: env only if both of its last two commands took longer: on a busy machine one
#: cheap command in ten took over 1 ms of wall time (preempted, not slow), and
#: each split cost the pool a message and a wake-up (docs/PERFORMANCE.md, session 46).
HOLD_FOR_S = 0.001
#: An env's last two command times before it ran any inline.
_NEVER_RAN = (0.0, 0.0)

#: The commands that run on an env (the others are the connection's own).
_ENV_COMMANDS = frozenset(
    (
        Command.STEP,
        Command.RESET,
        Command.STEP_AND_MAYBE_RESET,
        Command.STEP_RAW,
        Command.RESET_RAW,
        Command.SEED,
    )
)

#: How often a probe (workers.inline) looks whether the env threads are done meanwhile.
_IDLE_POLL_S = 0.0001

#: How long :meth:`Worker.close` waits for its threads to finish what they are
#: doing (an env step in flight) before it leaves them to the process's exit.
CLOSE_JOIN_S = 1.0

#: How long a remote worker that connected again waits for the connection before its
#: next REGISTER (a CURVE handshake: milliseconds, unless the network is down).
_RECONNECT_WAIT_S = 1.0
#: How long a remote worker whose env maker failed waits to be connected, to say so.
_FAILED_CONNECT_WAIT_MS = 2000
#: Messages a heartbeat check reads from the pool's beacon at most (and libzmq
#: queues for it): a beat comes per heartbeat interval, so more are a flood.
_BEATS_PER_CHECK = 64


class Worker:
    """One worker process's connection to its pool.

    Args:
        router: the pool's ROUTER endpoint.
        identity: this worker's routing identity (stable across restarts).
        host: the envs, keyed by the indices this worker asks for.
        heartbeat_interval_s: how often to tell the pool we are alive.
        register_timeout_s: how long to wait for the pool (``None``: forever;
            default :data:`REGISTER_TIMEOUT_S`).
        remote_slots: ask the pool for free remote slots, and rejoin it when
            it goes away or restarts.
        keys: CURVE keys, for a pool bound on TCP with ``curve_keys``.
        slots: the pool's env indices to ask for (remote workers; default: any free).
        env_threads: step each hosted env in its own thread (see :mod:`workers.threads`).
        inline_cheap: with env threads, step inline the envs judged cheap (see
            :mod:`workers.inline`); False keeps every env in its thread.
    """

    def __init__(
        self,
        router: str,
        identity: bytes,
        host: EnvHost,
        heartbeat_interval_s: float = 1.0,
        register_timeout_s: float | None = REGISTER_TIMEOUT_S,
        remote_slots: bool = False,
        keys: ClientKeys | None = None,
        slots: list[int] | None = None,
        env_threads: bool = False,
        inline_cheap: bool = True,
    ) -> None:
        self.router = router
        self.identity = identity
        self.host = host
        self.heartbeat_interval_s = heartbeat_interval_s
        self.register_timeout_s = register_timeout_s
        self.remote_slots = remote_slots
        self.keys = keys
        self.slots = slots
        self.incarnation = os.urandom(8)  # tells the pool this process is new
        self.epoch: bytes | None = None  # the pool we are registered with
        self.beats: str | None = None
        self.welcome: Welcome | None = None  # the pool's timings, token and endpoints
        self.pool_lost = threading.Event()
        self.context = zmq.Context()
        #: The largest frame a command may carry (TCP; unbounded over ipc): the
        #: DEALER's ``MAXMSGSIZE`` and its decoder's ``max_frame_bytes``. From the
        #: envs' specs, so build the envs before the worker (``workers.serving.serve``).
        self.frame_limit = command_frame_limit(host, router)
        self.dealer, self._dealer_watch = self._open_dealer()
        self.push: zmq.Socket | None = None
        self._push_watch: _DropWatch | None = None
        self.token = b""
        self.encoder = Encoder()
        #: What each env's replies are cast to (by its index, as ``host.envs``).
        self.spec_dtypes = {i: SpecDtypes(env.specs) for i, env in host.envs.items()}
        self.decoder = Decoder(max_frame_bytes=self.frame_limit)
        #: Messages from the beacon that were not a PING (counted, logged throttled, ignored).
        self.malformed_beats = 0
        self.dropped = 0
        self.runners = EnvRunners(self._env_thread_died) if env_threads else None
        #: With env threads: which envs step inline instead, being short and busy.
        self._judge = InlineJudge()
        self.inline_cheap = inline_cheap
        #: Every reply goes through it: the PUSH is its lock's.
        self._replies: ReplyQueue[Row | list[Any]] = ReplyQueue(self._send_now)
        #: The encoder's: a result is encoded (its bytes taken before its env steps
        #: again) and queued under it, so replies queue in the order they announce layouts.
        self._encoding = threading.Lock()
        #: The replies of a batch run inline, kept until it ends (None: each sent at once).
        self._outbox: list[Row | list[Any]] | None = None
        #: How long each hosted env's last two commands run inline took (s): the one
        #: before, then the last.
        self._step_s: dict[int, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        #: Set by the main thread: the heartbeat thread's DEALER is to connect again.
        self._renew_beat = threading.Event()

    def _open_dealer(self) -> tuple[zmq.Socket, _DropWatch | None]:
        """The DEALER to the pool's ROUTER, connected (with its watch, over TCP)."""
        dealer = self._socket(zmq.DEALER, self.identity)
        if self.remote_slots:
            dealer.setsockopt(zmq.IMMEDIATE, 1)  # no REGISTER queued for a pool not there
        return dealer, self._connect(dealer, self.router, self.frame_limit)

    def _reconnect_dealer(self) -> None:
        """A new DEALER, so a new connection: the pool's ROUTER may be ignoring this one.

        libzmq's ROUTER (without ``ROUTER_HANDOVER``, see DESIGN_NOTES) ignores
        a connection presenting an identity another connection holds, and keeps
        ignoring it after that one closes (libzmq 4.3): a restarted env process
        (the same identity) that connects while the pool still holds its
        predecessor's connection (its FIN lost in a link drop, or not yet read)
        would send REGISTER after REGISTER into nothing. A REGISTER left
        unanswered makes it connect again: once the old connection is gone
        (the pool's REJOIN to a dead peer is answered by a reset), the new one
        is heard. Messages queued on the old socket are dropped: unanswered
        REGISTERs, or what the pool sent a worker that is registering again.
        """
        rcvtimeo = self.dealer.rcvtimeo
        if self._dealer_watch is not None:
            self._dealer_watch.close()
        self.dealer.close()
        self.dealer, self._dealer_watch = self._open_dealer()
        self.dealer.rcvtimeo = rcvtimeo

    def _socket(self, kind: int, identity: bytes | None = None) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.linger = 0
        if identity is not None:
            sock.identity = identity
        if self.keys is not None:
            make_client(sock, self.keys)
        return sock

    def _connect(self, sock: zmq.Socket, endpoint: str, max_frame: int) -> _DropWatch | None:
        """Connect ``sock`` with its limits set first (libzmq reads them at connect).

        ``max_frame`` is the largest frame we expect; CURVE adds up to
        :data:`~zmqpool.limits.CURVE_FRAME_OVERHEAD` bytes to each, counted
        against ``MAXMSGSIZE``. The limits go on every socket, over ipc too:
        a pool's own ipc endpoints live in a 0700 directory of the trainer's
        user, but the results and heartbeat endpoints are whatever its WELCOME
        names, and a process listening at a path named there could otherwise
        send the worker a frame of any size. (A local pool's DEALER limit is
        :data:`~zmqpool.limits.MAX_FRAME_BYTES`, and it sends its worker's other
        sockets nothing over their limits: nothing it sends is dropped.)
        Over TCP, returns the watch that connects the socket again after a
        protocol error (its owner's thread checks it); a local pool never
        causes one, so its ipc sockets are spared the monitor.
        """
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame + CURVE_FRAME_OVERHEAD)
        sock.setsockopt(zmq.HANDSHAKE_IVL, TCP_HANDSHAKE_MS)
        if not endpoint.startswith("tcp://"):
            sock.connect(endpoint)
            return None
        watch = _DropWatch(sock, endpoint, self.keys)  # before connecting: no event is missed
        sock.connect(endpoint)
        return watch

    # ------------------------------------------------------------ registration

    def register(self) -> None:
        """Send REGISTER until the pool answers (with backoff), then take its WELCOME."""
        reg = self.registration()
        message = Header(Command.REGISTER, body=reg.to_body()).encode()
        if len(message) > self._control_limit()[0]:
            self._refuse_oversized(len(message), reg)
        header = self._register_until_answered(message)
        try:
            if header.command == Command.REFUSE:
                reason = Refuse.from_body(header.body).err
                raise RegistrationError(f"the pool at {self.router} refused this worker: {reason}")
            welcome = Welcome.from_body(header.body)
        except ProtocolError as err:
            raise RegistrationError(
                f"the pool at {self.router} answered with a message this worker cannot read "
                f"({err}): run the same zmqpool version on the trainer and the workers"
            ) from err
        self._accept_welcome(welcome)

    def registration(self) -> Register:
        """What this worker's REGISTER says: its envs, their specs, how to send it commands."""
        return Register(
            pid=os.getpid(),
            host=socket.gethostname()[:MAX_HOST_CHARS],
            envs=tuple(sorted(self.host.envs)),
            remote=self.remote_slots,
            incarnation=self.incarnation,
            slots=None if self.slots is None else tuple(self.slots),
            specs=tuple(spec_to_data(self.host.envs[i].specs) for i in sorted(self.host.envs)),
            # With env threads too: a call's commands then come as one COMMANDS,
            # one header and one decode for them all (measured in docs/PERFORMANCE.md,
            # session 22: +18% steps/s; BATCH alone had cost 5% for nothing).
            batches=len(self.host.envs) > 1,
            set_state=tuple(
                bool(self.host.envs[i]._supports_set_state) for i in sorted(self.host.envs)
            ),
        )

    def _refuse_oversized(self, size: int, reg: Register) -> None:
        """Raise, saying why, rather than send a REGISTER the pool's ROUTER would drop unseen.

        A local worker's pool is waiting for it: it hears why too (a FAILED
        message, small), so the trainer raises at construction, naming the env.
        """
        names = {i: type(env).__name__ for i, env in self.host.envs.items()}
        limit, name = self._control_limit()
        env, text = oversized_registration(
            size, list(reg.envs), list(reg.specs), names, limit, name
        )
        if not self.remote_slots:
            self._send_failed(env, Failed.clipped(text, "", FailureKind.REGISTER))
        raise RegistrationError(f"cannot register with the pool at {self.router}: {text}")

    def _control_limit(self) -> tuple[int, str]:
        """The largest control message the pool's ROUTER takes from us, and its name.

        A pool's remote side (TCP) takes less than its local one: libzmq applies
        the limit to the CURVE handshake of keyless peers too.
        """
        if self.router.startswith("tcp://") and self.remote_slots:
            return MAX_REMOTE_CONTROL_BYTES, "MAX_REMOTE_CONTROL_BYTES"
        return MAX_CONTROL_BYTES, "MAX_CONTROL_BYTES"

    def _register_until_answered(self, message: bytes) -> Header:
        timeout = self.register_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        wait_s = 0.2
        refused: int | None = None  # the ZAP status of the pool's last refusal of our key
        while deadline is None or time.monotonic() < deadline:
            if self._dealer_watch is not None:
                self._dealer_watch.check()
                if self._dealer_watch.refused is not None:
                    refused = self._dealer_watch.refused
            sent = False
            with contextlib.suppress(zmq.Again):  # not connected yet (IMMEDIATE): retry
                self.dealer.send(message, zmq.NOBLOCK)
                sent = True
            header = self._await_registration_reply(wait_s, deadline)
            if header is not None:
                return header
            if sent and self.remote_slots:  # sent and unanswered: maybe into nothing
                self._reconnect_dealer()
                # Connected again (IMMEDIATE: writable once connected) before the next try.
                wait = _RECONNECT_WAIT_S if deadline is None else deadline - time.monotonic()
                self.dealer.poll(max(1, int(min(wait, _RECONNECT_WAIT_S) * 1000)), zmq.POLLOUT)
            wait_s = min(2 * wait_s, 5.0)
        if refused is not None:
            raise RegistrationError(key_refused(self.router, refused, self.keys))
        raise RegistrationError(
            f"no answer from the pool at {self.router} within {timeout} s (is it up? "
            "for TCP with CURVE: is this worker's key in the pool's authorized/ folder, and is "
            "--server-key the pool's server.key?)"
        )

    def _await_registration_reply(self, wait_s: float, deadline: float | None) -> Header | None:
        until = time.monotonic() + wait_s
        if deadline is not None:
            until = min(until, deadline)
        while (remaining := until - time.monotonic()) > 0:
            if not self.dealer.poll(int(remaining * 1000) + 1):
                return None
            frames = recv_frames(self.dealer)
            try:
                header = Header.decode(frames[0].buffer)
            except VersionMismatchError as err:
                # The pool's REFUSE is written in its version, which we cannot read:
                # any message from it in another version means we will never agree.
                raise RegistrationError(
                    f"the pool at {self.router} speaks another protocol version ({err}): "
                    "run the same zmqpool version on the trainer and the workers"
                ) from err
            except ProtocolError as err:
                log.warning("dropped a malformed message while registering: %s", err)
                continue
            if header.command in (Command.WELCOME, Command.REFUSE):
                return header
        return None

    def _accept_welcome(self, welcome: Welcome) -> None:
        envs = list(welcome.envs)
        if len(envs) != len(self.host.envs):
            raise RegistrationError(
                f"the pool at {self.router} assigned envs {envs} to this worker, "
                f"which hosts {len(self.host.envs)}"
            )
        # Checked before anything changes: a WELCOME refused leaves the worker as it was.
        results = pool_endpoint(welcome.results, self.router, "results")
        beats = welcome.beats
        if beats is not None:
            beats = pool_endpoint(beats, self.router, "beats")
        # The pool may place our envs at other indices (remote workers ask for slots).
        hosted = sorted(self.host.envs)
        self.host.envs = dict(zip(envs, [self.host.envs[i] for i in hosted], strict=True))
        self.spec_dtypes = dict(zip(envs, [self.spec_dtypes[i] for i in hosted], strict=True))
        with self._replies.holding():  # env threads may be replying to the old pool
            self.token = welcome.token
            self._close_push()
            self.push = self._socket(zmq.PUSH)
            # A PUSH receives nothing: only the handshake's few small commands.
            self._push_watch = self._connect(self.push, results, MAX_BEAT_BYTES)
            # Before the replies held meanwhile go: they are cut by this pool's piece.
            self.beats = beats
            self.epoch = welcome.epoch
            self.welcome = welcome
        self.pool_lost.clear()
        log.info("registered envs %s with the pool at %s", envs, self.router)

    def _rejoin(self) -> None:
        """The pool went away or was replaced: forget its layouts, register again."""
        log.warning("the pool at %s went away or restarted; registering again", self.router)
        # As a new process: a pool that still holds this worker live (it did not listen
        # while the link was down) answered a REGISTER of the same incarnation as a
        # duplicate, keeping the link whose layouts this worker forgets below (its next
        # command failed: unknown layout id) and the commands this worker dropped while
        # registering (their recv hung). A new incarnation makes it a rejoin: fresh
        # codecs on both sides, its requests in flight sent again.
        self.incarnation = os.urandom(8)
        with self._encoding:
            self.encoder.forget()
        self.decoder = Decoder(max_frame_bytes=self.frame_limit)
        self.register()

    # ------------------------------------------------------------ serving

    def serve(self) -> None:
        """Answer commands until CLOSE (or the process is killed)."""
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="heartbeat", daemon=True
        )
        self._heartbeat.start()
        next_check = time.monotonic() + self.heartbeat_interval_s
        # Reads wait at most this long (_next_command), so the checks below run on time.
        self.dealer.rcvtimeo = max(1, int(self.heartbeat_interval_s * 1000))
        try:
            while not self._stop.is_set():
                if self.pool_lost.is_set() and self.remote_slots:
                    self._rejoin()
                if not self._serve_next():
                    break
                if (now := time.monotonic()) >= next_check:
                    next_check = now + self.heartbeat_interval_s
                    self._check_connections()
        finally:
            self._stop.set()

    def _serve_next(self) -> bool:
        """Handle the next command if one comes within a heartbeat interval; False for CLOSE.

        Its own frame so that a message's frames (libzmq's memory) are let go
        once it is handled, not kept until the next one comes.
        """
        frames = self._next_command()
        return frames is None or self.handle(frames)

    def _check_connections(self) -> None:
        """Connect the DEALER and the PUSH again if a protocol error dropped them for good."""
        if self._dealer_watch is not None:
            self._dealer_watch.check()
        with self._replies.holding():
            if self._push_watch is not None:
                self._push_watch.check()

    def _close_push(self) -> None:
        """Close the PUSH and its watch (the caller holds the reply queue's lock)."""
        if self._push_watch is not None:
            self._push_watch.close()
            self._push_watch = None
        if self.push is not None:
            self.push.close()
            self.push = None

    def _next_command(self) -> list[zmq.Frame] | None:
        """The next command's frames, waiting up to a heartbeat interval (``None``: nothing).

        The frames as libzmq received them, not copied: a frame is copied only
        once the decoder has matched it to the layouts its header names
        (:meth:`_decoded`), and frames past
        :data:`~zmqpool.limits.MAX_MESSAGE_FRAMES` are let go as they are read
        (:func:`~zmqpool.protocol.recv_frames`), each freed at once. libzmq
        itself has taken in the whole message before its first frame can be
        read: that much (each frame within the DEALER's ``MAXMSGSIZE``) is
        held whatever this worker does.

        One blocking read bounded by the DEALER's ``RCVTIMEO`` (set to the
        heartbeat interval in :meth:`serve`): a worker that hosts one env has
        nothing queued when it comes back for its next command, and a
        non-blocking read that fails (``zmq.Again`` raised and caught), then
        ``Socket.poll`` (a ``Poller`` built per call), then the read again cost
        ~14 us of the worker's CPU per step more (measured in
        docs/PERFORMANCE.md). ``frame.more`` is read off each frame instead of
        asking the socket for ``RCVMORE``.
        """
        try:
            return recv_frames(self.dealer, wait=True)
        except zmq.Again:
            return None

    def handle(self, frames: Sequence[Any]) -> bool:
        """Handle one message from the pool, as :meth:`serve` does each; False for CLOSE.

        A command is run on its env and answered on the PUSH (an error reply
        for a command that is malformed or that the env raised on); a frame
        that is not even a header is counted in :attr:`dropped`, and so is a
        malformed batch. A batch's commands, and the rows of a COMMANDS, are
        handled in order, each as if it had come alone. Driving a worker
        message by message, without the DEALER, is what this is for
        (``tests/test_fuzz_live.py`` feeds it hostile frames). ``frames``:
        ``zmq.Frame`` s as received, or bytes; none is copied before it is checked.
        """
        header = self._command_header(frames[0])
        if header is None:
            return True
        if header.command == Command.BATCH:
            return self._handle_batch(header, frames[1:])
        if header.command == Command.COMMANDS:
            return self._handle_several([_Command(header, list(frames[1:]))])
        return self._handle_command(_Command(header, list(frames[1:])))

    def _command_header(self, frame: Any) -> Header | None:
        try:
            return Header.decode(frame_buffer(frame))
        except ProtocolError as err:
            self.dropped += 1
            log.warning("dropped a malformed command: %s", err)
            return None

    def _handle_command(self, command: _Command, inline: bool | None = None) -> bool:
        """``inline``: where an env's command runs, if decided (see :meth:`_execute`)."""
        kind = command.header.command
        if kind == Command.CLOSE:
            return False
        if kind == Command.BATCH:
            self.dropped += 1
            log.warning("dropped a batch inside a batch")
        elif kind == Command.REJOIN:  # set aside (its token void): register again
            if self.remote_slots:
                log.warning("the pool set this worker aside; registering again")
                # The heartbeat socket connects again too: the pool may have heard no beats
                # because its ROUTER ignores that connection (see _reconnect_dealer). Not on
                # every rejoin: while the link is down, the old connection's FIN would be
                # lost and the new one could be ignored for that very reason.
                self._renew_beat.set()
                self.pool_lost.set()
        elif kind not in (Command.PING, Command.WELCOME):  # WELCOME: a repeat
            self._execute(command, inline)
        return True

    def _handle_batch(self, header: Header, frames: Sequence[Any]) -> bool:
        """A batch of commands: each handled in order; run inline, their replies go as a batch."""
        try:
            messages = split_batch(header, frames, max(1, len(self.host.envs)))
        except ProtocolError as err:
            self.dropped += 1
            log.warning("dropped a malformed batch: %s", err)
            return True
        commands = []
        for message in messages:
            inner = self._command_header(message[0])
            if inner is not None:
                commands.append(_Command(inner, message[1:]))
        return self._handle_several(commands)

    def _handle_several(self, commands: list[_Command]) -> bool:
        """Commands of one message in order (a COMMANDS as its rows), replies kept inline."""
        inline = self._runs_inline() or self._all_cheap()
        # Envs run inline: their replies are kept and go together at the end. (A
        # reply from an env thread, queued meanwhile, joins them: see _send_now.)
        self._outbox = [] if inline else None
        try:
            for command in commands:
                # A COMMANDS is taken apart when its turn comes: its error replies keep their place.
                rows = self._rows_of(command)
                hold = holds_replies(command.header)
                # One probe first, while no env thread has anything to run (it is then
                # judged clean); then the rows for env threads: a cheap env stepping
                # inline never waits for one of them to be handed to its thread (each
                # env comes once a message); then the rows of cheap envs, inline.
                probes, threaded, inline_rows = self._placed(rows)
                for row in probes:
                    self._handle_command(row, inline=True)  # an env's command: not a CLOSE
                for row in threaded:
                    self._handle_command(row, inline=False)
                for row in inline_rows:
                    if not self._handle_inline(row, inline, hold):
                        return False
            return True
        finally:
            self._flush_outbox()

    def _handle_inline(self, row: _Command, timed: bool, hold: bool) -> bool:
        """Handle a command that may run inline; ``timed``: note how long its env took;
        ``hold``: its message asked for its replies to be held (see :data:`HOLD_FOR_S`)."""
        env = row.header.env
        if self._outbox and self._slow(env, hold):
            self._flush_outbox(reopen=True)  # kept replies never wait on a slow env
        started = time.perf_counter()
        if not self._handle_command(row, inline=True):
            return False
        if timed and env in self.host.envs:
            took = time.perf_counter() - started
            self._step_s[env] = (self._step_s.get(env, _NEVER_RAN)[1], took)
        return True

    def _slow(self, env: int, hold: bool) -> bool:
        """Whether kept replies go before env ``env`` runs: its last command took longer
        than :data:`HOLD_FOR_S`; held (``hold``), its last two did."""
        before, last = self._step_s.get(env, _NEVER_RAN)
        return (min(before, last) if hold else last) > HOLD_FOR_S

    def _placed(
        self, rows: list[_Command]
    ) -> tuple[list[_Command], list[_Command], list[_Command]]:
        """A message's rows as: at most one probe, the rows for env threads, the rest
        (inline: cheap envs', and anything not an env's command), each in order."""
        probes: list[_Command] = []
        threaded: list[_Command] = []
        inline_rows: list[_Command] = []
        for row in rows:
            if self._goes_to_thread(row):
                threaded.append(row)
            elif self._is_probe(row):
                (threaded if probes else probes).append(row)  # others not judged: threads
            else:
                inline_rows.append(row)
        return probes, threaded, inline_rows

    def _is_probe(self, command: _Command) -> bool:
        """Whether a command would step inline an env not judged yet (workers.inline)."""
        return self._threaded_env(command) and self._judge.unjudged(command.header.env)

    def _threaded_env(self, command: _Command) -> bool:
        """Whether a command is for a hosted env of a worker with env threads."""
        return (
            self.runners is not None
            and not self._runs_inline()
            and command.header.command in _ENV_COMMANDS
            and command.header.env in self.host.envs
        )

    def _goes_to_thread(self, command: _Command) -> bool:
        """Whether a command runs in its env's thread (see :meth:`_execute`)."""
        if not self._threaded_env(command):
            return False
        index = command.header.env
        if not self.inline_cheap or not self._judge.runs_inline(index):
            return True
        assert self.runners is not None  # _threaded_env says so
        # Inline only with its thread idle: an env's commands run in the order they came.
        return not self.runners.runner_for(self.host.envs[index], index).idle()

    def _rows_of(self, command: _Command) -> list[_Command]:
        """A COMMANDS as one command per row; any other command as it is."""
        if command.header.command == Command.COMMANDS:
            return self._rows(command.header, command.frames)
        return [command]

    def _all_cheap(self) -> bool:
        """Whether every hosted env was judged cheap: all of them step inline."""
        if self.runners is None or not self.inline_cheap:
            return False
        return self._judge.all_cheap(self.host.envs.keys())

    def _rows(self, header: Header, frames: list[Any]) -> list[_Command]:
        """A COMMANDS as one command per env, each its row already decoded (wire: rows joined).

        A header that fails its checks is dropped whole (counted, as a malformed
        batch); frames that do not match its layouts answer each env with the
        error, as each command would have been answered alone.
        """
        try:
            kind, envs, seqs = command_rows(header, max(1, len(self.host.envs)))
        except ProtocolError as err:
            self.dropped += 1
            log.warning("dropped malformed joined commands: %s", err)
            return []
        headers = [
            Header(kind, env, seq, layouts=header.layouts)
            for env, seq in zip(envs, seqs, strict=True)
        ]
        try:
            _check_joined_size(frames)  # before the copy: a pool joins at most this
            # One copy of each joined frame, writable (see _decoded); each row a view of it.
            copies = [bytearray(frame_buffer(f)) for f in frames]
            rows = self.decoder.decode_rows(header, copies, len(envs))
        except ProtocolError as err:
            for inner in headers:
                self._send(self._error_reply(inner, err))
            return []
        return [_Command(inner, parts=parts) for inner, parts in zip(headers, rows, strict=True)]

    def _runs_inline(self) -> bool:
        """Whether commands run in this (the main) thread rather than in env threads."""
        return self.runners is None or len(self.host.envs) < 2

    def _flush_outbox(self, reopen: bool = False) -> None:
        """Send the replies kept during a batch, in order: rows joined, small messages batched.

        ``reopen``: keep the replies of the batch's next commands again.
        """
        outbox, self._outbox = self._outbox, [] if reopen else None
        if not outbox:
            return
        with self._replies.holding():
            for frames in self._joined(outbox):
                self._push(frames)

    def _joined(self, replies: list[Row | list[Any]]) -> list[list[Any]]:
        """Replies as few messages as can be: rows joined, small messages batched.

        A batch holds at most one message per hosted env, as the pool takes it.
        """
        # A batch's env names this worker to the pool: one it hosts.
        env = next(iter(self.host.envs), -1)
        joined = joined_messages(replies, self.token)
        return batch_messages(joined, env, self.token, max(1, len(self.host.envs)))

    def _execute(self, command: _Command, inline: bool | None = None) -> None:
        """Decode a command and run it: inline, or in its env's thread.

        With env threads, ``inline`` says where, as :meth:`_goes_to_thread`
        decided; None: decide here. An env runs inline only with its thread
        idle and not judged to wait (:mod:`workers.inline`).
        """
        header = command.header
        try:
            parts = command.parts
            if parts is None:  # decoded here, in order: layouts are announced on this connection
                parts = self._decoded(header, command.frames)
            td = parts[0].to_tensordict() if parts else None
        except Exception as err:
            self._send(self._error_reply(header, err))
            return
        env = self.host.envs.get(header.env)
        if self.runners is None or env is None or self._runs_inline():
            self._run(header, td)
            return
        if inline is None:
            inline = not self._goes_to_thread(command)
        if not inline:
            self.runners.runner_for(env, header.env).submit(lambda: self._run(header, td))
            return
        clean = self.runners.all_idle()  # then nothing else steps while this one runs inline
        if not clean and self._judge.unjudged(header.env):
            clean = self._await_idle_threads(PROBE_WAIT_S)  # a probe: judged alone if it can be
        self._run_judged(header, td, clean)

    def _decoded(self, header: Header, frames: list[Any]) -> list[DecodedPart]:
        """A command's parts, checked against its layouts before a byte of them is copied.

        The decoder matches the frames to the layouts the header names (their
        count and each one's exact size) on the received buffers; only then is
        the part an env gets (the first) copied, once, into memory of its own:
        env code may write into its input, and a received frame (bytes, or a
        zmq frame) is not the env's to write into. A message that fails the
        checks costs no copy at all (each frame used to be copied twice first:
        one STEP of 700 frames of 1000 KiB, refused for its unknown layout,
        grew a worker by 1.8 GB).
        """
        parts = self.decoder.decode(header, frames)
        if not parts:
            return parts
        first = parts[0]
        own = [memoryview(bytearray(buffer)) for buffer in first.buffers]
        return [DecodedPart(first.layout, own, first.nontensor), *parts[1:]]

    def _await_idle_threads(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for every env thread to finish its jobs; whether they did."""
        assert self.runners is not None
        deadline = time.perf_counter() + wait_s
        while not self.runners.all_idle():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(_IDLE_POLL_S)
        return True

    def _run_judged(self, header: Header, td: Any, clean: bool) -> None:
        """:meth:`_run` inline, the env's own work timed for the judge of which envs
        step inline. The reply's encoding and sending are not timed: they cost the same
        in any thread, and waiting for the encoder's lock (held by an env thread) is not
        the env waiting."""
        switches = _voluntary_switches()
        wall, cpu = time.perf_counter(), time.thread_time()  # after the system call
        out, err = self._outcome(header, td)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        # Ran for its CPU time, give or take a short wait: no need to ask (a system call).
        ran = wall - cpu < SHORT_WAIT_S and switches is not None
        waited = not ran and (switches is None or _voluntary_switches() != switches)
        self._judge.record(header.env, StepTimes(wall, cpu, waited), clean)
        self._reply(header, out, err)

    def _run(self, header: Header, td: Any) -> None:
        """Run one command on its env and send the reply (from an env thread, maybe)."""
        self._reply(header, *self._outcome(header, td))

    def _outcome(self, header: Header, td: Any) -> tuple[Any, BaseException | None]:
        """Run one command on its env: its output, or the error it raised.

        A ``SystemExit`` or another ``BaseException`` the env raised is its error
        too: the process is intact, and ending it (as they did) cost the other envs
        of the worker their results. Not a ``KeyboardInterrupt``: a remote worker's
        Ctrl-C must stop it (a local worker ignores SIGINT; there it is env code's,
        and ends the worker as an exit would).
        """
        try:
            return self.host.run(header.command, header.env, td, header.body), None
        except KeyboardInterrupt:
            raise
        except BaseException as err:
            return None, err

    def _reply(self, header: Header, out: Any, err: BaseException | None) -> None:
        """Send a command's reply: its env's output, or the error the env raised."""
        if err is not None:
            self._send(self._error_reply(header, err))
            return
        with self._encoding:
            self._replies.append(self._encoded(header, out))
        self._replies.drain()

    def _send(self, reply: list[Any]) -> None:
        """Send a reply now, or leave it to the thread sending now: it goes with that one's."""
        self._replies.put(reply)

    def _send_now(self, ready: list[Row | list[Any]]) -> None:
        """With the reply lock: send replies (or keep them: a batch run inline).

        Several (queued while another thread sent) go as few messages as can be.
        """
        if self._outbox is not None:  # a batch runs inline: its replies go when it ends
            self._outbox.extend(ready)  # where results of one layout may be joined
        elif len(ready) > 1:
            for frames in self._joined(ready):
                self._push(frames)
        else:  # a lone reply, as one-env workers' always are: nothing to join or batch
            reply = ready[0]
            self._push(reply.message(self.token) if isinstance(reply, Row) else reply)

    def _encoded(self, header: Header, out: list[Any]) -> Row | list[Any]:
        """A result as its row; an output that cannot cross the wire, as the env's error.

        Its header is held to what the pool takes (non-tensor data can make it
        large): a reply the pool dropped as malformed would leave its request
        unanswered.
        """
        parts: list[EncodedPart] = []
        dtypes = self.spec_dtypes.get(header.env)
        try:
            for part in out:
                parts.append(self.encoder.encode(part, dtypes))
                self._check_frames(parts[-1])
            check_header_room(parts)
            self._check_pieces(parts)
        except Exception as err:
            self.encoder.retract(parts)  # not sent: their layouts are announced again
            return self._error_reply(header, err, "its output cannot cross the wire")
        return Row(Command.RESULT, header.env, header.seq, parts)

    def _check_frames(self, part: EncodedPart) -> None:
        """Refuse an output with a frame larger than the pool takes (a leaf far off its spec)."""
        welcome = self.welcome
        largest = part.layout.largest_frame
        if welcome is not None and largest > welcome.max_frame:
            raise ProtocolError(
                f"a frame of {largest} bytes (a leaf larger than its spec allows); the pool "
                f"takes at most {welcome.max_frame} (twice what the specs declare, or its "
                "limit for remote frames)"
            )

    def _check_pieces(self, parts: list[EncodedPart]) -> None:
        """Refuse an output too large for the most pieces a reply may come in (wire: pieces)."""
        welcome = self.welcome
        if welcome is None or not welcome.piece:
            return
        piece = welcome.piece
        nbytes = sum(part.layout.frames_nbytes for part in parts)
        whole = min(piece * MAX_PIECES, max_pieced_bytes(welcome.max_frame))
        room = whole - MAX_HEADER_BYTES
        if nbytes > room:
            raise ProtocolError(
                f"an output of {nbytes} bytes; the pool takes replies of at most {room} "
                f"(in pieces of {piece} bytes, less a header)"
            )

    def _push(self, reply: list[Any]) -> None:
        if self.push is None:  # closed (the worker is closing): nobody awaits the reply
            return
        piece = 0 if self.welcome is None else self.welcome.piece
        if piece and any(memoryview(frame).nbytes > piece for frame in reply):
            reply = pieced_message(reply, next(iter(self.host.envs)), self.token, piece)
        send_frames(self.push, reply)

    def _error_reply(
        self, header: Header, err: BaseException, what: str | None = None
    ) -> list[Any]:
        malformed = isinstance(err, ProtocolError)
        what = what or ("malformed command" if malformed else "env raised")
        text = _safe_repr(err)
        log.warning("env %d: %s: %s", header.env, what, text)
        kind = FailureKind.PROTOCOL if malformed else FailureKind.ENV  # ENV may restart the worker
        # From the error itself: the reply may be made after its except block has ended.
        trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        body = Failed.clipped(f"{what}: {text}", trace, kind, builtin_base(err)).to_body()
        return [Header(Command.ERROR, header.env, header.seq, self.token, body=body).encode()]

    def _open_beat(self) -> tuple[zmq.Socket, _DropWatch | None]:
        """The heartbeat thread's DEALER, connected (with its watch, over TCP)."""
        beat = self._socket(zmq.DEALER, self.identity + b"!hb")
        # The pool sends this DEALER nothing, and nothing reads it: a header is the most
        # it could send, and one is all libzmq queues (by default 1,000: 1 GB of headers).
        beat.setsockopt(zmq.RCVHWM, 1)
        return beat, self._connect(beat, self.router, MAX_HEADER_BYTES)

    def _heartbeat_loop(self) -> None:
        # Its own sockets: zmq sockets are not thread-safe, and a long env step
        # in the main thread must not silence the heartbeats.
        beat, beat_watch = self._open_beat()
        message = Header(Command.HEARTBEAT).encode()
        watch = _PoolWatch(self)
        try:
            while not self._stop.wait(self.heartbeat_interval_s):
                if self._renew_beat.is_set():  # set aside: maybe ignored, as the DEALER may be
                    self._renew_beat.clear()
                    if beat_watch is not None:
                        beat_watch.close()
                    beat.close()
                    beat, beat_watch = self._open_beat()
                if beat_watch is not None:
                    beat_watch.check()
                with contextlib.suppress(zmq.Again):  # a full queue: the pool is away
                    beat.send(message, zmq.NOBLOCK)
                watch.check()
        except zmq.ZMQError as err:  # a socket error ends the beats; the pool hears the silence
            if not self._stop.is_set():
                log.error("the heartbeat thread stops on a socket error: %s", err)
        finally:  # this thread's sockets, closed by it (close() joins it before term())
            if beat_watch is not None:
                beat_watch.close()
            beat.close()
            watch.close()

    def report_maker_failure(self, err: EnvMakerError) -> None:
        # The pool names the env itself (EnvMakerError): the reason alone, not "env N: ...".
        cause = err.__cause__  # what the maker raised: its builtin class goes with it
        base = builtin_base(cause) if cause is not None else None
        failed = Failed.clipped(err.reason, err.remote_traceback, FailureKind.MAKER, base)
        self._send_failed(err.env_index, failed)

    def _send_failed(self, env: int, failed: Failed) -> None:
        message = Header(Command.FAILED, env, body=failed.to_body()).encode()
        if self.remote_slots:
            # Its DEALER (IMMEDIATE) takes a message once connected: a CURVE handshake
            # away. Not for ever: a pool that is not there hears nothing, and we exit.
            self.dealer.poll(_FAILED_CONNECT_WAIT_MS, zmq.POLLOUT)
        with contextlib.suppress(zmq.Again):
            self.dealer.send(message, zmq.NOBLOCK if self.remote_slots else 0)
        # Give the message a moment to leave before the process exits (linger is 0).
        time.sleep(0.2)

    def _env_thread_died(self, name: str, err: BaseException) -> None:
        """In an env thread that is ending: its env can answer nothing more, so the process ends.

        The pool sees the exit (its pidfd, or the missing heartbeats of a
        remote worker), restarts the worker and answers every request in
        flight with a restart truncation: the outcome of the same
        ``KeyboardInterrupt`` in an env stepped inline. Exit code
        :data:`~zmqpool.launcher.ENV_THREAD_DIED`.
        """
        if self._stop.is_set():
            log.warning("%s ended while the worker closed: %r", name, err)
            return
        lines = traceback.format_exception(type(err), err, err.__traceback__)
        sys.stderr.write(
            f"zmqpool worker pid {os.getpid()}: env thread {name} died; the worker exits "
            f"(code {ENV_THREAD_DIED}) for its pool to restart it\n{''.join(lines)}"
        )
        sys.stderr.flush()
        os._exit(ENV_THREAD_DIED)

    def close(self) -> None:
        """Stop the threads, each closing its own sockets; close ours; end the context.

        Bounded: threads still busy after :data:`CLOSE_JOIN_S` (an env step
        that goes on) are left to the process's exit; their envs are not
        closed under them, and an env thread finishing later finds no PUSH
        socket and drops its reply.
        """
        self._stop.set()
        deadline = time.monotonic() + CLOSE_JOIN_S
        busy = self.runners.stop(CLOSE_JOIN_S) if self.runners is not None else []
        heartbeat = self._heartbeat
        if heartbeat is not None:
            heartbeat.join(max(deadline - time.monotonic(), 0.0))
        with self._replies.holding():
            self._close_push()
        if self._dealer_watch is not None:
            self._dealer_watch.close()
        self.dealer.close()
        idle = {i: env for i, env in self.host.envs.items() if not any(env is b for b in busy)}
        EnvHost(idle).close()
        if heartbeat is not None and heartbeat.is_alive():
            log.warning("the heartbeat thread did not stop; leaving its sockets to the exit")
            return
        if busy:
            stepping = sorted(set(self.host.envs) - set(idle))
            log.warning("envs %s still stepping at close: left to the process's exit", stepping)
        self.context.term()  # every socket is closed: returns at once


class _PoolWatch:
    """In the heartbeat thread: is our pool still beating, and is it still the same pool?

    A remote worker asks the pool's beacon for a beat (a HEARTBEAT on its
    beats socket, a DEALER) at each check, and reads the PINGs that came
    since the last one (the beacon answers within a heartbeat interval).
    Only a one-frame PING whose body is a :class:`~zmqpool.protocol.Ping` is a
    beat. Anything else on the socket (bytes that are no header, another
    command, a bad body, more frames) proves nothing: it is counted in
    ``worker.malformed_beats``, logged at the 1st, 2nd, 4th, 8th... time, and
    ignored, so the beats, the watch and the worker go on. At most
    :data:`_BEATS_PER_CHECK` messages are read in a check: a peer posing as
    the pool cannot keep the thread from its own heartbeats.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.sock: zmq.Socket | None = None
        self.sock_watch: _DropWatch | None = None
        self.endpoint: str | None = None
        self.last_beat = time.monotonic()
        self.ask = Header(Command.HEARTBEAT).encode()
        self.welcome: Welcome | None = None  # the registration the beats are judged for

    def check(self) -> None:
        worker = self.worker
        if worker.beats != self.endpoint:
            self._connect(worker.beats)
        if worker.welcome is not self.welcome:
            self._new_registration(worker.welcome)
        if self.sock_watch is not None:
            self.sock_watch.check()
        if self.sock is None or worker.pool_lost.is_set():
            return
        for _ in range(_BEATS_PER_CHECK):
            if not self.sock.poll(0):
                break
            epoch = self._read_beat(self.sock)
            if epoch is None:
                continue
            if epoch != worker.epoch:
                worker.pool_lost.set()  # a new pool at the same address: a restarted trainer
                return
            self.last_beat = time.monotonic()
        welcome = worker.welcome
        # The pool's own timings (its WELCOME): lost after as many missed beats as it allows us.
        if welcome is not None and time.monotonic() - self.last_beat > welcome.pool_timeout_s:
            worker.pool_lost.set()
            return
        with contextlib.suppress(zmq.Again):  # a full queue: the pool is away, asked already
            self.sock.send(self.ask, zmq.NOBLOCK)

    def _new_registration(self, welcome: Welcome | None) -> None:
        """A new WELCOME: a new grace period, and nothing queued for the last pool counts.

        A beat comes only when asked for, and no ask is sent while the pool is
        lost: judged from the old pool's last beat, a worker that registered
        again a little before the timeout was lost again at once, and again
        after each WELCOME (session 54's review).
        """
        self.welcome, self.last_beat = welcome, time.monotonic()
        for _ in range(_BEATS_PER_CHECK):
            if self.sock is None or not self.sock.poll(0):
                return
            recv_frames(self.sock)  # answers to asks made for the last registration

    def _read_beat(self, sock: zmq.Socket) -> bytes | None:
        """The epoch of the PING queued on ``sock``, or ``None`` (counted) if it is none."""
        frames = recv_frames(sock)  # every frame of the message: none is left for the next read
        try:
            if len(frames) != 1:
                raise ProtocolError(f"a heartbeat is one frame, got {len(frames)}")
            header = Header.decode(frames[0].buffer)
            if header.command != Command.PING:
                raise ProtocolError(f"a heartbeat is a PING, got {header.command.name}")
            return Ping.from_body(header.body).epoch
        except ProtocolError as err:  # not a beat of any pool's: it proves nothing
            self.worker.malformed_beats += 1
            count = self.worker.malformed_beats
            log_throttled(
                log, count, "dropped a malformed pool heartbeat (%d so far): %s", count, err
            )
            return None

    def _connect(self, endpoint: str | None) -> None:
        self.close()
        self.endpoint, self.last_beat = endpoint, time.monotonic()
        if endpoint is not None:
            self.sock = self.worker._socket(zmq.DEALER)
            # One ask waits while the pool is away; a few beats wait for the next check.
            self.sock.setsockopt(zmq.SNDHWM, 1)
            self.sock.setsockopt(zmq.RCVHWM, _BEATS_PER_CHECK)
            try:
                self.sock_watch = self.worker._connect(self.sock, endpoint, MAX_BEAT_BYTES)
            except zmq.ZMQError as err:  # the WELCOME's endpoint: the pool's to get right
                log.error("cannot ask the pool for heartbeats at %r: %s", endpoint, err)
                self.close()

    def close(self) -> None:
        if self.sock_watch is not None:
            self.sock_watch.close()
            self.sock_watch = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class _DropWatch:
    """Connects a TCP socket again when libzmq will not: after a protocol error.

    libzmq connects a socket again by itself after a connection error or a
    handshake timeout, but after a protocol error (a frame over ``MAXMSGSIZE``,
    a greeting or handshake that is not ZMTP and CURVE) or a refused key (the
    pool's ZAP handler denied it: ``EVENT_HANDSHAKE_FAILED_AUTH``, status 400)
    it drops the endpoint for good (measured, libzmq 4.3: ``EVENT_DISCONNECTED``
    and no ``EVENT_CONNECT_RETRIED``). A command over this worker's limit, or a
    peer posing as the pool, would then cut the worker off for good. The thread
    that owns the socket calls :meth:`check` now and then: a drop libzmq has
    not retried within :attr:`GRACE_S` is connected again here, and logged
    (throttled: the 1st, 2nd, 4th... time) with its cause: the pool refused
    this worker's key (:func:`key_refused`: the fix is on the pool's side, in
    its ``authorized/`` folder), or a protocol error.
    """

    GRACE_S = 1.0
    EVENTS = (
        zmq.EVENT_DISCONNECTED
        | zmq.EVENT_CONNECT_RETRIED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_SUCCEEDED
    )

    def __init__(self, sock: zmq.Socket, endpoint: str, keys: ClientKeys | None = None) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.keys = keys
        self.monitor = sock.get_monitor_socket(self.EVENTS)
        self.monitor.linger = 0
        self.dropped_at: float | None = None
        self.reconnects = 0
        #: The ZAP status of the pool's last refusal of this worker's key (None: none seen).
        self.refused: int | None = None

    def check(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = event["value"]  # the drop that follows is the pool's refusal
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = None  # accepted now (a pool restarted with our key listed)
            elif event["event"] != zmq.EVENT_DISCONNECTED:
                self.dropped_at = None  # libzmq is connecting again itself
            elif self.dropped_at is None:
                self.dropped_at = time.monotonic()
        if self.dropped_at is None or time.monotonic() - self.dropped_at < self.GRACE_S:
            return
        self.dropped_at = None
        self.reconnects += 1
        self._log_drop()
        with contextlib.suppress(zmq.ZMQError):  # the endpoint may be gone already
            self.sock.disconnect(self.endpoint)
        self.sock.connect(self.endpoint)

    def _log_drop(self) -> None:
        if self.refused is not None:
            text = key_refused(self.endpoint, self.refused, self.keys)
            log_throttled(
                log, self.reconnects, "%s; trying again (%d times so far)", text, self.reconnects
            )
            return
        log_throttled(
            log,
            self.reconnects,
            "the connection to %s was dropped for a protocol error (a frame over this "
            "socket's limit of %d bytes, or a peer that is not the pool): connecting again "
            "(%d times so far)",
            self.endpoint,
            self.sock.getsockopt(zmq.MAXMSGSIZE),
            self.reconnects,
        )

    def close(self) -> None:
        """Stop monitoring (before the socket is closed)."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close()


def key_refused(endpoint: str, status: int, keys: ClientKeys | None) -> str:
    """What to say when the pool at ``endpoint`` refused our key in the CURVE handshake.

    ``status`` is the ZAP status code libzmq reports (``EVENT_HANDSHAKE_FAILED_AUTH``;
    400: the key is not on the pool's allow-list). The pool reads its
    ``authorized/`` folder when it starts.

    Example:
        >>> keys = ClientKeys(b"P" * 40, b"S" * 40, b"K" * 40, "keys/workers/worker-2.key_secret")
        >>> print(key_refused("tcp://10.0.0.1:5555", 400, keys))  # doctest: +NORMALIZE_WHITESPACE
        the pool at tcp://10.0.0.1:5555 refused this worker's CURVE key during the handshake
        (ZAP denied it, status 400): the public key of --client-key
        keys/workers/worker-2.key_secret (PPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPP) must be in the
        pool's authorized/ folder (copy worker-2.key there, then restart the pool)
    """
    text = (
        f"the pool at {endpoint} refused this worker's CURVE key during the handshake "
        f"(ZAP denied it, status {status})"
    )
    if keys is None:
        return f"{text}: is this worker's key in the pool's authorized/ folder?"
    source = "" if keys.secret_file is None else f" of --client-key {keys.secret_file}"
    public = keys.public.decode(errors="replace")
    advice = "then restart the pool"
    if keys.secret_file is not None and keys.secret_file.endswith(".key_secret"):
        advice = f"copy {os.path.basename(keys.secret_file)[: -len('_secret')]} there, {advice}"
    return (
        f"{text}: the public key{source} ({public}) must be in the pool's authorized/ "
        f"folder ({advice})"
    )


def _voluntary_switches() -> int | None:
    """How often this thread gave up the CPU on its own so far (it slept, read, or locked).

    None where the OS does not count it per thread (Linux does): every step then
    counts as one that waited, and the worker's envs keep their threads.
    """
    if _RUSAGE_THREAD is None:
        return None
    return resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def command_frame_limit(host: EnvHost, router: str) -> int:
    """The largest frame this worker accepts in a command from a pool at ``router``.

    A command carries the pool's header (at most
    :data:`~zmqpool.limits.MAX_HEADER_BYTES`) and the tensordict it sends an env,
    whose leaves are those the env's specs declare (actions, states, the
    observations of a step's root): no frame of it exceeds all of those leaves
    packed. So the bound is :func:`~zmqpool.layout.max_message_bytes` of each
    env's ``specs.zero()``, headroom included: the very bound the pool's decoder
    holds this worker's replies to (``Registrar._welcome``), from the same specs.
    A frame over it is refused by libzmq (the connection drops) or, inside it,
    by the decoder (an ERROR reply: malformed command). Over ipc the trainer
    is the only peer: no limit there (:data:`~zmqpool.limits.MAX_FRAME_BYTES`).
    """
    if not router.startswith("tcp://"):
        return MAX_FRAME_BYTES
    return max_message_bytes(layout_of(env.specs.zero()) for env in host.envs.values())


def _check_joined_size(frames: Sequence[Any]) -> None:
    """Refuse a COMMANDS whose joined frames add up to more than a pool ever joins.

    A pool joins rows into one COMMANDS only up to
    :data:`~zmqpool.limits.MAX_BATCH_BYTES` in all (:func:`~zmqpool.wire.joined_messages`,
    :mod:`zmqpool.outbox`); larger commands go alone. Checked before the
    joined frames are copied: each may be as large as the DEALER's limit.
    Raises :class:`ProtocolError`.
    """
    total = sum(frame_buffer(frame).nbytes for frame in frames)
    if total > MAX_BATCH_BYTES:
        raise ProtocolError(
            f"joined commands of {total} bytes; a pool joins at most {MAX_BATCH_BYTES}"
        )


def _safe_repr(err: BaseException) -> str:
    """``repr(err)``, or a stand-in if the env's exception cannot even say what it is."""
    try:
        return repr(err)
    except Exception:
        return f"<{type(err).__name__}: its repr() raised>"


def pool_endpoint(endpoint: str, router: str, name: str) -> str:
    """An endpoint the pool's WELCOME named (``name``: which), to connect to; or refused.

    It must use the transport this worker reached the pool by (``router``'s):
    every pool names its endpoints so (a local pool, ipc or loopback TCP; a
    remote one, TCP). A worker that reached its pool over TCP is on another
    machine, or treats the pool as one: an ipc or inproc endpoint there would
    be a local path that anyone on the worker's machine may be listening at,
    not the pool. Another host over TCP is allowed (a pool bound to one
    address may be reached by another name or through NAT; CURVE checks the
    server's key on every connection, and the limits bound what a peer
    without it can send). A wildcard host becomes the router's (:func:`reachable`).
    Raises :class:`RegistrationError`.
    """
    theirs, ours = _transport(endpoint), _transport(router)
    if theirs != ours:
        raise RegistrationError(
            f"the pool at {router} named its {name} endpoint {endpoint!r}, over {theirs or '?'}: "
            f"a worker that reached the pool over {ours} connects to it over {ours} only"
        )
    return reachable(endpoint, router)


def _transport(endpoint: str) -> str:
    """``"tcp"`` of ``"tcp://host:port"``; ``""`` if the endpoint names none."""
    transport, sep, _ = endpoint.partition("://")
    return transport if sep else ""


def reachable(endpoint: str, router: str) -> str:
    """An endpoint the pool advertised, with a wildcard host replaced by the one we reached it at.

    Example:
        >>> reachable("tcp://0.0.0.0:5556", "tcp://10.0.0.1:5555")
        'tcp://10.0.0.1:5556'
    """
    if not endpoint.startswith("tcp://") or not router.startswith("tcp://"):
        return endpoint
    host, port = endpoint[6:].rsplit(":", 1)
    if host in ("0.0.0.0", "*", "::", "[::]"):
        host = router[6:].rsplit(":", 1)[0]
    return f"tcp://{host}:{port}"


@dataclasses.dataclass(frozen=True, slots=True)
class _Command:
    """One command as the worker runs it: its header and tensor frames, or its row decoded."""

    header: Header
    frames: list[Any] = dataclasses.field(default_factory=list)
    parts: list[DecodedPart] | None = None  # a COMMANDS row, decoded with the others
