"""The pool's machinery below torchrl's API: sockets, processes, registration, the event loop.

:class:`Runtime` owns, for one pool, the :class:`~zmqpool.broker.Broker` (its
sockets), the :class:`~zmqpool.state.Ledger` (what is in flight and what is
ready), the :class:`~zmqpool.launcher.Launcher` (local worker processes), the
:class:`~zmqpool.admission.Registrar` and, once every env registered, the
:class:`~zmqpool.supervisor.Supervisor` (deaths, timeouts, restarts). It
knows nothing of torchrl's tensordict conventions:
:class:`~zmqpool.pool.ZMQAsyncEnvPool` turns the caller's tensordicts into
payloads, asks the runtime to send them and to collect replies, and turns the
replies into torchrl's results.

:class:`Resources` is what must be released even if the pool is dropped
without ``close()`` (a ``weakref.finalize`` holds it, not the pool).

Control flows one way: the pool calls :meth:`Runtime.send` and
:meth:`Runtime.collect`; ``collect`` pumps the broker, hands its events to
the supervisor, and returns the ready replies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from zmqpool.admission import Registrar
from zmqpool.broker import Broker, Event, ProcessExited, WorkerFailed
from zmqpool.config import PoolConfig
from zmqpool.endpoints import (
    Endpoints,
    ipc_endpoints,
    make_private_dir,
    remove_private_dir,
    tcp_endpoints,
)
from zmqpool.errors import EnvMakerError, RegistrationError, VersionMismatchError
from zmqpool.launcher import Launcher, WorkerProcess, pickle_recipes, stop_all, worker_argv
from zmqpool.protocol import FailureKind
from zmqpool.remote import RemoteSlots
from zmqpool.security import ServerKeys
from zmqpool.state import Channel, Kind, Ledger, Reply
from zmqpool.supervisor import Supervisor
from zmqpool.wire import Command, Header


class Resources:
    """What must be released when the pool goes, even if it is dropped without ``close()``.

    Kept apart from the pool so a ``weakref.finalize`` can release it without
    holding the pool alive.
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.directory = make_private_dir()
        self.processes: dict[bytes, WorkerProcess] = {}
        self.broker: Broker | None = None
        self.launcher: Launcher | None = None
        self.closed = False

    def release(self, grace_s: float | None = None) -> None:
        """Close workers (waiting ``grace_s``, default the config's close timeout), then kill."""
        if self.closed:
            return
        self.closed = True
        if self.broker is not None:
            close = Header(Command.CLOSE).encode()
            for identity in list(self.broker.workers):
                self.broker.route(identity, [close])
        grace_s = self.config.close_timeout_s if grace_s is None else grace_s
        stop_all(list(self.processes.values()), grace_s)
        if self.launcher is not None:
            self.launcher.close()
        if self.broker is not None:
            self.broker.close()
        remove_private_dir(self.directory)


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

    @property
    def num_envs(self) -> int:
        return len(self.env_makers)

    def worker_envs(self) -> list[tuple[int, ...]]:
        """The env indices of each local worker, in order."""
        per, n = self.envs_per_worker, self.num_local_envs
        return [tuple(range(s, min(s + per, n))) for s in range(0, n, per)]


