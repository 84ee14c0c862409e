"""Remote workers launched as Ray actors (zmqpool.ray_workers), on a local Ray cluster.

A mixed pool (one local env, two envs on Ray actors) runs the exactly-once
driver; one actor's process is SIGKILLed mid-run: Ray restarts it, it
rejoins its slot under the same identity and key, and its request in flight
is answered by one restart truncation. Nothing else is lost or duplicated,
and ``pool.close()`` ends the actors.
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import ray
import torch
from tensordict import TensorDict

from tests.exactly_once import ExactlyOnce
from zmqpool import (
    PoolConfig,
    RecvTimeoutError,
    RegistrationError,
    RemoteWorkerDeadError,
    ZMQAsyncEnvPool,
)
from zmqpool.ray_workers import RayWorkers
from zmqpool.testing import CountingEnv

CONFIG = PoolConfig(register_timeout_s=90.0, close_timeout_s=2.0)
#: The pool's register deadline where an actor gives up after 2 s: the pool must not wait it out.
POOL_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def ray_cluster():
    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"\nRay start-up: {time.monotonic() - started:.1f} s")
    yield
    ray.shutdown()


def restarts(pool) -> list[int]:
    return [s["restarts"] for _, s in sorted(pool.env_stats().items())]


def wait_for_new_pid(workers: RayWorkers, index: int, old: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = workers.actor_pids(timeout_s=5.0)[index]
        except Exception:  # the actor is being restarted: its methods fail for a moment
            pid = old
        if pid != old:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"Ray did not restart actor {index} within {timeout_s} s")


def test_a_ray_actor_killed_mid_run_rejoins_and_every_request_is_answered_once(ray_cluster):
    workers = RayWorkers(
        "zmqpool.testing:CountingEnv",
        count=2,
        env_kwargs=[{"env_id": 1}, {"env_id": 2}],
        num_cpus=0.5,
        max_restarts=-1,
    )
    started = time.monotonic()
    pool = ZMQAsyncEnvPool(
        [CountingEnv],
        create_env_kwargs=[{"env_id": 0}],
        remote_workers=workers,
        bind="tcp://127.0.0.1:*",
        config=CONFIG,
    )
    print(f"pool with 2 Ray-hosted envs built in {time.monotonic() - started:.1f} s")
    try:
        assert pool.num_envs == 3 and pool.remote_endpoint is not None
        driver = ExactlyOnce(pool, 3, 60, random.Random(3), restarts=True)
        driver.run()  # every env steps, Ray-hosted ones included
        assert driver.truncations == [0, 0, 0]

        victim = workers.actor_pids()[0]  # hosts env 1
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        driver.steps += 60
        while driver.truncations[1] == 0:
            assert time.monotonic() - killed < 90, "no truncation for the killed actor's env"
            driver.send([e for e in range(3) if e not in driver.awaited])
            driver.receive()
        print(f"kill to truncation: {time.monotonic() - killed:.1f} s")
        while driver.received < driver.steps:
            driver.send_random()
            if driver.awaited:
                driver.receive()
        assert driver.truncations == [0, 1, 0], driver.truncations
        assert restarts(pool) == [0, 1, 0]
        assert wait_for_new_pid(workers, 0, victim, 30.0) != victim
    finally:
        pool.close()
    assert workers.actors == []  # close() ended them (no restart)
    try:  # the next call starts the pool again, as SerialEnv: new actors, on a new port
        assert pool.reset()["observation"][:, 0].tolist() == [0.0, 1.0, 2.0]
        assert len(workers.actors) == 2
    finally:
        pool.close()
    assert workers.actors == []


def test_ray_actors_build_their_envs_with_the_trainers_default_dtype(ray_cluster):
    # As local workers do, and SerialEnv's in-process envs: float64 here, where an
    # actor's process left to itself builds float32 specs and observations.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        kwargs = [{"obs_dtype": None}]  # torch's default dtype, in the actor
        workers = RayWorkers("zmqpool.testing:CountingEnv", count=1, env_kwargs=kwargs)
        pool = ZMQAsyncEnvPool([], remote_workers=workers, bind="tcp://127.0.0.1:*", config=CONFIG)
    finally:
        torch.set_default_dtype(previous)
    try:
        assert pool.observation_spec["observation"].dtype == torch.float64
        assert pool.reset()["observation"].dtype == torch.float64
    finally:
        pool.close()


def failed_construction(workers: RayWorkers) -> tuple[str, float]:
    """The ``RegistrationError`` a pool of only ``workers`` fails with, and how long it took."""
    started = time.monotonic()
    with pytest.raises(RegistrationError) as caught:
        ZMQAsyncEnvPool(
            [],
            remote_workers=workers,
            bind="tcp://127.0.0.1:*",
            config=PoolConfig(register_timeout_s=POOL_DEADLINE_S, close_timeout_s=1.0),
        )
    return str(caught.value), time.monotonic() - started


def test_an_actor_that_cannot_reach_the_pool_names_the_address_and_key(ray_cluster):
    workers = RayWorkers(
        "zmqpool.testing:CountingEnv",
        count=1,
        num_cpus=0.5,
        connect_host="127.0.0.2",  # nothing listens there
        register_timeout_s=2.0,
        max_restarts=0,
    )
    message, waited = failed_construction(workers)
    assert "tcp://127.0.0.2:" in message and "with key" in message, message
    # The actor gave up after its own 2 s: the pool heard it then, not at its own deadline.
    assert waited < POOL_DEADLINE_S / 2, f"construction failed after {waited:.1f} s"
    assert workers.actors == []


def test_an_actor_whose_env_maker_fails_fails_construction_at_once_saying_why(ray_cluster):
    # Ray does not restart an actor whose constructor raised (max_restarts notwithstanding):
    # the pool must not wait out its deadline, and must say what the maker raised.
    workers = RayWorkers(
        "zmqpool.testing:CountingEnv", count=1, env_kwargs={"no_such_kwarg": 1}, num_cpus=0.5
    )
    message, waited = failed_construction(workers)
    assert waited < POOL_DEADLINE_S / 2, f"construction failed after {waited:.1f} s"
    assert "no_such_kwarg" in message, message
    assert workers.actors == []


#: A trainer that exits without close(), a weakref.finalize made before ray.init (as
#: tempfile's, or many a library's): Ray's own exit hook runs first, then the pool's.
EXIT_WITHOUT_CLOSE = """
import json, os, sys, tempfile
kept = tempfile.TemporaryDirectory()
import ray
from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.ray_workers import RayWorkers
ray.init(address=sys.argv[1], log_to_driver=False)
workers = RayWorkers("zmqpool.testing:CountingEnv", count=1, num_cpus=0.5)
pool = ZMQAsyncEnvPool([], remote_workers=workers, bind="tcp://127.0.0.1:*",
                       config=PoolConfig(register_timeout_s=90))
