"""The pool's machinery below torchrl's API: sockets, processes, registration, the event loop.

:class:`Runtime` owns, for one pool:

- the :class:`~zmqpool.roster.Roster` (who hosts which env, and every
  worker's and env's phase);
- the :class:`~zmqpool.state.Ledger` (what is in flight and what is ready);
- the :class:`~zmqpool.broker.Broker` (the sockets; the runtime is its sink);
- the :class:`~zmqpool.intake.Intake` (results) and the
  :class:`~zmqpool.admission.Registrar` (control messages);
- the :class:`~zmqpool.supervisor.Supervisor` (deaths, timeouts, silences,
  restarts) and the :class:`~zmqpool.launcher.Launcher` (local processes).

It knows nothing of torchrl's tensordict conventions:
:class:`~zmqpool.pool.ZMQAsyncEnvPool` turns the caller's tensordicts into
payloads, asks the runtime to send them and to collect replies, and turns the
replies into torchrl's results.

:class:`Resources` is what must be released even if the pool is dropped
without ``close()`` (a ``weakref.finalize`` holds it, not the pool).

Control flows one way: the pool calls :meth:`Runtime.send` and
:meth:`Runtime.collect`; ``collect`` pumps the broker, which hands results to
the intake, control messages to the registrar and pidfds back to the
runtime; their events go to the supervisor; the ready replies are returned.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import zmq
from tensordict import NonTensorData

from zmqpool import forkservers, interrupts
from zmqpool.admission import Registrar
from zmqpool.broker import Broker
from zmqpool.codec import DecodedPart, EncodedPart, layout_of
from zmqpool.config import PoolConfig
from zmqpool.conformity import mark_misfits
from zmqpool.endpoints import (
    Endpoints,
    ipc_endpoints,
    make_private_dir,
    remove_private_dir,
    tcp_endpoints,
)
from zmqpool.errors import (
    EnvError,
    PoolClosedError,
    ProtocolError,
    RecvTimeoutError,
    RegistrationError,
    TooFewInFlightError,
    VersionMismatchError,
    env_maker_error,
)
from zmqpool.events import Event, ProcessExited, WorkerFailed
from zmqpool.gate import SHARED_SLICE_S, Gate
from zmqpool.intake import Intake
from zmqpool.launcher import (
    ForkServerStarting,
    Launcher,
    WorkerProcess,
    pickle_recipes,
    stop_all,
    worker_argv,
)
from zmqpool.layout import max_message_bytes
from zmqpool.outbox import Outbox
from zmqpool.policy import Liveness
from zmqpool.protocol import FailureKind
from zmqpool.ray_workers import LaunchContext, RemoteLauncher
from zmqpool.remote_failures import RemoteFailures
from zmqpool.roster import EnvPhase, Link, Roster, WorkerPhase, WorkerRecord
from zmqpool.security import ServerKeys
from zmqpool.state import STEPS, Channel, Kind, Ledger, Pending, Reply
from zmqpool.supervisor import Supervisor
from zmqpool.wire import (
    NEXT_SEED,
    RESEED,
    Command,
    Header,
    Row,
    batch_messages,
    check_header_room,
    message_frames,
)

log = logging.getLogger("zmqpool")

#: How often construction asks launched workers whether one has given up (each
#: check is a non-blocking look at answers already in; see ``RayWorkers.poll_failures``).
LAUNCHER_CHECK_S = 0.5


class Resources:
    """What must be released when the pool goes, even if it is dropped without ``close()``.

    Kept apart from the pool so a ``weakref.finalize`` can release it without
    holding the pool alive.
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.directory = make_private_dir()
        self.roster: Roster | None = None
        self.broker: Broker | None = None
        self.launcher: Launcher | None = None
        self.launchers: list[RemoteLauncher] = []  # remote launchers started (RayWorkers)
        self.closed = False
        #: Set in a child forked from the pool's process: the workers, sockets and
        #: directory are the parent's, and the child neither uses nor releases them.
        self.inherited = False
        _OPEN.add(self)
        _MADE.add(self)
        interrupts.attach()  # a Ctrl-C in a pool call waits for a safe point

    def release(self, grace_s: float | None = None) -> None:
        """Close workers (waiting ``grace_s``, default the config's close timeout), then kill.

        Local workers still there after ``grace_s`` are killed; remote ones
        are waited for :data:`REMOTE_CLOSE_WAIT_S` more at most, to read
        their CLOSE and leave.

        In a forked child it does nothing: a child that exits (running its
        inherited finalizers) or calls ``close()`` must not stop the parent's
        workers nor remove its sockets.
        """
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        try:
            processes = self.roster.processes() if self.roster is not None else []
            told_remote: list[bytes] = []
            if self.broker is not None and self.roster is not None:
                close = Header(Command.CLOSE).encode()
                for link in self.roster.linked():
                    if self.broker.route(link.identity, [close], link.remote) and link.remote:
                        told_remote.append(link.identity)
                for record in self.roster.local:  # a restart not registered yet: it never
                    if record.process is not None and record.link is None:  # hears CLOSE
                        record.process.kill()
            grace_s = self.config.close_timeout_s if grace_s is None else grace_s
            stop_all(processes, grace_s)
            for launcher in self.launchers:
                try:
                    launcher.stop()
                except Exception as err:  # the sockets and the directory must still go
                    log.warning("could not stop %r: %s", launcher, err)
            if self.launcher is not None:
                self.launcher.close()
            if self.broker is not None:
                # Remote workers get REMOTE_CLOSE_WAIT_S to read their CLOSE and leave (see
                # Broker.close), whatever the grace: a failed start's (0) too, as waiting
                # costs only while a worker is still connected.
                self.broker.close(leaving=told_remote, wait_s=REMOTE_CLOSE_WAIT_S)
            remove_private_dir(self.directory)
        finally:
            interrupts.detach()


