"""A heterogeneous env end to end: torchrl's ``HeterogeneousCountingEnv`` in a real pool.

Its observations, rewards, dones and actions are nested lazy stacks of three
agents with different keys and shapes; they cross the wire as lazy stacks
(layout field ``"z"``, :mod:`zmqpool.wire`), both ways. What the pool returns
is compared with torchrl's ``SerialEnv`` of the same envs, env by env and
agent by agent: keys, shapes, dtypes, and values (all but the random actions:
the counting env's observations are its step count).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from torchrl.envs import SerialEnv
from torchrl.testing.mocking_classes import HeterogeneousCountingEnv

from tests.conftest import FAST
from zmqpool import ZMQAsyncEnvPool

NUM_ENVS = 2
AGENTS = 3


@pytest.fixture(scope="module")
def pool() -> Iterator[ZMQAsyncEnvPool]:
    pool = ZMQAsyncEnvPool([HeterogeneousCountingEnv] * NUM_ENVS, stack="lazy", config=FAST)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def serial() -> Iterator[SerialEnv]:
    env = SerialEnv(NUM_ENVS, HeterogeneousCountingEnv)
    yield env
    env.close()


def leaf_keys(td: TensorDictBase) -> set:
    return {key for key in td.keys(True, True) if key != "env_index"}


def agents(td: TensorDictBase, key: tuple[str, ...]) -> list[TensorDictBase]:
    """The per-agent members of the lazy stack at ``key`` of one env's tensordict."""
    stack = td.get(key)
    assert isinstance(stack, LazyStackedTensorDict), f"{key} is a {type(stack).__name__}"
    assert len(stack.tensordicts) == AGENTS
    return list(stack.unbind(stack.stack_dim))


def assert_like(got: TensorDictBase, want: TensorDictBase) -> None:
    """Env by env, agent by agent: the same keys, shapes, dtypes and (but actions) values."""
    assert got.batch_size == want.batch_size
    assert leaf_keys(got) == leaf_keys(want)
    lazy_keys = [("lazy",)] + ([("next", "lazy")] if "next" in want else [])
    for env in range(NUM_ENVS):
        mine, theirs = got[env], want[env]
        for key in ("state", ("next", "state")):
            if key in theirs.keys(True):
                assert torch.equal(mine.get(key), theirs.get(key)), (env, key)
        for key in lazy_keys:
            assert mine.get(key).stack_dim == theirs.get(key).stack_dim
            members = zip(agents(mine, key), agents(theirs, key), strict=True)
            for agent, (a, b) in enumerate(members):
                assert set(a.keys()) == set(b.keys()), (env, key, agent)
                for name in sorted(b.keys()):
                    x, y = a.get(name), b.get(name)
                    where = (env, key, agent, name)
                    assert (x.shape, x.dtype) == (y.shape, y.dtype), where
                    if name == "action":  # random: in the spec's bounds
                        assert bool(((x >= -1) & (x <= 1)).all()), where
                    else:
                        assert torch.equal(x, y), where


def test_reset_is_serial_envs_reset(pool, serial):
    got, want = pool.reset(), serial.reset()
    assert_like(got, want)
    assert [a.get("vector").shape[-1] for a in agents(got[0], ("lazy",))] == [3, 2, 2]


def test_rand_step_sends_heterogeneous_actions(pool, serial):
    got = pool.rand_step(pool.reset())
    want = serial.rand_step(serial.reset())
    assert [a.get("action").shape for a in agents(got[1], ("lazy",))] == [(3,), (2,), (2,)]
    assert_like(got, want)
    # The worker read the actions: its count moved (an action of 0.0 exactly aside).
    assert bool((got.get(("next", "state")) == 1).all())


def test_rollout_is_serial_envs_rollout(pool, serial):
    got, want = pool.rollout(3), serial.rollout(3)
    assert got.batch_size == want.batch_size == (NUM_ENVS, 3)
    assert_like(got, want)
    assert got[0].get(("next", "state"))[:, 0, 0, 0].tolist() == [1.0, 2.0, 3.0]
