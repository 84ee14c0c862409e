"""One thread at a time on a pool's sockets, and a waiting call that makes way for the others.

torchrl's pool may be driven from several threads at once (its threading
backend documents each env's own channel as safe for concurrent collector
threads; ``AsyncBatchedCollector`` runs a thread per env). ZeroMQ sockets are
not thread-safe, and neither is the pool's bookkeeping, so every public call
of :class:`~zmqpool.pool.ZMQAsyncEnvPool` holds its :class:`Gate`.

A recv waits for replies while holding the gate. Held for the whole wait, it
would keep every other thread out for as long as an env steps, even a
thread that only wants to send. So once a thread has had to wait for the
gate, the runtime waits in short slices (:attr:`Gate.slice_s`) and, between
two, hands the gate to a thread that is waiting for it (:meth:`Gate.make_way`).
The first such thread waits at most one unsliced wait (the runtime's are
capped at a heartbeat interval). A pool whose calls never overlap (one
thread, or one after another, as a pool built in one thread and driven in
another) pays a non-blocking acquire per call, and waits exactly as before.

Example:
    >>> gate = Gate()
    >>> with gate:
    ...     gate.make_way()  # nobody waiting: returns at once
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

from zmqpool import interrupts

#: Longest single wait on the sockets once several threads use a pool: how long a
#: thread that wants to send may wait behind another's recv.
SHARED_SLICE_S = 0.001
#: How often a thread that made way looks whether its successor has the gate.
_HANDOFF_POLL_S = 0.00005


class Gate:
    """A reentrant lock that knows whether anyone waits for it, and can hand itself over."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._waiting = 0
        self._handoffs = 0  # taken by a waiter: a thread that made way waits for this
        self._depth = 0
        #: Whether a thread has ever had to wait for the gate: then waits are sliced.
        self.shared = False

    @property
    def slice_s(self) -> float | None:
        """The longest wait on the sockets in one go (None: as long as the call needs)."""
        return SHARED_SLICE_S if self.shared else None

    def __enter__(self) -> Gate:
        # Interrupts are held first: from then on none lands between taking the lock
        # and counting it, where the lock would be left held.
        holds = interrupts.hold()
        try:
            if not self._lock.acquire(blocking=False):
                self._wait_for_turn()
        except BaseException:
            if holds:
                interrupts.unhold()
            raise
        self._depth += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._depth -= 1
        self._lock.release()
        interrupts.release()  # an interrupt held back meanwhile is raised now, the gate let go

    def _wait_for_turn(self) -> None:
        # Set before blocking: the holder may be waiting on its sockets, and from now on
        # it must wait in slices and make way, or this thread waits for its whole recv.
        self.shared = True
        with self._count_lock:
            self._waiting += 1
        waits = interrupts.wait_begins()  # a Ctrl-C may end this wait
        try:
            self._lock.acquire()
        except BaseException:  # an interrupt while waiting: no longer a waiter
            if self._lock._is_owned():  # type: ignore[attr-defined]  # taken just before it
                self._lock.release()
            with self._count_lock:
                self._waiting -= 1
            raise
        finally:
            if waits:
                interrupts.STATE.waiting = False
        with self._count_lock:
            self._waiting -= 1
            self._handoffs += 1

    def make_way(self) -> None:
        """If a thread waits for the gate, let it through, then wait for the gate again.

        Called by the thread holding the gate (at whatever depth), between two
        slices of a wait; the caller's state is kept across, since nothing it
        holds is half-done there.
        """
        if not self._waiting:
            return
        waits = interrupts.wait_begins()  # a Ctrl-C may end this wait
        depth, handoffs = self._depth, self._handoffs
        self._depth = 0
        for _ in range(depth):
            self._lock.release()
        try:
            # A released lock is not handed over: this thread would take it straight back.
            while self._handoffs == handoffs and self._waiting:
                time.sleep(_HANDOFF_POLL_S)
        finally:
            try:
                self._take_back(depth)
            finally:
                if waits:
                    interrupts.STATE.waiting = False

    def _take_back(self, depth: int) -> None:
        """Hold the gate again at ``depth``, even through an interrupt (raised after).

        The caller's ``with`` blocks release it ``depth`` times as they unwind:
        they must find it held, or a Ctrl-C here would leave the gate broken.
        """
        interrupted: BaseException | None = None
        while True:
            try:
                if not self._lock.acquire(blocking=False):
                    self._wait_for_turn()
                break
            except BaseException as err:  # KeyboardInterrupt and the like: take it back first
                interrupted = err
        for _ in range(depth - 1):
            self._lock.acquire()  # held already: at once
        self._depth = depth
        if interrupted is not None:
            raise interrupted