pool.reset()
print(json.dumps({"pid": os.getpid()}), flush=True)
"""


def test_a_trainer_that_exits_without_close_after_ray_leaves_nothing_behind(ray_cluster):
    # The pool's finalizer found Ray shut down: "RayWorkers: connect to a Ray cluster
    # first" on stderr, and its sockets' directory (/tmp/zmqp-<pid>-*) left behind.
    address = ray.get_runtime_context().gcs_address
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXIT_WITHOUT_CLOSE), address],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0 and '"pid"' in run.stdout, run.stderr[-3000:]
    assert "Error" not in run.stderr, run.stderr[-3000:]
    pid = json.loads(run.stdout.strip().splitlines()[-1])["pid"]
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"zmqp-{pid}-*"))


#: Far below the 10 s silence plus the 60 s rejoin_timeout_s a dead actor's envs waited before.
DEAD_FOR_GOOD_WITHIN_S = 8.0


def step_envs(pool, envs: list[int]) -> None:
    """A step for each env of ``envs``, each on its own channel (``recv_env``)."""
    for env in envs:
        pool.async_step_send(TensorDict({"action": torch.ones(1)}, []), env_index=env)


def recv_env(pool, env: int, timeout_s: float = 30.0):
    return pool.async_step_recv(env_index=env, timeout=timeout_s)


def wait_for_exit(pid: int, timeout_s: float) -> None:
    """Until process ``pid`` (on this node) is gone or a zombie."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs after {timeout_s} s")


def wait_until_lost(pool, env: int, since: float, within_s: float) -> float:
    """Receive env ``env``'s step until it raises (not caught here); fail after ``within_s``."""
    while time.monotonic() - since < within_s:
        try:
            out = recv_env(pool, env, timeout_s=0.5)
        except RecvTimeoutError:  # no answer yet: look again
            continue
        raise AssertionError(f"env {env} answered: {out}")
    raise AssertionError(f"env {env} was not lost within {within_s} s")


