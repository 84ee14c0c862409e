"""Hot restart: crashed, exiting, hung and raising envs come back; every request answered once."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from tensordict import TensorDict

import zmqpool.broker
from tests.conftest import pids_alive
from zmqpool import (
    CrashLoopError,
    NothingInFlightError,
    PoolConfig,
    RecvTimeoutError,
    ZMQAsyncEnvPool,
)
from zmqpool.roster import WorkerPhase, restart_seed
from zmqpool.testing import CountingEnv, FaultyEnv

QUICK = PoolConfig(
    register_timeout_s=90.0,
    close_timeout_s=2.0,
    restart_backoff_s=0.01,
    max_restarts=100,
)


def ids(td) -> list[int]:
    return [int(i) for i in td["env_index"]]


def actions(values) -> TensorDict:
    return TensorDict({"action": torch.tensor(values).unsqueeze(-1)}, [len(values)])


def registered(pool) -> bool:
    """Every worker is up and no restarted env still awaits its synthesized reply."""
    slots = pool.runtime.ledger.slots
    synth = any(p.synth for s in slots for p in s.in_flight)
    live = all(w.phase is WorkerPhase.LIVE for w in pool.runtime.roster.local)
    return live and not synth


class Checker:
    """Follows each env's step count; a synthesized reply restarts it from 0."""

    def __init__(self, num_envs: int) -> None:
        self.count = [0] * num_envs
        self.synthesized = [0] * num_envs
        self.awaited: dict[int, float] = {}

    def check(self, pool, out) -> int:
        restarted = set(pool.last_restarted_envs)
        for row, env in enumerate(ids(out)):
            obs = out["next", "observation"][row]
            assert obs[0].item() == env, "misrouted"
            action = self.awaited.pop(env)  # KeyError: an answer nobody asked for
            if env in restarted:
                self.synthesized[env] += 1
                self.count[env] = 0
                assert out["next", "truncated"][row].item() and out["next", "done"][row].item()
                assert not out["next", "terminated"][row].item()
                assert out["next", "reward"][row].item() == 0.0
                assert obs[1].item() == 0.0  # the fresh reset observation
            else:
                self.count[env] += 1
                assert obs[1].item() == self.count[env], "a step was lost or doubled"
                assert abs(obs[2].item() - action) < 1e-6
        return len(ids(out))


def kill_a_worker(pool, rng) -> None:
    processes = pool.worker_processes()  # those not already being restarted
    os.kill(processes[rng.choice(sorted(processes))].pid, signal.SIGKILL)


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_sigkill_storm_answers_every_request_exactly_once(envs_per_worker):
    num_envs, steps, rng = 4, 2000, random.Random(envs_per_worker)
    pool = ZMQAsyncEnvPool(
        CountingEnv,
        create_env_kwargs=[{"env_id": i} for i in range(num_envs)],
        envs_per_worker=envs_per_worker,
        config=QUICK,
    )
    try:
        pool.reset()
        checker, received, sent, kills = Checker(num_envs), 0, 0, 0
        while received < steps:
            idle = [e for e in range(num_envs) if e not in checker.awaited]
            if idle and sent < steps:
                values = [(sent + k + 1) / 10_000 for k in range(len(idle))]
                pool.async_step_send(actions(values), env_index=idle)
                checker.awaited.update(zip(idle, values, strict=True))
                sent += len(idle)
            # Kill only once the previous kill has been seen, so each one restarts something.
            seen = sum(s["restarts"] for s in pool.env_stats().values()) // envs_per_worker
            if received and received % 150 < 4 and registered(pool) and seen == kills:
                kill_a_worker(pool, rng)
                kills += 1
            received += checker.check(pool, pool.async_step_recv(min_get=1, timeout=60))
        while checker.awaited:
            checker.check(pool, pool.async_step_recv(min_get=1, timeout=60))
        # Step everyone until every restart has produced its truncation.
        for _ in range(100):
            settled = registered(pool)
            pool.async_step_send(actions([0.0] * num_envs), env_index=list(range(num_envs)))
            checker.awaited.update(dict.fromkeys(range(num_envs), 0.0))
            checker.check(pool, pool.async_step_recv(min_get=num_envs, timeout=60))
            if settled:
                break
        stats = pool.env_stats()
        assert kills >= 5
        assert [stats[e]["restarts"] for e in range(num_envs)] == checker.synthesized
        assert sum(checker.synthesized) == kills * envs_per_worker
        assert not checker.awaited
    finally:
        pool.close()


