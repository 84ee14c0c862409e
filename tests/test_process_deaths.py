"""Any pool process may die: the fork server, a worker, a worker's env thread.

The pool recovers, answers every request in flight exactly once (a restart
truncation), and says what happened; and a worker closes without races.

Real processes throughout. The pool makes progress only while it is called,
so every "wait for" below is a bounded loop of pool calls, each with its own
timeout (and pytest's 120 s per test on top).

Pids come from the pool's public ``fork_server_pid`` and
``worker_processes()``; one test replaces the supervisor's ``spawn`` hook to
force the exact order of deaths that once crashed the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import threading
import time
import warnings

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from tests.conftest import pids_alive
from tests.exactly_once import ExactlyOnce
from zmqpool import EnvError, PoolConfig, RecvTimeoutError, ZMQAsyncEnvPool
from zmqpool.launcher import ENV_THREAD_DIED, ForkServerWarning
from zmqpool.roster import WorkerRecord
from zmqpool.testing import CountingEnv, FaultyEnv

#: Fork servers are killed here: each pool has its own, so that the session's
#: other pools (sharing one, ``tests/conftest.py``) lose no worker with it.
QUICK = PoolConfig(
    register_timeout_s=90.0,
    close_timeout_s=2.0,
    restart_backoff_s=0.01,
    max_restarts=100,
    share_fork_server=False,
)


def env_stats(pool) -> dict[int, dict]:
    return pool.env_stats()


def restarts(pool) -> list[int]:
    stats = env_stats(pool)
    return [stats[e]["restarts"] for e in range(pool.num_envs)]


def fork_server_pid(pool) -> int | None:
    return pool.fork_server_pid


def worker_pid(pool, worker: int) -> int | None:
    process = pool.worker_processes().get(worker)
    return None if process is None else process.pid


@contextlib.contextmanager
def fork_server_warnings():
    """The ForkServerWarnings raised inside, each one recorded (other filters unchanged)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ForkServerWarning)
        yield caught
    caught[:] = [w for w in caught if issubclass(w.category, ForkServerWarning)]


def settle(driver: ExactlyOnce, expected: list[int], timeout_s: float = 60.0) -> None:
    """Step every env until each expected restart has produced its one truncation."""
    deadline = time.monotonic() + timeout_s
    while restarts(driver.pool) != expected or driver.truncations != expected:
        assert time.monotonic() < deadline, (restarts(driver.pool), driver.truncations, expected)
        driver.send([e for e in range(driver.num_envs) if e not in driver.awaited])
        driver.receive()
    while driver.awaited:
        driver.receive()


# ---------------------------------------------------------------- the fork server


def test_fork_server_killed_mid_run_then_a_worker_every_request_answered_once():
    """SIGKILL the zygote (4 envs, one per worker), then a worker it re-forked.

    The zygote's workers die with it; each death is still seen, the pool warns
    once, starts a new zygote, restarts all four and answers each request once.
    The worker killed afterwards is seen and restarted too (the dead zygote's
    closed pipe used to crash this recv with ``ValueError: I/O operation on
    closed file``).
    """
    pool = ZMQAsyncEnvPool(
        CountingEnv, create_env_kwargs=[{"env_id": i} for i in range(4)], config=QUICK
    )
    try:
        driver = ExactlyOnce(pool, 4, 600, random.Random(3), restarts=True)
        killed: dict[str, int] = {}

        def between() -> None:
            if "zygote" not in killed and driver.received >= 100:
                killed["zygote"] = pid = fork_server_pid(pool)
                os.kill(pid, signal.SIGKILL)
            elif "zygote" in killed and "worker" not in killed and min(driver.truncations) >= 1:
                # Every env is back, forked by the new zygote: kill one of those workers.
                assert fork_server_pid(pool) not in (None, killed["zygote"])
                killed["worker"] = pid = worker_pid(pool, 2)
                os.kill(pid, signal.SIGKILL)

        with fork_server_warnings() as caught:
            driver.run(between)
            settle(driver, [1, 1, 2, 1])
        assert set(killed) == {"zygote", "worker"}
        assert len(caught) == 1, [str(w.message) for w in caught]
        assert f"the fork server (pid {killed['zygote']}) died (killed by SIGKILL)" in str(
            caught[0].message
        )
        causes = [env_stats(pool)[e]["last_restart_cause"] for e in range(4)]
        assert all(c.startswith("killed with its fork server") for c in causes[:2] + causes[3:])
        assert causes[2] == "killed by SIGKILL"  # the re-forked worker's status is known again
    finally:
        pool.close()