class Runtime:
    """Sockets, processes, registration and the event loop of one pool; see the module docstring."""

    def __init__(self, plan: PoolPlan, resources: Resources) -> None:
        self.plan = plan
        self.config = plan.config
        self.resources = resources
        self.ledger = Ledger(plan.num_envs)
        self.broker = self._make_broker()
        resources.broker = self.broker
        self.worker_envs = plan.worker_envs()
        self.remote: RemoteSlots | None = None
        if plan.num_envs > plan.num_local_envs:
            indices = list(range(plan.num_local_envs, plan.num_envs))
            self.remote = RemoteSlots(indices, self.config.rejoin_timeout_s)
        self.registrar = Registrar(
            self.ledger, self.worker_envs, self.remote, same_specs=plan.same_specs
        )
        self.broker.admit = self.registrar.admit
        self.launcher = Launcher(self.config.fork_server, self.config.register_timeout_s)
        resources.launcher = self.launcher
        self.supervisor: Supervisor | None = None

    # ------------------------------------------------------------ set-up

    def start(self) -> list[Any]:
        """Spawn the local workers, wait for every env to register; each env's spec data."""
        for worker_index in range(len(self.worker_envs)):
            self.spawn(worker_index)
        self._await_registration()
        self.supervisor = Supervisor(
            self.broker,
            self.ledger,
            self.config,
            self.worker_envs,
            self.registrar.local_identities,
            self.spawn,
            remote=self.remote,
            restart_on_env_error=self.plan.restart_on_env_error,
        )
        return [self.registrar.specs[i] for i in range(self.plan.num_envs)]

    def _make_broker(self) -> Broker:
        if self.plan.local_transport == "tcp":
            local = Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        else:
            local = ipc_endpoints(self.resources.directory)
        tcp = tcp_endpoints(self.plan.bind) if self.plan.bind else None
        keys = ServerKeys.from_dir(self.plan.curve_keys) if self.plan.curve_keys else None
        return Broker(self.ledger, self.config, local, tcp, keys)

    @property
    def remote_endpoint(self) -> str | None:
        """Where remote workers connect (``--connect``), once bound."""
        return self.broker.tcp.router if self.broker.tcp else None

    def spawn(self, worker_index: int) -> None:
        """Start (or restart) local worker ``worker_index``; the supervisor calls this too."""
        indices = self.worker_envs[worker_index]
        payload = pickle_recipes(
            indices,
            [self.plan.env_makers[i] for i in indices],
            [self.plan.create_env_kwargs[i] for i in indices],
        )
        identity = self.registrar.identity(worker_index)
        argv = worker_argv(
            self.broker.router_ep,
            identity.decode(),
            indices,
            self.config.heartbeat_interval_s,
            self.config.env_threads,
        )
        masks = self.plan.worker_affinity
        affinity = None if masks is None else masks[worker_index]
        process = self.launcher.start(argv, payload, affinity)
        self.resources.processes[identity] = process
        self.broker.watch(identity, process)

    def _await_registration(self) -> None:
        deadline = time.monotonic() + self.config.register_timeout_s
        while len(self.registrar.specs) < self.plan.num_envs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RegistrationError(self._missing_message())
            self.broker.poll(min(remaining, 0.1))
            for event in self.broker.take_events():
                self._on_setup_event(event)

    def _missing_message(self) -> str:
        missing = sorted(set(range(self.plan.num_envs)) - set(self.registrar.specs))
        text = f"envs {missing} did not register within {self.config.register_timeout_s} s"
        remote = [e for e in missing if e >= self.plan.num_local_envs]
        if remote:
            text += (
                f"; remote envs {remote} wait for workers to connect to {self.remote_endpoint} "
                "(python -m workers --connect ... --env package.module:callable)"
            )
        return text

    def _envs_of(self, identity: bytes) -> list[int]:
        """The env indices of one of our local workers."""
        return list(self.worker_envs[self.registrar.local_identities[identity]])

    def _on_setup_event(self, event: Event) -> None:
        if isinstance(event, WorkerFailed):
            self._raise_setup_failure(event)
        if isinstance(event, ProcessExited):
            # A FAILED message may still be in flight: give it a moment to arrive.
            self.broker.poll(0.5)
            for other in self.broker.take_events():
                if isinstance(other, WorkerFailed):
                    self._raise_setup_failure(other)
            envs = self._envs_of(event.identity)
            raise RegistrationError(
                f"the worker of envs {envs} exited with status {event.status} "
                "before registering (see its stderr above)"
            )

    def _raise_setup_failure(self, event: WorkerFailed) -> NoReturn:
        if event.kind == FailureKind.REGISTER:  # built, but its REGISTER could not go
            raise RegistrationError(f"env {event.env}: {event.err}")
        if event.kind == FailureKind.VERSION:
            envs = self._envs_of(event.identity)
            raise VersionMismatchError(
                f"the worker of envs {envs} runs another zmqpool than this trainer "
                f"({event.err}); it imports zmqpool from its working directory or "
                "sys.path: check both load the same install"
            )
        raise EnvMakerError(event.env, event.err, event.tb)

    # ------------------------------------------------------------ requests

    def send(self, env: int, command: Command, payload: Any, per_env: bool, body=None) -> None:
        """Record one request and route it; its payload is kept as the request's input too."""
        self.broker.send(env, command, payload, per_env, inputs=payload, body=body)

    def refuse_lost(self, envs: Sequence[int]) -> None:
        """Raise the error of the first env in ``envs`` that is lost (a crash loop, a silence)."""
        for env in envs:
            lost = self.ledger.slots[env].lost
            if lost is not None:
                raise lost

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
        A ready error is handed to ``raise_error``, which raises it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = self.pump(0)
        while self.ledger.count_ready(channel) < min_get:
            self._raise_ready_error(channel, raise_error)
            remaining = self._remaining(deadline)
            if remaining <= 0:
                raise TimeoutError(
                    f"async recv timed out: {self.ledger.count_ready(channel)}/{min_get} results "
                    f"after {timeout}s; they remain available to the next call."
                )
            drained = self.pump(remaining)
        if deadline is not None:
            awaiting = self.ledger.awaiting(channel)
            wanted = awaiting if max_get is None else min(awaiting, max_get)
            drained = self._batch_until(channel, wanted, deadline, drained)
        if not drained:  # a pump that read everything just now left nothing to take
            self.pump(0)
        self._raise_ready_error(channel, raise_error)
        return sorted(self.ledger.take(channel, max_get), key=lambda r: r.env)

    def _batch_until(self, channel: Channel, wanted: int, deadline: float, drained: bool) -> bool:
        """Deadline batching: pump until ``deadline`` or until there is nothing more to wait for."""
        while self.ledger.count_ready(channel) < wanted:
            if self.ledger.first_error(channel) is not None:
                break
            remaining = self._remaining(deadline)
            if remaining <= 0:
                break
            drained = self.pump(remaining)
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
        assert self.supervisor is not None, "the runtime is not started"
        wake = self.supervisor.next_wakeup() - time.monotonic()
        drained = self.broker.poll(max(0.0, min(timeout_s, wake)))
        for event in self.broker.take_events():
            self.supervisor.on_event(event)
        self.supervisor.tick(time.monotonic(), judge=drained)
        return drained

    def set_seed(self, seed: int | None, raise_error: Callable[[Reply], NoReturn]) -> None:
        """Seed env ``i`` with ``seed + i``, each on its own channel, and wait for every one."""
        for env in range(self.plan.num_envs):
            body = {"seed": None if seed is None else int(seed) + env}
            self.send(env, Command.SEED, None, True, body=body)
        for env in range(self.plan.num_envs):
            channel = (Kind.RESET, env)
            self.collect(channel, 1, 1, self.config.register_timeout_s, raise_error)

    # ------------------------------------------------------------ processes

    def worker_processes(self) -> dict[int, WorkerProcess]:
        """Each local worker's process, by worker index (one being restarted is absent)."""
        assert self.supervisor is not None, "the runtime is not started"
        return self.supervisor.worker_processes()
