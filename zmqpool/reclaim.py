"""Memory that failed TCP handshakes leave behind, given back to the system.

libzmq takes in a peer's frame before anything of it is checked, a frame of
the handshake too: a process without a key may open connections to a TCP
port and start a handshake frame as large as the port's ``MAXMSGSIZE`` on
each, and libzmq holds it until the handshake fails (``HANDSHAKE_IVL``) or
the peer leaves. That much is the price of a port anyone can reach (README).
What need not stay is the memory once they are gone: glibc keeps what it
freed in its arenas, since freed MiB-sized buffers raise its dynamic mmap
threshold and later ones come from the heap. An audit's 600 connections on
each local port left a trainer at 1,602 MiB instead of 370 after they had
gone; ``malloc_trim(0)`` gave 307 MB back in 28 ms in a smaller run.

:class:`HandshakeWatch` listens to the monitor events of a pool's TCP
sockets (handshakes that failed, connections that ended) and, once they
have been quiet for :data:`QUIET_S`, trims the allocator once. A pool that
sees no such event never trims: what its hot path gains is a look, per poll
of a TCP pool, at whether a monitor is among the poll's events (the clock is
read only when one is, or while a trim is pending).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("zmqpool")

#: The events that may leave a peer's frames freed but kept by the allocator.
EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
)
#: How long the events must have stopped before the allocator is trimmed: a flood
#: trims once, after it, not once a connection.
QUIET_S = 1.0
#: Events read from one monitor per poll at most (the rest wait for the next poll).
_MAX_EVENTS_PER_POLL = 1024


def _malloc_trim() -> Callable[[], Any] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class HandshakeWatch:
    """Monitors for a pool's TCP sockets, and the trim once their failures stop."""

    def __init__(self) -> None:
        #: glibc's ``malloc_trim(0)``; None where the C library has none (events are still read).
        self.trim = _malloc_trim()
        self.monitors: list[zmq.Socket] = []
        #: Events seen since the last trim, and when the last one came (monotonic).
        self.pending = 0
        self.last_event_at = 0.0
        #: Trims done.
        self.trims = 0

    def watch(self, sock: zmq.Socket) -> zmq.Socket:
        """A monitor of ``sock``'s handshake failures and disconnections, to poll."""
        monitor = sock.get_monitor_socket(EVENTS)
        self.monitors.append(monitor)
        return monitor

    def read(self, monitor: zmq.Socket, now: float) -> None:
        """Take the events ``monitor`` holds (a bounded number)."""
        count = 0
        while count < _MAX_EVENTS_PER_POLL:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)  # which event does not matter: each may
            except zmq.Again:  # have left memory behind
                break
            count += 1
        if count:
            self.pending += count
            self.last_event_at = now

    def maybe_trim(self, now: float) -> bool:
        """Trim once the events have been quiet for :data:`QUIET_S`; whether it did."""
        if not self.pending or now - self.last_event_at < QUIET_S:
            return False
        events, self.pending = self.pending, 0
        if self.trim is None:
            return False
        self.trim()
        self.trims += 1
        log.info("returned freed memory to the system after %d failed or ended connections", events)
        return True

    def close(self) -> None:
        """Close the monitors (before their sockets' context is destroyed)."""
        for monitor in self.monitors:
            monitor.close(linger=0)
        self.monitors.clear()
