"""The local side over loopback TCP (``local_transport="tcp"``), which any local user may reach.

Findings of session 61's audit, played as another user of the machine against a
pool run by root (README: unencrypted and unauthenticated, refused with ``bind``):

- a worker started as a fresh interpreter had its routing identity on its
  command line (``--identity w0.<secret>``), which every user reads in
  ``/proc/PID/cmdline``: read 11 ms after the spawn, it let the other user
  register as the worker, receive its env's actions and answer for it;
- the side kept libzmq's queue of 1,000 messages a connection and its 30 s
  handshake limit: one connection of 1 MB messages took the trainer from 373
  to 1,327 MiB while it idled;
- a second results endpoint (a larger frame limit) was bound at the first's
  port with "1" appended, another port (40599 became 12775), which anything
  already listening there would make fail.

Session 62: the side had no CURVE, so any local process could connect and send
a message of as many frames as it liked (libzmq holds a whole message before
the pool reads its first frame). Now each local worker gets a key pair the
pool made, on its stdin, and only those keys complete a handshake.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import struct
import time
from pathlib import Path

import torch
import zmq
from tensordict import TensorDict

from tests.conftest import FAST
from tests.hostile import Peer
from zmqpool import ZMQAsyncEnvPool
from zmqpool.broker import Broker
from zmqpool.endpoints import Endpoints
from zmqpool.layout import max_message_bytes
from zmqpool.limits import REMOTE_CONTROL_QUEUE, REMOTE_RESULTS_QUEUE
from zmqpool.testing import CountingEnv, FaultyEnv


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def test_a_local_workers_command_line_does_not_hold_its_identity():
    config = dataclasses.replace(FAST, fork_server=False)  # a fresh interpreter's command line
    pool = ZMQAsyncEnvPool([CountingEnv] * 2, local_transport="tcp", config=config)
    try:
        pool.reset()  # registered: the identity reached them
        lines = []
        for pid in descendants(os.getpid()):
            with contextlib.suppress(OSError):
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
        workers = [argv for argv in lines if b"--env-indices" in argv]  # local workers only
        assert len(workers) == 2, lines
        for argv in workers:
            # The roster's identities: w<index>.<secret> (zmqpool.roster).
            named = [a for a in argv if re.fullmatch(rb"w\d+\.\w+", a)]
            assert b"--identity" not in argv and not named, argv
    finally:
        pool.close()


def test_the_local_tcp_side_queues_few_messages_and_bounds_handshakes():
    broker = Broker(FAST, Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    try:
        assert broker.local.router.getsockopt(zmq.RCVHWM) == REMOTE_CONTROL_QUEUE
        assert broker.local.pull.getsockopt(zmq.RCVHWM) == REMOTE_RESULTS_QUEUE
        for sock in (broker.local.router, broker.local.pull):
            assert sock.getsockopt(zmq.HANDSHAKE_IVL) == 5000
    finally:
        broker.close()


def test_a_larger_results_endpoint_over_tcp_takes_a_port_of_its_own():
    broker = Broker(FAST, Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    squatter = broker.context.socket(zmq.PULL)
    squatter.linger = 0
    try:
        port = broker.local.results_ep.rsplit(":", 1)[1]
        appended = int(f"{port}1") % 65536  # where PORT followed by "1" landed
        with contextlib.suppress(zmq.ZMQError):  # in use already: busy either way
            squatter.bind(f"tcp://127.0.0.1:{appended}")
        endpoint = broker.results_endpoint(2 * max_message_bytes([]))
        assert endpoint.startswith("tcp://127.0.0.1:") and endpoint != broker.local.results_ep
        assert int(endpoint.rsplit(":", 1)[1]) != appended
    finally:
        squatter.close()
        broker.close()


class Heard:
    """A broker's sink that keeps what reaches the pool."""

    def __init__(self) -> None:
        self.results: list[list[bytes]] = []
        self.control: list[list[bytes]] = []

    def on_result(self, frames: list[zmq.Frame], remote: bool) -> None:
        self.results.append([f.bytes for f in frames])

    def on_control(self, identity: bytes, frames: list[zmq.Frame], remote: bool) -> None:
        self.control.append([f.bytes for f in frames])

    def on_fd(self, fd: int) -> None:
        raise AssertionError(f"no fd is watched here, yet {fd} was readable")


