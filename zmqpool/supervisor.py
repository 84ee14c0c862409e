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
:class:`~zmqpool.errors.EnvLostError`. A launcher that knows its worker is
dead for good (a Ray actor Ray will not restart: ``RemoteLauncher.poll_lost``)
has its envs failed at once instead, with
:class:`~zmqpool.errors.RemoteWorkerDeadError` and its reason.

Requests in flight on a dead worker stay in the :class:`~zmqpool.state.Ledger`.
When the new process registers, each is sent again with a new sequence number
(the old worker's token is void, so its late replies are dropped); a step-type
request is sent as a reset instead, and its reply is marked ``synthesized``:
the pool answers it as a truncation caused by the restart
(:mod:`zmqpool.synthesis`). No step is run twice, and a step that kills its
worker is not sent to the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from zmqpool.config import PoolConfig
from zmqpool.errors import CrashLoopError, EnvError, EnvLostError, RemoteWorkerDeadError
from zmqpool.events import Event, ProcessExited, WorkerFailed, WorkerRegistered
from zmqpool.launcher import ForkServerStarting, describe_status
from zmqpool.policy import Liveness, RestartPolicy
from zmqpool.remote_failures import RemoteFailures
from zmqpool.roster import Roster, WorkerPhase, WorkerRecord
from zmqpool.state import STEPS, Ledger, Pending

if TYPE_CHECKING:
    from zmqpool.ray_workers import RemoteLauncher

log = logging.getLogger("zmqpool")

#: How often, at most, remote launchers are asked which of their workers are dead
#: for good (``RemoteLauncher.poll_lost``: a look at answers already in, no wait).
LAUNCHER_CHECK_S = 0.5

#: How often, at most, the envs' requests in flight are checked against
#: ``PoolConfig.step_timeout_s`` (or a tenth of it, if shorter): the check
#: looks at every env, and pumps come far oftener than that with many envs.
DEADLINE_CHECK_S = 0.01

#: Sends a recorded request (again) to the worker that hosts its env now.
Dispatch = Callable[[int, Pending], None]


class Supervisor:
    """Keeps every local worker alive; see the module docstring.

    Args:
        roster, ledger, config, liveness: the pool's.
        spawn: starts (again) the process of a local worker.
        dispatch: sends a recorded request to its env's worker.
        ask_rejoin: asks a remote worker that was set aside to register again.
        remote_failures: why remote workers could not start, named when envs
            waiting for one are lost.
        launchers: the pool's remote launchers; those with ``poll_lost`` are
            asked, every :data:`LAUNCHER_CHECK_S` at most, which workers are dead
            for good.
    """

    def __init__(
        self,
        roster: Roster,
        ledger: Ledger,
        config: PoolConfig,
        liveness: Liveness,
        spawn: Callable[[WorkerRecord], None],
        dispatch: Dispatch,
        ask_rejoin: Callable[[WorkerRecord], None] = lambda record: None,
        remote_failures: RemoteFailures | None = None,
        launchers: Sequence[RemoteLauncher] = (),
    ) -> None:
        self.roster = roster
        self.ledger = ledger
        self.config = config
        self.liveness = liveness
        self.spawn = spawn
        self.dispatch = dispatch
        self.ask_rejoin = ask_rejoin
        self.remote_failures = RemoteFailures() if remote_failures is None else remote_failures
        #: The launchers that can say a worker is dead for good (poll_lost is optional).
        self._watched = [la for la in launchers if callable(getattr(la, "poll_lost", None))]
        self._next_launcher_check = float("-inf") if self._watched else float("inf")
        self.policy = RestartPolicy(
            config.max_restarts,
            config.restart_window_s,
            config.restart_backoff_s,
            config.restart_backoff_max_s,
        )
        self._next_deadline_check = float("-inf")
        #: When the oldest request in flight turns late (as of the last deadline check, or
        #: a send since): a pump waiting for replies wakes then, not a heartbeat later.
        self._next_late_at = float("inf")
        self._local_timeout, self._remote_timeout = self._timeouts()
        #: The shortest of the two (None: no request is ever late).
        self._shortest_timeout = min(
            (t for t in (self._local_timeout, self._remote_timeout) if t is not None),
            default=None,
        )

    # ------------------------------------------------------------ events

    def on_event(self, event: Event) -> None:
        if isinstance(event, WorkerRegistered):
            if event.rejoin:
                self._resend(event.envs)
            return
        record = self.roster.worker(event.identity)
        if record is None:
            return
        if isinstance(event, ProcessExited):
            self._on_exit(record, event.cause or describe_status(event.status))
        elif isinstance(event, WorkerFailed):
            log.warning("a worker failed to come back in a restart: %s", event.err)

    def _on_exit(self, record: WorkerRecord, why: str) -> None:
        cause, traceback = self.roster.exited(record, why)
        self.liveness.forget(record.identity)
        decision = self.policy.on_death(record.identity, time.monotonic())
        if decision.crash_loop:
            self._give_up(record.envs, cause, traceback, decision.deaths_in_window)
            return
        log.warning("restarting the worker of envs %s: %s", list(record.envs), cause)
        self.roster.respawn_due(record, decision.restart_at)

    def _spawn_failed(self, record: WorkerRecord, now: float, err: OSError) -> None:
        """A restart that could not start its process: counted as a death, tried again.

        Raised from the recv, the error (EMFILE when a peer holds the trainer's
        file descriptors) would cost the other envs that recv's results, and
        this env its restart.
        """
        cause = f"its restart could not start a process: {type(err).__name__}: {err}"
        self.roster.note_cause(record, cause)
        decision = self.policy.on_death(record.identity, now)
        if decision.crash_loop:
            self._give_up(record.envs, cause, "", decision.deaths_in_window)
            return
        log.warning("envs %s: %s; trying again", list(record.envs), cause)
        self.roster.respawn_due(record, decision.restart_at)

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
        self.roster.lose(envs, error)
        self.ledger.fail(envs, error)

    def _resend(self, envs: list[int]) -> None:
        """A restarted or rejoining worker is in: resend what is in flight on its (fresh) envs.

        Every step among them is sent as a reset and answered as a truncation
        (``pending.synth``), not run again: the old worker may have run it
        already (its reply lost with it), it was meant for an episode that is
        gone, and the step that killed the worker would kill the new one too,
        one restart per step queued behind it.
        """
        for env in envs:
            for pending in list(self.ledger.slots[env].in_flight):
                self.ledger.restamp(env, pending)
                if pending.command in STEPS:
                    pending.synth = True
                self.dispatch(env, pending)

    def on_env_error(self, env: int, pending: Pending, error: EnvError) -> bool:
        """``on_env_error="restart"``: requeue the request and kill the worker."""
        record = self.roster.envs[env].holder
        if record is None or record.remote:
            return False  # a remote env: its own host restarts it; the caller gets the error
        self.ledger.requeue(env, pending)
        log.warning("env %d raised; restarting its worker:\n%s", env, error.remote_traceback)
        # Every env of the worker gets this cause: it names the one that raised, once.
        what = (error.reason.splitlines() or [""])[0].removeprefix("env raised: ")
        cause = f"env {env} raised: {what}"
        self._kill(record, cause, error.remote_traceback)
        return True

    # ------------------------------------------------------------ timers

    def next_wakeup(self) -> float:
        return min(
            self.roster.next_respawn(),
            self.roster.next_register_deadline(self.config.register_timeout_s),
            self._next_late_at,
            self._next_launcher_check,
        )

    def tick(self, now: float, judge_lateness: bool = True) -> None:
        """Respawn what is due; act on lateness, silence and expired vacancies.

        ``judge_lateness=False``: replies may still wait unread in the sockets
        (see :meth:`zmqpool.runtime.Runtime.pump`), so no request is judged late.
        """
        for record in self.roster.due(now):
            try:
                self.spawn(record)
            except ForkServerStarting as wait:  # a new zygote imports torch: not us
                self.roster.respawn_due(record, now + wait.retry_after_s)
            except OSError as err:  # out of file descriptors, processes, memory: try again
                self._spawn_failed(record, now, err)
        self._check_registrations(now)
        if judge_lateness:
            self._check_deadlines(now)
        for identity in self.liveness.silent(now):
            assert isinstance(identity, bytes)
            quiet = self.roster.worker(identity)
            # The cause is worded only for a worker found silent (not at every pump).
            silence = f"silent for more than {self.config.heartbeat_timeout_s} s (no heartbeat)"
            if quiet is None or quiet.phase is not WorkerPhase.LIVE:
                self.liveness.forget(identity)
            elif quiet.remote:
                self.vacate(quiet, now, silence)
            else:
                self._kill(quiet, silence, "")
        self._expire_vacancies(now)
        if now >= self._next_launcher_check:
            self._next_launcher_check = now + LAUNCHER_CHECK_S
            self._check_launchers(now)

    def _check_launchers(self, now: float) -> None:
        """Fail at once the envs of remote workers their launcher says are dead for good.

        ``poll_lost`` does not block (answers already in). A launcher that
        raises is logged and asked again next time: its envs then fall back on
        the silence and ``rejoin_timeout_s``, as without ``poll_lost``.
        """
        for launcher in self._watched:
            try:
                lost = launcher.poll_lost()
            except Exception as err:
                log.warning("could not ask %r for its dead workers: %s", launcher, err)
                continue
            for worker in lost:
                self._lose_remote(list(worker.slots), f"{launcher!r}: {worker.reason}", now)

    def _lose_remote(self, envs: list[int], why: str, now: float) -> None:
        """A remote worker is dead for good: its envs' requests fail with ``why``.

        A worker still registered (the pool has not heard its silence yet) is
        unlinked first, so that neither the silence nor ``rejoin_timeout_s``
        report its envs again.
        """
        envs = [e for e in envs if e not in self.roster.lost]
        if not envs:
            return
        for record in {self.roster.envs[e].holder for e in envs} - {None}:
            assert record is not None
            if record.remote and record.phase is WorkerPhase.LIVE:
                self.liveness.forget(record.identity)
                self.roster.vacate(record, now, why)
            if record.remote:
                record.phase = WorkerPhase.LOST
        log.error("envs %s are lost: %s", envs, why)
        self._fail(envs, RemoteWorkerDeadError(envs, why))

    def vacate(self, record: WorkerRecord, now: float, cause: str) -> None:
        """A remote worker went silent or hung: keep its requests, wait for it to rejoin.

        It is asked to (REJOIN): one that was only slow or stopped for a while
        would otherwise beat on, unheard (its token void), until its envs are lost.
        """
        self.liveness.forget(record.identity)
        self.roster.vacate(record, now, cause)
        self.ask_rejoin(record)
        log.warning(
            "remote worker %r of envs %s: %s; waiting %s s for a rejoin",
            record.identity,
            list(record.envs),
            cause,
            self.config.rejoin_timeout_s,
        )

    def _expire_vacancies(self, now: float) -> None:
        late = self.roster.expired(now, self.config.rejoin_timeout_s)
        if late:
            causes = sorted({self.roster.envs[e].last_restart_cause or "gone" for e in late})
            why = f"their remote worker was set aside ({'; '.join(causes)}) and none rejoined "
            why += f"within {self.config.rejoin_timeout_s} s"
            failures = self.remote_failures.summary()
            why += f"; {failures}" if failures else ""
            log.error("envs %s are lost: %s", late, why)
            self._fail(late, EnvLostError(late, why))

    def _check_registrations(self, now: float) -> None:
        """A restarted worker that does not register in time is killed: a failed start.

        Its exit then counts as a death like any other (a restart with backoff,
        or a crash loop), so its envs' requests never wait on it without bound:
        neither the deadlines nor the silence check look at a worker before it
        registers.
        """
        timeout = self.config.register_timeout_s
        for record in self.roster.overdue(now, timeout):
            self._kill(record, f"its restart did not register within {timeout} s", "")

    def _timeouts(self) -> tuple[float | None, float | None]:
        """When a local and a remote env's request is late (None: never).

        A remote env's is ``step_timeout_s``, or without it ``remote_step_timeout_s``.
        """
        local = self.config.step_timeout_s
        if not self.roster.remote_indices:
            return local, None
        return local, local if local is not None else self.config.remote_step_timeout_s

    def note_sent(self, now: float) -> None:
        """Requests were sent at ``now``: a pump waiting for their replies wakes at their
        deadline (the next deadline check would note it only after that pump's wait)."""
        if self._shortest_timeout is not None:
            self._next_late_at = min(self._next_late_at, now + self._shortest_timeout)

    def _check_deadlines(self, now: float) -> None:
        local, remote, shortest = self._local_timeout, self._remote_timeout, self._shortest_timeout
        if shortest is None:  # nothing is ever late
            return
        if now < self._next_deadline_check:  # a request sent since the last look: look then
            self._next_late_at = min(self._next_late_at, self._next_deadline_check)
            return
        # A look at every env, so not at every pump: at most every DEADLINE_CHECK_S (a
        # hang is then seen that much later at most: milliseconds, against a timeout).
        self._next_deadline_check = now + min(DEADLINE_CHECK_S, shortest / 10)
        next_late = float("inf")
        for slot in self.ledger.slots:  # the cheap lateness test first
            if not slot.in_flight:
                continue
            late_at = slot.in_flight[0].sent_at + shortest
            if now <= late_at:
                next_late = min(next_late, late_at)
                continue
            env = self.roster.envs[slot.index]
            host = env.holder
            if env.link is None or host is None or host.phase is not WorkerPhase.LIVE:
                continue
            timeout = remote if host.remote else local
            if timeout is None:  # a local env without step_timeout_s: never late
                continue
            late_at = slot.in_flight[0].sent_at + timeout
            if self._steps_in_turn(host):
                late_at = self._late_in_turn_at(host, timeout)
            if now <= late_at:
                next_late = min(next_late, late_at)
                continue
            cause = f"hung: no reply to {sent_as(slot.in_flight[0])} within {timeout} s"
            if host.remote:  # not ours to kill: its token is void, its slots wait
                self.vacate(host, now, cause)
            else:
                self._kill(host, cause, "")
        self._next_late_at = max(next_late, self._next_deadline_check)

    def _steps_in_turn(self, host: WorkerRecord) -> bool:
        """Whether ``host`` may run its envs' commands one after another, not side by side.

        A local worker of several envs without env threads does; so may a remote
        one (``--env-threads`` is its own choice, and the default is without).
        """
        return len(host.envs) > 1 and (host.remote or not self.config.env_threads)

    def _late_in_turn_at(self, host: WorkerRecord, timeout: float) -> float:
        """When a worker stepping its envs in turn is late: once its requests in flight have
        had ``timeout`` each since the oldest was sent, or since the worker answered a
        request sent no later than it (it then started on the next one).

        Each env's clock alone would count the steps queued ahead of it on the
        worker (session 53's audit: two envs of 0.4 s steps, step_timeout_s=0.6,
        every step truncated, then a crash loop). A reply to a request sent after
        the oldest says nothing of the oldest (a worker with env threads answers
        one env while another hangs), so it does not move the clock: a hang is
        seen after at most as many timeouts as the worker has requests in flight.
        """
        slots = [self.ledger.slots[env] for env in host.envs]
        pending = [p for slot in slots for p in slot.in_flight]
        oldest = min(p.sent_at for p in pending)
        answered = [s.answered_at for s in slots if s.answered_sent_at <= oldest]
        return max(oldest, *answered) + len(pending) * timeout

    def _kill(self, record: WorkerRecord, cause: str, traceback: str) -> None:
        """SIGKILL a local worker; its pidfd then reports the death as usual."""
        if record.process is None:
            return
        self.roster.killing(record, cause, traceback)
        record.process.kill()


def sent_as(pending: Pending) -> str:
    """What ``pending`` went to its env as: a step cut short by a restart went as a reset."""
    if pending.synth and pending.command in STEPS:
        return f"the RESET sent in place of a {pending.command.name} (after a restart)"
    return pending.command.name
