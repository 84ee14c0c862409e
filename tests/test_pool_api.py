"""torchrl's AsyncEnvPool API on ZMQAsyncEnvPool, against envs whose outputs say who they are.

CountingEnv's observation is (env_id, step_count, last_action, seed): a
result routed to the wrong env, lost or delivered twice shows in the numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from torchrl.envs import AsyncEnvPool, StepCounter, TransformedEnv
from torchrl.envs.utils import check_env_specs

from tests.conftest import NUM_ENVS, action_for, awaited
from zmqpool import EnvBusyError, TooFewInFlightError
from zmqpool.testing import CountingEnv


def env_ids(td) -> list[int]:
    return [int(i) for i in td["env_index"]]


def test_is_a_torchrl_async_env_pool(pool):
    assert isinstance(pool, AsyncEnvPool)
    assert pool.batch_size == torch.Size([NUM_ENVS])
    assert pool.resolved_exchange == "zmq"


def test_reset_returns_every_env_in_order(fresh):
    assert isinstance(fresh.get("env_index"), NonTensorStack)
    assert env_ids(fresh) == list(range(NUM_ENVS))
    assert fresh["observation"][:, 0].tolist() == list(range(NUM_ENVS))
    assert fresh["observation"][:, 1].tolist() == [0.0] * NUM_ENVS


def test_step_routes_each_action_to_its_env(pool, fresh):
    fresh["action"] = torch.tensor([[0.1], [0.2], [0.3], [0.4]])
    out = pool.step(fresh)
    assert out is fresh  # EnvBase semantics: the input comes back with "next"
    nxt = out["next", "observation"]
    assert nxt[:, 0].tolist() == list(range(NUM_ENVS))
    assert nxt[:, 1].tolist() == [1.0] * NUM_ENVS
    assert torch.allclose(nxt[:, 2], torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert out["next", "reward"][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_rand_step_and_rollout(pool, fresh):
    td = pool.rand_step(fresh)
    assert ("next", "observation") in td.keys(True)
    rollout = pool.rollout(10, break_when_any_done=False)
    assert rollout.shape == torch.Size([NUM_ENVS, 10])
    counts = rollout["next", "observation"][0, :, 1].tolist()
    assert counts == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]  # episodes of 5, auto-reset


def test_step_and_maybe_reset_resets_done_envs(pool, fresh):
    td = fresh
    for step in range(1, 6):
        td["action"] = action_for(td)
        result, td = pool.step_and_maybe_reset(td)
        assert result["next", "observation"][:, 1].tolist() == [float(step)] * NUM_ENVS
    assert result["next", "done"].all()
    assert td["observation"][:, 1].tolist() == [0.0] * NUM_ENVS  # reset after done
    assert isinstance(td.get("env_index"), NonTensorStack)


def test_check_env_specs_passes(pool):
    check_env_specs(pool)


def test_transformed_env_goes_through_private_methods(pool):
    env = TransformedEnv(pool, StepCounter())
    check_env_specs(env)
    rollout = env.rollout(3)
    assert rollout["next", "step_count"][0, :, 0].tolist() == [1, 2, 3]


def test_async_step_min_get_collects_everything_once(pool, fresh):
    fresh["action"] = action_for(fresh)
    pool.async_step_send(fresh, env_index=list(range(NUM_ENVS)))
    seen: list[int] = []
    while len(seen) < NUM_ENVS:
        out = pool.async_step_recv(min_get=1, timeout=30)
        assert env_ids(out) == sorted(env_ids(out))  # sorted within one recv
        assert out["next", "observation"][:, 0].tolist() == env_ids(out)
        seen += env_ids(out)
    assert sorted(seen) == list(range(NUM_ENVS))


def test_async_send_to_a_subset(pool, fresh):
    sub = fresh[[1, 3]]
    sub["action"] = action_for(sub)
    pool.async_step_send(sub, env_index=[1, 3])
    out = pool.async_step_recv(min_get=2, timeout=30)
    assert env_ids(out) == [1, 3]
    assert out["next", "observation"][:, 0].tolist() == [1.0, 3.0]


def test_max_get_leaves_the_rest_for_the_next_call(pool, fresh):
    fresh["action"] = action_for(fresh)
    pool.async_step_send(fresh, env_index=list(range(NUM_ENVS)))
    first = pool.async_step_recv(min_get=1, max_get=1, timeout=30)
    assert len(env_ids(first)) == 1
    rest = pool.async_step_recv(min_get=NUM_ENVS - 1, timeout=30)
    assert sorted(env_ids(first) + env_ids(rest)) == list(range(NUM_ENVS))


def test_per_env_channel(pool, fresh):
    single = fresh[2]
    single["action"] = torch.tensor([0.25])
    pool.async_step_send(single, env_index=2)
    out = pool.async_step_recv(env_index=2, timeout=30)
    # As torchrl's: the env's own tensordict (its batch size), env_index a NonTensorData.
    assert out.batch_size == () and out["env_index"] == 2
    assert out["next", "observation"][0].item() == 2.0
    assert out["next", "observation"][2].item() == 0.25
    pool.async_reset_send(env_index=1)
    reset = pool.async_reset_recv(env_index=1, timeout=30)
    assert reset.batch_size == () and reset["env_index"] == 1
    assert reset["observation"][:2].tolist() == [1.0, 0.0]


def test_async_reset_and_step_and_maybe_reset(pool, fresh):
    pool.async_reset_send(env_index=[0, 2])
    out = pool.async_reset_recv(min_get=2, timeout=30)
    assert env_ids(out) == [0, 2]
    td = fresh[[0, 2]]
    td["action"] = action_for(td)
    pool.async_step_and_maybe_reset_send(td, env_index=[0, 2])
    result, next_root = pool.async_step_and_maybe_reset_recv(min_get=2, timeout=30)
    assert env_ids(result) == env_ids(next_root) == [0, 2]
    assert next_root["observation"][:, 1].tolist() == [1.0, 1.0]


def test_busy_env_is_refused(pool, fresh):
    fresh["action"] = action_for(fresh)
    pool.async_step_send(fresh[[0]], env_index=[0])
    try:
        # torchrl's pool raises RuntimeError: EnvBusyError is one, and a ZMQPoolError.
        with pytest.raises(EnvBusyError, match=r"busy: \[0\]"):
            pool.async_step_send(fresh[[0, 1]], env_index=[0, 1])
    finally:
        pool.async_step_recv(min_get=1, timeout=30)


def test_a_sync_reset_refused_for_a_busy_env_leaves_the_callers_async_reset_alone(pool):
    """The caller's async reset of env 0 is in flight; a sync reset() is refused, and so is
    one tried again (env 0 is still busy), and the async reset's result comes back."""
    pool.async_reset_send(env_index=[0])
    try:
        for _ in range(2):
            with pytest.raises(EnvBusyError, match=r"busy: \[0\]"):
                pool.reset()
    finally:
        out = pool.async_reset_recv(min_get=1, timeout=30)
    assert env_ids(out) == [0]