#: The longest a pool's close waits for its remote workers to read its CLOSE and
#: leave, after its local workers have stopped (a few ms for idle workers): a host
#: that is unreachable costs no more.
REMOTE_CLOSE_WAIT_S = 0.5

#: Every pool's resources not yet released.
_OPEN: weakref.WeakSet[Resources] = weakref.WeakSet()
#: Every pool's resources, released or not, for the fork hook below.
_MADE: weakref.WeakSet[Resources] = weakref.WeakSet()


def _inherited_by_a_child() -> None:
    """In a child just forked: every pool of the parent is closed here, and not released.

    The child's copy of a ZeroMQ context is not usable, and the workers answer
    the parent; calls in the child raise :class:`PoolClosedError` saying so.
    Closed ones too: one another thread was closing (its gate held) is inherited
    all the same, and a call there must not wait for that gate.
    """
    for resources in list(_MADE):
        resources.inherited = resources.closed = True
    _OPEN.clear()


os.register_at_fork(after_in_child=_inherited_by_a_child)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """What the runtime is asked to run: the envs, where they live, how they are reached."""

    config: PoolConfig
    env_makers: Sequence[Any]  # one per env; remote slots have a placeholder
    create_env_kwargs: Sequence[dict]
    num_local_envs: int
    envs_per_worker: int
    worker_affinity: Sequence[Any] | None  # one CPU mask per local worker, or None
    same_specs: bool  # every env must register the same specs (stack="dense")
    restart_on_env_error: bool
    bind: str | None = None
    curve_keys: Any = None
    local_transport: str = "ipc"
    remote_spec: Any = None  # the specs remote workers must bring (None: the local envs')
    launchers: Sequence[RemoteLauncher] = ()  # remote workers the pool starts, first slots
    default_dtype: str = "float32"  # torch's in local workers: the trainer's at construction
    #: CURVE keys (z85) the pool revoked (``revoke_worker_key``): refused in a start again too.
    revoked_keys: frozenset[str] = frozenset()

    @property
    def num_envs(self) -> int:
        return len(self.env_makers)

    def worker_envs(self) -> list[tuple[int, ...]]:
        """The env indices of each local worker, in order."""
        per, n = self.envs_per_worker, self.num_local_envs
        return [tuple(range(s, min(s + per, n))) for s in range(0, n, per)]


