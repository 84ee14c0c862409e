"""Local worker processes: spawn, watch, stop.

A local worker is a plain ``python -m workers`` process. Its env makers reach
it cloudpickled on its standard input (a pipe from this process: local and
trusted), never over a socket, which is why lambdas and closures work here
while torchrl's spawn-based pool rejects them. Its death is seen at once
through a pidfd that the broker polls next to its sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

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


class LocalProcess:
    """One spawned worker process and the pidfd that says when it exits."""

    def __init__(self, argv: list[str], payload: bytes, cpu_affinity: Sequence[int] | None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            close_fds=True,
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

    def release(self) -> None:
        """Reap the process and close the pidfd (after it exited or was killed)."""
        self.kill()
        self.wait(5.0)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _affinity_setter(cpu_affinity: Sequence[int] | None):
    if cpu_affinity is None:
        return None
    cpus = set(cpu_affinity)

    def set_affinity() -> None:
        os.sched_setaffinity(0, cpus)

    return set_affinity


def worker_argv(
    router: str, identity: str, indices: Sequence[int], heartbeat_s: float
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "workers",
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
    ]


def stop_all(processes: Sequence[LocalProcess], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` in all for the processes to exit, then kill the rest."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        if not process.wait(deadline - time.monotonic()):
            if timeout_s > 0:
                log.warning("worker pid %d did not exit in time; killing it", process.pid)
            process.kill()
    for process in processes:
        process.release()