def test_fork_server_dying_just_before_a_restart_is_forked():
    """The zygote dies after a worker's death was seen, before that worker is re-forked.

    The restart finds the zygote dead before its other workers' deaths are
    read: the exact order behind the ``ValueError: I/O operation on closed
    file`` (the launcher closed the dead zygote's pipes, then read them for
    those deaths). To hit it every time, the test kills the zygote from
    inside the supervisor's respawn hook (private), and waits for its other
    workers to die before letting the respawn go on.
    """
    pool = ZMQAsyncEnvPool(
        CountingEnv, create_env_kwargs=[{"env_id": i} for i in range(3)], config=QUICK
    )
    try:
        zygote, others = fork_server_pid(pool), [worker_pid(pool, w) for w in (1, 2)]
        respawn = pool.runtime.supervisor.spawn

        def kill_zygote_then_respawn(worker: WorkerRecord) -> None:
            pool.runtime.supervisor.spawn = respawn
            os.kill(zygote, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pids_alive(others):  # they die with it (PR_SET_PDEATHSIG)
                assert time.monotonic() < deadline, "the zygote's workers outlived it"
                time.sleep(0.01)
            respawn(worker)

        pool.runtime.supervisor.spawn = kill_zygote_then_respawn
        driver = ExactlyOnce(pool, 3, 30, random.Random(5), restarts=True)
        with fork_server_warnings() as caught:
            driver.pool.reset()
            os.kill(worker_pid(pool, 0), signal.SIGKILL)
            settle(driver, [1, 1, 1])
        assert pool.runtime.supervisor.spawn == respawn  # the hook ran
        assert len(caught) == 1 and f"(pid {zygote}) died" in str(caught[0].message)
        assert fork_server_pid(pool) not in (None, zygote)
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("envs_per_worker", "seed"),
    [
        (1, 1),  # worker 0, worker 3, fork server, worker 1, fork server
        (2, 0),  # worker 0, worker 0, fork server, worker 0, worker 1
    ],
)
def test_a_random_pool_process_killed_every_100_steps_answers_each_request_once(
    envs_per_worker, seed
):
    """Zygote or worker, chosen at random, SIGKILLed every 100 steps of 600 (4 envs).

    Each kill waits for the previous one to be fully answered (every restarted
    env has given its truncation), so each restarts something. Every request is
    answered exactly once; a zygote kill restarts every env, a worker kill its
    own; one warning per zygote death.
    """
    pool = ZMQAsyncEnvPool(
        CountingEnv,
        create_env_kwargs=[{"env_id": i} for i in range(4)],
        envs_per_worker=envs_per_worker,
        config=QUICK,
    )
    workers = 4 // envs_per_worker
    rng = random.Random(seed)
    try:
        driver = ExactlyOnce(pool, 4, 600, random.Random(4), restarts=True)
        expected = [0, 0, 0, 0]
        kills: list[str] = []

        def between() -> None:
            recovered = restarts(pool) == expected == driver.truncations
            if not recovered or driver.received < 100 * (len(kills) + 1):
                return
            victim = rng.choice(["fork server"] + [f"worker {w}" for w in range(workers)])
            if victim == "fork server":
                pid, hit = fork_server_pid(pool), range(4)
            else:
                first = int(victim[-1]) * envs_per_worker
                pid, hit = worker_pid(pool, int(victim[-1])), range(first, first + envs_per_worker)
            assert pid is not None, victim
            os.kill(pid, signal.SIGKILL)
            kills.append(victim)
            for env in hit:
                expected[env] += 1

        with fork_server_warnings() as caught:
            driver.run(between)
            settle(driver, expected)
        assert len(kills) == 5 and "fork server" in kills and len(set(kills)) >= 3, kills
        assert len(caught) == kills.count("fork server"), [str(w.message) for w in caught]
        assert restarts(pool) == driver.truncations == expected
    finally:
        pool.close()


