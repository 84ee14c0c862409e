"""One thread per hosted env, for workers that host several (``--env-threads``).

A worker reads commands in its main thread, in order; with env threads, each
env's commands go to that env's own thread, in order, so an env that waits (a
simulator sleeping, or releasing the GIL in C) does not hold up the others, as
in torchrl's pools. The reply is sent from the env's thread under the worker's
send lock: the encoder's layout ids and the PUSH socket are shared, one thread
at a time. For one env per worker there is nothing to overlap, and the thread
hop would only cost: the worker then runs commands inline.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

#: What a runner is asked to run: the work for one command, reply included.
Job = Callable[[], None]


class EnvRunner:
    """A daemon thread running one env's jobs in the order they were given."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """Finish the jobs given so far, then end (without waiting for it)."""
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()  # a job answers its command itself, errors included


class EnvRunners:
    """The runners of a worker's envs, one per env object, made on first use."""

    def __init__(self) -> None:
        # Keyed by the env object, not its pool index: a rejoining remote
        # worker's envs may get new indices, and one env must never run in two threads.
        self._runners: dict[int, tuple[Any, EnvRunner]] = {}

    def runner_for(self, env: Any, index: int) -> EnvRunner:
        entry = self._runners.get(id(env))
        if entry is None or entry[0] is not env:
            entry = (env, EnvRunner(f"env-{index}"))
            self._runners[id(env)] = entry
        return entry[1]

    def stop(self) -> None:
        for _, runner in self._runners.values():
            runner.stop()
        self._runners.clear()
