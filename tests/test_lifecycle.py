"""Construction and teardown: clear errors, lambdas, mixed envs, bounded close, no leftovers."""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

import zmqpool.runtime
from tests.conformance import GlobalRandomEnv, assert_same_td, counting_makers
from tests.conftest import FAST, pids_alive
from zmqpool import EnvMakerError, PoolClosedError, PoolConfig, ZMQAsyncEnvPool
from zmqpool.endpoints import make_private_dir, remove_private_dir, sweep_stale_dirs
from zmqpool.testing import CountingEnv, FaultyEnv


def worker_pids(pool) -> list[int]:
    return [p.pid for p in pool.worker_processes().values()]


def test_env_maker_error_names_the_env_and_leaves_nothing_behind(monkeypatch):
    made: list[str] = []

    def recording_make_private_dir() -> str:
        made.append(make_private_dir())
        return made[-1]

    monkeypatch.setattr(zmqpool.runtime, "make_private_dir", recording_make_private_dir)
    makers = [CountingEnv, functools.partial(FaultyEnv, in_init=True)]
    with pytest.raises(EnvMakerError) as info:
        ZMQAsyncEnvPool(makers, create_env_kwargs=[{"env_id": 0}, {"env_id": 1}], config=FAST)
    assert info.value.env_index == 1
    assert str(info.value).startswith("env 1: env maker raised ")  # the env named once
    assert "FaultyEnv 1 refuses to be built" in info.value.remote_traceback
    assert made and not any(os.path.exists(d) for d in made)


def test_lambdas_closures_and_heterogeneous_envs_with_a_lazy_stack():
    width = 6

    def wide_env():  # a closure: torchrl's spawn-based pool cannot send it
        return CountingEnv(env_id=1, obs_shape=(width,))

    pool = ZMQAsyncEnvPool(
        [lambda: CountingEnv(env_id=0), wide_env], stack="lazy", envs_per_worker=2, config=FAST
    )
    try:
        td = pool.reset()
        assert isinstance(td, LazyStackedTensorDict)
        assert [t["observation"].shape[-1] for t in td.tensordicts] == [4, width]
        td["action"] = torch.full((2, 1), 0.5)
        out = pool.step(td)
        assert [t["observation"][1].item() for t in out["next"].tensordicts] == [1.0, 1.0]
        pool.async_step_send(td, env_index=[0, 1])
        got = pool.async_step_recv(min_get=2, timeout=30)
        assert [t["observation"][0].item() for t in got.tensordicts] == [0.0, 1.0]
    finally:
        pool.close()


def test_close_is_bounded_with_hung_workers_and_leaves_nothing():
    """``close_timeout_s`` bounds the whole close, not each worker's wait.

    Three hung workers: waiting ``close_timeout_s`` for each in turn would take
    3 s, more than the bound (``close_timeout_s`` plus 1.5 s of slack).
    """
    config = PoolConfig(register_timeout_s=90.0, close_timeout_s=1.0)
    pool = ZMQAsyncEnvPool(
        FaultyEnv, create_env_kwargs=[{"fault": "hang", "fault_at": 1}] * 3, config=config
    )
    pids, directory = worker_pids(pool), pool.runtime.resources.directory
    assert len(pids) == 3
    td = pool.reset()
    td["action"] = torch.zeros(3, 1)
    pool.async_step_send(td, env_index=[0, 1, 2])
    with pytest.raises(TimeoutError):
        pool.async_step_recv(min_get=1, timeout=0.3)
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < config.close_timeout_s + 1.5
    assert pids_alive(pids) == []
    assert not glob.glob(f"{directory}*")
    with pytest.raises(PoolClosedError):
        pool.async_step_recv(min_get=1, timeout=1.0)
    assert pool.worker_processes() == {} and pool.worker_pid(0) is None  # not the dead pid