# ---------------------------------------------------------------- env threads


class FatalEnv(CountingEnv):
    """A CountingEnv whose step raises what its action asks for.

    ``0.9``: ``SystemExit``; ``0.8``: ``KeyboardInterrupt``; ``0.6``: the process
    exits (``os._exit``); ``0.7``: an
    exception whose ``repr`` raises too; ``0.5``: a step of a second (still in
    flight when its neighbour's thread dies). Any other action: a normal step.
    """

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        action = round(float(tensordict["action"].reshape(-1)[0]), 2)
        if action == 0.9:
            raise SystemExit(0)
        if action == 0.8:
            raise KeyboardInterrupt
        if action == 0.6:
            os._exit(1)
        if action == 0.7:
            raise UnprintableError("the env failed")
        if action == 0.5:
            time.sleep(1.0)
        return super()._step(tensordict)


def test_a_cheap_env_stepped_inline_that_ends_its_worker_restarts_it_with_truncations():
    """With env threads, envs judged cheap step in the worker's main thread
    (workers.inline): env code's KeyboardInterrupt there ends the worker as in any
    inline worker, and the pool restarts it, answering both envs with truncations."""
    pool = two_fatal_envs(QUICK)
    try:
        pool.reset()
        for _ in range(4):  # enough to judge both cheap
            step(pool, [0.1, 0.1])
        out = step(pool, [0.8, 0.1])
        assert pool.last_restarted_envs == [0, 1] and out["next", "truncated"].all()
        assert restarts(pool) == [1, 1]
        # A recv that raises returns no result, so none from a restart (it kept the last's).
        slow = TensorDict({"action": torch.tensor([[0.5]])}, [1])  # a step of 1 s
        pool.async_step_send(slow, env_index=[0])
        with pytest.raises(RecvTimeoutError):
            pool.async_step_recv(min_get=1, timeout=0.05)
        assert pool.last_restarted_envs == []
        pool.async_step_recv(min_get=1, timeout=30)
        cause = env_stats(pool)[0]["last_restart_cause"]
        assert cause.startswith("exited with code")
        assert ENV_THREAD_DIED == 70 and "code 70" not in cause  # not from an env thread
        # On from the restart's reset: env 0 took the slow step too.
        assert step(pool, [0.1, 0.1])["next", "observation"][:, 1].tolist() == [2.0, 1.0]
    finally:
        pool.close()


class UnprintableError(ValueError):
    def __repr__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


def two_fatal_envs(config: PoolConfig) -> ZMQAsyncEnvPool:
    """Two :class:`FatalEnv` s in one worker process (with env threads, the default)."""
    return ZMQAsyncEnvPool(
        [FatalEnv] * 2,
        create_env_kwargs=[{"env_id": i} for i in range(2)],
        envs_per_worker=2,
        config=config,
    )


def step(pool, values: list[float]) -> TensorDictBase:
    actions = TensorDict({"action": torch.tensor(values).unsqueeze(-1)}, [len(values)])
    pool.async_step_send(actions, env_index=list(range(len(values))))
    return pool.async_step_recv(min_get=len(values), timeout=30)


