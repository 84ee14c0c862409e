"""Env errors and deadlines: the caller gets a clear error, the other envs stay usable."""

from __future__ import annotations

import time

import pytest
import torch

from tests.conftest import FAST, awaited
from zmqpool import EnvError, RecvTimeoutError, ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv, FaultyEnv

RAISING, SLOW, PLAIN = 2, 1, 0  # an error names its env: not the first one


@pytest.fixture(scope="module")
def odd_pool():
    """env 0 is plain, env 1 takes 0.4 s a step, env 2 raises at step 2 of every episode."""
    p = ZMQAsyncEnvPool(
        [CountingEnv, CountingEnv, FaultyEnv],
        create_env_kwargs=[
            {"env_id": PLAIN},
            {"env_id": SLOW, "step_sleep_s": (0.4, 0.4)},
            {"env_id": RAISING, "fault": "raise", "fault_at": 2},
        ],
        config=FAST,
    )
    yield p
    p.close()


def one(td, env):
    sub = td[[env]]
    sub["action"] = torch.full((1, 1), 0.5)
    return sub


def test_env_error_names_the_env_and_carries_its_traceback(odd_pool):
    td = odd_pool.reset()
    odd_pool.async_step_send(one(td, RAISING), env_index=[RAISING])
    odd_pool.async_step_recv(min_get=1, timeout=30)
    odd_pool.async_step_send(one(td, RAISING), env_index=[RAISING])
    with pytest.raises(EnvError) as info:
        odd_pool.async_step_recv(min_get=1, timeout=30)
    assert info.value.env_index == RAISING
    assert f"FaultyEnv {RAISING} failed at step 2" in info.value.remote_traceback
    assert "Traceback" in str(info.value)
    assert not awaited(odd_pool)


def test_other_envs_stay_usable_after_an_env_error(odd_pool):
    td = odd_pool.reset()
    odd_pool.async_step_send(one(td, RAISING), env_index=[RAISING])
    odd_pool.async_step_recv(min_get=1, timeout=30)
    both = td[[RAISING, PLAIN]]
    both["action"] = torch.full((2, 1), 0.5)
    odd_pool.async_step_send(both, env_index=[RAISING, PLAIN])
    with pytest.raises(EnvError):
        odd_pool.async_step_recv(min_get=2, timeout=30)
    # The healthy env's reply was kept for the next call.
    out = odd_pool.async_step_recv(min_get=1, timeout=30)
    assert [int(i) for i in out["env_index"]] == [PLAIN]
    # The raising env itself still answers: a reset brings it back.
    odd_pool.async_reset_send(env_index=[RAISING])
    assert odd_pool.async_reset_recv(min_get=1, timeout=30)["observation"][0, 0] == RAISING


def test_timeout_raises_and_keeps_the_result_for_the_next_call(odd_pool):
    td = odd_pool.reset()
    odd_pool.async_step_send(one(td, SLOW), env_index=[SLOW])
    with pytest.raises(RecvTimeoutError):  # a TimeoutError, and a ZMQPoolError
        odd_pool.async_step_recv(min_get=1, timeout=0.05)
    out = odd_pool.async_step_recv(min_get=1, timeout=30)
    assert out["next", "observation"][0, :2].tolist() == [SLOW, 1.0]


def test_timeout_bounds_the_call_once_min_get_is_met(odd_pool):
    td = odd_pool.reset()
    both = td[[SLOW, PLAIN]]
    both["action"] = torch.full((2, 1), 0.5)
    odd_pool.async_step_send(both, env_index=[SLOW, PLAIN])
    first = odd_pool.async_step_recv(min_get=1, timeout=0.2)
    assert [int(i) for i in first["env_index"]] == [PLAIN]
    rest = odd_pool.async_step_recv(min_get=1, timeout=30)
    assert [int(i) for i in rest["env_index"]] == [SLOW]


