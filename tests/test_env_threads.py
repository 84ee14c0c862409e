"""A worker hosting several envs steps each in its own thread (``PoolConfig.env_threads``).

Two envs share one worker process and meet: env 0's step waits until env 1's
step has started. Stepped one after another, env 0 would wait alone and give
up; in threads, they meet.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from tests.conftest import FAST
from zmqpool import EnvError, PoolConfig, ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

#: Shared by the envs of one worker process (each worker imports this module once).
_MET = threading.Event()


class RendezvousEnv(CountingEnv):
    """Env 0's step waits (up to ``wait_s``) for env 1's step to start; env 1's signals it."""

    def __init__(self, env_id: int = 0, wait_s: float = 30.0) -> None:
        super().__init__(env_id=env_id)
        self.wait_s = wait_s

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.env_id == 1:
            _MET.set()
        elif not _MET.wait(self.wait_s):
            raise TimeoutError("env 1 never started its step while env 0 waited")
        return super()._step(tensordict)


def step_both(config: PoolConfig, wait_s: float) -> TensorDictBase:
    kwargs = [{"env_id": i, "wait_s": wait_s} for i in range(2)]
    pool = ZMQAsyncEnvPool(
        [RendezvousEnv] * 2, create_env_kwargs=kwargs, envs_per_worker=2, config=config
    )
    try:
        pool.reset()
        actions = TensorDict({"action": torch.zeros(2, 1)}, batch_size=[2])
        pool.async_step_send(actions, env_index=[0, 1])
        return pool.async_step_recv(min_get=2, timeout=60)
    finally:
        pool.close()


def test_envs_of_one_worker_step_at_the_same_time():
    result = step_both(FAST, wait_s=30.0)
    assert result["next", "observation"][:, :2].tolist() == [[0.0, 1.0], [1.0, 1.0]]


def test_without_env_threads_they_step_one_after_another():
    sequential = PoolConfig(register_timeout_s=FAST.register_timeout_s, env_threads=False)
    with pytest.raises(EnvError, match="env 1 never started its step"):
        step_both(sequential, wait_s=0.5)


@pytest.mark.parametrize("field", ["env_threads", "fork_server", "share_fork_server"])
def test_switches_must_be_bools(field):
    with pytest.raises(ValueError, match=f"PoolConfig.{field} must be a bool, got 1"):
        PoolConfig(**{field: 1})
