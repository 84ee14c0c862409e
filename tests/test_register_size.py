"""Control messages fit the pool's ROUTER, or fail loudly on the side the user watches.

The ROUTER's ``MAXMSGSIZE`` keeps unauthenticated peers from making the pool
allocate; libzmq drops a larger message by closing the connection, telling
nobody. So a worker checks its REGISTER first (``limits.MAX_CONTROL_BYTES``),
scalar bounds travel as one element (a pixel env fits), and a FAILED message
clips its traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq
from torchrl.data import Bounded, Composite

from tests.conftest import FAST
from zmqpool import EnvMakerError, PoolConfig, RegistrationError, ZMQAsyncEnvPool
from zmqpool.layout import max_message_bytes
from zmqpool.limits import MAX_CONTROL_BYTES
from zmqpool.protocol import MAX_TRACEBACK_CHARS, Failed, FailureKind
from zmqpool.testing import CountingEnv
from zmqpool.wire import Command, Header

ROOT = Path(__file__).resolve().parent.parent


def big_bounded_env(**kwargs) -> CountingEnv:
    """A CountingEnv declaring a per-pixel Bounded image: 2 x 3 MiB of low/high in its specs.

    Bounds that differ pixel by pixel: scalar ones would travel as one element.
    """
    env = CountingEnv(**kwargs)
    low = torch.rand((3, 512, 512), generator=torch.Generator().manual_seed(0))
    env.observation_spec = Composite(
        observation=Bounded(low, low + 1.0, shape=(3, 512, 512)), shape=env.batch_size
    )
    return env


def pixel_env(**kwargs) -> CountingEnv:
    """A CountingEnv with a standard uint8 image observation, Bounded(0, 255) per pixel."""
    env = CountingEnv(obs_shape=(3, 512, 512), obs_dtype=torch.uint8, **kwargs)
    pixels = Bounded(0, 255, shape=(3, 512, 512), dtype=torch.uint8)
    env.observation_spec = Composite(observation=pixels, shape=env.batch_size)
    return env


def loudly_failing_env(**kwargs) -> CountingEnv:
    """An env maker whose error, and so its traceback, is megabytes long."""
    raise ValueError("a very long reason " * 200_000 + "and its end")


def test_a_local_env_whose_specs_do_not_fit_fails_construction_naming_it():
    with pytest.raises(RegistrationError) as info:
        ZMQAsyncEnvPool(
            [CountingEnv, big_bounded_env],
            create_env_kwargs=[{"env_id": 0}, {"env_id": 1}],
            config=FAST,  # a timeout, never reached: the worker says why at once
        )
    text = str(info.value)
    assert text.startswith("env 1: its REGISTER message is ")
    assert f"over the limit of {MAX_CONTROL_BYTES} bytes" in text
    assert "env 1 (CountingEnv)" in text
    assert "full_observation_spec/observation/low (3145728 bytes)" in text
    assert "Unbounded rather than Bounded" in text


def test_a_remote_worker_whose_specs_do_not_fit_says_why_and_exits():
    # Nothing listens there: the worker must fail before it sends anything.
    with zmq.Context() as context, context.socket(zmq.REP) as unused:
        port = unused.bind_to_random_port("tcp://127.0.0.1")
        unused.unbind(unused.last_endpoint)
        argv = [sys.executable, "-m", "workers", "--connect", f"tcp://127.0.0.1:{port}"]
        argv += ["--env", "tests.test_register_size:big_bounded_env", "--single-process"]
        argv += ["--register-timeout", "60"]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2  # REFUSED: a supervisor does not restart it
    assert f"cannot register with the pool at tcp://127.0.0.1:{port}" in done.stderr
    # Over TCP the pool's remote side takes less than its local one.
    assert "REGISTER message is" in done.stderr and "MAX_REMOTE_CONTROL_BYTES" in done.stderr
    assert "env 0 (CountingEnv)" in done.stderr and "observation/high" in done.stderr


def test_a_pixel_env_with_scalar_bounds_registers_and_steps():
    # Element by element, its bounds alone weigh 1.57 MB, over MAX_CONTROL_BYTES.
    config = PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0, step_timeout_s=60.0)
    pool = ZMQAsyncEnvPool([pixel_env], config=config)
    try:
        expected = torch.stack([pixel_env().observation_spec])  # the pool's batch of one
        assert pool.observation_spec == expected
        low = pool.observation_spec["observation"].space.low
        assert low.dtype == torch.uint8 and bool((low == 0).all())
        pool.async_reset_send(env_index=[0])
        td = pool.async_reset_recv(min_get=1, timeout=60)
        td["action"] = torch.full((1, 1), 0.5)
        pool.async_step_send(td, env_index=[0])
        out = pool.async_step_recv(min_get=1, timeout=60)
    finally:
        pool.close()
    observation = out["next", "observation"]
    assert observation.shape == (1, 3, 512, 512) and observation.dtype == torch.uint8
    assert observation[0, 0, 0, :2].tolist() == [0, 1]  # env 0, step 1


def test_a_failed_message_clips_a_huge_traceback_keeping_head_and_tail():
    head = "Traceback (most recent call last):\n"
    tb = head + '  File "deep.py", line 1, in f\n' * 100_000 + "ValueError: the cause\n"
    for err, text in [("boom", tb), ("\U0001f4a5" * 3_000_000, "\U0001f4a5" * 3_000_000)]:
        body = Failed.clipped(err, text, FailureKind.ENV).to_body()
        message = Header(Command.FAILED, 3, body=body).encode()
        assert len(message) < MAX_CONTROL_BYTES // 2  # 4-byte characters included
        got = Failed.from_body(Header.decode(message).body)  # within the limits it checks
        assert got.kind is FailureKind.ENV
        assert len(got.tb) <= MAX_TRACEBACK_CHARS
    assert got.err.startswith("\U0001f4a5") and "characters cut" in got.err
    kept_head, rest = Failed.clipped("boom", tb, FailureKind.MAKER).tb.split("\n... [")
    count, kept_tail = rest.split(" characters cut] ...\n")
    assert kept_head.startswith(head) and tb.startswith(kept_head)
    assert kept_tail.endswith("ValueError: the cause\n") and tb.endswith(kept_tail)
    assert len(kept_head) + int(count) + len(kept_tail) == len(tb)  # the count is exact
    short = Failed.clipped("boom", "short", FailureKind.MAKER)
    assert short == Failed("boom", "short", FailureKind.MAKER)


def test_an_env_maker_error_megabytes_long_still_reaches_the_trainer():
    # Unclipped, its FAILED message would exceed the ROUTER's MAXMSGSIZE and
    # vanish: the trainer would only learn that the worker exited.
    with pytest.raises(EnvMakerError) as info:
        ZMQAsyncEnvPool([loudly_failing_env], config=FAST)
    error = info.value
    assert error.env_index == 0
    assert "characters cut" in error.remote_traceback
    assert error.remote_traceback.rstrip().endswith("a very long reason and its end")
    assert "env maker raised ValueError('a very long reason" in str(error).split("\n")[0]


@pytest.mark.parametrize("curve", [False, True])
def test_the_control_limit_fits_through_the_routers_maxmsgsize(curve):
    """CURVE's per-frame bytes count against MAXMSGSIZE: MAX_CONTROL_BYTES leaves room."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    with zmq.Context() as context:
        router = context.socket(zmq.ROUTER)
        router.linger = 0
        router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes([]))  # as the broker's
        dealer = context.socket(zmq.DEALER)
        dealer.linger = 0
        if curve:
            router.curve_server = True
            router.curve_secretkey, router.curve_publickey = server_secret, server_public
            dealer.curve_serverkey = server_public
            dealer.curve_publickey, dealer.curve_secretkey = client_public, client_secret
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(bytes(MAX_CONTROL_BYTES))
        assert router.poll(10_000), "a control message of MAX_CONTROL_BYTES was dropped"
        assert len(router.recv_multipart()[1]) == MAX_CONTROL_BYTES
        router.close()
        dealer.close()
