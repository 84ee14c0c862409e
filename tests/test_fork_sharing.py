"""The pools of a process share a fork server (``zmqpool.forkservers``).

In this session the fork server is kept (``tests/conftest.py``), so the
first two tests see it kept; the last runs a trainer of its own, with no
keeper, to see it end with its last pool and to kill it under two pools.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, pids_alive
from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.launcher import ForkServerStarting, Launcher
from zmqpool.testing import CountingEnv

REPO = Path(__file__).resolve().parents[1]
PRIVATE = PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0, share_fork_server=False)


def counting_pool(config: PoolConfig = FAST, **kwargs) -> ZMQAsyncEnvPool:
    return ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}], config=config, **kwargs)


def test_pools_fork_from_one_kept_fork_server_and_a_private_one_is_their_own():
    first, second = counting_pool(), counting_pool()
    private = counting_pool(PRIVATE)
    try:
        shared = first.fork_server_pid
        assert shared is not None and second.fork_server_pid == shared
        assert private.fork_server_pid not in (None, shared)
        first.close()
        third = counting_pool()  # forked from the kept one, though a pool closed meanwhile
        try:
            assert third.fork_server_pid == shared
            assert third.reset()["observation"][0, 0].item() == 0.0
        finally:
            third.close()
        own = private.fork_server_pid
        private.close()
        assert pids_alive([own]) == [] and pids_alive([shared]) == [shared]
    finally:
        for pool in (first, second, private):
            pool.close()


def _environment_checked(expected_env: str, expected_cwd: str):
    """An env maker that refuses to build unless the worker sees the trainer's now."""

    def make() -> CountingEnv:
        seen = (os.environ.get("ZMQPOOL_PROBE"), os.getcwd())
        if seen != (expected_env, expected_cwd):
            raise RuntimeError(f"the worker sees {seen}, not {(expected_env, expected_cwd)}")
        return CountingEnv()

    return make


def test_a_worker_forked_later_sees_the_trainers_environment_and_directory_now(
    tmp_path, monkeypatch
):
    before = counting_pool()  # the fork server is running before the change
    try:
        monkeypatch.setenv("ZMQPOOL_PROBE", "set after the fork server started")
        monkeypatch.chdir(tmp_path)
        pool = ZMQAsyncEnvPool(
            [_environment_checked("set after the fork server started", str(tmp_path))],
            config=FAST,
        )
        try:
            assert pool.fork_server_pid == before.fork_server_pid
            assert pool.reset().batch_size == (1,)
        finally:
            pool.close()
    finally:
        before.close()


TRAINER = textwrap.dedent(
    """
    import os, random, signal, sys, time, warnings
    sys.path.insert(0, sys.argv[1])
    from tests.exactly_once import ExactlyOnce
    from zmqpool import PoolConfig, ZMQAsyncEnvPool, keep_fork_server
    from zmqpool.launcher import ForkServerWarning
    from zmqpool.testing import CountingEnv

    config = PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0, restart_backoff_s=0.01)

    def pool():
        kwargs = [{"env_id": i} for i in range(2)]
        return ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs, config=config)

    def tell(pid):
        print(pid, flush=True)
        sys.stdin.readline()  # the test has looked at it

    def settle(driver):
        deadline = time.monotonic() + 60
        while driver.truncations != [1, 1]:
            assert time.monotonic() < deadline, driver.truncations
            driver.send([e for e in range(2) if e not in driver.awaited])
            driver.receive()
        while driver.awaited:
            driver.receive()

    a, b = pool(), pool()
    zygote = a.fork_server_pid
    assert zygote is not None and b.fork_server_pid == zygote
    drivers = [ExactlyOnce(p, 2, 40, random.Random(k), restarts=True) for k, p in enumerate((a, b))]
    for driver in drivers:
        driver.run()
    os.kill(zygote, signal.SIGKILL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ForkServerWarning)
        for driver in drivers:
            settle(driver)
    told = [w for w in caught if issubclass(w.category, ForkServerWarning)]
    assert len(told) == 2, [str(w.message) for w in told]  # once per pool
    replacement = a.fork_server_pid
    assert replacement not in (None, zygote) and b.fork_server_pid == replacement
    a.close()
    tell(replacement)  # b still holds it
    b.close()
    tell(replacement)  # nobody does: it ends with b
    with keep_fork_server():
        c = pool()
        kept = c.fork_server_pid
        c.close()
        tell(kept)  # kept after c.close()
    tell(kept)  # it ends with the block
    """
)


@pytest.mark.timeout(240)
def test_a_shared_fork_servers_death_restarts_every_pools_workers_and_it_ends_with_its_last_pool(
    tmp_path,
):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(REPO)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        held = told_pid(proc)  # after the first pool's close
        assert pids_alive([held]) == [held]
        assert told_pid(proc) == held and gone_within(held, 5.0)  # after the last one's
        kept = told_pid(proc)
        assert kept != held and pids_alive([kept]) == [kept]
        assert told_pid(proc) == kept and gone_within(kept, 5.0)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


def told_pid(proc: subprocess.Popen) -> int:
    """The next pid the trainer prints; it waits for our answer before it goes on."""
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120.0)
    line = proc.stdout.readline() if ready else ""  # it prints whole lines, flushed
    if not line.strip():
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"the trainer stopped (exit {proc.returncode}):\n{proc.stderr.read()}")
    proc.stdin.write("\n")
    proc.stdin.flush()
    return int(line)


def gone_within(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` ends within ``timeout_s`` (a fork server closes in about a second)."""
    deadline = time.monotonic() + timeout_s
    while pids_alive([pid]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_construction_waits_while_a_replacement_fork_server_starts(monkeypatch):
    # Session 62's audit: a fork server that died while a pool was being built let the
    # launcher's internal ForkServerStarting (a bare RuntimeError) out of the constructor.
    starting = iter(range(2))  # the first two starts find the replacement still importing
    original = Launcher.start

    def start(self, *args, **kwargs):
        if next(starting, None) is not None:
            raise ForkServerStarting("the replacement is still importing torch")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Launcher, "start", start)
    pool = ZMQAsyncEnvPool([CountingEnv] * 2, config=FAST)
    try:
        assert pool.reset()["observation"].shape == (2, 4)
    finally:
        pool.close()
    assert next(starting, None) is None  # it did wait them out