def step_one(pool, value=0.5):
    pool.async_step_send(actions([value]), env_index=[0])
    return pool.async_step_recv(min_get=1, timeout=60)


def test_env_that_exits_mid_step_is_answered_with_a_truncation():
    pool = ZMQAsyncEnvPool(
        FaultyEnv,
        create_env_kwargs=[{"fault": "exit", "fault_at": 3, "every_episode": False}],
        config=QUICK,
    )
    try:
        pool.reset()
        assert [step_one(pool)["next", "observation"][0, 1].item() for _ in range(2)] == [1, 2]
        out = step_one(pool)
        assert pool.last_restarted_envs == [0]
        assert out["next", "truncated"].item() and out["next", "observation"][0, 1] == 0
        assert "exited with code 3" in pool.env_stats()[0]["last_restart_cause"]
        assert step_one(pool)["next", "observation"][0, 1].item() == 1  # the new env steps on
    finally:
        pool.close()


def test_hung_env_is_killed_after_step_timeout_and_restarted(caplog):
    """Killed no sooner than ``step_timeout_s`` and not much later either.

    The upper bound is when the kill is logged (not when the truncation comes
    back, which waits for the restart too): ``step_timeout_s`` plus 1 s of
    slack for a loaded machine, less than twice the timeout, so a deadline
    check that let a hang run twice as long would fail here. Heartbeats every
    30 s: a recv waiting for the hung step wakes for its deadline, not for the
    next heartbeat (it did: session 53's audit saw 0.3 s hangs killed at 1.09 s).
    """
    config = PoolConfig(
        register_timeout_s=90.0, close_timeout_s=2.0, step_timeout_s=2.0, heartbeat_interval_s=30.0
    )
    pool = ZMQAsyncEnvPool(
        FaultyEnv,
        create_env_kwargs=[{"fault": "hang", "fault_at": 1, "every_episode": False}],
        config=config,
    )
    try:
        pool.reset()  # nothing in flight at its last deadline check: none is due
        start, wall = time.monotonic(), time.time()
        with caplog.at_level(logging.WARNING, logger="zmqpool"):
            out = step_one(pool)
        assert time.monotonic() - start >= config.step_timeout_s
        [killed] = [r for r in caplog.records if "restarting the worker" in r.getMessage()]
        assert "hung" in killed.getMessage()
        assert killed.created - wall < config.step_timeout_s + 1.0, "the hang was seen late"
        assert pool.last_restarted_envs == [0] and out["next", "truncated"].item()
        assert pool.env_stats()[0]["last_restart_cause"].startswith("hung")
    finally:
        pool.close()


def test_replies_not_read_yet_after_a_trainer_pause_are_not_a_hang(monkeypatch):
    """A trainer away longer than ``step_timeout_s`` finds its replies waiting: not late.

    Every env answered in milliseconds; the first pump after the pause read
    only part of them (one message a drain here, standing in for more than
    ``_DRAIN_BATCH`` replies or a drain stretched by a GC pause), and the
    deadline check used to kill the workers whose replies it had not read yet.
    """
    monkeypatch.setattr(zmqpool.broker, "_DRAIN_BATCH", 1)
    config = PoolConfig(register_timeout_s=90.0, close_timeout_s=2.0, step_timeout_s=0.5)
    kwargs = [{"env_id": i} for i in range(3)]
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs, config=config)
    try:
        pool.reset()
        pool.async_step_send(actions([0.5] * 3), env_index=[0, 1, 2])
        time.sleep(1.5)  # the trainer's own work: longer than step_timeout_s
        got = pool.async_step_recv(min_get=3, timeout=30)
        assert sorted(got["env_index"]) == [0, 1, 2] and pool.last_restarted_envs == []
        out = pool.step(actions([0.5] * 3))
        assert pool.last_restarted_envs == [] and not out["next", "truncated"].any()
        assert [stats["restarts"] for stats in pool.env_stats().values()] == [0, 0, 0]
    finally:
        pool.close()