def test_a_collector_shut_down_early_closes_the_pool_as_serial_env():
    """The pool said is_closed from its construction until a restart, so Collector.shutdown
    (``close_env and not env.is_closed``) left its workers running until close() (ecosystem
    audit). Open, it says it is open, as SerialEnv does once started."""
    from torchrl.collectors import Collector
    from torchrl.envs import SerialEnv

    makers = counting_makers(2, max_steps=3)
    serial, pool = SerialEnv(2, makers), ZMQAsyncEnvPool(makers)
    try:
        assert not pool.is_closed and len(worker_pids(pool)) == 2
        pids = worker_pids(pool)
        for env in (serial, pool):
            collector = Collector(env, policy=None, frames_per_batch=4, total_frames=400)
            next(iter(collector))  # one batch of many, then stop
            collector.shutdown()
            assert env.is_closed
        assert pool.worker_processes() == {} and pids_alive(pids) == []  # close() reaps them
    finally:
        serial.close(raise_if_closed=False)
        pool.close(raise_if_closed=False)


def test_a_pool_a_collector_closed_starts_again_when_used_after_as_serial_env():
    """torchrl's Collector closes its env at total_frames. SerialEnv starts again on the
    next call, and so does the pool (torchrl's stays closed): the same rollout after."""
    from torchrl.collectors import Collector
    from torchrl.envs import SerialEnv

    makers = counting_makers(2, max_steps=3)
    serial, pool = SerialEnv(2, makers), ZMQAsyncEnvPool(makers)
    try:
        for env in (serial, pool):
            collector = Collector(env, policy=None, frames_per_batch=4, total_frames=8)
            assert sum(batch.numel() for batch in collector) == 8
            collector.shutdown(close_env=False)
            assert env.is_closed
        with pytest.raises(PoolClosedError, match="a step, reset or send starts"):
            pool.async_step_recv(min_get=1, timeout=1.0)  # nothing can be in flight
        old_pids = worker_pids(pool)
        rollouts = [
            env.rollout(5, policy=ones_of(env), break_when_any_done=False) for env in (serial, pool)
        ]
        assert_same_td(
            *rollouts, what="rollout after the Collector closed the env", exclude={"env_index"}
        )
        assert not pool.is_closed and len(worker_pids(pool)) == 2
        assert not set(worker_pids(pool)) & set(old_pids)
    finally:
        serial.close(raise_if_closed=False)
        pool.close(raise_if_closed=False)


def ones_of(env):
    return lambda td: td.update(env.full_action_spec.one())


def test_two_threads_using_a_closed_pool_start_it_once():
    """The first call starts the pool again under its gate; one waiting meanwhile uses the
    new pool, rather than starting another."""
    kwargs = [{"env_id": 0}, {"env_id": 1}]
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs, config=FAST)
    try:
        pool.reset()
        pool.close()
        barrier = threading.Barrier(2, timeout=30.0)
        results: queue.Queue[object] = queue.Queue()

        def reset_env(index: int) -> None:
            try:
                barrier.wait()
                pool.async_reset_send(env_index=index)
                results.put(pool.async_reset_recv(env_index=index, timeout=30.0))
            except BaseException as err:
                results.put(err)

        threads = [threading.Thread(target=reset_env, args=(i,), daemon=True) for i in (0, 1)]
        for thread in threads:
            thread.start()
        got = [results.get(timeout=120.0) for _ in threads]
        assert all(isinstance(td, TensorDictBase) for td in got), got
        assert sorted(td["observation"][0].item() for td in got) == [0.0, 1.0]
        assert len(worker_pids(pool)) == 2  # one start: a second would have closed the first
        assert_workers_answer(pool)
    finally:
        pool.close(raise_if_closed=False)


def test_a_copy_shares_the_workers_and_closing_or_dropping_it_closes_the_original():
    """``copy.copy(pool)`` shares the workers; closing the copy stopped them, and the
    original's ``is_closed`` still said False. Each starts again on its next call."""
    import copy
    import gc

    kwargs = [{"env_id": 0}, {"env_id": 1}]
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs, config=FAST)
    copies = []
    try:
        twin = copy.copy(pool)
        copies.append(twin)
        assert worker_pids(twin) == worker_pids(pool) and not pool.is_closed
        old_pids = worker_pids(pool)
        twin.close()
        assert twin.is_closed and pool.is_closed and "closed" in repr(pool)
        assert_workers_answer(pool)  # the original starts again, with workers of its own
        assert not pool.is_closed and not set(worker_pids(pool)) & set(old_pids)
        assert twin.is_closed  # the copy's next call would start its own
        copies.clear()
        del twin
        dropped = copy.copy(pool)
        del dropped
        gc.collect()  # a dropped copy closes what it shares, as EnvBase.__del__ does
        assert pool.is_closed
        assert_workers_answer(pool)
        assert not pool.is_closed
    finally:
        for twin in copies:
            twin.close(raise_if_closed=False)
        pool.close(raise_if_closed=False)