def test_an_env_thread_killed_by_env_code_restarts_its_worker_with_truncations():
    """KeyboardInterrupt in one env's thread (2 envs, one worker, env threads).

    The thread dies; the worker exits (code ENV_THREAD_DIED) instead of
    leaving the request unanswered forever; the pool restarts it and answers
    both envs' requests with truncations, as a crash. An exception whose repr
    raises is still an EnvError for its env, not a dead thread.
    """
    # Every env in its thread: one judged cheap would step inline (workers.inline),
    # where the same KeyboardInterrupt ends the worker as any inline crash does.
    threaded = dataclasses.replace(QUICK, inline_cheap_envs=False)
    pool = two_fatal_envs(threaded)
    try:
        pool.reset()
        assert step(pool, [0.1, 0.1])["next", "observation"][:, 1].tolist() == [1.0, 1.0]
        out = step(pool, [0.8, 0.5])
        assert pool.last_restarted_envs == [0, 1]
        assert out["next", "truncated"].all() and not out["next", "terminated"].any()
        assert restarts(pool) == [1, 1]
        cause = env_stats(pool)[0]["last_restart_cause"]
        assert cause.startswith(f"exited with code {ENV_THREAD_DIED}: an env thread died")
        assert step(pool, [0.1, 0.1])["next", "observation"][:, 1].tolist() == [1.0, 1.0]
        pool.async_step_send(TensorDict({"action": torch.tensor([[0.7]])}, [1]), env_index=[0])
        with pytest.raises(EnvError, match="UnprintableError: its repr\\(\\) raised") as info:
            pool.async_step_recv(min_get=1, timeout=30)
        assert info.value.env_index == 0
        assert step(pool, [0.1, 0.1])["next", "observation"][:, 1].tolist() == [2.0, 2.0]
        assert restarts(pool) == [1, 1]
    finally:
        pool.close()


@pytest.mark.parametrize("inline", [False, True], ids=["env-threads", "inline"])
def test_an_envs_sys_exit_is_its_error_and_its_neighbour_keeps_its_result(inline):
    """A SystemExit env code raises is that env's error (helper audit): it ended the
    worker, and the other env of the worker lost its result to a restart's truncation."""
    config = QUICK if inline else dataclasses.replace(QUICK, inline_cheap_envs=False)
    pool = two_fatal_envs(config)
    try:
        pool.reset()
        for _ in range(4):  # inline: enough to judge both cheap
            step(pool, [0.1, 0.1])
        pool.async_step_send(
            TensorDict({"action": torch.tensor([[0.9], [0.1]])}, [2]), env_index=[0, 1]
        )
        results, errors = [], []
        while len(results) + len(errors) < 2:
            try:
                out = pool.async_step_recv(min_get=1, timeout=30)
                results += out["next", "observation"][:, 0].tolist()  # the env_id
            except EnvError as err:
                errors.append(err)
        assert results == [1.0] and [e.env_index for e in errors] == [0]
        assert "SystemExit(0)" in str(errors[0]) and not isinstance(errors[0], SystemExit)
        assert restarts(pool) == [0, 0] and pool.last_restarted_envs == []
        assert step(pool, [0.1, 0.1])["next", "observation"][:, 1].tolist() == [5.0, 6.0]
    finally:
        pool.close()


# ---------------------------------------------------------------- a failed sync call


def sync_step(pool, values: list[float], mask: bool = False) -> TensorDictBase:
    td = TensorDict({"action": torch.tensor(values).unsqueeze(-1)}, [len(values)])
    if mask:  # every env selected: the pool's masked step calls its step
        td.set("_step", torch.ones(len(values), dtype=torch.bool))
    return pool.step(td)


def assert_truncated_then_stepped_on(pool, env: int) -> None:
    """Of two envs: the next sync step answers ``env`` with its restart's truncation (the
    reset's observation), naming it once; the step after goes on from that reset."""
    out = sync_step(pool, [0.1, 0.1])
    assert pool.last_restarted_envs == [env]
    assert out["next", "truncated"].tolist() == [[e == env] for e in range(2)]
    assert out["next", "observation"][env, 1].item() == 0.0  # the reset's step count
    out = sync_step(pool, [0.1, 0.1])
    assert pool.last_restarted_envs == [] and not out["next", "truncated"].any()
    assert out["next", "observation"][env, 1].item() == 1.0  # on from the reset


