"""PoolConfig and the pool's arguments are checked at construction, naming field and value.

In-process and fast: nothing here starts a worker (a wrong argument must be
refused before any process starts).
"""

from __future__ import annotations

import math
import time

import pytest

from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.broker import Broker
from zmqpool.endpoints import Endpoints, tcp_endpoints
from zmqpool.testing import CountingEnv

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("close_timeout_s", NAN),
        ("register_timeout_s", NAN),
        ("register_timeout_s", INF),
        ("register_timeout_s", 0),
        ("heartbeat_interval_s", NAN),
        ("heartbeat_interval_s", 0.0),
        ("step_timeout_s", NAN),
        ("step_timeout_s", INF),
        ("step_timeout_s", 0.0),
        ("restart_window_s", 0),
        ("rejoin_timeout_s", 0),
        ("rejoin_timeout_s", -1.0),
        ("restart_backoff_s", -0.1),
        ("heartbeat_liveness", 0),
        ("max_slots_per_key", 0),
        ("max_remote_frame_bytes", 0),
        ("max_remote_spec_bytes", 0),
        ("max_restarts", -1),
        ("worker_torch_threads", -1),
    ],
)
def test_a_bad_value_is_a_value_error_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"PoolConfig\.{field} must be .*got {value!r}") as info:
        PoolConfig(**{field: value})
    assert not isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_restarts", 2.5),
        ("heartbeat_liveness", 1.5),
        ("max_slots_per_key", 1.5),
        ("zero_copy_threshold_bytes", 1.5),
        ("max_restarts", True),
        ("step_timeout_s", "5"),
        ("register_timeout_s", None),
        ("fork_server", 1),
        ("worker_torch_threads", "2"),
    ],
)
def test_a_wrong_type_is_a_type_error_naming_field_and_value(field, value):
    with pytest.raises(TypeError, match=rf"PoolConfig\.{field} must be .*got {value!r}") as info:
        PoolConfig(**{field: value})
    assert isinstance(info.value, ValueError)  # what it was before: callers catching that still do


def test_the_first_restart_delay_may_not_exceed_the_longest():
    with pytest.raises(ValueError, match=r"restart_backoff_s \(5\) must not exceed .*\(1\)"):
        PoolConfig(restart_backoff_s=5, restart_backoff_max_s=1)
    assert PoolConfig(restart_backoff_s=1, restart_backoff_max_s=1).restart_backoff_s == 1


def test_good_values_still_pass():
    config = PoolConfig(
        register_timeout_s=90,
        close_timeout_s=0,
        restart_backoff_s=0.0,
        max_restarts=0,
        max_slots_per_key=1,
        worker_torch_threads=0,
        step_timeout_s=None,
    )
    assert config.register_timeout_s == 90 and config.max_slots_per_key == 1


def test_a_dict_as_config_is_a_type_error_naming_config():
    with pytest.raises(TypeError, match=r"config must be a PoolConfig: PoolConfig\(\*\*config\)"):
        ZMQAsyncEnvPool([CountingEnv], config={"step_timeout_s": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("makers", [[3], [CountingEnv, "CountingEnv"]])
def test_a_maker_that_is_not_callable_is_refused_before_any_process_starts(makers):
    started = time.monotonic()
    with pytest.raises(TypeError, match=rf"env maker {len(makers) - 1} must be callable"):
        ZMQAsyncEnvPool(makers)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    "kwargs, error, says",
    [
        ({"remote_envs": "2"}, TypeError, "remote_envs must be an int, got str"),
        ({"remote_envs": -1}, ValueError, "remote_envs must be >= 0"),
        ({"stack": "weird"}, NotImplementedError, "stack must be 'dense'"),  # torchrl's type
        ({"remote_envs": 1, "bind": "garbage", "insecure": True}, ValueError, "tcp://HOST:PORT"),
        (
            {"remote_envs": 1, "bind": "tcp://127.0.0.1:65534", "insecure": True},
            ValueError,
            "leaves no room for the results and heartbeat ports",
        ),
        (
            {"remote_envs": 1, "bind": "tcp://127.0.0.1:*", "curve_keys": "/nonexistent/keys"},
            FileNotFoundError,
            "is not a directory",
        ),
    ],
    ids=["remote_envs-str", "remote_envs-negative", "stack", "bind", "bind-port", "curve_keys"],
)
def test_bad_pool_arguments_are_refused_before_any_process_starts(kwargs, error, says):
    start = time.monotonic()
    with pytest.raises(error, match=says):
        ZMQAsyncEnvPool([CountingEnv], **kwargs)
    assert time.monotonic() - start < 1.0  # no worker was started first


def test_bind_port_0_gives_every_remote_port_one_the_os_chooses():
    # Session 62's audit: port 0 put the results and heartbeat ports on ports 1 and 2,
    # which a trainer run as root took.
    broker = Broker(PoolConfig(), Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    try:
        broker.bind_remote(tcp_endpoints("tcp://127.0.0.1:0"), None, 1 << 16)
        assert broker.tcp is not None
        endpoints = (broker.tcp.router, broker.tcp.results, broker.tcp.beats)
        ports = [int(endpoint.rsplit(":", 1)[1]) for endpoint in endpoints]
        assert len(set(ports)) == 3 and min(ports) > 1024, ports
    finally:
        broker.close()