def test_envs_a_worker_steps_in_turn_each_within_step_timeout_are_not_a_hang(caplog):
    """Without env threads a worker steps its envs one after another: two 0.4 s steps
    take 0.8 s, more than ``step_timeout_s`` (0.6 s), and neither is a hang (each env's
    clock used to count the other's step: every step truncated, then a crash loop).
    A hang in such a worker is still seen, within a timeout per request in flight.
    """
    config = PoolConfig(
        register_timeout_s=90.0, close_timeout_s=2.0, step_timeout_s=0.6, env_threads=False
    )
    slow = {"step_sleep_s": (0.4, 0.4)}
    kwargs = [
        {"env_id": 0, "fault": "hang", "fault_at": 4, "every_episode": False, **slow},
        {"env_id": 1, "fault": "hang", "fault_at": 10**6, **slow},
    ]
    pool = ZMQAsyncEnvPool(FaultyEnv, create_env_kwargs=kwargs, envs_per_worker=2, config=config)
    try:
        pool.reset()
        for _ in range(3):
            out = pool.step(actions([0.5, 0.5]))
            assert pool.last_restarted_envs == [] and not out["next", "truncated"].any()
        start, wall = time.monotonic(), time.time()
        with caplog.at_level(logging.WARNING, logger="zmqpool"):
            out = pool.step(actions([0.5, 0.5]))  # env 0 hangs in its 4th step
        assert pool.last_restarted_envs == [0, 1] and out["next", "truncated"].all()
        [killed] = [r for r in caplog.records if "restarting the worker" in r.getMessage()]
        assert "hung" in killed.getMessage()
        waited = killed.created - wall
        assert 2 * config.step_timeout_s <= waited < 2 * config.step_timeout_s + 1.0, waited
        assert time.monotonic() - start < 30.0
    finally:
        pool.close()


def test_queued_steps_each_within_step_timeout_are_not_a_hang():
    """A step's clock starts when the worker begins it, not when it was queued.

    Five 0.25 s steps queued at once on one env take 1.25 s together, twice
    ``step_timeout_s``; each one alone is well within it, so none is a hang.
    """
    config = PoolConfig(register_timeout_s=90.0, close_timeout_s=2.0, step_timeout_s=0.6)
    pool = ZMQAsyncEnvPool(
        CountingEnv,
        create_env_kwargs=[{"env_id": 0, "step_sleep_s": (0.25, 0.25)}],
        config=config,
    )
    try:
        pool.reset()
        for _ in range(5):
            pool.async_step_send(TensorDict({"action": torch.full((1,), 0.1)}, []), 0)
        counts = []
        for _ in range(5):
            out = pool.async_step_recv(env_index=0, timeout=30)
            assert not out["next", "truncated"].item(), pool.env_stats()[0]["last_restart_cause"]
            counts.append(int(out["next", "observation"][1]))
        assert counts == [1, 2, 3, 4, 5]
        assert pool.env_stats()[0]["restarts"] == 0
    finally:
        pool.close()


def test_on_env_error_restart_logs_the_traceback_and_truncates(caplog):
    pool = ZMQAsyncEnvPool(
        FaultyEnv,
        create_env_kwargs=[{"fault": "raise", "fault_at": 2, "every_episode": False}],
        on_env_error="restart",
        config=QUICK,
    )
    try:
        pool.reset()
        step_one(pool)
        with caplog.at_level(logging.WARNING, logger="zmqpool"):
            out = step_one(pool)
        assert pool.last_restarted_envs == [0] and out["next", "truncated"].item()
        assert "FaultyEnv 0 failed at step 2" in caplog.text
        cause = pool.env_stats()[0]["last_restart_cause"]
        assert cause.startswith("env 0 raised: ") and "FaultyEnv 0 failed at step 2" in cause, cause
        assert cause.count("raised") == 1, cause  # once, not "env 0 raised: env 0: env raised"
    finally:
        pool.close()