def _handshake(peer: Peer, timeout_s: float = 10.0) -> str:
    """The first handshake outcome ``peer``'s monitor reports within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome = [e for e in peer.events() if e.startswith("EVENT_HANDSHAKE_")]
        if outcome:
            return outcome[0]
        time.sleep(0.01)
    raise AssertionError(f"no handshake outcome within {timeout_s} s: {peer.events()}")


def test_the_local_tcp_side_takes_only_the_keys_the_pool_made_for_its_workers():
    broker = Broker(FAST, Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    context = zmq.Context()
    strangers: list[Peer] = []
    try:
        ports = [(broker.local.router_ep, zmq.DEALER), (broker.local.results_ep, zmq.PUSH)]
        for endpoint, kind in ports:
            strangers.append(Peer(context, endpoint, kind=kind, monitor=True))  # no key
            strangers[-1].send(b"a stranger's frame")
            assert _handshake(strangers[-1]) != "EVENT_HANDSHAKE_SUCCEEDED", endpoint
        keys = broker.local_keys
        assert keys is not None
        unknown_public, unknown_secret = zmq.curve_keypair()
        strangers.append(
            Peer(
                context,
                broker.local.results_ep,
                kind=zmq.PUSH,
                monitor=True,
                curve=(unknown_public, unknown_secret, keys.public),  # a key nobody authorized
            )
        )
        strangers[-1].send(b"a stranger's frame")
        assert _handshake(strangers[-1]) == "EVENT_HANDSHAKE_FAILED_AUTH"
        worker_public, worker_secret = zmq.curve_keypair()
        broker.authorize_local(worker_public)
        worker = Peer(
            context,
            broker.local.results_ep,
            kind=zmq.PUSH,
            monitor=True,
            curve=(worker_public, worker_secret, keys.public),
        )
        strangers.append(worker)
        worker.send(b"the worker's frame")
        heard = Heard()
        deadline = time.monotonic() + 10.0
        while not heard.results and time.monotonic() < deadline:
            broker.poll(0.1, heard)
        assert heard.results == [[b"the worker's frame"]] and not heard.control
    finally:
        for peer in strangers:
            peer.close()
        context.destroy(linger=0)
        broker.close()


def test_a_local_worker_restarted_over_tcp_gets_a_key_that_registers():
    config = dataclasses.replace(FAST, register_timeout_s=60.0)
    pool = ZMQAsyncEnvPool(
        [FaultyEnv, CountingEnv],
        create_env_kwargs=[{"fault": "exit", "fault_at": 2, "every_episode": False}, {}],
        local_transport="tcp",
        config=config,
    )
    try:
        pool.reset()
        counts = []
        for _ in range(3):  # the second step kills env 0's worker; its replacement steps on
            pool.async_step_send(TensorDict({"action": torch.zeros(2, 1)}, [2]), env_index=[0, 1])
            out = pool.async_step_recv(min_get=2, timeout=60)
            counts.append(out["next", "observation"][:, 1].tolist())
        assert pool.env_stats()[0]["restarts"] == 1
        assert counts == [[1.0, 1.0], [0.0, 2.0], [1.0, 3.0]]
    finally:
        pool.close()


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


#: ZMTP 3.0's greeting of a CURVE client (64 bytes), and a handshake command frame
#: declared ``HANDSHAKE_FRAME`` bytes long: libzmq takes it in before any check.
_CURVE_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"CURVE".ljust(20, b"\0") + bytes(32)
HANDSHAKE_FRAME = 1_000_000


def _start_handshakes(endpoint: str, count: int) -> list[socket.socket]:
    """``count`` keyless connections, each with all but the last byte of a large frame sent."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    frame = b"\x06" + struct.pack(">Q", HANDSHAKE_FRAME) + bytes(HANDSHAKE_FRAME - 1)
    peers = []
    for _ in range(count):
        peer = socket.create_connection((host, int(port)), timeout=5.0)
        peer.sendall(_CURVE_GREETING)
        peer.recv(64)  # the pool's greeting
        peer.sendall(frame)
        peers.append(peer)
    return peers


def test_memory_held_by_keyless_handshakes_is_given_back_once_they_end():
    # Session 62's audit: 600 keyless connections on each local port took a trainer from
    # 370 to 1,602 MiB, and it kept that after they had gone (the allocator kept it).
    broker = Broker(FAST, Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    heard = Heard()
    peers: list[socket.socket] = []
    try:
        before = _rss_mib()
        peers = _start_handshakes(broker.local.results_ep, 100)
        deadline = time.monotonic() + 10.0
        while _rss_mib() - before < 60 and time.monotonic() < deadline:
            broker.poll(0.05, heard)  # libzmq takes the frames in meanwhile
        held = _rss_mib() - before
        assert held >= 60, f"the flood took only {held:.0f} MiB: the scenario is wrong"
        for peer in peers:
            peer.close()
        deadline = time.monotonic() + 10.0
        while _rss_mib() - before > 25 and time.monotonic() < deadline:
            broker.poll(0.05, heard)
        left = _rss_mib() - before
        assert left <= 25, f"{held:.0f} MiB taken, {left:.0f} MiB still held after the peers left"
        assert broker.handshakes.trims >= 1 and not heard.results and not heard.control
    finally:
        for peer in peers:
            peer.close()
        broker.close()
