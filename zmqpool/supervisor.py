"""Hot restart: notice a dead or hung worker, bring it back, and answer what it left unanswered.

Deaths are seen three ways, under one :class:`~zmqpool.policy.RestartPolicy`:

- the worker process exits (its pidfd, polled by the broker): at once, also
  when the fork server that forked it died first and took it along;
- a request runs past ``step_timeout_s``: the worker is killed;
- the worker goes silent past the heartbeat timeout while the pool listens:
  it is killed (a hung interpreter that no longer runs its heartbeat thread).

With ``on_env_error="restart"`` an env that raises is handled like a crash.

A remote worker cannot be restarted from here: when it goes silent its slots
are vacated and wait ``rejoin_timeout_s`` for it (or a replacement) to
register again; past that, their requests fail with
:class:`~zmqpool.errors.EnvLostError`.

Requests in flight on a dead worker stay in the :class:`~zmqpool.state.Ledger`.
When the new process registers, each is sent again with a new sequence number
(the old worker's token is void, so its late replies are dropped); the first
step-type request of a restarted env is sent as a reset instead, and its reply
is marked ``synthesized``: the pool answers it as a truncation caused by the
restart (:mod:`zmqpool.synthesis`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from zmqpool.broker import Broker, Event, ProcessExited, WorkerFailed, WorkerRegistered
from zmqpool.config import PoolConfig
from zmqpool.errors import CrashLoopError, EnvError, EnvLostError
from zmqpool.launcher import ForkServerStarting, WorkerProcess, describe_status
from zmqpool.policy import RestartPolicy
from zmqpool.remote import RemoteSlots
from zmqpool.state import Ledger, Pending

log = logging.getLogger("zmqpool")


class Supervisor:
    """Keeps every local worker alive; see the module docstring.

    Args:
        broker, ledger, config: the pool's.
        worker_envs: env indices of each local worker, by worker index.
        local_identities: routing identity -> local worker index.
        spawn: starts (again) the process of a worker index.
        remote: the remote slots, if the pool has any.
        restart_on_env_error: treat an env exception as a crash.
    """

    def __init__(
        self,
        broker: Broker,
        ledger: Ledger,
        config: PoolConfig,
        worker_envs: list[tuple[int, ...]],
        local_identities: dict[bytes, int],
        spawn: Callable[[int], None],
        remote: RemoteSlots | None = None,
        restart_on_env_error: bool = False,
    ) -> None:
        self.broker = broker
        self.ledger = ledger
        self.config = config
        self.worker_envs = worker_envs
        self.local_identities = local_identities
        self.identities = {index: identity for identity, index in local_identities.items()}
        self.spawn = spawn
        self.remote = remote
        self.policy = RestartPolicy(
            config.max_restarts,
            config.restart_window_s,
            config.restart_backoff_s,
            config.restart_backoff_max_s,
        )
        self._scheduled: dict[int, float] = {}  # worker index -> when to respawn
        self._kill_cause: dict[int, tuple[str, str]] = {}  # why we killed it, its traceback
        self._maker_traceback: dict[int, str] = {}
        if restart_on_env_error:
            broker.on_env_error = self._on_env_error

    # ------------------------------------------------------------ events

    def on_event(self, event: Event) -> None:
        if isinstance(event, WorkerRegistered):
            if event.rejoin:
                self._on_rejoin(event.envs)
            return
        worker = self.local_identities.get(event.identity)
        if worker is None:
            return
        if isinstance(event, ProcessExited):
            self._on_exit(worker, event.status, event.cause)
        elif isinstance(event, WorkerFailed):
            self._maker_traceback[worker] = event.tb
            log.warning("worker %d failed to come back in a restart: %s", worker, event.err)

    def _on_exit(self, worker: int, status: int | None, why: str | None = None) -> None:
        cause, traceback = self._kill_cause.pop(worker, (why or describe_status(status), ""))
        traceback = traceback or self._maker_traceback.pop(worker, "")
        envs = self.worker_envs[worker]
        self.broker.forget_worker(self.identities[worker])
        self.ledger.detach(envs, cause)
        decision = self.policy.on_death(worker, time.monotonic())
        if decision.crash_loop:
            self._give_up(envs, cause, traceback, decision.deaths_in_window)
            return
        log.warning("restarting the worker of envs %s: %s", list(envs), cause)
        self._scheduled[worker] = decision.restart_at

    def _give_up(self, envs: tuple[int, ...], cause: str, traceback: str, deaths: int) -> None:
        message = (
            f"crash loop: {deaths} deaths within {self.config.restart_window_s} s "
            f"(max_restarts={self.config.max_restarts}); last: {cause}"
        )
        if traceback:
            message += f"\n--- last traceback ---\n{traceback.rstrip()}"
        log.error("envs %s: %s", list(envs), message)
        self._fail(envs, CrashLoopError(list(envs), message))

    def _fail(self, envs: tuple[int, ...] | list[int], error: EnvLostError) -> None:
        """Answer every request in flight on ``envs`` with ``error``, and refuse new ones."""
        self.ledger.fail(envs, error)

    def _on_rejoin(self, envs: list[int]) -> None:
        """A restarted or rejoining worker is in: its envs are fresh; resend what is in flight."""
        self.ledger.mark_fresh(envs)
        for env in envs:
            slot = self.ledger.slots[env]
            for pending in list(slot.in_flight):
                self.ledger.restamp(env, pending)
                self.broker.dispatch(env, pending)

    def _on_env_error(self, env: int, pending: Pending, error: EnvError) -> bool:
        """``on_env_error="restart"``: requeue the request and kill the worker."""
        worker = self._worker_of(env)
        if worker is None:
            return False  # a remote env: its own host restarts it; the caller gets the error
        self.ledger.requeue(env, pending)
        log.warning("env %d raised; restarting its worker:\n%s", env, error.remote_traceback)
        cause = f"env {env} raised: {str(error).splitlines()[0]}"
        self._kill(worker, cause, error.remote_traceback)
        return True

    def _worker_of(self, env: int) -> int | None:
        return next((w for w, envs in enumerate(self.worker_envs) if env in envs), None)

    # ------------------------------------------------------------ timers

    def next_wakeup(self) -> float:
        return min(self._scheduled.values(), default=float("inf"))

    def tick(self, now: float, judge: bool = True) -> None:
        """Respawn what is due; with ``judge`` (all input read), act on lateness and silence."""
        for worker, when in list(self._scheduled.items()):
            if when <= now:
                del self._scheduled[worker]
                try:
                    self.spawn(worker)
                except ForkServerStarting as wait:  # a new zygote imports torch: not us
                    self._scheduled[worker] = now + wait.retry_after_s
        if not judge:
            return
        self._check_deadlines(now)
        silence = f"silent for more than {self.config.heartbeat_timeout_s} s (no heartbeat)"
        for identity in self.broker.liveness.silent(now):
            assert isinstance(identity, bytes)
            index = self.local_identities.get(identity)
            if index is None:
                self._vacate(identity, now, silence)
            elif index not in self._kill_cause:
                self._kill(index, silence, "")
        self._expire_vacancies(now)

    def _vacate(self, identity: bytes, now: float, cause: str) -> None:
        """A remote worker went silent: keep its requests, wait for it to rejoin."""
        self.broker.forget_worker(identity)
        envs = self.remote.vacate(identity, now) if self.remote else []
        self.ledger.detach(envs, cause)
        wait = self.config.rejoin_timeout_s
        log.warning(
            "remote worker %r of envs %s: %s; waiting %s s for a rejoin",
            identity,
            envs,
            cause,
            wait,
        )

    def _expire_vacancies(self, now: float) -> None:
        if self.remote is None:
            return
        late = self.remote.expired(now)
        if late:
            why = "their remote worker went silent and none rejoined within "
            why += f"{self.config.rejoin_timeout_s} s"
            log.error("envs %s are lost: %s", late, why)
            self._fail(late, EnvLostError(late, why))

    def _check_deadlines(self, now: float) -> None:
        timeout = self.config.step_timeout_s
        if timeout is None:
            return
        for slot in self.ledger.slots:
            if slot.worker is None or not slot.in_flight:
                continue
            pending = slot.in_flight[0]
            if now - pending.sent_at > timeout:
                worker = self._worker_of(slot.index)
                if worker is not None and worker not in self._kill_cause:
                    cause = f"hung: no reply to {pending.command.name} within {timeout} s"
                    self._kill(worker, cause, "")

    def worker_processes(self) -> dict[int, WorkerProcess]:
        """The process of each local worker, by worker index (one being restarted is absent)."""
        return {
            self.local_identities[identity]: process
            for identity, process in self.broker.processes.values()
            if identity in self.local_identities
        }

    def _kill(self, worker: int, cause: str, traceback: str) -> None:
        self._kill_cause[worker] = (cause, traceback)
        self.broker.kill(self.identities[worker])