def test_min_get_above_in_flight_is_refused(pool, fresh):
    fresh["action"] = action_for(fresh)
    pool.async_step_send(fresh[[0]], env_index=[0])
    try:
        with pytest.raises(TooFewInFlightError, match="Cannot await 2"):  # a RuntimeError
            pool.async_step_recv(min_get=2)
    finally:
        pool.async_step_recv(min_get=1, timeout=30)


def test_set_seed_seeds_along_serial_envs_chain(pool):
    """Env 0 gets s, env i + 1 what env i's set_seed returned (remote envs too, in "mixed")."""
    expected, seed = [], 100
    for _ in range(NUM_ENVS):  # each a CountingEnv: EnvBase.set_seed's chain
        expected.append(float(seed))
        seed = CountingEnv().set_seed(seed)
    assert pool.set_seed(100) == seed
    td = pool.reset()
    assert td["observation"][:, 3].tolist() == torch.tensor(expected).tolist()


@pytest.mark.parametrize(
    "seed",
    [np.int64(100), np.int32(100), torch.tensor(100)],
    ids=["np.int64", "np.int32", "0-d tensor"],
)
def test_set_seed_takes_integers_of_any_kind(pool, seed):
    """An np.int64 seed once failed to pack after its request was recorded: env 0 stayed
    busy until close() (seeding audit). An integer of any kind seeds as the int it holds."""
    expected = pool.set_seed(100)
    assert pool.set_seed(seed) == expected
    assert pool.reset()["observation"][0, 3].item() == 100.0


