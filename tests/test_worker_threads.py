"""Torch threads in local workers: ``PoolConfig.worker_torch_threads``, else the variable, else 1.

Each env reports ``torch.get_num_threads()`` as seen when the worker built
it (its ``env_id``, the reset observation's first entry), so the test reads
what the worker process really set.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from tests.conftest import FAST
from workers.cli import build_parser
from workers.hosting import WORKER_THREADS_VAR
from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv


def threads_env() -> CountingEnv:
    """A CountingEnv whose id is the worker's torch thread count when it was built."""
    return CountingEnv(env_id=torch.get_num_threads())


def worker_threads(threads: int | None) -> int:
    config = dataclasses.replace(FAST, worker_torch_threads=threads)
    pool = ZMQAsyncEnvPool([threads_env], config=config)
    try:
        return int(pool.reset()["observation"][0, 0])
    finally:
        pool.close()


def test_a_worker_runs_one_torch_thread_by_default(monkeypatch):
    monkeypatch.delenv(WORKER_THREADS_VAR, raising=False)
    assert worker_threads(None) == 1


def test_the_variable_sets_it_and_the_config_overrides_the_variable(monkeypatch):
    monkeypatch.setenv(WORKER_THREADS_VAR, "2")
    assert worker_threads(None) == 2
    assert worker_threads(3) == 3


def test_zero_leaves_torch_s_own_default(monkeypatch):
    monkeypatch.delenv(WORKER_THREADS_VAR, raising=False)
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert worker_threads(0) == int(fresh.stdout)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_the_config_refuses_what_is_not_a_count(value):
    with pytest.raises(ValueError, match=r"PoolConfig\.worker_torch_threads must be"):
        PoolConfig(worker_torch_threads=value)


def test_a_worker_refuses_a_negative_count(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--connect", "ipc:///x", "--torch-threads", "-1"])
    assert "--torch-threads must be >= 0, got -1" in capsys.readouterr().err