def test_crash_loop_raises_naming_the_env_and_spares_the_others():
    config = PoolConfig(
        register_timeout_s=90.0, close_timeout_s=2.0, max_restarts=2, restart_backoff_s=0.01
    )
    pool = ZMQAsyncEnvPool(
        [FaultyEnv, CountingEnv],
        create_env_kwargs=[{"fault": "raise", "fault_at": 0}, {"env_id": 1}],  # every reset fails
        on_env_error="restart",
        config=config,
    )
    try:
        pool.async_reset_send(env_index=[0, 1])
        got, error = [], None
        for _ in range(2):
            try:
                got += ids(pool.async_reset_recv(min_get=1, timeout=60))
            except CrashLoopError as err:
                error = err
        assert got == [1] and error is not None
        assert error.env_indices == [0]
        assert "crash loop: 3 deaths" in str(error)
        assert "FaultyEnv 0 failed at step 0" in str(error)  # the last traceback
        assert pool.env_stats()[0]["lost"]
        with pytest.raises(CrashLoopError):
            pool.async_step_send(actions([0.1]), env_index=[0])
        start = time.monotonic()
        with pytest.raises(CrashLoopError):  # at once, none seeded: it waited register_timeout_s
            pool.set_seed(5)
        assert time.monotonic() - start < 5.0
        pool.async_step_send(actions([0.3]), env_index=[1])  # the healthy env carries on
        out = pool.async_step_recv(min_get=1, timeout=60)
        assert out["next", "observation"][0, 1] == 1 and out["next", "observation"][0, 3] == -1
        pool.close()  # the way back for a lost env: the next call starts every env again
        pool.async_step_send(actions([0.3]), env_index=[1])
        assert pool.async_step_recv(min_get=1, timeout=60)["next", "observation"][0, 1] == 1
        assert not pool.env_stats()[0]["lost"]
    finally:
        pool.close()


def test_a_step_longer_than_the_heartbeat_timeout_is_not_a_death():
    config = PoolConfig(
        register_timeout_s=90.0, close_timeout_s=2.0, heartbeat_interval_s=0.1, heartbeat_liveness=3
    )
    slow = {"env_id": 0, "step_sleep_s": (1.5, 1.5)}  # five heartbeat timeouts per step
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[slow], config=config)
    try:
        pool.reset()
        assert step_one(pool)["next", "observation"][0, 1].item() == 1
        assert pool.last_restarted_envs == [] and pool.env_stats()[0]["restarts"] == 0
    finally:
        pool.close()


def test_a_trainer_pause_longer_than_the_heartbeat_timeout_restarts_nothing():
    config = PoolConfig(
        register_timeout_s=90.0, close_timeout_s=2.0, heartbeat_interval_s=0.1, heartbeat_liveness=3
    )
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}], config=config)
    try:
        pool.reset()
        step_one(pool)
        time.sleep(10 * config.heartbeat_timeout_s)  # the scenario itself: a long training step
        assert step_one(pool)["next", "observation"][0, 1].item() == 2
        assert pool.env_stats()[0]["restarts"] == 0
    finally:
        pool.close()


def test_a_stopped_worker_is_found_silent_across_the_trainers_pauses():
    """Env 1's worker is stopped (SIGSTOP) with a step in flight; the trainer steps env 0 in
    bursts of 0.2 s, shorter than the 0.5 s heartbeat timeout, with 0.3 s of its own work
    between (over the 0.2 s pause the pool does not count). Silence adds up across the
    pauses: env 1's step is answered by a restart's truncation. Before, every pause gave
    each worker a fresh start, and the step was never answered (failure audit)."""
    config = PoolConfig(
        register_timeout_s=90.0, close_timeout_s=2.0, heartbeat_interval_s=0.1, heartbeat_liveness=5
    )
    makers = [{"env_id": 0}, {"env_id": 1}]
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=makers, config=config)
    stopped = pool.worker_pid(1)
    try:
        pool.reset()
        os.kill(stopped, signal.SIGSTOP)
        pool.async_step_send(actions([0.5]), env_index=[1])
        answered = _step_env_0_in_bursts_until_env_1_answers(pool, bursts=20)
        assert answered is not None, "the stopped worker's step was never answered"
        assert answered["next", "truncated"].item() and pool.last_restarted_envs == [1]
        assert "silent" in pool.env_stats()[1]["last_restart_cause"]
    finally:
        with contextlib.suppress(ProcessLookupError):  # still there: it must be able to exit
            os.kill(stopped, signal.SIGCONT)
        pool.close()