class _Stop(Exception):
    """What a caller's own SIGINT handler raises instead of KeyboardInterrupt."""


def _stop(signum, frame):
    raise _Stop("the caller's handler")


@pytest.mark.parametrize(
    "cut_short_by",
    ["another env's error", "a Ctrl-C", "a Ctrl-C in a masked step", "the caller's handler"],
)
def test_a_restart_truncation_dropped_with_a_failed_sync_call_answers_the_next_step(
    cut_short_by,
):
    """Env 0's worker dies in a sync step that then fails: env 1 raises, or a Ctrl-C comes.

    The call's results are dropped with it, env 0's restart truncation among
    them. Had the next step just stepped the rebuilt env, the caller would go
    on from the observation before the crash with no ``done`` between. The
    truncation is owed instead: the next step answers env 0 with it (done,
    truncated, the reset observation) and names it in ``last_restarted_envs``,
    once. A Ctrl-C is held to the call's end (a masked step nests a step in
    it), where the caller's own SIGINT handler may raise what it likes.
    """
    # No fork server is killed here: the session's shared one forks these workers.
    config = dataclasses.replace(QUICK, share_fork_server=True)
    pool = ZMQAsyncEnvPool(
        [FatalEnv] * 2, create_env_kwargs=[{"env_id": i} for i in range(2)], config=config
    )
    previous = signal.getsignal(signal.SIGINT)
    try:
        pool.reset()
        sync_step(pool, [0.1, 0.1])
        if cut_short_by == "another env's error":
            with pytest.raises(EnvError, match="env 1"):
                sync_step(pool, [0.6, 0.7])
        else:  # env 1 steps for a second: the Ctrl-C comes while the call waits for it
            if cut_short_by == "the caller's handler":
                signal.signal(signal.SIGINT, _stop)
            ctrl_c = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            ctrl_c.start()
            try:
                with pytest.raises((KeyboardInterrupt, _Stop)) as info:
                    sync_step(pool, [0.6, 0.5], mask=cut_short_by.endswith("masked step"))
                expected = _Stop if cut_short_by == "the caller's handler" else KeyboardInterrupt
                assert info.type is expected
            finally:
                ctrl_c.join(timeout=5)
        assert restarts(pool) == [1, 0] and pool.last_restarted_envs == []
        assert_truncated_then_stepped_on(pool, 0)
    finally:
        signal.signal(signal.SIGINT, previous)
        pool.close()


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_restart_whose_rebuilt_env_cannot_reset_owes_its_truncation(api):
    """Env 1's worker is killed mid-step, and its rebuilt env raises in its first reset:
    the one sent in place of the step, to answer it as a truncation (failure audit).

    The step gets that error, noting the restart. The truncation is owed: the
    next step is a reset again, answered as the truncation, naming env 1. Before,
    the env counted as live, and the next step stepped an env never reset: no
    ``done`` between the observation before the crash and a new episode.
    """
    config = dataclasses.replace(QUICK, share_fork_server=True)  # no fork server is killed
    slow = {"step_sleep_s": (0.6, 0.6)}
    # Each FaultyEnv raises in its first reset only: the pool's first reset, and the rebuilt one's.
    kwargs = [{"env_id": 0}, {"env_id": 1, "fault_at": 0, "every_episode": False, **slow}]
    pool = ZMQAsyncEnvPool([CountingEnv, FaultyEnv], create_env_kwargs=kwargs, config=config)
    try:
        with pytest.raises(EnvError, match="env 1"):
            pool.reset()
        pool.reset()
        kill = threading.Timer(0.2, os.kill, (pool.worker_pid(1), signal.SIGKILL))
        kill.start()
        with pytest.raises(EnvError, match="FaultyEnv 1 failed") as info:
            if api == "sync":
                sync_step(pool, [0.1, 0.1])
            else:
                pool.async_step_send(TensorDict({"action": torch.full((2, 1), 0.1)}, [2]), [0, 1])
                pool.async_step_recv(min_get=2, timeout=30)
        if api == "async":  # env 0's result stays for the next recv
            assert pool.async_step_recv(min_get=1, timeout=30).get("env_index").tolist() == [0]
        kill.join(timeout=5)
        assert "was restarted" in "".join(getattr(info.value, "__notes__", []))
        assert restarts(pool) == [0, 1] and pool.last_restarted_envs == []
        assert_truncated_then_stepped_on(pool, 1)
    finally:
        pool.close()


