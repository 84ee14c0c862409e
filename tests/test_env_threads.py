"""A worker hosting several envs steps each in its own thread (``PoolConfig.env_threads``).

Two envs share one worker process and meet: env 0's step waits until env 1's
step has started. Stepped one after another, env 0 would wait alone and give
up; in threads, they meet.

Envs judged cheap (short steps that never wait) step in the worker's main
thread instead (:mod:`workers.inline`); an env that sleeps keeps its thread.
Each env here reports the thread it stepped in. An env that waits for
another env of its worker needs ``inline_cheap_envs=False`` (the judge cannot
see that wait coming).
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
    # Env 0 waits for env 1, which it cannot show while judged (env 1 may have come
    # first): inline, it would hold env 1 up. inline_cheap_envs=False keeps both in threads.
    threaded = PoolConfig(register_timeout_s=FAST.register_timeout_s, inline_cheap_envs=False)
    result = step_both(threaded, wait_s=30.0)
    assert result["next", "observation"][:, :2].tolist() == [[0.0, 1.0], [1.0, 1.0]]


def test_without_env_threads_they_step_one_after_another():
    sequential = PoolConfig(register_timeout_s=FAST.register_timeout_s, env_threads=False)
    with pytest.raises(EnvError, match="env 1 never started its step"):
        step_both(sequential, wait_s=0.5)


@pytest.mark.parametrize(
    "field", ["env_threads", "inline_cheap_envs", "fork_server", "share_fork_server"]
)
def test_switches_must_be_bools(field):
    with pytest.raises(ValueError, match=f"PoolConfig.{field} must be a bool, got 1"):
        PoolConfig(**{field: 1})


class ThreadReportingEnv(CountingEnv):
    """A :class:`CountingEnv` whose ``observation[4]`` is 1 if it stepped in the main thread."""

    def __init__(self, env_id: int = 0, step_sleep_s: tuple[float, float] = (0.0, 0.0)) -> None:
        super().__init__(env_id=env_id, obs_shape=(5,), step_sleep_s=step_sleep_s)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        out = super()._step(tensordict)
        on_main = threading.current_thread() is threading.main_thread()
        out["observation"][4] = float(on_main)
        return out


def steps_on_main(kwargs: list[dict], rounds: int, config: PoolConfig = FAST) -> list[list[float]]:
    """Step two envs of one worker ``rounds`` times (alternating which is sent last):
    for each round, whether each env stepped in the worker's main thread."""
    pool = ZMQAsyncEnvPool(
        [ThreadReportingEnv] * 2, create_env_kwargs=kwargs, envs_per_worker=2, config=config
    )
    try:
        pool.reset()
        seen = []
        for r in range(rounds):
            order = [0, 1] if r % 2 else [1, 0]  # each env is sometimes its message's last
            pool.async_step_send(TensorDict({"action": torch.zeros(2, 1)}, [2]), env_index=order)
            result = pool.async_step_recv(min_get=2, timeout=60)
            seen.append(result["next", "observation"][:, 4].tolist())
        return seen
    finally:
        pool.close()


def test_cheap_envs_of_a_worker_step_in_its_main_thread():
    seen = steps_on_main([{"env_id": 0}, {"env_id": 1}], rounds=12)
    assert seen[-4:] == [[1.0, 1.0]] * 4  # judged cheap: inline, whichever comes first


def test_an_env_that_sleeps_keeps_its_thread():
    sleeps = {"env_id": 0, "step_sleep_s": (0.02, 0.02)}
    seen = steps_on_main([sleeps, {"env_id": 1}], rounds=12)
    assert seen[-4:] == [[0.0, 1.0]] * 4  # the sleeper in its thread, the cheap one inline


def test_without_inline_cheap_envs_every_env_keeps_its_thread():
    threaded = PoolConfig(register_timeout_s=FAST.register_timeout_s, inline_cheap_envs=False)
    seen = steps_on_main([{"env_id": 0}, {"env_id": 1}], rounds=6, config=threaded)
    assert seen == [[0.0, 0.0]] * 6
