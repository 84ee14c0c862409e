"""Where the pool's sockets live: a private ipc directory, removed at close.

Local endpoints are ``ipc://`` files in a fresh directory of mode 0700, so no
other user can connect. Paths are kept short because ``ipc://`` paths are
limited to ``zmq.IPC_PATH_MAX_LEN`` (107 bytes on Linux).

A trainer killed by a signal cannot remove its directory; the next pool made
on the machine removes those it finds stale (:func:`sweep_stale_dirs`).
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import os
import shutil
import socket
import stat
import tempfile

import zmq


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """The two endpoints a worker connects to."""

    router: str  # commands out, registration and heartbeats in
    results: str  # results in (PULL)
    beats: str = ""  # the pool's heartbeats, asked for and answered (the beacon's ROUTER), TCP only


def tcp_endpoints(bind: str) -> Endpoints:
    """``tcp://HOST:PORT`` -> router on PORT, results on PORT+1, beats on PORT+2.

    ``*`` or ``0`` (the operating system's "any free port"): each on a port of
    its own choosing, which WELCOME tells each worker. (Port 0 used to put the
    results and heartbeat ports on ports 1 and 2: a root trainer took them.)
    """
    if not bind.startswith("tcp://") or ":" not in bind[6:]:
        raise ValueError(f"bind must look like tcp://HOST:PORT, got {bind!r}")
    host, port = bind[6:].rsplit(":", 1)
    if not (port == "*" or port.isdigit()):
        raise ValueError(f"bind port must be a number or *, got {port!r}")
    if port == "*" or int(port) == 0:
        return Endpoints(f"tcp://{host}:*", f"tcp://{host}:*", f"tcp://{host}:*")
    base = int(port)
    if base > _MAX_PORT - 2:
        raise ValueError(
            f"bind port {base} leaves no room for the results and heartbeat ports "
            f"({base + 1}, {base + 2}): give at most {_MAX_PORT - 2}, or *"
        )
    return Endpoints(bind, f"tcp://{host}:{base + 1}", f"tcp://{host}:{base + 2}")


_MAX_PORT = 65535


def make_private_dir() -> str:
    """A fresh 0700 directory with a short path, named after this process.

    Stale directories of trainers that were killed go first (:func:`sweep_stale_dirs`).
    """
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    sweep_stale_dirs(base)
    path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base)
    os.chmod(path, 0o700)
    return path


_PREFIX = "zmqp-"


def sweep_stale_dirs(base: str) -> list[str]:
    """Remove the pool directories in ``base`` that no live trainer uses; returns them.

    One is stale if it is ours (same user), the process it is named after is
    gone, and nothing listens on its router socket. The socket test guards
    against a process of the same pid in another pid namespace sharing /tmp.
    """
    removed = []
    for path in glob.glob(os.path.join(base, f"{_PREFIX}*-*")):
        if _is_stale(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _is_stale(path: str) -> bool:
    pid = os.path.basename(path)[len(_PREFIX) :].split("-", 1)[0]
    try:
        found = os.lstat(path)  # not a link's target: another user may plant a link there
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
            return False
        if not pid.isdigit() or _alive(int(pid)):
            return False
    except OSError:  # removed meanwhile
        return False
    return not _listening(os.path.join(path, "r"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def _listening(path: str) -> bool:
    """Whether a socket at ``path`` accepts connections (a pool's router binds there).

    Without waiting: a socket that listens and never accepts (a forked child of a
    killed trainer holds its router open) fills its backlog with our probes, one a
    construction, and a blocking connect then waited for ever, in every pool made
    on the machine. A full backlog (``EAGAIN``) is a listener too.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except FileNotFoundError:
            return False
        except OSError as err:
            return err.errno != errno.ECONNREFUSED
    return True


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
