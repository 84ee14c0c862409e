"""Replies from several threads onto one socket, joined when they meet.

A worker's env threads (and its main thread) all reply on one PUSH socket,
one thread at a time. A thread that finds the socket taken used to wait for
it, then send its reply alone. Here it leaves its reply (encoded already:
the entries are ready to go) in the queue and goes back to its env: the
thread that has the socket sends what was queued meanwhile too, as one
message where the replies join (measured in docs/PERFORMANCE.md: with 16
cheap envs in threads, about 40% of replies found the socket taken).

Nothing waits for company: a reply that finds the socket free goes at once,
alone, as before. Every thread that held the socket looks at the queue again
after letting it go, so a reply queued while it held it is never left behind.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class ReplyQueue(Generic[Entry]):
    """Entries put from any thread, handed to ``send`` in order, under one lock.

    ``send`` gets every entry queued when it is called (at least one), in
    the order they were put, and runs with the lock held: the socket it
    uses is the lock's. An exception from ``send`` reaches the
    thread that called it (those entries are lost, as a failed send loses
    its reply).
    """

    def __init__(self, send: Callable[[list[Entry]], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._queued: collections.deque[Entry] = collections.deque()

    def put(self, entry: Entry) -> None:
        """Send ``entry`` now, or leave it to the thread that holds the lock."""
        self.append(entry)
        self.drain()

    def append(self, entry: Entry) -> None:
        """Queue ``entry`` without sending anything; :meth:`drain` must follow.

        For a caller that must queue in an order it holds a lock of its own
        for (a worker queues each reply as it encodes it, so that a layout's
        announcement never travels after a message that uses it).
        """
        self._queued.append(entry)  # before trying the lock: its holder looks after releasing

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the lock (to use or replace the socket); what was queued meanwhile goes after."""
        try:
            with self._lock:
                yield
        finally:  # even if the holder failed: what others queued must not wait for a next put
            self.drain()

    def drain(self) -> None:
        """Send what is queued, unless another thread holds the lock (it sends it after)."""
        while self._queued:
            if not self._lock.acquire(blocking=False):
                return  # its holder sends ours once it lets go (holding() and here)
            try:
                # Only the lock's holder takes entries; others may append meanwhile.
                entries = [self._queued.popleft() for _ in range(len(self._queued))]
                if entries:  # another holder may have sent them since the loop looked
                    self._send(entries)
            finally:
                self._lock.release()
