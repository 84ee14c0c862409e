"""Local worker processes: start, watch, stop.

A local worker runs ``python -m workers``'s code. Its env makers reach it
cloudpickled through a pipe from this process (local and trusted), never over
a socket, which is why lambdas and closures work here while torchrl's
spawn-based pool rejects them. Its death is seen at once through a pidfd that
the broker polls next to its sockets.

Two ways to start one, behind one interface (:class:`WorkerProcess`):

- :class:`ForkServer` (default): a zygote process that imported torch and
  torchrl once forks each worker in tens of milliseconds, so a restart costs
  milliseconds, not the seconds of a fresh interpreter's imports;
- :class:`LocalProcess`: a fresh interpreter per worker (the fallback).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import cloudpickle

log = logging.getLogger("zmqpool")


def pickle_recipes(indices: Sequence[int], makers: Sequence[Any], kwargs: Sequence[dict]) -> bytes:
    """The stdin payload of a local worker; fails here, naming the env, if a maker won't pickle."""
    recipes = []
    for index, maker, kw in zip(indices, makers, kwargs, strict=True):
        try:
            cloudpickle.dumps(maker)
        except Exception as err:
            raise TypeError(
                f"env maker {index} ({maker!r}) cannot be sent to a worker process: {err}"
            ) from err
        recipes.append((maker, dict(kw)))
    payload = {"indices": list(indices), "recipes": recipes, "sys_path": list(sys.path)}
    return cloudpickle.dumps(payload)


class WorkerProcess(Protocol):
    """What the broker and the pool need of a worker process."""

    @property
    def pid(self) -> int: ...
    @property
    def pidfd(self) -> int: ...

    def exit_status(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout_s: float) -> bool: ...
    def release(self) -> None: ...


def _child_env() -> dict[str, str]:
    """The environment of a worker: ours, with our sys.path importable (as multiprocessing does)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


class _Watched:
    """What both kinds of worker process share: a pidfd, released once."""

    pidfd: int

    def kill(self) -> None:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        """Kill if still alive, reap, and close the pidfd."""
        self.kill()
        self.wait(5.0)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class LocalProcess(_Watched):
    """One worker in a fresh interpreter, and the pidfd that says when it exits."""

    def __init__(self, argv: list[str], payload: bytes, cpu_affinity: Sequence[int] | None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            close_fds=True,
            env=_child_env(),
            preexec_fn=_affinity_setter(cpu_affinity),
        )
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it already died; the pidfd will say so
        self.pidfd = os.pidfd_open(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_status(self) -> int | None:
        """None while alive; the exit code (negative: the signal) once dead."""
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return False
        return True


def _affinity_setter(cpu_affinity: Sequence[int] | None):
    if cpu_affinity is None:
        return None
    cpus = set(cpu_affinity)

    def set_affinity() -> None:
        os.sched_setaffinity(0, cpus)

    return set_affinity


#: The fork server's reports on its pipe: (kind, pid, exit code).
REPORT = struct.Struct("!iii")
SPAWNED, EXITED = 1, 2

#: Where our ``workers`` package is: installed (or checked out) beside ``zmqpool``.
_WORKERS_DIR = Path(__file__).resolve().parents[1] / "workers"

#: ``python -m MODULE`` with *our* ``workers`` package: ``-m`` would import the
#: first ``workers`` on sys.path, and a user's project may well have its own
#: (the trainer's script folder and working directory come first). The rest of
#: our sys.path comes in through PYTHONPATH.
_RUN_MODULE = """\
import importlib.util, runpy, sys
where, module = sys.argv.pop(1), sys.argv.pop(1)
spec = importlib.util.spec_from_file_location(
    "workers", where + "/__init__.py", submodule_search_locations=[where])
sys.modules["workers"] = package = importlib.util.module_from_spec(spec)
spec.loader.exec_module(package)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def module_argv(module: str) -> list[str]:
    """The command line of ``python -m module`` (a module of our ``workers`` package)."""
    return [sys.executable, "-c", _RUN_MODULE, str(_WORKERS_DIR), module]


#: How many leading items of :func:`worker_argv` name the program (the rest are its arguments).
_PROGRAM_ARGS = len(module_argv("workers"))


