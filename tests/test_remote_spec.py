"""Remote slots held to the specs the user gives (``remote_spec=``), and commands a worker
cannot take answered with an error instead of a hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from tests import warm
from tests.netns import free_port_base
from zmqpool import EnvError, PoolConfig, ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

CONFIG = PoolConfig(register_timeout_s=60.0, close_timeout_s=2.0)


def remote_worker(port: int, keys, obs_shape: tuple[int, ...]) -> warm.WarmProcess:
    argv = [sys.executable, "-m", "workers", "--connect", f"tcp://127.0.0.1:{port}"]
    argv += ["--env", "zmqpool.testing:CountingEnv", "--single-process"]
    argv += ["--kwargs", json.dumps({"obs_shape": list(obs_shape)}), "--register-timeout", "60"]
    argv += ["--server-key", str(keys / "server.key")]
    argv += ["--client-key", str(keys / "workers" / "worker-0.key_secret")]
    return warm.popen(argv, stderr=subprocess.PIPE)


def test_a_remote_only_pool_with_remote_spec_refuses_the_first_worker_if_it_differs(key_dir):
    port = free_port_base("127.0.0.1")
    built: list[ZMQAsyncEnvPool] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            built.append(
                ZMQAsyncEnvPool(
                    [],
                    remote_envs=1,
                    bind=f"tcp://127.0.0.1:{port}",
                    curve_keys=key_dir,
                    remote_spec=CountingEnv().specs,
                    config=CONFIG,
                )
            )
        except BaseException as err:  # re-raised in the test's thread
            errors.append(err)

    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    odd = remote_worker(port, key_dir, (6,))  # registers first, with other specs
    try:
        _, err = odd.communicate(timeout=90)
        assert odd.returncode == 2, err  # refused (REFUSED), not welcomed
        assert "spec mismatch" in err, err
        honest = remote_worker(port, key_dir, (4,))
        try:
            builder.join(timeout=90)
            assert not builder.is_alive() and not errors, errors
            (pool,) = built
            try:
                assert pool.reset()["observation"].shape == (1, 4)
            finally:
                pool.close()
        finally:
            honest.terminate()
            honest.wait(timeout=10)
    finally:
        if odd.poll() is None:
            odd.kill()


def test_remote_spec_needs_remote_envs():
    with pytest.raises(ValueError, match="remote_spec"):
        ZMQAsyncEnvPool([CountingEnv], remote_spec=CountingEnv().specs)


def test_a_command_its_worker_cannot_take_is_that_envs_error_not_a_hang():
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}, {"env_id": 1}])
    try:
        pool.reset()
        blob = torch.zeros(2, 4 << 20)  # 16 MiB a row: far over what the specs imply
        big = TensorDict({"action": torch.zeros(2, 1), "blob": blob}, [2])
        pool.async_step_send(big, env_index=[0, 1])
        for _ in range(2):
            with pytest.raises(EnvError, match=r"has a 16777216-byte frame; its worker takes"):
                pool.async_step_recv(min_get=1, timeout=30)
        small = TensorDict({"action": torch.zeros(2, 1)}, [2])
        pool.async_step_send(small, env_index=[0, 1])  # both envs are idle again
        out = pool.async_step_recv(min_get=2, timeout=30)
        assert out["next", "observation"].shape == (2, 4)
    finally:
        pool.close()


def test_a_refused_command_leaves_a_restarted_env_fresh():
    """An oversized reset refused to a restarted env was never sent: its next step is a reset.

    A restarted env was rebuilt and never reset, so the pool turns its first
    step into a reset (answered as a truncation). A command refused for its
    size must not count as that first command.
    """
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}], config=CONFIG)
    try:
        pool.reset()
        killed = pool.worker_pid(0)
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pool.worker_pid(0) in (None, killed):  # the pool restarts it while it pumps
            assert time.monotonic() < deadline, "the killed worker was not restarted in 30 s"
            pool.runtime.pump(0.1)
        big = TensorDict({"blob": torch.zeros(1, 4 << 20)}, [1])
        pool.async_reset_send(big, env_index=[0])
        with pytest.raises(EnvError, match=r"has a 16777216-byte frame; its worker takes"):
            pool.async_reset_recv(min_get=1, timeout=30)
        pool.async_step_send(TensorDict({"action": torch.zeros(1, 1)}, [1]), env_index=[0])
        out = pool.async_step_recv(min_get=1, timeout=30)
        assert pool.last_restarted_envs == [0] and out["next", "truncated"].item()
    finally:
        pool.close()
