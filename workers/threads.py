"""One thread per hosted env, for workers that host several (``--env-threads``).

A worker reads commands in its main thread, in order; with env threads, each
env's commands go to that env's own thread, in order, so an env that waits (a
simulator sleeping, or releasing the GIL in C) does not hold up the others, as
in torchrl's pools. The env's thread encodes the reply (the encoder's layout
ids are shared under a short lock of their own) and hands it to the worker's
reply queue (:mod:`workers.replies`): the PUSH socket is shared, one thread
at a time, and a reply that finds it taken is sent by the thread holding it,
so its own thread goes on to its next command. For one env per worker there
is nothing to overlap, and the thread hop would only cost: the worker then
runs commands inline. So do envs whose steps are short and never wait, once
judged so (:mod:`workers.inline`): a runner says when it is idle, so that an
env steps inline only after everything given to its thread has run.

A job answers its command itself, env exceptions included (a ``SystemExit``
too). Anything that escapes it (a ``KeyboardInterrupt`` raised by env code, or
a reply that could not be sent) ends the thread, and with it every later
command of that env: the runner hands it to ``on_death``, and the worker ends
the process, as the same ``KeyboardInterrupt`` would have inline, so the pool
restarts it and answers what was in flight.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

#: What a runner is asked to run: the work for one command, reply included.
Job = Callable[[], None]

#: Called in a runner's thread with its name and what killed it.
OnDeath = Callable[[str, BaseException], None]


class EnvRunner:
    """A daemon thread running one env's jobs in the order they were given."""

    def __init__(
        self, name: str, on_death: OnDeath, on_submit: Callable[[EnvRunner], None] | None = None
    ) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._on_death = on_death
        self._on_submit = on_submit
        self._cancelled = False
        # Each written by one thread only (the submitter's, the runner's): no lock needed.
        self._submitted = 0
        self._finished = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Run ``job`` after those submitted before it (call from one thread only)."""
        self._submitted += 1
        self._jobs.put(job)
        if self._on_submit is not None:
            self._on_submit(self)

    def idle(self) -> bool:
        """Whether every job submitted so far has finished (from the submitting thread)."""
        return self._finished == self._submitted

    def cancel(self) -> None:
        """End after the job it is running; the jobs not started are dropped."""
        self._cancelled = True
        self._jobs.put(None)

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread to end; whether it did."""
        self._thread.join(max(timeout_s, 0.0))
        return not self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                if not self._cancelled:  # closing: nobody will read the reply
                    job()
                self._finished += 1
        except BaseException as err:  # the thread ends here: say so, or the env hangs unseen
            self._on_death(self._thread.name, err)


class EnvRunners:
    """The runners of a worker's envs, one per env object, made on first use."""

    def __init__(self, on_death: OnDeath) -> None:
        # Keyed by the env object, not its pool index: a rejoining remote
        # worker's envs may get new indices, and one env must never run in two threads.
        self._runners: dict[int, tuple[Any, EnvRunner]] = {}
        self._on_death = on_death
        # Runners given a job since all_idle last found them idle: the only ones it looks at.
        self._maybe_busy: set[EnvRunner] = set()

    def runner_for(self, env: Any, index: int) -> EnvRunner:
        entry = self._runners.get(id(env))
        if entry is None or entry[0] is not env:
            entry = (env, EnvRunner(f"env-{index}", self._on_death, self._maybe_busy.add))
            self._runners[id(env)] = entry
        return entry[1]

    def all_idle(self) -> bool:
        """Whether no runner has a job to run or running (from the submitting thread)."""
        busy = self._maybe_busy
        if busy:  # emptied in place: each runner holds its add
            busy.difference_update([runner for runner in busy if runner.idle()])
        return not busy

    def stop(self, timeout_s: float) -> list[Any]:
        """End every runner, waiting up to ``timeout_s`` in all for the jobs they are running.

        Returns the envs whose thread is still running one (an env step that
        outlasted the wait): they must not be closed under it.
        """
        deadline = time.monotonic() + timeout_s
        for _, runner in self._runners.values():
            runner.cancel()
        busy = [
            env
            for env, runner in self._runners.values()
            if not runner.join(deadline - time.monotonic())
        ]
        self._runners.clear()
        return busy
