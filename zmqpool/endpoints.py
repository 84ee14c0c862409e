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
