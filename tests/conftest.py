"""Shared fixtures: pools are expensive (workers import torchrl), so tests share them where safe."""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from tests import warm
from tests.netns import RemoteHost, free_port_base, make_remote_host, remove_remote_host
from zmqpool import PoolConfig, ZMQAsyncEnvPool, keep_fork_server
from zmqpool import cli as zmqpool_cli
from zmqpool.security import write_keys
from zmqpool.state import Kind
from zmqpool.testing import CountingEnv

faulthandler.enable()

NUM_ENVS = 4

#: Short timings so failure paths are quick; construction may still take a
#: while on a loaded 2-core machine (every worker imports torchrl).
FAST = PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0)


def counting_kwargs(n: int = NUM_ENVS, **extra) -> list[dict]:
    return [{"env_id": i, **extra} for i in range(n)]


@pytest.fixture(scope="session", autouse=True)
def one_fork_server():
    """Every pool of this session forks its workers from one fork server, kept between pools.

    A fork server imports torch and torchrl (seconds of CPU): kept, each pool
    after the first starts in milliseconds. Tests that kill a fork server use
    one of their own (``share_fork_server=False``), so no other pool's workers
    die with it.
    """
    with keep_fork_server():
        yield


@pytest.fixture(scope="session")
def remote_host():
    """Another "machine": a network namespace behind a veth pair (or loopback, saying why)."""
    host = make_remote_host()
    if host.namespace is None:
        print(f"\nremote-worker tests use 127.0.0.1: {host.why_not}")
    yield host
    remove_remote_host(host)


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> Path:
    """``zmqpool keygen DIR --workers 1``: the files a trainer and one worker get."""
    root = tmp_path_factory.mktemp("keygen") / "keys"
    assert zmqpool_cli.main(["keygen", str(root), "--workers", "1"]) == 0
    return root


@pytest.fixture(scope="session")
def key_dir(tmp_path_factory):
    """CURVE keys: workers 0 and 1 authorized; worker 2's key is not on the allow-list."""
    root = tmp_path_factory.mktemp("keys")
    write_keys(root, 3)
    (root / "authorized" / "worker-2.key").unlink()
    return root


def start_remote_worker(
    host: RemoteHost,
    port: int,
    keys,
    *,
    key: int = 0,
    kwargs: object = None,
    num_envs: int = 1,
    extra: tuple[str, ...] = (),
    env: str = "zmqpool.testing:CountingEnv",
) -> warm.WarmProcess:
    """``python -m workers`` inside the remote host, connecting to the pool's TCP port."""
    argv = [sys.executable, "-m", "workers", "--connect", f"tcp://{host.pool_ip}:{port}"]
    argv += ["--env", env, "--num-envs", str(num_envs)]
    argv += ["--kwargs", json.dumps(kwargs if kwargs is not None else {})]
    argv += ["--server-key", str(keys / "server.key")]
    argv += ["--client-key", str(keys / "workers" / f"worker-{key}.key_secret"), *extra]
    # Forked warm (tests/warm.py) into the host's namespace: as ``ip netns exec``, without
    # the seconds of CPU a fresh interpreter spends importing torchrl.
    return warm.popen(argv, stderr=subprocess.PIPE, netns=host.namespace)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="session", params=["local", "mixed"])
def pool(request):
    """Four CountingEnvs with episodes of 5 steps whose env_id is their index.

    ``local``: two per local worker process. ``mixed``: envs 0-1 local, envs
    2-3 on the remote host over TCP with CURVE, one process each.
    """
    if request.param == "local":
        p = ZMQAsyncEnvPool(
            CountingEnv,
            create_env_kwargs=counting_kwargs(max_steps=5),
            envs_per_worker=2,
            config=FAST,
        )
        yield p
        p.close()
        return
    yield from _mixed_pool(
        request.getfixturevalue("remote_host"), request.getfixturevalue("key_dir")
    )


def _mixed_pool(host: RemoteHost, keys):
    port = free_port_base(host.pool_ip)
    remote_kwargs = [{"env_id": 2, "max_steps": 5}, {"env_id": 3, "max_steps": 5}]
    worker = start_remote_worker(
        host, port, keys, kwargs=remote_kwargs, num_envs=2, extra=("--slots", "2,3")
    )
    try:
        p = ZMQAsyncEnvPool(
            CountingEnv,
            create_env_kwargs=counting_kwargs(2, max_steps=5),
            remote_envs=2,
            bind=f"tcp://{host.pool_ip}:{port}",
            curve_keys=keys,
            config=FAST,
        )
        yield p
        p.close()
    finally:
        stop(worker)


def awaited(pool: ZMQAsyncEnvPool) -> dict[tuple[str, int | None], int]:
    """The requests no recv has taken yet, by channel (kind, env or None): empty when idle.

    Read through the runtime's documented read-only API (``awaiting``), not the
    private ``_busy`` set the pool keeps for torchrl's code.
    """
    envs = [None, *range(pool.batch_size[0])]
    counts = {(k.value, env): pool.runtime.awaiting((k, env)) for k in Kind for env in envs}
    return {channel: n for channel, n in counts.items() if n}


@pytest.fixture
def fresh(pool):
    """The shared pool, reset, with nothing in flight."""
    assert not awaited(pool), "a previous test left envs busy"
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


@pytest.fixture
def context():
    """A ZeroMQ context for a test's own sockets (hostile peers, fake trainers), destroyed after."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def unused_port() -> Iterator[int]:
    """A port bound (so no one else takes it) but never listened on: connections are refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()