def _step_env_0_in_bursts_until_env_1_answers(pool, bursts: int):
    """Env 1's result once it comes (None if it never does); env 0 stepped meanwhile."""
    busy = False
    for _ in range(bursts):
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            if not busy:
                pool.async_step_send(actions([0.5]), env_index=[0])
                busy = True
            out = pool.async_step_recv(min_get=1, max_get=1, timeout=10)  # no batching wait
            for row, env in enumerate(out.get("env_index").tolist()):
                if env == 1:
                    return out[row]
                busy = False
        time.sleep(0.3)  # the trainer's own work (an update) between its recvs
    return None


def test_a_step_that_kills_its_worker_kills_it_once_and_none_runs_twice():
    """Six steps queued on one env's channel, the last one exiting the process (chaos audit).

    Replies the worker had not sent yet died with it. The steps were sent
    again to the new worker, the first as a reset: the ones it had run ran
    twice, and the fatal one killed each new worker in turn, one restart per
    step queued before it (a crash loop with ``max_restarts=2``). Now every
    step in flight is answered by a truncation: one restart, none run again.
    """
    pool = ZMQAsyncEnvPool(
        FaultyEnv,
        create_env_kwargs=[{"fault": "exit", "fault_at": 6, "step_sleep_s": (0.1, 0.1)}],
        config=PoolConfig(
            register_timeout_s=90.0,
            close_timeout_s=2.0,
            restart_backoff_s=0.01,
            max_restarts=2,
            env_threads=False,
        ),
    )
    try:
        pool.reset()
        for step in range(1, 7):
            pool.async_step_send(TensorDict({"action": torch.full((1,), step / 10)}, []), 0)
        counts, truncated = [], []
        for _ in range(6):
            out = pool.async_step_recv(env_index=0, timeout=60)
            counts.append(int(out["next", "observation"][1]))
            truncated.append(bool(out["next", "truncated"]))
        first_cut = truncated.index(True)  # the fatal step is cut short, at least
        assert counts[:first_cut] == list(range(1, first_cut + 1))  # run once, in order
        assert all(truncated[first_cut:]) and not any(counts[first_cut:])
        assert pool.env_stats()[0]["restarts"] == 1
    finally:
        pool.close()


def hangs_when_rebuilt(flag: str, env_id: int) -> CountingEnv:
    """A CountingEnv whose build, once ``flag`` exists, never finishes (a restart that hangs)."""
    if os.path.exists(flag):
        time.sleep(1000)
    return CountingEnv(env_id=env_id)


def hanging_restart_pool(tmp_path, max_restarts: int, register_timeout_s: float = 1.0):
    """Two envs, env 0's worker SIGKILLed once its rebuild hangs; returns (pool, flag).

    Built with QUICK's long registration timeout (a first fork server imports
    torch within it); then the supervisor's is shortened, so a restart that does
    not register is seen in ``register_timeout_s``, not minutes.
    """
    flag = tmp_path / "rebuilds-hang"
    config = dataclasses.replace(QUICK, max_restarts=max_restarts)
    pool = ZMQAsyncEnvPool(
        hangs_when_rebuilt,
        create_env_kwargs=[{"flag": str(flag), "env_id": i} for i in range(2)],
        config=config,
    )
    pool.runtime.supervisor.config = dataclasses.replace(
        config, register_timeout_s=register_timeout_s
    )
    pool.reset()
    flag.touch()
    os.kill(pool.worker_pid(0), signal.SIGKILL)
    return pool, flag


def test_a_restart_that_never_registers_ends_in_a_crash_loop_not_a_hang(tmp_path):
    """The audit's hang: a restarted worker that never registered had no deadline at all.

    Its env's requests waited for ever (a sync step blocked; an async loop
    lost the env without a word). Now a start not registered within
    ``register_timeout_s`` is killed and counted as a death: here, with
    ``max_restarts=1``, the second one is a crash loop and the request fails.
    """
    pool, _ = hanging_restart_pool(tmp_path, max_restarts=1)
    try:
        pool.async_step_send(actions([0.1, 0.2]), env_index=[0, 1])
        # max_get: with a timeout, a recv would go on batching until env 0's answer too
        out = pool.async_step_recv(min_get=1, max_get=1, timeout=60)
        assert ids(out) == [1]  # the other env carries on
        start = time.monotonic()
        with pytest.raises(CrashLoopError) as info:
            pool.async_step_recv(min_get=1, timeout=20)
        assert info.value.env_indices == [0]
        assert "did not register within 1.0 s" in str(info.value)
        assert time.monotonic() - start < 15
        pool.async_step_send(actions([0.3]), env_index=[1])
        assert ids(pool.async_step_recv(min_get=1, timeout=20)) == [1]
    finally:
        pool.close()