def test_sync_calls_after_an_env_error_find_the_pool_idle(odd_pool):
    # SerialEnv raises the env's error and carries on; ours used to leave the other
    # envs in flight, and every sync call after it raised "still processing".
    td = odd_pool.reset()
    td["action"] = torch.full((3, 1), 0.5)
    td = odd_pool.step(td)["next"]  # count 1 everywhere
    td["action"] = torch.full((3, 1), 0.5)
    with pytest.raises(EnvError) as info:
        odd_pool.step(td)  # env RAISING raises at its step 2
    assert info.value.env_index == RAISING and isinstance(info.value, ValueError)  # as SerialEnv
    td = odd_pool.reset()
    td["action"] = torch.full((3, 1), 0.5)
    assert odd_pool.step(td)["next", "observation"][:, 1].tolist() == [1.0, 1.0, 1.0]


def test_a_reset_that_raises_leaves_the_pool_idle():
    pool = ZMQAsyncEnvPool(
        FaultyEnv,
        create_env_kwargs=[
            {"env_id": 0},
            {"env_id": 1, "fault": "raise", "fault_at": 0, "every_episode": False},
        ],
        config=FAST,
    )
    try:
        with pytest.raises(EnvError, match="FaultyEnv 1 failed"):
            pool.reset()
        assert pool.reset()["observation"][:, 0].tolist() == [0.0, 1.0]
    finally:
        pool.close()


def test_timeout_bounds_a_recv_on_an_env_s_own_channel(odd_pool):
    td = odd_pool.reset()
    own = td[SLOW].exclude("env_index")
    own["action"] = torch.full((1,), 0.5)
    odd_pool.async_step_send(own, env_index=SLOW)
    with pytest.raises(TimeoutError):
        odd_pool.async_step_recv(env_index=SLOW, timeout=0.05)
    out = odd_pool.async_step_recv(env_index=SLOW, timeout=30)  # kept for the next call
    assert int(out["env_index"]) == SLOW and out["next", "observation"][:2].tolist() == [SLOW, 1]


def test_an_env_s_own_channel_answers_a_result_before_a_later_error(odd_pool):
    """Two sends on the raising env's own channel, the second raising: the first recv gets it.

    Both replies are in before the first recv (the pool reads them while it
    waits for the slow env on the batch channel). The error used to be raised first,
    and every recv after it then took the answer of the request before its own.
    """
    td = odd_pool.reset()
    own = td[RAISING].exclude("env_index")
    own["action"] = torch.full((1,), 0.5)
    odd_pool.async_step_send(own.clone(), env_index=RAISING)  # step 1: a result
    odd_pool.async_step_send(own.clone(), env_index=RAISING)  # step 2: raises
    deadline = time.monotonic() + 30
    while odd_pool.env_stats()[RAISING]["in_flight"]:  # pump: step the slow env meanwhile
        assert time.monotonic() < deadline, "the raising env did not answer both in 30 s"
        odd_pool.async_step_send(one(td, SLOW), env_index=[SLOW])
        odd_pool.async_step_recv(min_get=1, timeout=30)
    first = odd_pool.async_step_recv(env_index=RAISING, timeout=30)
    assert first["next", "observation"][:2].tolist() == [RAISING, 1.0]
    with pytest.raises(EnvError, match="failed at step 2"):
        odd_pool.async_step_recv(env_index=RAISING, timeout=30)


def test_an_input_too_large_to_send_is_answered_in_its_turn_on_an_env_s_own_channel(odd_pool):
    """A slow step, then an input whose leaf is over its worker's frame limit (review finding).

    The second cannot be sent: it is answered with an error at once. On the
    env's own channel it used to overtake the first, whose result the second
    recv then took; now it waits its turn.
    """
    td = odd_pool.reset()
    own = td[SLOW].exclude("env_index")
    own["action"] = torch.full((1,), 0.5)
    odd_pool.async_step_send(own.clone(), env_index=SLOW)  # 0.4 s
    too_large = own.clone().set("junk", torch.zeros(4 << 20, dtype=torch.uint8))
    odd_pool.async_step_send(too_large, env_index=SLOW)
    first = odd_pool.async_step_recv(env_index=SLOW, timeout=30)
    assert first["next", "observation"][:2].tolist() == [SLOW, 1.0]
    with pytest.raises(EnvError, match="frame"):
        odd_pool.async_step_recv(env_index=SLOW, timeout=30)
