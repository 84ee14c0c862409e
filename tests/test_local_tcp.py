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
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path

import zmq

from tests.conftest import FAST
from zmqpool import ZMQAsyncEnvPool
from zmqpool.broker import Broker
from zmqpool.endpoints import Endpoints
from zmqpool.layout import max_message_bytes
from zmqpool.limits import REMOTE_CONTROL_QUEUE, REMOTE_RESULTS_QUEUE
from zmqpool.testing import CountingEnv


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