def worker_argv(
    router: str,
    identity: str,
    indices: Sequence[int],
    heartbeat_s: float,
    env_threads: bool = False,
) -> list[str]:
    threads = ["--env-threads"] if env_threads and len(indices) > 1 else []
    return [
        *module_argv("workers"),
        "--connect",
        router,
        "--identity",
        identity,
        "--env-indices",
        ",".join(str(i) for i in indices),
        "--maker-stdin",
        "--parent-pid",
        str(os.getpid()),
        "--heartbeat-interval",
        str(heartbeat_s),
        *threads,
    ]


class ForkedProcess(_Watched):
    """A worker forked by the :class:`ForkServer`; the zygote reaps it and reports its status."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.server = server
        self.pidfd = os.pidfd_open(pid)

    def _dead(self, timeout_s: float) -> bool:
        if self.pidfd < 0:
            return True
        ready, _, _ = select.select([self.pidfd], [], [], max(timeout_s, 0.0))
        return bool(ready)

    def exit_status(self) -> int | None:
        if not self._dead(0.0):
            return None
        return self.server.status_of(self.pid, wait_s=1.0)

    def kill(self) -> None:
        if self.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def wait(self, timeout_s: float) -> bool:
        return self._dead(timeout_s)


class ForkServer:
    """The client of ``workers.zygote``: ask it to fork a worker, learn how children died."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [*module_argv("workers.zygote"), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            env=_child_env(),
        )
        self.statuses: dict[int, int] = {}
        self._spawned: list[int] = []
        self._partial = b""

    def start(
        self, argv: list[str], payload: bytes, cpu_affinity: Sequence[int] | None, timeout_s: float
    ) -> ForkedProcess:
        """Fork a worker running ``argv`` (the arguments after ``python -m workers``)."""
        argv = _with_parent(argv, self.proc.pid)  # a forked worker's parent is the zygote
        request = cloudpickle.dumps({"argv": argv, "payload": payload, "affinity": cpu_affinity})
        assert self.proc.stdin is not None
        self.proc.stdin.write(len(request).to_bytes(8, "big") + request)
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while not self._spawned:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise OSError("the fork server did not answer (is it dead?)")
            self._read_reports(0.1)
        return ForkedProcess(self._spawned.pop(0), self)

    def status_of(self, pid: int, wait_s: float) -> int | None:
        deadline = time.monotonic() + wait_s
        while pid not in self.statuses and time.monotonic() < deadline:
            self._read_reports(0.01)
        return self.statuses.pop(pid, None)

    def _read_reports(self, timeout_s: float) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return
        data = self._partial + os.read(fd, 65536)
        cut = len(data) - len(data) % REPORT.size
        self._partial = data[cut:]
        for offset in range(0, cut, REPORT.size):
            kind, pid, status = REPORT.unpack_from(data, offset)
            if kind == SPAWNED:
                self._spawned.append(pid)
            elif kind == EXITED:
                self.statuses[pid] = status

    def close(self) -> None:
        # The zygote holds no state worth a graceful exit (its children are
        # stopped first), and an interpreter with torch loaded takes a second
        # to tear down: kill it.
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()


def _with_parent(argv: list[str], parent_pid: int) -> list[str]:
    argv = list(argv)
    if "--parent-pid" in argv:
        argv[argv.index("--parent-pid") + 1] = str(parent_pid)
    return argv


class Launcher:
    """Starts local workers, through the fork server when it is enabled and alive."""

    def __init__(self, use_fork_server: bool, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.use_fork_server = use_fork_server
        self.fork_server: ForkServer | None = None

    def start(
        self, argv: list[str], payload: bytes, cpu_affinity: Sequence[int] | None
    ) -> WorkerProcess:
        if self.use_fork_server and self.fork_server is None:
            self.fork_server = ForkServer()  # only once a local worker is wanted
        if self.fork_server is not None:
            try:
                args = argv[_PROGRAM_ARGS:]
                return self.fork_server.start(args, payload, cpu_affinity, self.timeout_s)
            except OSError as err:
                log.warning("fork server unavailable (%s); starting workers afresh", err)
                self.fork_server.close()
                self.fork_server, self.use_fork_server = None, False
        return LocalProcess(argv, payload, cpu_affinity)

    def close(self) -> None:
        if self.fork_server is not None:
            self.fork_server.close()
            self.fork_server = None


def stop_all(processes: Sequence[WorkerProcess], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` in all for the processes to exit, then kill the rest."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        if not process.wait(deadline - time.monotonic()):
            if timeout_s > 0:
                log.warning("worker pid %d did not exit in time; killing it", process.pid)
            process.kill()
    for process in processes:
        process.release()
