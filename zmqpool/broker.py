"""The pool's sockets: a ROUTER that routes commands to workers by env index, a PULL for results.

::

    pool ──send()──▶ ROUTER (bind) ── [identity, header, frames…] ──▶ worker DEALER
    pool ◀─poll()─── PULL (bind)   ◀── [header, frames…] ─────────── worker PUSH
                     ROUTER        ◀── REGISTER / FAILED / HEARTBEAT ─ worker DEALER

``ROUTER_MANDATORY`` is on, so a command to a worker that is not connected
raises instead of vanishing. ``ROUTER_HANDOVER`` is off: with it, any peer
presenting a live worker's identity would take over its route; a restarted
worker registers only after its predecessor's connection is gone. Local
worker processes are watched through pidfds polled beside the sockets: a
death is seen at once, not after a timeout. ``MAXMSGSIZE`` is set per
socket (and, for local workers, per results endpoint) from the layouts the
worker's specs imply, so an oversized frame is refused by libzmq before it
is allocated.

The broker only moves frames and keeps the :class:`~zmqpool.state.Ledger`
true; what to do about a dead worker is the pool's decision, so the broker
reports it as a typed event (:data:`Event`: :class:`ProcessExited`,
:class:`WorkerFailed`, :class:`WorkerRegistered`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from zmqpool.codec import Decoder, Encoder, layout_of
from zmqpool.config import PoolConfig
from zmqpool.endpoints import Endpoints
from zmqpool.errors import EnvError, ProtocolError, RegistrationError, VersionMismatchError
from zmqpool.launcher import WorkerProcess
from zmqpool.layout import max_message_bytes
from zmqpool.policy import Liveness
from zmqpool.protocol import (
    Failed,
    FailureKind,
    Ping,
    Refuse,
    Register,
    Welcome,
    recv_frames,
    send_frames,
)
from zmqpool.security import ServerKeys, make_server, start_authenticator
from zmqpool.specs import spec_from_data
from zmqpool.state import Ledger, Pending, Reply, WorkerRecord
from zmqpool.wire import Command, Header, encode_message

log = logging.getLogger("zmqpool")

#: How many messages one poll drains from a socket before looking at the others.
_DRAIN_BATCH = 256


@dataclasses.dataclass(frozen=True)
class ProcessExited:
    """A watched local worker process died (its pidfd said so)."""

    identity: bytes
    pid: int
    status: int | None  # None: unknown (it died with its fork server)
    cause: str | None  # what the launcher knows of why, if anything


@dataclasses.dataclass(frozen=True)
class WorkerFailed:
    """A worker could not come up: its env maker raised, its REGISTER would not fit,
    or it speaks another protocol version."""

    identity: bytes
    kind: FailureKind
    err: str
    tb: str = ""
    env: int = -1  # the env it names, if one


@dataclasses.dataclass(frozen=True)
class WorkerRegistered:
    """A worker was admitted for ``envs``; ``rejoin``: it replaces one that went away."""

    identity: bytes
    envs: list[int]
    reg: Register
    rejoin: bool


#: What the broker reports for the pool to decide about.
Event = ProcessExited | WorkerFailed | WorkerRegistered


@dataclasses.dataclass(frozen=True)
class Admission:
    """The pool's answer to a REGISTER: which envs, and whether they were rebuilt."""

    envs: list[int]
    rejoin: bool = False  # the envs are fresh: requests in flight get truncations
    duplicate: bool = False  # the same process registering again: answer, change nothing


Admit = Callable[[bytes, Register], Admission]
EnvErrorHook = Callable[[int, Pending, EnvError], bool]