def test_an_actor_ray_will_not_restart_fails_its_envs_at_once_saying_why(ray_cluster):
    # ray.kill(handle) ends an actor for good (no_restart=True): its env's step fails
    # within seconds with Ray's reason, not after the silence and rejoin_timeout_s.
    workers = RayWorkers("zmqpool.testing:CountingEnv", count=2, num_cpus=0.5, max_restarts=-1)
    pool = ZMQAsyncEnvPool([], remote_workers=workers, bind="tcp://127.0.0.1:*", config=CONFIG)
    try:
        pool.reset()
        handle = workers.actors[0]  # hosts env 0
        pid = workers.actor_pids()[0]
        ray.kill(handle)
        killed = time.monotonic()
        wait_for_exit(pid, 10.0)  # the step below cannot be answered before it died
        step_envs(pool, [0, 1])
        assert int(recv_env(pool, 1)["env_index"]) == 1  # the other actor steps on
        with pytest.raises(RemoteWorkerDeadError) as caught:
            wait_until_lost(pool, 0, killed, DEAD_FOR_GOOD_WITHIN_S)
        waited = time.monotonic() - killed
        message = str(caught.value)
        assert caught.value.env_indices == [0], message
        assert "Ray actor 0" in message and "ray.kill" in message, message
        assert waited < DEAD_FOR_GOOD_WITHIN_S, f"lost after {waited:.1f} s"
        print(f"ray.kill to RemoteWorkerDeadError: {waited:.1f} s")
        with pytest.raises(RemoteWorkerDeadError):  # later calls on the env fail alike
            step_envs(pool, [0])
        for _ in range(3):
            step_envs(pool, [1])
            assert int(recv_env(pool, 1)["env_index"]) == 1
    finally:
        pool.close()
    assert workers.actors == []


def test_an_env_maker_that_fails_on_ray_restart_loses_its_envs_with_the_makers_error(
    ray_cluster, tmp_path
):
    # The actor's process dies; Ray restarts it, and its env maker raises this time.
    # Ray does not restart a failed constructor: the env's error says what the maker raised.
    flag = tmp_path / "fail"
    kwargs = [{"fail_if_exists": str(flag)}, {}]
    workers = RayWorkers(
        "tests.test_ray:maker_failing_on_restart", count=2, env_kwargs=kwargs, num_cpus=0.5
    )
    pool = ZMQAsyncEnvPool([], remote_workers=workers, bind="tcp://127.0.0.1:*", config=CONFIG)
    try:
        pool.reset()
        flag.touch()
        os.kill(workers.actor_pids()[0], signal.SIGKILL)
        killed = time.monotonic()
        step_envs(pool, [0])
        with pytest.raises(RemoteWorkerDeadError) as caught:  # Ray starts a process first
            wait_until_lost(pool, 0, killed, 30.0)
        message = str(caught.value)
        assert "maker refused: the flag file is there" in message, message
        print(f"SIGKILL to RemoteWorkerDeadError: {time.monotonic() - killed:.1f} s")
        step_envs(pool, [1])
        assert int(recv_env(pool, 1)["env_index"]) == 1
    finally:
        pool.close()


def test_an_actor_past_its_max_restarts_fails_its_envs_saying_so(ray_cluster):
    workers = RayWorkers("zmqpool.testing:CountingEnv", count=2, num_cpus=0.5, max_restarts=0)
    pool = ZMQAsyncEnvPool([], remote_workers=workers, bind="tcp://127.0.0.1:*", config=CONFIG)
    try:
        pool.reset()
        os.kill(workers.actor_pids()[1], signal.SIGKILL)  # hosts env 1
        killed = time.monotonic()
        step_envs(pool, [1])
        with pytest.raises(RemoteWorkerDeadError) as caught:
            wait_until_lost(pool, 1, killed, DEAD_FOR_GOOD_WITHIN_S)
        message = str(caught.value)
        assert "Ray actor 1" in message and "max_restarts=0 exhausted" in message, message
        step_envs(pool, [0])
        assert int(recv_env(pool, 0)["env_index"]) == 0
    finally:
        pool.close()


def maker_failing_on_restart(fail_if_exists: str | None = None) -> CountingEnv:
    """A ``CountingEnv`` whose maker raises once ``fail_if_exists`` exists (on a restart)."""
    if fail_if_exists is not None and os.path.exists(fail_if_exists):
        raise RuntimeError("maker refused: the flag file is there")
    return CountingEnv()