@pytest.mark.parametrize("behind", ["another step", "the caller's reset"])
def test_a_failed_restart_reset_owes_nothing_when_a_reset_in_flight_answers_for_it(behind):
    """As above, with a second request on env 1's own channel behind the step (review).

    Another step cut short goes again as a reset too, and is answered as the
    truncation; the caller's own reset begins an episode. Either way the env
    is reset: its next step is a step. It used to be turned into a reset again,
    answered as a second truncation, its action never applied.
    """
    config = dataclasses.replace(QUICK, share_fork_server=True)
    kwargs = [{"env_id": 0}, {"env_id": 1, "fault_at": 0, "every_episode": False}]
    kwargs[1]["step_sleep_s"] = (0.6, 0.6)
    pool = ZMQAsyncEnvPool([CountingEnv, FaultyEnv], create_env_kwargs=kwargs, config=config)
    one = TensorDict({"action": torch.full((1,), 0.1)}, [])
    try:
        with pytest.raises(EnvError, match="env 1"):
            pool.reset()  # each FaultyEnv's first reset raises
        pool.reset()
        pool.async_step_send(one.clone(), env_index=1)
        if behind == "another step":
            pool.async_step_send(one.clone(), env_index=1)
        else:
            pool.async_reset_send(env_index=1)
        kill = threading.Timer(0.2, os.kill, (pool.worker_pid(1), signal.SIGKILL))
        kill.start()
        with pytest.raises(EnvError, match="FaultyEnv 1 failed"):
            pool.async_step_recv(env_index=1, timeout=30)
        kill.join(timeout=5)
        recv = pool.async_step_recv if behind == "another step" else pool.async_reset_recv
        answered = recv(env_index=1, timeout=30)
        assert answered.get(("next", "observation"), answered.get("observation"))[1] == 0
        pool.async_step_send(one.clone(), env_index=1)
        out = pool.async_step_recv(env_index=1, timeout=30)
        assert not out["next", "truncated"].item() and pool.last_restarted_envs == []
        assert out["next", "observation"][1].item() == 1.0  # a step, on from the reset
    finally:
        pool.close()


# ---------------------------------------------------------------- closing


def test_closing_pools_with_busy_env_threads_leaves_clean_worker_exits(capfd):
    """Close pools while every env thread is mid-step, repeatedly.

    A worker's close used to ``Context.destroy()`` while its heartbeat thread
    closed its own socket (``RuntimeError: Set changed size during
    iteration``) and env threads sent replies on sockets being closed. Now
    every worker exits with code 0 and writes no traceback.
    """
    config = PoolConfig(register_timeout_s=90.0, close_timeout_s=5.0)
    busy = {"step_sleep_s": (0.0, 0.004)}
    for _ in range(3):
        pool = ZMQAsyncEnvPool(
            CountingEnv,
            create_env_kwargs=[{"env_id": i, **busy} for i in range(6)],
            envs_per_worker=2,
            config=config,
        )
        try:
            processes = pool.worker_processes()
            assert len(processes) == 3
            pool.reset()
            for _ in range(20):
                step(pool, [0.1] * 6)
            pool.async_step_send(
                TensorDict({"action": torch.zeros(6, 1)}, [6]), env_index=list(range(6))
            )
        finally:
            pool.close()  # with every env thread in a step
        assert [processes[w].exit_status() for w in range(3)] == [0, 0, 0]
    err = capfd.readouterr().err
    for sign in ("Traceback", "Set changed size", "Exception in thread", "ZMQError"):
        assert sign not in err, err