@pytest.mark.parametrize(
    ("seed", "error", "match"),
    [
        (7.0, TypeError, r"integer or None, got 7.0 \(a float\)"),
        ("7", TypeError, r"got '7' \(a str\)"),
        ([7], TypeError, r"got \[7\] \(a list\)"),
        (2**64, ValueError, "outside the integers a command carries"),
        (-(2**63) - 1, ValueError, "cannot cross the wire"),
    ],
    ids=["float", "str", "list", "2**64", "below -2**63"],
)
def test_a_seed_that_is_not_a_wire_integer_is_refused_and_leaves_no_env_busy(
    pool, seed, error, match
):
    with pytest.raises(error, match=match):
        pool.set_seed(seed)
    assert pool.set_seed(100) is not None  # nothing was left in flight
    assert all(stats["in_flight"] == 0 for stats in pool.env_stats().values())


def test_set_seed_is_refused_while_an_envs_own_reset_is_in_flight(pool, fresh):
    """A seed's reply comes on its env's own reset channel: it and an own-channel reset
    in flight took each other's replies, set_seed returned None and the reset's recv a
    seed (thread-sharing audit). Now the seed is refused, naming the env."""
    pool.async_reset_send(env_index=1)
    try:
        with pytest.raises(EnvBusyError, match=r"envs \[1\] have resets in flight"):
            pool.set_seed(100)
    finally:
        out = pool.async_reset_recv(env_index=1, timeout=30)
    assert out["observation"][0].item() == 1.0  # env 1's reset, not a seed's reply
    assert pool.set_seed(100) is not None


def test_bad_trainer_input_is_refused_before_sending(pool, fresh):
    with pytest.raises(IndexError):
        pool.async_step_send(fresh[[0]], env_index=[NUM_ENVS])
    with pytest.raises(ValueError, match="repeat"):
        pool.async_step_send(fresh[[0, 1]], env_index=[1, 1])
    with pytest.raises(ValueError, match="batch size"):
        pool.async_step_send(fresh[[0, 1]], env_index=[0, 1, 2])
    assert not awaited(pool)
    pool.reset()  # still usable


def test_collector_runs_on_the_pool(pool):
    from torchrl.collectors import Collector

    # total_frames=-1: the collector never ends on its own, so it never closes the shared pool.
    collector = Collector(pool, policy=None, frames_per_batch=8 * NUM_ENVS, total_frames=-1)
    batches = []
    for batch in collector:
        batches.append(batch)
        if len(batches) == 2:
            break
    collector.shutdown(close_env=False)
    assert len(batches) == 2
    batch = batches[0]
    assert batch.shape == torch.Size([NUM_ENVS, 8])
    assert batch["next", "observation"][:, 0, 0].tolist() == list(range(NUM_ENVS))


def test_results_carry_all_input_keys(pool, fresh):
    fresh["action"] = action_for(fresh)
    fresh["extra"] = torch.arange(NUM_ENVS)
    out = pool.step(fresh)
    assert out["extra"].tolist() == list(range(NUM_ENVS))
    td = pool.reset()
    pool.async_step_send(
        TensorDict({"action": action_for(td), "extra": torch.arange(NUM_ENVS)}, [NUM_ENVS]),
        env_index=list(range(NUM_ENVS)),
    )
    out = pool.async_step_recv(min_get=NUM_ENVS, timeout=30)
    assert out["extra"].tolist() == list(range(NUM_ENVS))
