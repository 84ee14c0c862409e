"""Where the pool's sockets live: a private ipc directory, removed at close.

Local endpoints are ``ipc://`` files in a fresh directory of mode 0700, so no
other user can connect. Paths are kept short because ``ipc://`` paths are
limited to ``zmq.IPC_PATH_MAX_LEN`` (107 bytes on Linux).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import zmq


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """The two endpoints a worker connects to."""

    router: str  # commands out, registration and heartbeats in
    results: str  # results in (PULL)
    beats: str = ""  # the pool's heartbeats out (PUB), TCP only


def tcp_endpoints(bind: str) -> Endpoints:
    """``tcp://HOST:PORT`` -> router on PORT, results on PORT+1, beats on PORT+2 (``*``: any)."""
    if not bind.startswith("tcp://") or ":" not in bind[6:]:
        raise ValueError(f"bind must look like tcp://HOST:PORT, got {bind!r}")
    host, port = bind[6:].rsplit(":", 1)
    if port == "*":
        return Endpoints(bind, f"tcp://{host}:*", f"tcp://{host}:*")
    if not port.isdigit():
        raise ValueError(f"bind port must be a number or *, got {port!r}")
    base = int(port)
    return Endpoints(bind, f"tcp://{host}:{base + 1}", f"tcp://{host}:{base + 2}")


def make_private_dir() -> str:
    """A fresh 0700 directory with a short path."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    path = tempfile.mkdtemp(prefix="zmqp-", dir=base)
    os.chmod(path, 0o700)
    return path


def ipc_endpoints(directory: str) -> Endpoints:
    endpoints = Endpoints(f"ipc://{directory}/r", f"ipc://{directory}/p")
    longest = max(len(endpoints.router), len(endpoints.results)) - len("ipc://")
    if longest > zmq.IPC_PATH_MAX_LEN:
        raise OSError(
            f"ipc path {directory!r} is too long for ZeroMQ "
            f"({longest} > {zmq.IPC_PATH_MAX_LEN}); set TMPDIR to a shorter directory"
        )
    return endpoints


def remove_private_dir(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