def test_a_restart_that_does_not_register_in_time_is_tried_again(tmp_path):
    pool, flag = hanging_restart_pool(tmp_path, max_restarts=100)
    try:
        pool.async_step_send(actions([0.1]), env_index=[0])
        deadline = time.monotonic() + 20
        while "did not register" not in (pool.env_stats()[0]["last_restart_cause"] or ""):
            assert time.monotonic() < deadline, "the hung restart was never given up on"
            with pytest.raises(TimeoutError):  # listens meanwhile: nothing to answer yet
                pool.async_step_recv(min_get=1, timeout=0.1)
        flag.unlink()  # the next start builds its env: the request is answered
        out = pool.async_step_recv(min_get=1, timeout=20)
        assert ids(out) == [0] and out["next", "truncated"].item()
        assert pool.last_restarted_envs == [0] and pool.env_stats()[0]["restarts"] >= 2
    finally:
        pool.close()


def test_close_during_a_restart_kills_the_unregistered_worker_at_once(tmp_path, caplog):
    """A worker not registered yet never hears CLOSE: close() waited all of
    ``close_timeout_s`` for it, then killed it ("did not exit in time"). Now it is
    killed at once."""
    pool, _ = hanging_restart_pool(tmp_path, max_restarts=100, register_timeout_s=60.0)
    closed = False
    try:
        old, deadline = pool.runtime.roster.local[0].process, time.monotonic() + 20
        while pool.runtime.roster.local[0].process in (old, None):  # until its restart is forked
            assert time.monotonic() < deadline, "env 0's worker was never restarted"
            pool.async_step_send(actions([0.1]), env_index=[1])
            assert ids(pool.async_step_recv(min_get=1, timeout=60)) == [1]
        new = pool.runtime.roster.local[0]
        assert new.phase is WorkerPhase.STARTING and new.process is not None
        pid = new.process.pid
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="zmqpool"):
            pool.close()
        closed = True
        assert time.monotonic() - start < QUICK.close_timeout_s / 2
        assert "did not exit in time" not in caplog.text
        assert pids_alive([pid]) == []
    finally:
        if not closed:
            pool.close()


_OUT_OF_FILES = """
import os, resource, signal, time
import torch
from tensordict import TensorDict
from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

# A restart 2 s after the death is seen: on a busy machine, one 0.5 s after could come
# before the limit below is set, and its worker's connection then met a trainer out of
# files, where libzmq aborts (an accept's EMFILE is fatal to it).
config = PoolConfig(
    register_timeout_s=90.0, close_timeout_s=2.0, restart_backoff_s=2.0, restart_backoff_max_s=2.0
)
pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}, {"env_id": 1}], config=config)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

def step(env):
    pool.async_step_send(TensorDict({"action": torch.full((1, 1), 0.5)}, [1]), env_index=[env])
    out = pool.async_step_recv(min_get=1, timeout=30)
    assert [int(i) for i in out["env_index"]] == [env]

def until_cause(text):
    deadline = time.monotonic() + 30
    while text not in (pool.env_stats()[0]["last_restart_cause"] or ""):
        assert time.monotonic() < deadline, f"env 0's cause never read {text!r}"
        step(1)  # env 1's results come back meanwhile

try:
    pool.reset()
    victim = pool.worker_pid(0)
    os.kill(victim, signal.SIGKILL)
    until_cause("SIGKILL")  # seen: its restart is due in restart_backoff_s
    lowest_free = os.open(os.devnull, os.O_RDONLY)  # a new file takes the lowest free
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # none below it
    try:
        until_cause("could not start")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    step(0)
    assert pool.worker_pid(0) not in (None, victim)
finally:
    pool.close()
print("tried again")
"""