class Broker:
    """Sockets, registration and result intake; see the module docstring."""

    def __init__(
        self,
        ledger: Ledger,
        config: PoolConfig,
        local: Endpoints,
        tcp: Endpoints | None = None,
        keys: ServerKeys | None = None,
    ) -> None:
        self.ledger = ledger
        self.config = config
        self.context = zmq.Context()
        self.epoch = os.urandom(8)  # tells workers that this is a new pool (a restarted trainer)
        self.router = self._socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # MAXMSGSIZE is per frame and read when an endpoint is bound. Workers send the
        # ROUTER one-frame control messages only: nothing longer than a header. A worker
        # whose REGISTER would not fit fails on its side (limits.MAX_CONTROL_BYTES), saying why.
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes([]))
        self.pull = self._socket(zmq.PULL)
        self.pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes([]))
        self.router_ep = self._bind(self.router, local.router)
        self.results_ep = self._bind(self.pull, local.results)
        # One local results endpoint per frame limit, bound when a worker first needs it.
        self.results_eps: dict[int, str] = {max_message_bytes([]): self.results_ep}
        self.auth: Any = None  # the ZAP thread, with CURVE
        self.beacon: Beacon | None = None
        self.tcp: Endpoints | None = None
        if tcp is not None:
            self._bind_tcp(tcp, keys)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.pull, zmq.POLLIN)
        self.workers: dict[bytes, WorkerRecord] = {}
        self.processes: dict[int, tuple[bytes, WorkerProcess]] = {}
        self.events: list[Event] = []
        self.admit: Admit | None = None
        self.on_env_error: EnvErrorHook | None = None
        # A pause longer than two heartbeats means the trainer was away, not the workers.
        self.liveness = Liveness(config.heartbeat_timeout_s, 2 * config.heartbeat_interval_s)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.linger = 0
        return sock

    def _bind(self, sock: zmq.Socket, endpoint: str) -> str:
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def results_endpoint(self, limit: int) -> str:
        """A local results endpoint taking frames of ``limit`` bytes (bound on first need)."""
        for bound in sorted(self.results_eps):
            if bound >= limit:
                return self.results_eps[bound]
        self.pull.setsockopt(zmq.MAXMSGSIZE, limit)
        endpoint = self._bind(self.pull, f"{self.results_ep}{len(self.results_eps)}")
        self.results_eps[limit] = endpoint
        return endpoint

    def _bind_tcp(self, tcp: Endpoints, keys: ServerKeys | None) -> None:
        """Bind the TCP side; with keys, under CURVE (ipc binds above stay without it)."""
        if keys is not None:
            self.auth = start_authenticator(self.context, keys)
            make_server(self.router, keys)
            make_server(self.pull, keys)
        # The TCP results port is fixed before any layout is known: no limit (or a configured one).
        self.pull.setsockopt(zmq.MAXMSGSIZE, -1)
        router = self._bind(self.router, tcp.router)
        results = self._bind(self.pull, tcp.results)
        self.beacon = Beacon(self.context, tcp.beats, keys, self.epoch, self.config)
        self.tcp = Endpoints(router, results, self.beacon.endpoint)
        log.info("pool listening for remote workers on %s (results %s)", router, results)

    # ------------------------------------------------------------ processes

    def watch(self, identity: bytes, process: WorkerProcess) -> None:
        self.processes[process.pidfd] = (identity, process)
        self.poller.register(process.pidfd, zmq.POLLIN)

    def kill(self, identity: bytes) -> None:
        """SIGKILL a local worker; its pidfd then reports the death as usual."""
        for watched, process in self.processes.values():
            if watched == identity:
                process.kill()

    def forget_worker(self, identity: bytes) -> None:
        self.workers.pop(identity, None)
        self.liveness.forget(identity)

    def unwatch(self, process: WorkerProcess) -> None:
        if process.pidfd in self.processes:
            del self.processes[process.pidfd]
            self.poller.unregister(process.pidfd)

    def _on_process_exit(self, pidfd: int) -> None:
        identity, process = self.processes[pidfd]
        self.unwatch(process)
        status = process.exit_status()
        cause = process.exit_cause()  # e.g. killed with its fork server: no status to say so
        process.release()
        self.events.append(ProcessExited(identity, process.pid, status, cause))

    # ------------------------------------------------------------ sending

    def send(
        self,
        env: int,
        command: Command,
        payload: Any,
        per_env: bool,
        inputs: Any,
        body: dict[str, Any] | None = None,
    ) -> Pending:
        """Record one request and route it to the worker hosting ``env``."""
        now = time.monotonic()
        pending = self.ledger.open_request(env, command, per_env, inputs, payload, body, now)
        self.dispatch(env, pending)
        return pending

    def dispatch(self, env: int, pending: Pending) -> None:
        """Send a recorded request; while its worker restarts, it waits in the ledger."""
        slot = self.ledger.slots[env]
        worker = slot.worker
        if worker is None:
            return  # re-dispatched when the worker registers again
        command, payload = self.ledger.command_to_send(env, pending)
        parts = [] if payload is None else [worker.encoder.encode(payload)]
        pending.sent_at = time.monotonic()
        frames = encode_message(Header(command, env, pending.seq, body=pending.body), parts)
        self.route(worker.identity, frames)

    def route(self, identity: bytes, frames: list[Any]) -> bool:
        try:
            send_frames(self.router, [identity, *frames])
        except zmq.ZMQError as err:  # EHOSTUNREACH: the worker is gone; liveness handles it
            log.debug("could not route to %r: %s", identity, err)
            return False
        return True

    # ------------------------------------------------------------ receiving

    def poll(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for traffic, then take in what is ready.

        Returns whether both sockets were drained (nothing left unread), the
        condition for judging anyone's silence or lateness fairly.
        """
        self.liveness.listening(time.monotonic())
        events = dict(self.poller.poll(max(0, int(timeout_s * 1000))))
        drained = True
        if self.pull in events:
            drained &= self._drain(self.pull, self._on_result)
        if self.router in events:
            drained &= self._drain(self.router, self._on_control)
        for fd in list(events):
            if isinstance(fd, int) and fd in self.processes:
                self._on_process_exit(fd)
        return drained

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None]) -> bool:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return True
            handle(frames)
        return False

    def _on_result(self, frames: list[zmq.Frame]) -> None:
        try:
            header = Header.decode(frames[0].buffer)
        except ProtocolError as err:
            self.ledger.drop(f"malformed result header: {type(err).__name__}")
            return
        if header.command not in (Command.RESULT, Command.ERROR):
            self.ledger.drop("not a result on the results socket")
            return
        pending = self.ledger.match(header.env, header.seq, header.token, time.monotonic())
        if pending is None:
            return
        worker = self.ledger.slots[header.env].worker
        assert worker is not None  # match() checked the token against it
        self.liveness.heard(worker.identity, time.monotonic())
        if header.command == Command.ERROR:
            error, kind = _env_error(header)
            reply = Reply(header.env, pending, error=error)
            if kind is FailureKind.ENV and self._handled_as_crash(header.env, reply):
                return
        else:
            reply = self._reply(header, pending, frames[1:])
        self.ledger.deliver(reply)

    def _handled_as_crash(self, env: int, reply: Reply) -> bool:
        if self.on_env_error is None or not isinstance(reply.error, EnvError):
            return False
        return self.on_env_error(env, reply.pending, reply.error)

    def _reply(self, header: Header, pending: Pending, frames: list[zmq.Frame]) -> Reply:
        worker = self.ledger.slots[header.env].worker
        assert worker is not None  # match() checked the token against it
        try:
            parts = worker.decoder.decode(header, frames)
        except ProtocolError as err:
            # The request was real; its reply is broken: answer it with the error.
            return Reply(header.env, pending, error=EnvError(header.env, f"malformed reply: {err}"))
        return Reply(header.env, pending, parts=parts, synthesized=pending.synth)

    def _on_control(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self.ledger.drop("control message without a header")
            return
        identity = frames[0].bytes
        try:
            header = Header.decode(frames[1].buffer)
        except ProtocolError as err:
            self.ledger.drop(f"malformed control header: {type(err).__name__}")
            self._refuse_if_version(identity, err)
            return
        handler = self._CONTROL.get(header.command)
        if handler is None:
            self.ledger.drop("unexpected command on the control socket")
            return
        handler(self, identity, header)

    def _refuse_if_version(self, identity: bytes, err: ProtocolError) -> None:
        if not isinstance(err, VersionMismatchError):
            return
        log.warning("refused worker %r: %s", identity, err)
        # A worker of another version cannot read our REFUSE (it reads the
        # version first and stops); our own process cannot tell us either, so
        # the pool hears of it here.
        self._refuse(identity, str(err))
        if self._spawned(identity):
            self.events.append(WorkerFailed(identity, FailureKind.VERSION, str(err)))

    def _refuse(self, identity: bytes, reason: str) -> None:
        refusal = Header(Command.REFUSE, body=Refuse.because(reason).to_body())
        self.route(identity, [refusal.encode()])

    def _on_heartbeat(self, identity: bytes, header: Header) -> None:
        worker = self.workers.get(identity.removesuffix(b"!hb"))
        if worker is None:
            self.ledger.drop("heartbeat from an identity that is not a registered worker")
            return
        self.liveness.heard(worker.identity, time.monotonic())

    def _spawned(self, identity: bytes) -> bool:
        return any(watched == identity for watched, _ in self.processes.values())

    def _on_failed(self, identity: bytes, header: Header) -> None:
        if identity not in self.workers and not self._spawned(identity):
            self.ledger.drop("FAILED from an identity that is not a worker")
            return
        try:
            failed = Failed.from_body(header.body)
        except ProtocolError as err:
            self.ledger.drop(f"malformed FAILED: {type(err).__name__}")
            log.warning("worker %r sent a malformed FAILED: %s", identity, err)
            return
        # kind MAKER: the env maker raised; REGISTER: its REGISTER would not fit.
        event = WorkerFailed(identity, failed.kind, failed.err, failed.tb, header.env)
        self.events.append(event)

    def _on_register(self, identity: bytes, header: Header) -> None:
        try:
            reg = Register.from_body(header.body)
            if self.admit is None:
                raise RegistrationError("this pool takes no registrations yet")
            admission = self.admit(identity, reg)
        except (RegistrationError, ProtocolError) as err:
            log.warning("refused worker %r: %s", identity, err)
            self._refuse(identity, str(err))
            return
        self._welcome(identity, admission, reg)

    def _welcome(self, identity: bytes, admission: Admission, reg: Register) -> None:
        known = self.workers.get(identity)
        if admission.duplicate and known is not None:
            self._send_welcome(identity, known, reg)  # our WELCOME was lost: say it again
            return
        envs = admission.envs
        token = os.urandom(16)
        # admit() validated the specs; what they hold bounds the frames this worker sends.
        limit = max_message_bytes(layout_of(spec_from_data(s).zero()) for s in reg.specs)
        record = WorkerRecord(
            identity,
            token,
            tuple(envs),
            reg.pid,
            Decoder(max_frame_bytes=limit),
            Encoder(self.config.zero_copy_threshold_bytes),
        )
        self.workers[identity] = record
        self.liveness.heard(identity, time.monotonic())
        self.ledger.attach(envs, record)
        self._send_welcome(identity, record, reg)
        self.events.append(WorkerRegistered(identity, list(envs), reg, admission.rejoin))

    def _send_welcome(self, identity: bytes, record: WorkerRecord, reg: Register) -> None:
        tcp = self.tcp if reg.remote else None
        welcome = Welcome(
            token=record.token,
            envs=record.envs,
            results=tcp.results if tcp else self.results_endpoint(record.decoder.max_frame_bytes),
            beats=tcp.beats if tcp else None,
            epoch=self.epoch,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            heartbeat_liveness=self.config.heartbeat_liveness,
        )
        self.route(identity, [Header(Command.WELCOME, body=welcome.to_body()).encode()])

    _CONTROL = {
        Command.REGISTER: _on_register,
        Command.FAILED: _on_failed,
        Command.HEARTBEAT: _on_heartbeat,
    }

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        if self.beacon is not None:
            self.beacon.stop()
        if self.auth is not None:
            self.auth.stop()
        for pidfd in list(self.processes):
            self.poller.unregister(pidfd)
        self.processes.clear()
        self.context.destroy(linger=0)


class Beacon:
    """The pool's heartbeat to remote workers, from its own thread and its own PUB socket.

    A thread, so that a trainer busy for minutes between calls still looks
    alive; each beat carries the pool's epoch, so workers of a restarted
    trainer notice the new pool and register again.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        keys: ServerKeys | None,
        epoch: bytes,
        config: PoolConfig,
    ) -> None:
        self.sock = context.socket(zmq.PUB)
        self.sock.linger = 0
        if keys is not None:
            make_server(self.sock, keys)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.beat = Header(Command.PING, body=Ping(epoch).to_body()).encode()
        self.interval_s = config.heartbeat_interval_s
        self._stop = threading.Event()
        # The socket moves to the thread now and is used by nobody else.
        self.thread = threading.Thread(target=self._run, name="zmqpool-beacon", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self.sock.send(self.beat, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the context is being destroyed: the pool is closing
        finally:
            self.sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2 * self.interval_s + 1)


def _env_error(header: Header) -> tuple[EnvError, FailureKind | None]:
    """An ERROR reply as the caller's error, and what kind of failure it reports."""
    try:
        failed = Failed.from_body(header.body)
    except ProtocolError as err:  # the request was real; answer it with what is wrong
        return EnvError(header.env, f"malformed error reply: {err}"), None
    return EnvError(header.env, failed.err, failed.tb), failed.kind