def test_a_with_block_closes_the_pool_and_reaps_its_workers_even_when_it_raises():
    kwargs = [{"env_id": 0}, {"env_id": 1}]
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs, config=FAST)
    with pytest.raises(KeyError, match="raised in the block"), pool as entered:
        assert entered is pool and pool.reset()["observation"].shape[0] == 2
        pids = worker_pids(pool)
        raise KeyError("raised in the block")
    assert pool.is_closed and len(pids) == 2 and pids_alive(pids) == []


def test_a_failed_start_again_leaves_the_pool_closed_and_the_next_call_tries_again(tmp_path):
    down = tmp_path / "down"

    def make_env():
        if down.exists():
            raise RuntimeError("the simulator's licence server is down")
        return CountingEnv()

    pool = ZMQAsyncEnvPool([make_env], config=FAST)
    try:
        pool.close()
        down.touch()
        with pytest.raises(EnvMakerError, match="licence server is down"):
            pool.reset()
        assert pool.is_closed and pool.worker_processes() == {}
        with pytest.raises(PoolClosedError):
            pool.async_step_recv(min_get=1, timeout=1.0)
        down.unlink()
        assert pool.reset()["observation"].shape == (1, 4)
        assert not pool.is_closed
    finally:
        pool.close(raise_if_closed=False)


def assert_workers_answer(pool) -> None:
    td = pool.reset()
    td["action"] = torch.zeros(2, 1)
    pool.async_step_send(td, env_index=[0, 1])
    assert sorted(pool.async_step_recv(min_get=2, timeout=30.0)["env_index"]) == [0, 1]


DROPPED = textwrap.dedent(
    """
    import gc, os, sys
    from zmqpool import ZMQAsyncEnvPool
    from zmqpool.testing import CountingEnv
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}, {"env_id": 1}])
    pids = [p.pid for p in pool.worker_processes().values()] + [pool.fork_server_pid]
    print(" ".join(str(pid) for pid in pids))  # its fork server ends with it too
    print(pool.runtime.resources.directory, flush=True)
    pool.reset()
    if sys.argv[1] == "drop":
        del pool
        gc.collect()
        print("dropped", flush=True)
    # else: exit with the pool still open
    """
)


@pytest.mark.parametrize("how", ["drop", "exit"])
def test_unclosed_pool_cleans_up_and_does_not_block_exit(how, tmp_path):
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED)
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    pids_line, directory = out.stdout.splitlines()[:2]
    assert pids_alive([int(p) for p in pids_line.split()]) == []
    assert not glob.glob(f"{directory}*")
    if how == "drop":
        assert "dropped" in out.stdout
    assert time.monotonic() - start < 110


FORKED = textwrap.dedent(
    """
    import os, sys
    from zmqpool import PoolClosedError, ZMQAsyncEnvPool
    from zmqpool.testing import CountingEnv
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}, {"env_id": 1}],
                           envs_per_worker=2)
    action = pool.full_action_spec.zero()
    pool.reset()
    for child in ("exits", "closes", "uses"):
        pid = os.fork()
        if pid == 0:  # the child: exits as a script does, running its inherited finalizers
            if child == "closes":
                pool.close()
            elif child == "uses":
                try:
                    pool.async_step_send(action, env_index=[0, 1])
                except PoolClosedError as err:
                    print(err, flush=True)
            sys.exit(0)
        os.waitpid(pid, 0)
        pool.async_step_send(action, env_index=[0, 1])
        out = pool.async_step_recv(min_get=2, timeout=30.0)
        print("parent stepped after a child that", child, sorted(out["env_index"]), flush=True)
    pool.close()
    """
)


def test_a_forked_child_leaves_its_parents_pool_alone(tmp_path):
    # Its inherited finalizer used to stop the parent's workers and remove its
    # sockets: the parent's next recv waited for workers that could not register.
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for child in ("exits", "closes", "uses"):
        assert f"parent stepped after a child that {child} [0, 1]" in out.stdout
    assert "a forked child cannot use it" in out.stdout