def test_a_restart_that_cannot_open_a_file_is_tried_again():
    """The trainer out of file descriptors (a hostile audit had a keyless peer hold them all).

    Once a worker's death is seen, no new file may be opened (``RLIMIT_NOFILE``
    at the lowest free descriptor): its restart fails with EMFILE. That
    ``OSError`` used to escape the recv, costing the other env its result; now
    the restart is tried again, with backoff, and succeeds once files can be
    opened. In a process of its own: out of files, libzmq itself may abort.
    """
    done = subprocess.run(
        [sys.executable, "-c", _OUT_OF_FILES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("tried again")


def _seed_in(out, env: int) -> float:
    """The seed CountingEnv's observation holds, in env ``env``'s row of a step's result."""
    return out["next", "observation"][ids(out).index(env), 3].item()


def _as_observed(seed: int) -> float:
    return torch.tensor(float(seed)).to(torch.float32).item()  # the observation's dtype


def _kill_and_step(pool) -> TensorDict:
    os.kill(pool.worker_pid(0), signal.SIGKILL)
    pool.async_step_send(actions([0.1, 0.2]), env_index=[0, 1])
    return pool.async_step_recv(min_get=2, timeout=60)


def test_a_rebuilt_env_is_seeded_from_the_seed_set_seed_gave_it():
    """A rebuilt env was unseeded (seeding audit): a seeded run did not reproduce past its
    first restart, and set_seed again restarted every healthy env's stream. Its first
    reset now seeds it first, with restart_seed(its seed, its restarts); a set_seed
    made before that reset wins."""
    pool = ZMQAsyncEnvPool([CountingEnv] * 2, config=QUICK)
    try:
        pool.set_seed(100)
        healthy_seed = pool.reset()["observation"][1, 3].item()  # env 1's, from the chain
        out = _kill_and_step(pool)
        assert pool.last_restarted_envs == [0]
        assert _seed_in(out, 0) == _as_observed(restart_seed(100, 1))
        assert _seed_in(out, 1) == healthy_seed  # not seeded again
        os.kill(pool.worker_pid(0), signal.SIGKILL)
        pool.set_seed(300)  # before the rebuilt env's first reset: it is seeded with this
        out = pool.step(actions([0.1, 0.2]))
        assert pool.env_stats()[0]["restarts"] == 2
        assert _seed_in(out, 0) == 300.0
    finally:
        pool.close()


class SeedStallsOnce(CountingEnv):
    """A ``CountingEnv`` whose first ``set_seed`` takes ``stall_s`` (``flag``, a file, marks it)."""

    def __init__(self, env_id: int = 0, stall_s: float = 0.0, flag: str = "") -> None:
        super().__init__(env_id=env_id)
        self.stall_s, self.flag = stall_s, flag

    def _set_seed(self, seed):
        if self.stall_s and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            time.sleep(self.stall_s)
        super()._set_seed(seed)


def test_a_seed_past_its_deadline_names_its_env_and_its_late_reply_is_dropped(tmp_path):
    # Session 62's audit: set_seed raised the generic "async recv timed out", and the late
    # reply stayed on env 0's own reset channel: every later set_seed was refused ("resets
    # in flight") and async_reset_recv(env_index=0) returned it as a reset nobody sent.
    config = PoolConfig(register_timeout_s=6.0, close_timeout_s=2.0)  # set_seed's deadline
    stalled = {"env_id": 0, "stall_s": 9.0, "flag": str(tmp_path / "stalled")}
    kwargs = [stalled, {"env_id": 1}]
    pool = ZMQAsyncEnvPool(SeedStallsOnce, create_env_kwargs=kwargs, config=config)
    try:
        pool.reset()
        with pytest.raises(RecvTimeoutError, match=r"env 0 did not answer its set_seed within"):
            pool.set_seed(7)
        with pytest.raises(NothingInFlightError):  # no reset was sent on env 0's channel
            pool.async_reset_recv(env_index=0, timeout=1.0)
        deadline = time.monotonic() + 30.0
        while True:  # once the stall is over, the late reply goes and a seed comes back
            try:
                pool.set_seed(9)
                break
            except RecvTimeoutError:
                assert time.monotonic() < deadline, "set_seed never went through"
        seeds = pool.reset()["observation"][:, 3].tolist()
        assert seeds[0] == 9 and seeds[1] != -1, seeds
        assert pool.env_stats()[0]["in_flight"] == 0
    finally:
        pool.close()
