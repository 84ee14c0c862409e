"""The pool's heartbeat to remote workers: each worker asks on the beats port, a thread answers.

::

    worker DEALER ── HEARTBEAT ──▶ ROUTER (bind, TCP port + 2) ── PING {epoch} ──▶ worker DEALER

A thread of its own, with its own socket, so that a trainer busy for
minutes between calls still looks alive to its workers. Each PING carries
the pool's epoch, so the workers of a restarted trainer notice the new pool
and register again.

Why a ROUTER that answers, not a PUB that broadcasts: a PUB keeps every
prefix a peer subscribes to (libzmq's trie, about 50 bytes of memory a byte
sent: 17 MB of subscriptions from an authorized key grew the trainer by
830 MB), and an XPUB with manual subscriptions keeps them all the same. A
ROUTER keeps nothing a peer sends beyond its queue: at most
:data:`_QUEUE` messages of at most :data:`_MAX_FRAME` bytes per connection,
read and let go (but for a message of many frames, which libzmq holds whole
before it can be read, as on the pool's other ports: README, Known limits).
What answering costs the trainer is bounded too: at most
:data:`_READS_PER_TICK` messages are read in each heartbeat interval, and a
peer is answered once in an interval however often it asks (an ask already
answered in this one is answered as the next begins: a worker that asks more
often than the pool beats gets a beat each interval, as from a PUB). Peers are
fair-queued, so a flooding connection does not starve the others of their
turn; thousands of flooding connections (one key may open as many as the
trainer has file descriptors) share the budget with the honest ones, and an
honest ask then waits about one interval per 4,096 of them.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable

import zmq

from zmqpool.protocol import Ping, recv_frames
from zmqpool.wire import Command, Header

#: A worker's ask is a header of a few bytes; nothing longer is read.
_MAX_FRAME = 1024
#: Messages libzmq queues per connection, each way (its HWMs; the default is 1,000).
_QUEUE = 4
#: Messages read in one heartbeat interval at most (then the rest waits for the next).
_READS_PER_TICK = 4096


class Beacon:
    """Answers each remote worker's HEARTBEAT on ``endpoint`` with this pool's PING.

    Args:
        context: the broker's.
        endpoint: where to bind (``tcp://HOST:PORT``).
        secure: sets CURVE and ZAP on the socket before it binds (None: ``insecure``).
        epoch: the pool's; in every PING.
        interval_s: the pool's heartbeat interval: what a peer may get at most one
            PING in, and what the read budget is counted over.
        handshake_ms: what a peer's CURVE handshake may take before it is dropped.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        secure: Callable[[zmq.Socket], None] | None,
        epoch: bytes,
        interval_s: float,
        handshake_ms: int,
    ) -> None:
        self.sock = context.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        self.sock.setsockopt(zmq.RCVHWM, _QUEUE)
        self.sock.setsockopt(zmq.SNDHWM, _QUEUE)  # a peer that does not read loses its PINGs
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)
        if secure is not None:
            secure(self.sock)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ask = Header(Command.HEARTBEAT).encode()
        self.beat = Header(Command.PING, body=Ping(epoch).to_body()).encode()
        self.interval_s = interval_s
        # stop() writes a byte here: the thread's poll wakes at once, not at its next tick.
        self._wake_read, self._wake_write = os.pipe()
        self._stopping = threading.Lock()
        self._stopped = False
        self._owner = os.getpid()  # a forked child's stop() must not stop the parent's thread
        # The socket moves to the thread now and is used by nobody else.
        self.thread = threading.Thread(target=self._run, name="zmqpool-beacon", daemon=True)
        try:
            self.thread.start()
        except BaseException:  # no thread to close them
            self.sock.close(linger=0)
            os.close(self._wake_read)
            os.close(self._wake_write)
            raise

    def _run(self) -> None:
        answering = zmq.Poller()
        answering.register(self.sock, zmq.POLLIN)
        answering.register(self._wake_read, zmq.POLLIN)
        resting = zmq.Poller()  # the tick's reads are spent: only a stop wakes us
        resting.register(self._wake_read, zmq.POLLIN)
        try:
            tick = _Tick(self.interval_s)
            while True:
                poller = answering if tick.reads < _READS_PER_TICK else resting
                events = dict(poller.poll(math.ceil(tick.left_s() * 1000)))
                if self._wake_read in events:
                    return
                if self.sock in events:
                    self._answer(tick)
                if tick.is_over():
                    tick = tick.renew()
                    self._answer_deferred(tick)
        except zmq.ZMQError:
            pass  # the context is being destroyed: the pool is closing
        finally:
            self.sock.close(linger=0)
            os.close(self._wake_read)

    def _answer(self, tick: _Tick) -> None:
        """Read what is queued (within the tick's budget); PING each peer that asked."""
        while tick.reads < _READS_PER_TICK:
            try:
                # The identity and the ask; a third frame is read to tell, not kept.
                frames = recv_frames(self.sock, max_frames=3)
            except zmq.Again:
                return
            tick.reads += 1
            identity = frames[0].bytes
            if len(frames) != 2 or frames[1].bytes != self.ask:
                continue  # anything but an ask proves nothing: let go
            if identity in tick.answered:
                tick.deferred.add(identity)
            else:
                tick.answered.add(identity)
                self._ping(identity)

    def _answer_deferred(self, tick: _Tick) -> None:
        for identity in tick.answered:  # the new tick's: the asks deferred by the last one
            self._ping(identity)

    def _ping(self, identity: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # gone, or its queue full: it lost this one
            self.sock.send_multipart([identity, self.beat], zmq.NOBLOCK)

    def stop(self) -> None:
        """End the thread (which closes the socket); bounded. Once, and only in its process."""
        with self._stopping:
            if self._stopped or os.getpid() != self._owner:
                return
            self._stopped = True
            with contextlib.suppress(OSError):
                os.write(self._wake_write, b"x")
            self.thread.join(timeout=2.0)
            os.close(self._wake_write)


class _Tick:
    """One heartbeat interval's budget: the messages read in it, the peers answered.

    Both sets hold at most :data:`_READS_PER_TICK` identities.
    """

    def __init__(self, interval_s: float, answered: set[bytes] | None = None) -> None:
        self.interval_s = interval_s
        self.reads = 0
        self.answered: set[bytes] = answered or set()
        #: peers that asked again once answered: answered as the next tick begins
        self.deferred: set[bytes] = set()
        self.ends = time.monotonic() + interval_s

    def left_s(self) -> float:
        return max(self.ends - time.monotonic(), 0.0)

    def is_over(self) -> bool:
        return time.monotonic() >= self.ends

    def renew(self) -> _Tick:
        """The next tick, its peers answered already: those this one deferred."""
        return _Tick(self.interval_s, self.deferred)
