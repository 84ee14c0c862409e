"""What cannot cross the wire is an error naming it, both ways, never a request left unanswered.

A message a peer would drop (a header over 1 MiB, a frame over the size the
pool's results socket takes, a value msgpack packs but cannot unpack) used
to be sent anyway: the peer dropped it as malformed, or libzmq dropped it
with the connection, and the request it answered waited for ever. Now the
trainer refuses such an input at the send (``ProtocolError``, a
``ValueError``, naming it), and a worker answers such an output with the
env's ``EnvError``. Every env here lives in one worker process (cheap), stepped
through its own async send and recv; after each error the env steps on.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack

from tests.conformance import OffTheWireEnv
from tests.conftest import FAST
from zmqpool import EnvError, ProtocolError, ZMQAsyncEnvPool

PLAIN, BIG_TEXT, TUPLE_KEY, BIG_OBS, TWICE_TEXT, NUMPY_INFO = range(6)
RECV_S = 30.0


@pytest.fixture(scope="module")
def pool():
    makers = [
        OffTheWireEnv,
        functools.partial(OffTheWireEnv, text_bytes=1_100_000),
        functools.partial(OffTheWireEnv, tuple_key=True),
        functools.partial(OffTheWireEnv, obs_elems=1 << 20),  # 4 MiB for a spec of 16 bytes
        functools.partial(OffTheWireEnv, text_bytes=600_000, declared=True),  # once, not twice
        functools.partial(OffTheWireEnv, numpy_info=True),
    ]
    p = ZMQAsyncEnvPool(makers, envs_per_worker=len(makers), config=FAST, stack="lazy")
    for env in range(len(makers)):  # one at a time: env 4 declares one entry more
        p.async_reset_send(env_index=env)
        p.async_reset_recv(env_index=env, timeout=RECV_S)
    yield p
    p.close()


def step(pool, env, **entries):
    td = pool.full_action_spec[env].zero()
    for key, value in entries.items():
        td.set(key, value)
    pool.async_step_send(td, env_index=env)
    return pool.async_step_recv(env_index=env, timeout=RECV_S)


def test_an_env_steps_when_its_output_crosses(pool):
    assert step(pool, PLAIN)["next", "observation"][0] == PLAIN


@pytest.mark.parametrize(
    "env, says",
    [
        (BIG_TEXT, "header would be 11"),
        (TUPLE_KEY, "non-tensor value at info of type dict is not plain data"),
        (BIG_OBS, "a frame of 4194304 bytes"),
    ],
    ids=["a 1.1 MB string", "a dict keyed by a tuple", "a 4 MiB observation"],
)
def test_an_output_that_cannot_cross_is_the_env_s_error(pool, env, says):
    for _ in range(2):  # and again: the env, its worker and its layouts serve on
        with pytest.raises(EnvError, match="its output cannot cross the wire") as info:
            step(pool, env)
        assert info.value.env_index == env and says in str(info.value)
    assert step(pool, PLAIN)["next", "observation"][0] == PLAIN


def test_numpy_scalars_in_an_output_cross_as_python_numbers(pool):
    info = step(pool, NUMPY_INFO)["next", "info"]
    assert info == {"count": 1, "ok": True, "w": [0.5]}
    assert [type(v) for v in (info["count"], info["ok"], info["w"][0])] == [int, bool, float]


def test_step_and_maybe_reset_counts_its_two_parts(pool):
    # The text is in "next" and in the next root: 1.2 MB in one header.
    assert len(step(pool, TWICE_TEXT)["next", "text"]) == 600_000
    td = pool.full_action_spec[TWICE_TEXT].zero()
    pool.async_step_and_maybe_reset_send(td, env_index=TWICE_TEXT)
    with pytest.raises(EnvError, match="header would be 12"):
        pool.async_step_and_maybe_reset_recv(env_index=TWICE_TEXT, timeout=RECV_S)


@pytest.mark.parametrize(
    "value, says",
    [
        ("y" * 1_100_000, "pack to 1100"),
        ({(1, 2): 0}, "not plain data"),
    ],
    ids=["a 1.1 MB string", "a dict keyed by a tuple"],
)
def test_an_input_that_cannot_cross_is_refused_at_the_send(pool, value, says):
    td = pool.full_action_spec[[PLAIN]].zero()
    td.set("note", NonTensorStack(NonTensorData(value)))
    with pytest.raises(ProtocolError, match=says):
        pool.async_step_send(td, env_index=[PLAIN])
    assert step(pool, PLAIN, note=NonTensorData("fits"))["next", "observation"][0] == PLAIN
    assert isinstance(ProtocolError("x"), ValueError)


def test_the_frame_limit_is_what_the_pool_takes_from_the_worker(pool):
    # Not a fixed figure: the worker is told (WELCOME) what its specs imply here.
    with pytest.raises(EnvError) as info:
        step(pool, BIG_OBS)
    limit = int(str(info.value).split("takes at most ")[1].split(" ")[0])
    assert 16 < limit < 4 << 20
    assert torch.zeros(4).nbytes <= limit
