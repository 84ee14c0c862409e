"""A worker's sockets: register with the pool, then answer commands until told to stop.

The worker's DEALER connects to the pool's ROUTER (registration, commands,
heartbeats); its PUSH connects to the pool's results PULL. One command in,
one reply out, in order, for each env. The loop only moves frames: what a
command does to an env is :mod:`workers.hosting`'s business.

A remote worker also listens to the pool's heartbeats (a SUB socket, in the
heartbeat thread). When they stop, or come from a new pool (another epoch: a
restarted trainer), it registers again, retrying with backoff: ZeroMQ
reconnects the TCP connections by itself, so a restarted trainer at the same
address picks its workers up again.

Threads and sockets: the main thread owns the DEALER, the heartbeat thread
its own DEALER (and SUB), and the PUSH is shared under the send lock. Closing
stops the threads first (each closes its own sockets), then closes the main
thread's, then ends the context: never ``Context.destroy()``, which closes
every socket from one thread while the others may still use theirs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from workers.hosting import EnvHost
from workers.reports import oversized_registration
from workers.threads import EnvRunners
from zmqpool.codec import Decoder, Encoder
from zmqpool.errors import (
    EnvMakerError,
    ProtocolError,
    RegistrationError,
    VersionMismatchError,
)
from zmqpool.launcher import ENV_THREAD_DIED
from zmqpool.limits import MAX_CONTROL_BYTES
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
from zmqpool.wire import Command, Header, encode_message

log = logging.getLogger("workers")

#: How long :meth:`Worker.close` waits for its threads to finish what they are
#: doing (an env step in flight) before it leaves them to the process's exit.
CLOSE_JOIN_S = 1.0

#: How long a worker waits for its pool's WELCOME (sending REGISTER again with
#: backoff) before it gives up: the default of :class:`Worker` and of ``python -m
#: workers``'s local workers, and as long as a pool waits for its envs by default
#: (``PoolConfig.register_timeout_s``). A remote worker started with ``--env``
#: waits forever unless given ``--register-timeout``. Every other timing the
#: worker shares with its pool comes in the WELCOME (:class:`~zmqpool.protocol.Welcome`).
REGISTER_TIMEOUT_S = 120.0


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
        self.dealer = self._socket(zmq.DEALER, identity)
        if remote_slots:
            self.dealer.setsockopt(zmq.IMMEDIATE, 1)  # no REGISTER queued for a pool not there
        self.dealer.connect(router)
        self.push: zmq.Socket | None = None
        self.token = b""
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.dropped = 0
        self.runners = EnvRunners(self._env_thread_died) if env_threads else None
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def _socket(self, kind: int, identity: bytes | None = None) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.linger = 0
        if identity is not None:
            sock.identity = identity
        if self.keys is not None:
            make_client(sock, self.keys)
        return sock

    # ------------------------------------------------------------ registration

    def register(self) -> None:
        """Send REGISTER until the pool answers (with backoff), then take its WELCOME."""
        reg = Register(
            pid=os.getpid(),
            host=socket.gethostname()[:MAX_HOST_CHARS],
            envs=tuple(sorted(self.host.envs)),
            remote=self.remote_slots,
            incarnation=self.incarnation,
            slots=None if self.slots is None else tuple(self.slots),
            specs=tuple(spec_to_data(self.host.envs[i].specs) for i in sorted(self.host.envs)),
        )
        message = Header(Command.REGISTER, body=reg.to_body()).encode()
        if len(message) > MAX_CONTROL_BYTES:
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

    def _refuse_oversized(self, size: int, reg: Register) -> None:
        """Raise, saying why, rather than send a REGISTER the pool's ROUTER would drop unseen.

        A local worker's pool is waiting for it: it hears why too (a FAILED
        message, small), so the trainer raises at construction, naming the env.
        """
        names = {i: type(env).__name__ for i, env in self.host.envs.items()}
        env, text = oversized_registration(size, list(reg.envs), list(reg.specs), names)
        if not self.remote_slots:
            self._send_failed(env, Failed.clipped(text, "", FailureKind.REGISTER))
        raise RegistrationError(f"cannot register with the pool at {self.router}: {text}")

    def _register_until_answered(self, message: bytes) -> Header:
        timeout = self.register_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        wait_s = 0.2
        while deadline is None or time.monotonic() < deadline:
            with contextlib.suppress(zmq.Again):  # not connected yet (IMMEDIATE): retry
                self.dealer.send(message, zmq.NOBLOCK)
            header = self._await_registration_reply(wait_s, deadline)
            if header is not None:
                return header
            wait_s = min(2 * wait_s, 5.0)
        raise RegistrationError(
            f"no answer from the pool at {self.router} within {timeout} s (is it up? "
            "for TCP with CURVE: is this worker's key in the pool's authorized/ folder?)"
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
        # The pool may place our envs at other indices (remote workers ask for slots).
        hosted = [self.host.envs[i] for i in sorted(self.host.envs)]
        self.host.envs = dict(zip(envs, hosted, strict=True))
        with self._send_lock:  # env threads may be replying to the old pool
            self.token = welcome.token
            if self.push is not None:
                self.push.close()
            self.push = self._socket(zmq.PUSH)
            self.push.connect(reachable(welcome.results, self.router))
        self.beats = None if welcome.beats is None else reachable(welcome.beats, self.router)
        self.epoch = welcome.epoch
        self.welcome = welcome
        self.pool_lost.clear()
        log.info("registered envs %s with the pool at %s", envs, self.router)

    def _rejoin(self) -> None:
        """The pool went away or was replaced: forget its layouts, register again."""
        log.warning("the pool at %s went away or restarted; registering again", self.router)
        with self._send_lock:
            self.encoder.forget()
        self.decoder = Decoder()
        self.register()

    # ------------------------------------------------------------ serving

    def serve(self) -> None:
        """Answer commands until CLOSE (or the process is killed)."""
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="heartbeat", daemon=True
        )
        self._heartbeat.start()
        try:
            while not self._stop.is_set():
                if self.pool_lost.is_set() and self.remote_slots:
                    self._rejoin()
                frames = self._next_command()
                if frames is not None and not self._handle(frames):
                    break
        finally:
            self._stop.set()

    def _next_command(self) -> list[bytes] | None:
        """The next command's frames, waiting up to a heartbeat interval (``None``: nothing).

        Reads first and polls only when nothing is queued: ``Socket.poll``
        builds a ``Poller`` per call, which costs more than the read when
        commands queue up (several envs per worker). ``frame.more`` is read off
        each frame instead of asking the socket for ``RCVMORE``.
        """
        try:
            frames = recv_frames(self.dealer)
        except zmq.Again:
            if not self.dealer.poll(int(self.heartbeat_interval_s * 1000)):
                return None
            frames = recv_frames(self.dealer)
        return [frame.bytes for frame in frames]

    def _handle(self, frames: list[bytes]) -> bool:
        """Handle one message; False when told to close."""
        try:
            header = Header.decode(frames[0])
        except ProtocolError as err:
            self.dropped += 1
            log.warning("dropped a malformed command: %s", err)
            return True
        if header.command == Command.CLOSE:
            return False
        if header.command not in (Command.PING, Command.WELCOME):  # WELCOME: a repeat
            self._execute(header, frames[1:])
        return True

    def _execute(self, header: Header, frames: list[bytes]) -> None:
        try:
            # Decoded here, in order: layouts are announced on this connection.
            # bytearray: env code may write into its input; zmq's buffers are read-only.
            parts = self.decoder.decode(header, [bytearray(f) for f in frames])
            td = parts[0].to_tensordict() if parts else None
        except Exception as err:
            self._send(self._error_reply(header, err))
            return
        env = self.host.envs.get(header.env)
        if self.runners is None or env is None or len(self.host.envs) < 2:
            self._run(header, td)
        else:
            self.runners.runner_for(env, header.env).submit(lambda: self._run(header, td))

    def _run(self, header: Header, td: Any) -> None:
        """Run one command on its env and send the reply (from an env thread, maybe)."""
        try:
            out = self.host.run(header.command, header.env, td, header.body)
            with self._send_lock:  # the encoder's layout ids and the socket are shared
                reply = encode_message(
                    Header(Command.RESULT, header.env, header.seq, self.token),
                    [self.encoder.encode(part) for part in out],
                )
                self._send_unlocked(reply)
            return
        except Exception as err:
            reply = self._error_reply(header, err)
        self._send(reply)

    def _send(self, reply: list[Any]) -> None:
        with self._send_lock:
            self._send_unlocked(reply)

    def _send_unlocked(self, reply: list[Any]) -> None:
        if self.push is None:  # closed (the worker is closing): nobody awaits the reply
            return
        send_frames(self.push, reply)

    def _error_reply(self, header: Header, err: Exception) -> list[Any]:
        malformed = isinstance(err, ProtocolError)
        what = "malformed command" if malformed else "env raised"
        text = _safe_repr(err)
        log.warning("env %d: %s: %s", header.env, what, text)
        kind = FailureKind.PROTOCOL if malformed else FailureKind.ENV  # ENV may restart the worker
        body = Failed.clipped(f"{what}: {text}", traceback.format_exc(), kind).to_body()
        return [Header(Command.ERROR, header.env, header.seq, self.token, body=body).encode()]

    def _heartbeat_loop(self) -> None:
        # Its own sockets: zmq sockets are not thread-safe, and a long env step
        # in the main thread must not silence the heartbeats.
        beat = self._socket(zmq.DEALER, self.identity + b"!hb")
        beat.connect(self.router)
        message = Header(Command.HEARTBEAT).encode()
        watch = _PoolWatch(self)
        try:
            while not self._stop.wait(self.heartbeat_interval_s):
                with contextlib.suppress(zmq.Again):  # a full queue: the pool is away
                    beat.send(message, zmq.NOBLOCK)
                watch.check()
        except zmq.ZMQError:
            pass  # a socket error ends the beats; the pool hears the silence
        finally:  # this thread's sockets, closed by it (close() joins it before term())
            beat.close()
            watch.close()

    def report_maker_failure(self, err: EnvMakerError) -> None:
        text = str(err).split("\n", 1)[0]
        failed = Failed.clipped(text, err.remote_traceback, FailureKind.MAKER)
        self._send_failed(err.env_index, failed)

    def _send_failed(self, env: int, failed: Failed) -> None:
        self.dealer.send(Header(Command.FAILED, env, body=failed.to_body()).encode())
        # Give the message a moment to leave before the process exits (linger is 0).
        time.sleep(0.2)

    def _env_thread_died(self, name: str, err: BaseException) -> None:
        """In an env thread that is ending: its env can answer nothing more, so the process ends.

        The pool sees the exit (its pidfd, or the missing heartbeats of a
        remote worker), restarts the worker and answers every request in
        flight with a restart truncation: the outcome of the same
        ``SystemExit`` in an env stepped inline. Exit code
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
        with self._send_lock:
            if self.push is not None:
                self.push.close()
                self.push = None
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
    """In the heartbeat thread: is our pool still beating, and is it still the same pool?"""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.sub: zmq.Socket | None = None
        self.endpoint: str | None = None
        self.last_beat = time.monotonic()

    def check(self) -> None:
        worker = self.worker
        if worker.beats != self.endpoint:
            self._subscribe(worker.beats)
        if self.sub is None or worker.pool_lost.is_set():
            return
        while self.sub.poll(0):
            try:
                header = Header.decode(self.sub.recv())
                epoch = Ping.from_body(header.body).epoch
            except ProtocolError as err:  # not a beat of any pool's: it proves nothing
                log.warning("dropped a malformed pool heartbeat: %s", err)
                continue
            if epoch != worker.epoch:
                worker.pool_lost.set()  # a new pool at the same address: a restarted trainer
                return
            self.last_beat = time.monotonic()
        welcome = worker.welcome
        # The pool's own timings (its WELCOME): lost after as many missed beats as it allows us.
        if welcome is not None and time.monotonic() - self.last_beat > welcome.pool_timeout_s:
            worker.pool_lost.set()

    def _subscribe(self, endpoint: str | None) -> None:
        self.close()
        self.endpoint, self.last_beat = endpoint, time.monotonic()
        if endpoint is not None:
            self.sub = self.worker._socket(zmq.SUB)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(endpoint)

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()
            self.sub = None


def _safe_repr(err: BaseException) -> str:
    """``repr(err)``, or a stand-in if the env's exception cannot even say what it is."""
    try:
        return repr(err)
    except Exception:
        return f"<{type(err).__name__}: its repr() raised>"


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