FORKED_MID_CALL = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from zmqpool import PoolClosedError, ZMQAsyncEnvPool
    from zmqpool.testing import CountingEnv
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"step_sleep_s": (1.5, 1.5)}])
    action = pool.full_action_spec.zero()
    pool.reset()
    worker = pool.worker_pid(0)
    if sys.argv[1] == "closing":  # stopped, the worker does not exit: close waits 3 s
        os.kill(worker, signal.SIGSTOP)
        stepping = threading.Thread(target=pool.close)
    else:
        stepping = threading.Thread(target=pool.step, args=(action,))  # in the pool for 1.5 s
    stepping.start()
    time.sleep(0.5)
    pid = os.fork()
    if pid == 0:  # the child: the gate it inherited is held, by a thread it does not have
        try:
            pool.async_step_send(action, env_index=[0])
        except PoolClosedError as err:
            print(err, flush=True)
        os._exit(0)
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print("the child hung", flush=True)
            break
        time.sleep(0.05)
    if sys.argv[1] == "closing":
        try:
            os.kill(worker, signal.SIGCONT)
        except ProcessLookupError:  # killed by the close already
            pass
    stepping.join(timeout=30)
    pool.close()
    """
)


@pytest.mark.parametrize("thread_in", ["stepping", "closing"])
def test_a_child_forked_while_a_thread_is_in_the_pool_is_refused_at_once(tmp_path, thread_in):
    # The child's first call waited for ever for the gate (thread-sharing audit), and in a
    # pool another thread was closing, once the first was mended (review).
    script = tmp_path / "forked_mid_call.py"
    script.write_text(FORKED_MID_CALL)
    argv = [sys.executable, str(script), thread_in]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "a forked child cannot use it" in out.stdout and "hung" not in out.stdout


def test_each_worker_and_each_restart_draws_its_own_random_numbers():
    # Forked from one fork server, every worker began with its generators'
    # state, and a restarted worker replayed its first life's draws.
    pool = ZMQAsyncEnvPool(GlobalRandomEnv, create_env_kwargs=[{}, {}], config=FAST)
    try:
        draws = pool.reset()["observation"][:, 4:6]
        assert not torch.equal(draws[0], draws[1])  # torch's draws and numpy's both
        assert (draws[0] != draws[1]).all()
        os.kill(worker_pids(pool)[0], signal.SIGKILL)
        again = pool.reset()["observation"][:, 4:6]  # env 0's first reset of its new life
        assert (again[0] != draws[0]).all()
    finally:
        pool.close()


def test_a_killed_trainers_directory_is_removed_by_the_next_pool(tmp_path):
    # A trainer killed by a signal leaves its ipc directory; the next pool made
    # removes those whose process is gone and whose router nobody listens on.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale, listened = tmp_path / f"zmqp-{gone.pid}-a", tmp_path / f"zmqp-{gone.pid}-b"
    live = tmp_path / f"zmqp-{os.getpid()}-c"
    for directory in (stale, listened, live):
        directory.mkdir()
    (stale / "r").touch()  # a socket file with nothing bound: ECONNREFUSED
    target = tmp_path / "not-a-pool"
    target.mkdir()
    (tmp_path / f"zmqp-{gone.pid}-link").symlink_to(target)  # another user's plant: not ours
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as router:
        router.bind(str(listened / "r"))  # a live process of that pid in another namespace
        router.listen()
        assert sweep_stale_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and listened.exists() and live.exists() and target.exists()
    mine = make_private_dir()
    remove_private_dir(mine)
    assert os.path.basename(mine).startswith(f"zmqp-{os.getpid()}-")  # what the sweep reads


def test_the_sweep_does_not_wait_on_a_router_that_listens_and_never_accepts(tmp_path):
    # A forked child of a killed trainer keeps its router listening and accepts nothing:
    # each sweep's probe took a place in its backlog, and once it was full (about 100
    # pool constructions later) every construction on the machine waited for ever.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    held = tmp_path / f"zmqp-{gone.pid}-held"
    held.mkdir()
    queued = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as router:
        router.bind(str(held / "r"))
        router.listen(0)
        for _ in range(8):  # fill the backlog: connects that are never accepted
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.setblocking(False)
            queued.append(client)
            with contextlib.suppress(BlockingIOError):
                client.connect(str(held / "r"))
        swept: list = []
        sweeper = threading.Thread(target=lambda: swept.append(sweep_stale_dirs(str(tmp_path))))
        sweeper.daemon = True  # if it waits for ever, the test fails and leaves it
        sweeper.start()
        sweeper.join(10)
        for client in queued:
            client.close()
    assert swept == [[]], "the sweep waited on a router that never accepts"
    assert held.exists()


def test_env_instances_maybe_dense_stack_and_worker_affinity():
    cpu = sorted(os.sched_getaffinity(0))[0]
    pool = ZMQAsyncEnvPool(
        [CountingEnv(env_id=0), CountingEnv(env_id=1)],  # instances, sent to their workers
        stack="maybe_dense",
        worker_affinity=[[cpu], [cpu]],
        config=FAST,
    )
    try:
        for pid in worker_pids(pool):
            assert os.sched_getaffinity(pid) == {cpu}
        td = pool.reset()
        assert td["observation"][:, 0].tolist() == [0.0, 1.0]
        td["action"] = torch.full((2, 1), 0.5)
        assert pool.step(td)["next", "observation"][:, 1].tolist() == [1.0, 1.0]
    finally:
        pool.close()


BUILT_IN_A_THREAD = textwrap.dedent(
    """
    import faulthandler, json, os, sys, threading, time
    from zmqpool import PoolConfig, ZMQAsyncEnvPool
    from zmqpool.testing import CountingEnv
    faulthandler.dump_traceback_later(60, exit=True)  # the test reads until it ends
    built = {}

    def build():
        built["pool"] = ZMQAsyncEnvPool(
            CountingEnv,
            create_env_kwargs=[{"env_id": 0}, {"env_id": 1}],
            config=PoolConfig(fork_server=sys.argv[1] == "fork-server"),
        )
        built["thread"] = threading.get_native_id()

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/self/task/{built['thread']}"):  # its OS thread has exited
        assert time.monotonic() < deadline, "the builder thread never exited"
        time.sleep(0.01)
    pool = built["pool"]
    pids = [p.pid for p in pool.worker_processes().values()]
    td = pool.reset()  # a worker its thread's exit killed could not answer: it restarts first
    pool.step(td.update(pool.full_action_spec.rand()))
    print(json.dumps({
        "pids": pids + [pid for pid in [pool.fork_server_pid] if pid is not None],
        "restarts": [stats["restarts"] for stats in pool.env_stats().values()],
        "same": [p.pid for p in pool.worker_processes().values()] == pids,
        "directory": pool.runtime.resources.directory,
    }), flush=True)
    sys.stdin.read()  # until the test kills us
    """
)


@pytest.mark.parametrize("mode", ["fork-server", "fresh-interpreters"])
def test_a_pool_built_in_a_thread_outlives_it_and_still_dies_with_the_trainer(mode, tmp_path):
    """Its processes used to die with the thread that built it (``PR_SET_PDEATHSIG`` fires
    when the parent *thread* ends): the thread returned, every worker (and a fork server
    it started) was SIGKILLed, every env restarted. Now they are started from a thread
    that lives as long as the process, and still die at once with the trainer."""
    script = tmp_path / "built_in_a_thread.py"
    script.write_text(BUILT_IN_A_THREAD)
    trainer = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline()  # the trainer's own watchdog bounds this
        assert line, f"the trainer exited with {trainer.wait(10)}"
        report = json.loads(line)
        assert report["restarts"] == [0, 0] and report["same"]
        pids = report["pids"]
        assert len(pids) == (3 if mode == "fork-server" else 2)
        assert pids_alive(pids) == pids
        trainer.kill()
        killed = time.monotonic()
        trainer.wait(10)
        while pids_alive(pids):
            assert time.monotonic() - killed < 5, f"{pids_alive(pids)} outlived their trainer"
            time.sleep(0.01)
        assert time.monotonic() - killed < 2  # PR_SET_PDEATHSIG: about 0.1 s
    finally:
        trainer.kill()
        trainer.wait(10)
    shutil.rmtree(report["directory"], ignore_errors=True)  # a killed trainer leaves it
