"""Shared fixtures: pools are expensive (workers import torchrl), so tests share them where safe."""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch

from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

faulthandler.enable()

NUM_ENVS = 4

#: Short timings so failure paths are quick; construction may still take a
#: while on a loaded 2-core machine (every worker imports torchrl).
FAST = PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0)


def counting_kwargs(n: int = NUM_ENVS, **extra) -> list[dict]:
    return [{"env_id": i, **extra} for i in range(n)]


@pytest.fixture(scope="session")
def pool():
    """Four CountingEnvs, two per worker process, episodes of 5 steps."""
    p = ZMQAsyncEnvPool(
        CountingEnv,
        create_env_kwargs=counting_kwargs(max_steps=5),
        envs_per_worker=2,
        config=FAST,
    )
    yield p
    p.close()


@pytest.fixture
def fresh(pool):
    """The shared pool, reset, with nothing in flight."""
    assert not pool._busy, "a previous test left envs busy"
    return pool.reset()


def action_for(td: torch.Tensor | object, value: float = 0.5) -> torch.Tensor:
    n = td.shape[0]  # type: ignore[union-attr]
    return torch.full((n, 1), value)


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie is dead for our purposes; its parent reaps it.
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] != "Z":
                alive.append(pid)
    return alive