class Runtime:
    """Sockets, processes, registration and the event loop of one pool; see the module docstring."""

    def __init__(self, plan: PoolPlan, resources: Resources, gate: Gate | None = None) -> None:
        self.plan = plan
        self.config = config = plan.config
        self.resources = resources
        remote = range(plan.num_local_envs, plan.num_envs)
        self.roster = Roster(plan.num_envs, plan.worker_envs(), remote)
        resources.roster = self.roster
        self.ledger = Ledger(plan.num_envs)
        self.broker = self._make_broker()
        resources.broker = self.broker
        # A pause longer than two heartbeats means the trainer was away, not the workers.
        self.liveness = Liveness(config.heartbeat_timeout_s, 2 * config.heartbeat_interval_s)
        self.events: list[Event] = []
        # Commands awaiting the end of send_all(), per worker (None: send each at once).
        self._outbox: Outbox | None = None
        #: Whether the last recv waited for several results: a call's commands joined to a
        #: worker then ask it to keep their replies together (wire: rows joined, "h").
        self.hold_replies = False
        #: Since when pumps have not read the sockets to the end (None: the last one did).
        self._unread_since: float | None = None
        #: One thread at a time (the pool's public calls hold it): see :mod:`zmqpool.gate`.
        #: The pool's own, kept when it starts again, so a thread waiting meanwhile waits on.
        self.gate = Gate() if gate is None else gate
        self.intake = Intake(self.roster, self.ledger, self.liveness)
        #: Why remote workers could not start, for the errors of envs waiting for one.
        self.remote_failures = RemoteFailures()
        self.registrar = Registrar(
            self.roster,
            self.ledger,
            self.broker,
            config,
            self.liveness,
            self.events,
            same_specs=plan.same_specs,
            remote_spec=plan.remote_spec,
            remote_failures=self.remote_failures,
        )
        self.registrar.revoked.update(plan.revoked_keys)
        servers = forkservers.SHARED if config.share_fork_server else None
        self.launcher = Launcher(config.fork_server, config.register_timeout_s, servers)
        resources.launcher = self.launcher
        self.supervisor = Supervisor(
            self.roster,
            self.ledger,
            config,
            self.liveness,
            self.spawn,
            self.dispatch,
            self._ask_rejoin,
            self.remote_failures,
            plan.launchers,
        )
        if plan.restart_on_env_error:
            self.intake.on_env_error = self.supervisor.on_env_error
        #: Over loopback TCP, the CURVE public key each local worker was last started with.
        self._local_worker_keys: dict[bytes, bytes] = {}
        self._started = False

    # ------------------------------------------------------------ set-up

    def start(self) -> list[Any]:
        """Spawn the local workers, wait for every env to register; each env's decoded specs.

        The remote side binds only once the local envs are in: their specs are
        the remote slots' reference (unless ``remote_spec`` was given), so no
        remote worker's REGISTER can be read first and set it, and the results
        port's frame limit is sized from them before anyone can connect.
        """
        deadline = time.monotonic() + self.config.register_timeout_s
        for record in self.roster.local:
            self._spawn_by(record, deadline)
        self._await_registration(self.plan.num_local_envs, deadline)
        if self.plan.bind:
            self._bind_remote()
        self._await_registration(self.plan.num_envs, deadline)
        self._started = True
        return [env.spec for env in self.roster.envs]

    def _spawn_by(self, record: WorkerRecord, deadline: float) -> None:
        """:meth:`spawn`, waiting out a replacement fork server's start until ``deadline``.

        A fork server that dies (or is given up on) while the pool starts is
        replaced, and no worker can be forked while the new one imports torch
        (:class:`~zmqpool.launcher.ForkServerStarting`, internal): construction
        waits for it, and fails with a :class:`RegistrationError` saying so if
        ``register_timeout_s`` runs out first.
        """
        while True:
            try:
                self.spawn(record)
                return
            except ForkServerStarting as starting:
                if time.monotonic() + starting.retry_after_s >= deadline:
                    raise RegistrationError(
                        f"the worker of envs {record.envs} could not be started within "
                        f"register_timeout_s ({self.config.register_timeout_s} s): {starting}"
                    ) from None
                time.sleep(starting.retry_after_s)

    def _make_broker(self) -> Broker:
        if self.plan.local_transport == "tcp":
            local = Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        else:
            local = ipc_endpoints(self.resources.directory)
        return Broker(self.config, local)

    def _server_keys(self) -> ServerKeys | None:
        if self.plan.curve_keys:
            return ServerKeys.from_dir(self.plan.curve_keys)
        if self.plan.launchers:  # they get keys made here: the pool's pair can be made here too
            return ServerKeys.ephemeral()
        return None

    def _bind_remote(self) -> None:
        assert self.plan.bind is not None
        keys = self._server_keys()
        reference = self.registrar.remote_reference()
        if reference is None:
            cap = self.config.max_remote_frame_bytes
        else:  # a header, or the reference's leaves with headroom
            cap = max_message_bytes([layout_of(reference.zero())])
        self.broker.bind_remote(tcp_endpoints(self.plan.bind), keys, cap)
        for key in self.registrar.revoked:  # authorized/ may still list it
            self.broker.revoke(key)
        self._start_launchers(keys)

    def _start_launchers(self, keys: ServerKeys | None) -> None:
        """Start the remote workers the pool launches, each key authorized for its slots."""
        if not self.plan.launchers:
            return
        assert keys is not None and self.broker.tcp is not None
        first = self.plan.num_local_envs
        for launcher in self.plan.launchers:
            slots = list(range(first, first + launcher.num_envs))
            first += launcher.num_envs
            self.resources.launchers.append(launcher)
            launcher.start(
                LaunchContext(
                    self.broker.tcp.router,
                    keys.public,
                    slots,
                    self._authorize,
                    self.plan.default_dtype,
                )
            )

    def _authorize(self, key: bytes, slots: list[int]) -> None:
        self.broker.authorize(key)
        self.roster.reserve(key.decode("ascii"), slots)

    @property
    def remote_endpoint(self) -> str | None:
        """Where remote workers connect (``--connect``), once bound."""
        return self.broker.tcp.router if self.broker.tcp else None

    def spawn(self, record: WorkerRecord) -> None:
        """Start (or restart) a local worker; the supervisor calls this too."""
        assert record.local_index is not None
        indices = record.envs
        payload = pickle_recipes(
            indices,
            [self.plan.env_makers[i] for i in indices],
            [self.plan.create_env_kwargs[i] for i in indices],
            record.identity.decode(),  # on its stdin: a command line is every user's to read
            self._local_curve(record.identity),
        )
        argv = worker_argv(
            self.broker.local.router_ep,
            indices,
            self.config.heartbeat_interval_s,
            self.config.env_threads,
            self.config.worker_torch_threads,
            self.config.inline_cheap_envs,
            self.plan.default_dtype,
        )
        masks = self.plan.worker_affinity
        affinity = None if masks is None else masks[record.local_index]
        process = self.launcher.start(argv, payload, affinity)
        self.roster.spawned(record, process, time.monotonic())
        self.broker.watch_fd(process.pidfd)

    def _local_curve(self, identity: bytes) -> tuple[bytes, bytes, bytes] | None:
        """Over loopback TCP: the pool's public key and a new pair for the worker ``identity``
        is about to start as, authorized on the local side (its predecessor's key revoked)."""
        server = self.broker.local_keys
        if server is None:
            return None
        public, secret = zmq.curve_keypair()
        previous = self._local_worker_keys.get(identity)
        if previous is not None:
            self.broker.revoke(previous.decode("ascii"))
        self._local_worker_keys[identity] = public
        self.broker.authorize_local(public)
        return server.public, public, secret

    def _await_registration(self, count: int, deadline: float) -> None:
        """Until the first ``count`` envs have registered (local envs come first).

        Launched workers that report they gave up end the wait at once (see
        :meth:`_check_launchers`): their slots would stay empty until the deadline.
        """
        next_launcher_check = time.monotonic()
        while self.roster.registered() < count:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise RegistrationError(self._missing_message())
            if self.resources.launchers and now >= next_launcher_check:
                next_launcher_check = now + LAUNCHER_CHECK_S
                self._check_launchers()
            self.broker.poll(min(remaining, 0.1), self)
            for event in self._take_events():
                self._on_setup_event(event)

    def _check_launchers(self) -> None:
        """Raise ``RegistrationError`` if a launched worker says it could not join."""
        for launcher in self.resources.launchers:
            failures = launcher.poll_failures()
            if failures:
                missing = [env.index for env in self.roster.envs if env.spec_data is None]
                raise RegistrationError(
                    f"envs {missing} will not register: {launcher!r}: " + "; ".join(failures)
                )

    def _missing_message(self) -> str:
        missing = [env.index for env in self.roster.envs if env.spec_data is None]
        text = f"envs {missing} did not register within {self.config.register_timeout_s} s"
        for launcher in self.resources.launchers:
            for failure in launcher.failures(wait_s=1.0):
                text += f"; {launcher!r}: {failure}"
        remote = [e for e in missing if e >= self.plan.num_local_envs]
        if remote:
            text += (
                f"; remote envs {remote} wait for workers to connect to {self.remote_endpoint} "
                "(python -m workers --connect ... --env package.module:callable)"
            )
            failures = self.remote_failures.summary()
            text += f"; {failures}" if failures else ""
        return text

    def _envs_of(self, identity: bytes) -> list[int]:
        record = self.roster.worker(identity)
        return [] if record is None else list(record.envs)

    def _on_setup_event(self, event: Event) -> None:
        if isinstance(event, WorkerFailed):
            self._raise_setup_failure(event)
        if isinstance(event, ProcessExited):
            # A FAILED message may still be in flight: give it a moment to arrive.
            self.broker.poll(0.5, self)
            for other in self._take_events():
                if isinstance(other, WorkerFailed):
                    self._raise_setup_failure(other)
            raise RegistrationError(
                f"the worker of envs {self._envs_of(event.identity)} exited with status "
                f"{event.status} before registering (see its stderr above)"
            )

    def _raise_setup_failure(self, event: WorkerFailed) -> NoReturn:
        if event.kind == FailureKind.REGISTER:  # built, but its REGISTER could not go
            raise RegistrationError(f"env {event.env}: {event.err}")
        if event.kind == FailureKind.REFUSED:
            envs = self._envs_of(event.identity)
            raise RegistrationError(f"the worker of envs {envs} was refused: {event.err}")
        if event.kind == FailureKind.VERSION:
            raise VersionMismatchError(
                f"the worker of envs {self._envs_of(event.identity)} runs another zmqpool than "
                f"this trainer ({event.err}); it imports zmqpool from its working directory or "
                "sys.path: check both load the same install"
            )
        raise env_maker_error(event.env, event.err, event.tb, event.base)

    def _take_events(self) -> list[Event]:
        events = list(self.events)
        self.events.clear()  # the registrar holds this list: emptied, never replaced
        return events

    # ------------------------------------------------------------ the broker's sink

    def on_result(self, frames: list[zmq.Frame], remote: bool) -> None:
        self.intake.on_result(frames, remote)

    def on_control(self, identity: bytes, frames: list[zmq.Frame], remote: bool) -> None:
        self.registrar.on_control(identity, frames, remote)

    def on_fd(self, fd: int) -> None:
        """A local worker's pidfd is readable: it died."""
        record = self.roster.by_pidfd(fd)
        if record is None or record.process is None:
            return
        process = record.process
        self.broker.unwatch_fd(fd)
        status = process.exit_status()
        cause = process.exit_cause()  # e.g. killed with its fork server: no status to say so
        process.release()
        self.events.append(ProcessExited(record.identity, process.pid, status, cause))

    # ------------------------------------------------------------ requests

    def send(self, env: int, command: Command, payload: Any, per_env: bool, body=None) -> None:
        """Record one request and route it; its payload is kept as the request's input too."""
        now = time.monotonic()
        pending = self.ledger.open_request(env, command, per_env, payload, payload, body, now)
        self.dispatch(env, pending)
        self.supervisor.note_sent(now)

    def dispatch(self, env: int, pending: Pending) -> None:
        """Send a recorded request; while its env has no worker, it waits in the ledger.

        A restarted env was rebuilt but not reset; stepping it would step an env
        that never began an episode, so its first step becomes a reset, answered
        to the caller as a truncation (``pending.synth``). So does every step that
        was in flight when its worker died or hung (see ``Supervisor._resend``).
        """
        record = self.roster.envs[env]
        link = record.link
        if link is None:
            return  # sent again when a worker registers for it
        command, payload = pending.command, pending.payload
        resets = command not in STEPS
        # A seed begins nothing; anything else to a fresh env begins its life (roster.begin).
        fresh = command is not Command.SEED and record.phase is EnvPhase.FRESH
        if (fresh or pending.synth) and not resets:  # what begin() will say, or a step cut short
            command, payload, pending.synth = Command.RESET, None, True
        if fresh and record.reseed is not None:  # rebuilt: seeded before its first reset
            pending.body = {**(pending.body or {}), RESEED: record.reseed}
        outbox = self._outbox if link.batches else None  # within send_all(): with its others
        if outbox is not None and type(payload) is DecodedPart and pending.body is None:
            self._keep_row(env, pending, link, outbox, fresh)  # sent as it came: no synth
            return
        # Encoded only if sent: encoding announces its layout on this connection.
        parts: list[EncodedPart]
        if payload is None:
            parts, largest = [], 0
            if pending.body is not None and not self._header_fits(env, pending, link, parts):
                return
        else:
            part = link.encoder.encode(payload)
            parts, largest = [part], part.layout.largest_frame  # its frames are laid out so
            if (
                part.nontensor or part.new_layout is not None or pending.body is not None
            ) and not self._header_fits(env, pending, link, parts):
                return
        if largest > link.decoder.max_frame_bytes:
            # Its worker's socket takes frames as large as its specs imply (with headroom),
            # and would drop the connection for this one: answer with an error instead.
            # Before roster.begin: nothing is sent, so a fresh env stays fresh.
            self._refuse_oversized(env, pending, largest, link.decoder.max_frame_bytes)
            return
        if fresh:
            self.roster.begin(env, resets)
        pending.sent_at = time.monotonic()
        if outbox is not None:
            # Kept as a row: rows of one command and layout go as one COMMANDS.
            entry: Row | list[Any] = (
                Row(command, env, pending.seq, parts)
                if pending.body is None
                else message_frames(command, env, pending.seq, b"", pending.body, parts)
            )
            outbox.add(link, entry)
            return
        frames = message_frames(command, env, pending.seq, b"", pending.body, parts)
        self.broker.route(link.identity, frames, link.remote)

    def _keep_row(
        self, env: int, pending: Pending, link: Link, outbox: Outbox, fresh: bool
    ) -> None:
        """:meth:`dispatch` of a packed row (its payload) into ``outbox``, encoded there
        with its worker's others. ``fresh``: the env is fresh, and this is its reset."""
        part = pending.payload
        assert type(part) is DecodedPart
        largest = part.layout.largest_frame  # an encoded part's is its layout's too
        if largest > link.decoder.max_frame_bytes:  # as dispatch() refuses it
            self._refuse_oversized(env, pending, largest, link.decoder.max_frame_bytes)
            return
        if fresh:
            self.roster.begin(env, True)
        pending.sent_at = time.monotonic()
        outbox.add(link, (pending.command, env, pending.seq, part))

    def send_all(
        self,
        envs: Sequence[int],
        command: Command,
        payloads: Sequence[Any],
        per_env: bool,
        bodies: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """:meth:`send` for each env, in one message per worker where several go to one.

        ``bodies``: each env's header body (a reset's keywords), if any.

        Rows of one command and layout join into one COMMANDS (wire: rows joined);
        the rest of a worker's messages go as a BATCH.

        Whatever fails midway, what was recorded is sent: each request is in the
        ledger already and awaits its reply.
        """
        if len(envs) == 1 or not self.roster.batching:
            # Nothing to batch. Held back to the end, commands would also reach
            # their workers later (measured: ~4% of a cheap env's steps/s).
            self._send_each(envs, command, payloads, per_env, bodies)
            return
        outbox = self._outbox = Outbox()
        try:
            self._send_each(envs, command, payloads, per_env, bodies)
        finally:
            self._outbox = None
            for link, messages in outbox.messages(self.hold_replies):
                batches = messages if len(messages) == 1 else batch_messages(messages, -1)
                for frames in batches:
                    self.broker.route(link.identity, frames, link.remote)

    def _send_each(
        self,
        envs: Sequence[int],
        command: Command,
        payloads: Sequence[Any],
        per_env: bool,
        bodies: Sequence[dict[str, Any]] | None,
    ) -> None:
        """:meth:`send` for each env in turn (each recorded, then sent, before the next)."""
        now = time.monotonic()  # one call's requests are opened at one time
        open_request, dispatch = self.ledger.open_request, self.dispatch
        if bodies is None:  # every step's
            for env, payload in zip(envs, payloads, strict=True):
                dispatch(env, open_request(env, command, per_env, payload, payload, None, now))
        else:
            for env, payload, body in zip(envs, payloads, bodies, strict=True):
                dispatch(env, open_request(env, command, per_env, payload, payload, body, now))
        self.supervisor.note_sent(now)

    def revoke(self, key: str) -> list[int]:
        """Refuse CURVE key ``key`` from now on, and vacate the slots its workers hold.

        Their requests wait ``rejoin_timeout_s`` for another worker; whatever the
        revoked workers still send is dropped. Returns the vacated env slots.
        """
        self.registrar.revoked.add(key)
        self.broker.revoke(key)
        envs: list[int] = []
        for record in self.roster.keyed(key):
            if record.phase is WorkerPhase.LIVE:  # a vacant one is set aside already
                self.supervisor.vacate(record, time.monotonic(), "its key was revoked")
            envs += record.envs
        return envs

    def _ask_rejoin(self, record: WorkerRecord) -> None:
        """Tell a remote worker the pool set aside to register again (its slots wait for it)."""
        if record.remote:
            self.broker.route(record.identity, [Header(Command.REJOIN).encode()], True)

    def _header_fits(self, env: int, pending: Pending, link: Link, parts: list[Any]) -> bool:
        """Whether the header of ``parts`` is one the worker takes; if not, answer with an error.

        The send refused most such inputs already (``check_crossable``); this is
        the exact check, for what the layouts add. A worker would drop the
        message as malformed, leaving the request unanswered.
        """
        try:
            check_header_room(parts, pending.body)
        except ProtocolError as err:
            link.encoder.retract(parts)  # not sent: announced again with the next use
            self.ledger.answer_now(env, pending, EnvError(env, f"the input cannot be sent: {err}"))
            return False
        return True

    def _refuse_oversized(self, env: int, pending: Pending, size: int, limit: int) -> None:
        error = EnvError(
            env,
            f"the {pending.command.name} input for env {env} has a {size}-byte frame; its "
            f"worker takes frames of at most {limit} bytes (twice what its specs declare)",
        )
        self.ledger.answer_now(env, pending, error)

    def refuse_lost(self, envs: Sequence[int]) -> None:
        """Raise the error of the first env in ``envs`` that is lost (a crash loop, a silence)."""
        if not self.roster.lost:  # the usual case, told without a look at every env
            return
        for env in envs:
            lost = self.roster.envs[env].lost
            if lost is not None:
                raise lost

    def give_back(self, channel: Channel, replies: list[Reply]) -> None:
        """Replies that :meth:`collect` returned and the recv could not: for the next recv."""
        self.ledger.give_back(channel, replies)

    def drop_replies(self, replies: list[Reply]) -> None:
        """Replies a failed sync call took and never returned (its ``_settle``, ``_sync_call``).

        A restart's truncation among them is owed still: its env's next step is
        sent as a reset again and answered as a truncation, so the caller learns
        that the episode it was stepping ended (:meth:`Roster.owe_truncation`).
        """
        for reply in replies:
            if reply.synthesized:
                self.roster.owe_truncation(reply.env)

    def awaiting(self, channel: Channel) -> int:
        """Requests on ``channel`` that no recv has taken yet (in flight or ready)."""
        return self.ledger.awaiting(channel)

    def collect(
        self,
        channel: Channel,
        min_get: int,
        max_get: int | None,
        timeout: float | None,
        raise_error: Callable[[Reply], NoReturn],
    ) -> list[Reply]:
        """Wait (up to ``timeout``) for ``min_get`` replies, then batch until the deadline.

        Without a ``timeout``, what else is ready now is taken and nothing is
        waited for; with one, the call keeps collecting until the deadline or
        until ``max_get`` replies (or every request awaited on the channel) are in.
        A ready error is handed to ``raise_error``, which raises it. Whether it
        waits for several notes :attr:`hold_replies` for the sends after it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self.hold_replies = min_get > 1
        # With too few ready, the first wait takes what is queued at once: a look
        # without waiting before it would be one more poll (~9 us) for every recv.
        looked = self.ledger.count_ready(channel) >= min_get
        drained = self.pump(0) if looked else True
        while True:
            while self.ledger.count_ready(channel) < min_get:
                self._raise_ready_error(channel, raise_error)
                remaining = self._remaining(deadline)
                if remaining <= 0 and looked:  # an expired deadline still takes what is queued
                    raise RecvTimeoutError(
                        f"async recv timed out: {self.ledger.count_ready(channel)}/{min_get} "
                        f"results after {timeout}s; they remain available to the next call."
                    )
                drained, looked = self._wait(channel, min_get, max(0.0, remaining)), True
            if deadline is None:
                break
            awaiting = self.ledger.awaiting(channel)
            wanted = awaiting if max_get is None else min(awaiting, max_get)
            drained = self._batch_until(channel, wanted, deadline, drained)
            if self.ledger.count_ready(channel) >= min_get:
                break
            # Another thread sharing the pool took results while this one made way for
            # it (a batching wait makes way too): below min_get again, it waits until
            # its deadline (which batching reached) and times out: no empty result.
        if not drained:  # a pump that read everything just now left nothing to take
            self.pump(0)
        if self.plan.same_specs and channel[1] is None:  # a dense stack takes one structure
            # Of the replies this recv takes (oldest first, up to max_get): those left for
            # a later recv are judged with the replies stacked with them then.
            ready = self.ledger.ready.get(channel, [])
            mark_misfits(ready if max_get is None else ready[:max_get])
        self._raise_ready_error(channel, raise_error)
        return sorted(self.ledger.take(channel, max_get), key=_BY_ENV)

    def _batch_until(self, channel: Channel, wanted: int, deadline: float, drained: bool) -> bool:
        """Deadline batching: pump until ``deadline`` or until there is nothing more to wait for."""
        while self.ledger.count_ready(channel) < wanted:
            if self.ledger.first_error(channel) is not None:
                break
            remaining = self._remaining(deadline)
            if remaining <= 0:
                break
            drained = self._wait(channel, 0, remaining)
        return drained

    def _wait(self, channel: Channel, min_get: int, timeout_s: float) -> bool:
        """Pump for up to ``timeout_s``; if threads share the pool, a slice, then make way.

        Another thread may take what this recv awaits meanwhile (both waiting on
        the batch channel): with fewer than ``min_get`` left, it raises rather
        than wait for replies that will not come.
        """
        gate = self.gate
        if not gate.shared:
            return self.pump(timeout_s)
        drained = self.pump(min(timeout_s, SHARED_SLICE_S))
        gate.make_way()
        if self.resources.closed:  # by another thread, while this one made way
            raise PoolClosedError("the pool was closed while this call waited")
        if self.ledger.awaiting(channel) < min_get:
            raise TooFewInFlightError(
                f"another thread took the {channel[0].value} results this recv awaited: "
                f"{self.ledger.awaiting(channel)} left in flight, {min_get} wanted"
            )
        return drained

    def _raise_ready_error(
        self, channel: Channel, raise_error: Callable[[Reply], NoReturn]
    ) -> None:
        reply = self.ledger.first_error(channel)
        if reply is not None:
            self.ledger.remove(channel, reply)
            raise_error(reply)

    def _remaining(self, deadline: float | None) -> float:
        if deadline is None:
            return self.config.heartbeat_interval_s
        return min(deadline - time.monotonic(), self.config.heartbeat_interval_s)

    def pump(self, timeout_s: float) -> bool:
        """Move frames in, then let the supervisor act on deaths, timers and silences.

        Returns whether every socket was read to the end.
        """
        assert self._started, "the runtime is not started"
        self.liveness.listening(time.monotonic())
        wake = self.supervisor.next_wakeup() - time.monotonic()
        drained = self.broker.poll(max(0.0, min(timeout_s, wake)), self)
        for event in self._take_events():
            self.supervisor.on_event(event)
        now = time.monotonic()
        self.liveness.listening(now)  # the poll's end: a pause is counted from here
        # Silences are judged every time, drained or not: the ROUTER queues fairly per
        # peer, so a flood from one connection never keeps another's heartbeat unread for
        # long. Lateness waits until the sockets were read to the end: after a trainer
        # away longer than step_timeout_s, replies it has not read yet are not late.
        # Not for longer than a heartbeat interval, so a flood cannot switch it off.
        if drained:
            self._unread_since = None
        elif self._unread_since is None:
            self._unread_since = now
        unread_for = 0.0 if self._unread_since is None else now - self._unread_since
        judge = drained or unread_for > self.config.heartbeat_interval_s
        self.supervisor.tick(now, judge_lateness=judge)
        return drained

    def set_seed(
        self, seed: int | None, static_seed: bool, raise_error: Callable[[Reply], NoReturn]
    ) -> int | None:
        """``SerialEnv.set_seed``: env 0 gets ``seed``, env ``i + 1`` what env ``i``'s returned.

        One env after the other, each on its own channel (a round trip each);
        returns what the last one returned. A lost env is refused first, with its
        error, before any env is seeded (it would never answer: the wait ran to
        its end). An env that does not answer within ``register_timeout_s``
        raises :class:`~zmqpool.errors.RecvTimeoutError` naming it, and its
        late reply is dropped when it comes, not taken for a reset of that env.
        """
        envs = range(self.plan.num_envs)
        self.refuse_lost(envs)
        for env in envs:
            self.refuse_lost([env])  # lost while an env before it was seeded
            body = {"seed": seed, "static": static_seed}
            self.send(env, Command.SEED, None, True, body=body)
            channel: Channel = (Kind.RESET, env)
            try:
                [reply] = self.collect(channel, 1, 1, self.config.register_timeout_s, raise_error)
            except RecvTimeoutError:
                self.ledger.abandon(channel, env)
                raise RecvTimeoutError(
                    f"env {env} did not answer its set_seed within register_timeout_s "
                    f"({self.config.register_timeout_s} s); envs {list(envs)[env + 1 :]} were "
                    "not seeded (its reply, if it comes, is dropped)"
                ) from None
            self.roster.seeded(env, seed)
            seed = _next_seed(reply)
        return seed

    # ------------------------------------------------------------ processes

    def worker_processes(self) -> dict[int, WorkerProcess]:
        """Each local worker's process, by worker index (one being restarted is absent)."""
        return {
            record.local_index: record.process
            for record in self.roster.local
            if record.process is not None and record.local_index is not None
        }


#: Sorts replies by env index (in C: a lambda would be a Python call per reply).
_BY_ENV = operator.attrgetter("env")


def _next_seed(reply: Reply) -> int | None:
    """The seed a SEED reply carries (checked: a peer's value)."""
    value = reply.parts[0].to_tensordict().get(NEXT_SEED) if reply.parts else None
    if isinstance(value, NonTensorData):
        value = value.data
    if value is not None and type(value) is not int:
        raise ProtocolError(f"env {reply.env}: set_seed replied with a {type(value).__name__}")
    return value
