"""The pool's sockets: ROUTERs that route commands to workers, PULLs for results, the beacon.

::

    pool ──route()──▶ ROUTER (bind) ── [identity, header, frames…] ──▶ worker DEALER
    pool ◀──poll()─── PULL (bind)   ◀── [header, frames…] ─────────── worker PUSH
                      ROUTER        ◀── REGISTER / FAILED / HEARTBEAT ─ worker DEALER

Two sides, never sharing a socket:

- the **local** side (:class:`Side`), for the workers this pool spawned:
  ipc files in a 0700 directory, without CURVE; or, with
  ``local_transport="tcp"``, loopback TCP with CURVE and ZAP enforced, each
  worker's key made by the pool and authorized one by one
  (:meth:`Broker.authorize_local`), since any local user can reach a port;
- the **remote** side, with ``bind``: TCP with CURVE (unless ``insecure``),
  ZAP enforced, for workers on other machines, and the
  :class:`~zmqpool.beacon.Beacon` that answers their heartbeats.

Options that libzmq reads when an endpoint is bound (``MAXMSGSIZE``, CURVE,
the handshake interval) are set on each socket before its bind, so one side
never inherits the other's. The remote ports take small frames only (a remote
reply's larger frames come in pieces: see :mod:`zmqpool.wire`), since a port's
limit is what any peer, keyless too, can make the pool hold per connection
while a handshake lasts. ``ROUTER_MANDATORY`` is on, so a command to a
worker that is not connected raises instead of vanishing; ``ROUTER_HANDOVER``
is off, so no peer presenting a live worker's identity takes over its route.

The broker only moves frames: it hands what it reads to a :class:`Sink`
(results, control messages, and readable file descriptors such as the pidfds
of local workers, polled beside the sockets) and routes what it is given.
Who may send what is decided above it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from zmqpool import interrupts
from zmqpool.beacon import Beacon
from zmqpool.config import PoolConfig
from zmqpool.endpoints import Endpoints
from zmqpool.layout import max_message_bytes
from zmqpool.limits import (
    CURVE_FRAME_OVERHEAD,
    MAX_REMOTE_CONTROL_BYTES,
    REMOTE_CONTROL_QUEUE,
    REMOTE_RESULTS_QUEUE,
    remote_piece_bytes,
)
from zmqpool.protocol import recv_frames, send_frames
from zmqpool.reclaim import HandshakeWatch
from zmqpool.security import ServerKeys, make_server, serve_domain, start_authenticator
from zmqpool.wire import Command, Header

log = logging.getLogger("zmqpool")

#: How many messages one poll drains from a socket before looking at the others.
_DRAIN_BATCH = 256
#: ... and for at most this long (then the pump returns, and the next one goes on).
_DRAIN_SECONDS = 0.01
#: What a CURVE handshake may take on the remote side before libzmq drops the peer (ms).
_HANDSHAKE_MS = 5000
#: The ZAP domain of the remote side's sockets (enforced: no handler, no peer).
_ZAP_DOMAIN = b"zmqpool"
#: The local side's over loopback TCP: its workers' keys are good for it alone.
_LOCAL_ZAP_DOMAIN = "zmqpool-local"


class Sink(Protocol):
    """Who the broker hands its input to."""

    def on_result(self, frames: list[zmq.Frame], remote: bool) -> None: ...
    def on_control(self, identity: bytes, frames: list[zmq.Frame], remote: bool) -> None: ...
    def on_fd(self, fd: int) -> None: ...


@dataclasses.dataclass
class Side:
    """One side's ROUTER and PULL, and where they are bound."""

    router: zmq.Socket
    pull: zmq.Socket
    router_ep: str
    results_ep: str
    remote: bool


class Broker:
    """The sockets of one pool; see the module docstring.

    Args:
        config: the pool's (the results cap for the remote side, heartbeats).
        local: where the local side binds (loopback TCP: with CURVE, see
            :attr:`local_keys`).
    """

    def __init__(self, config: PoolConfig, local: Endpoints) -> None:
        self.config = config
        self.context = _io_context(config.io_thread_batch_sched)
        self.epoch = os.urandom(8)  # tells workers that this is a new pool (a restarted trainer)
        self.poller = zmq.Poller()
        #: The TCP sockets' failed handshakes, and the allocator trimmed after them.
        self.handshakes = HandshakeWatch()
        self.auth: Any = None  # the ZAP thread, with CURVE on either side
        #: The local side's CURVE pair over loopback TCP (None over ipc).
        self.local_keys: ServerKeys | None = None
        if local.router.startswith("tcp://"):
            self.local_keys = ServerKeys.ephemeral()
            self.auth = start_authenticator(self.context, self.local_keys, _LOCAL_ZAP_DOMAIN)
        try:
            self.local = self._side(local, self.local_keys, None)
        except BaseException:  # a bind that failed: no ZAP thread or context left behind
            if self.auth is not None:
                self.auth.stop()
            self.context.destroy(linger=0)
            raise
        # One local results endpoint per frame limit, bound when a worker first needs it.
        self.results_eps: dict[int, str] = {max_message_bytes([]): self.local.results_ep}
        self.remote: Side | None = None
        self.beacon: Beacon | None = None
        self.tcp: Endpoints | None = None
        #: The largest frame a remote reply may hold, and the remote results port's limit.
        self.remote_frame_cap = 0
        self.remote_piece = 0

    # ------------------------------------------------------------ binding

    def _socket(
        self, kind: int, max_bytes: int, keys: ServerKeys | None, remote: bool, tcp: bool
    ) -> Any:
        """A socket with its limits set (before it binds); ``tcp``: any local user reaches it."""
        sock = self.context.socket(kind)
        sock.linger = 0
        if keys is not None:  # libzmq counts CURVE's own bytes per frame against the limit too
            max_bytes += CURVE_FRAME_OVERHEAD
        if tcp:  # the local side over loopback TCP too: any local user may connect
            queue = REMOTE_RESULTS_QUEUE if kind == zmq.PULL else REMOTE_CONTROL_QUEUE
            sock.setsockopt(zmq.RCVHWM, queue)  # per connection: see limits
            sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        # MAXMSGSIZE is per frame; libzmq reads it (and CURVE) when an endpoint is bound.
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        if keys is not None:
            _enforce_curve(sock, keys, _ZAP_DOMAIN if remote else _LOCAL_ZAP_DOMAIN)
        return sock

    def _side(self, endpoints: Endpoints, keys: ServerKeys | None, results_cap: int | None) -> Side:
        """A ROUTER and a PULL, bound; remote (TCP, CURVE) if ``results_cap`` is given."""
        remote = results_cap is not None
        # Queue and handshake limits: the remote side's always, the local side's over TCP.
        tcp = remote or endpoints.router.startswith("tcp://")
        # Workers send the ROUTER one-frame control messages only: nothing longer than a
        # header. A worker whose REGISTER would not fit fails on its side, saying why.
        control_cap = MAX_REMOTE_CONTROL_BYTES if remote else max_message_bytes([])
        router = self._socket(zmq.ROUTER, control_cap, keys, remote, tcp)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        pull = self._socket(zmq.PULL, results_cap or max_message_bytes([]), keys, remote, tcp)
        side = Side(router, pull, _bind(router, endpoints.router), "", remote)
        side.results_ep = _bind(pull, endpoints.results)
        self.poller.register(router, zmq.POLLIN)
        self.poller.register(pull, zmq.POLLIN)
        if tcp:  # any process that reaches the port may start a handshake: see zmqpool.reclaim
            for sock in (router, pull):
                self.poller.register(self.handshakes.watch(sock), zmq.POLLIN)
        return side

    def results_endpoint(self, limit: int) -> str:
        """A local results endpoint taking frames of ``limit`` bytes (bound on first need)."""
        for bound in sorted(self.results_eps):
            if bound >= limit:
                return self.results_eps[bound]
        overhead = CURVE_FRAME_OVERHEAD if self.local_keys is not None else 0
        self.local.pull.setsockopt(zmq.MAXMSGSIZE, limit + overhead)
        base = self.local.results_ep
        if base.startswith("tcp://"):  # a port of its own: PORT followed by "1" is another port
            where = f"{base.rsplit(':', 1)[0]}:*"
        else:
            where = f"{base}{len(self.results_eps)}"
        endpoint = _bind(self.local.pull, where)
        self.results_eps[limit] = endpoint
        return endpoint

    def bind_remote(self, tcp: Endpoints, keys: ServerKeys | None, results_cap: int) -> None:
        """The remote side: its own sockets, CURVE and limits set before they bind.

        ``results_cap``: the largest frame a remote worker's reply may hold
        (from the layouts the remote slots' reference specs imply). The results
        port itself takes frames of a piece (:func:`~zmqpool.limits.remote_piece_bytes`):
        larger ones come cut (wire: pieces).
        """
        if keys is not None and self.auth is not None:  # the local side's, over TCP
            serve_domain(self.auth, keys, _ZAP_DOMAIN.decode())
        elif keys is not None:
            self.auth = start_authenticator(self.context, keys, _ZAP_DOMAIN.decode())
        self.remote_frame_cap = results_cap
        self.remote_piece = remote_piece_bytes(results_cap)
        self.remote = self._side(tcp, keys, self.remote_piece)
        secure = None
        if keys is not None:
            secure = functools.partial(_enforce_curve, keys=keys, domain=_ZAP_DOMAIN)
        interval_s = self.config.heartbeat_interval_s
        self.beacon = Beacon(self.context, tcp.beats, secure, self.epoch, interval_s, _HANDSHAKE_MS)
        self.tcp = Endpoints(self.remote.router_ep, self.remote.results_ep, self.beacon.endpoint)
        log.info(
            "pool listening for remote workers on %s (results %s)",
            self.remote.router_ep,
            self.remote.results_ep,
        )

    def authorize(self, key: bytes) -> None:
        """Accept connections with CURVE public key ``key`` (z85), besides ``authorized/``'s."""
        assert self.remote is not None and self.auth is not None, "no remote side with CURVE"
        self.auth.certs.setdefault(_ZAP_DOMAIN.decode(), {})[key] = True

    def authorize_local(self, key: bytes) -> None:
        """Accept connections on the local side over TCP with CURVE public key ``key`` (z85)."""
        assert self.local_keys is not None and self.auth is not None, "the local side is ipc"
        self.auth.certs.setdefault(_LOCAL_ZAP_DOMAIN, {})[key] = True

    def revoke(self, key: str) -> None:
        """No new connection with CURVE public key ``key`` (z85) from now on."""
        if self.auth is None:
            return
        for certs in self.auth.certs.values():
            certs.pop(key.encode("ascii"), None)

    # ------------------------------------------------------------ file descriptors

    def watch_fd(self, fd: int) -> None:
        """Poll ``fd`` (a pidfd) beside the sockets; the sink hears when it is readable."""
        self.poller.register(fd, zmq.POLLIN)

    def unwatch_fd(self, fd: int) -> None:
        self.poller.unregister(fd)

    # ------------------------------------------------------------ sending

    def route(self, identity: bytes, frames: list[Any], remote: bool) -> bool:
        """Send ``frames`` to the peer ``identity`` on its side; False if it was not sent.

        Never waits: a peer that does not read (its queue at the high-water mark,
        1,000 messages) loses the message, as one that is gone does, and
        liveness handles a worker that stopped reading. A blocking send here
        let a peer that floods REGISTERs and reads no REFUSE stop the trainer.
        """
        side = self.remote if remote else self.local
        if side is None:
            return False
        try:
            send_frames(side.router, [identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as err:  # EHOSTUNREACH: gone; EAGAIN: not reading
            log.debug("could not route to %r: %s", identity, err)
            return False
        return True

    def _await_departures(self, identities: Sequence[bytes], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the remote peers ``identities`` to leave.

        A peer has left once ``ROUTER_MANDATORY`` can no longer route to it:
        its connection is gone (normally: it read the CLOSE and exited). A
        PING (which workers ignore) is routed to each every
        :data:`DEPARTURE_PROBE_S`. A peer whose queue is full (``EAGAIN``) is
        still there.
        """
        assert self.remote is not None, "only remote peers are waited for"
        probe = Header(Command.PING).encode()
        waiting = list(identities)
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            time.sleep(DEPARTURE_PROBE_S)
            waiting = [peer for peer in waiting if _connected(self.remote.router, peer, probe)]

    # ------------------------------------------------------------ receiving

    def poll(self, timeout_s: float, sink: Sink) -> bool:
        """Wait up to ``timeout_s`` for input, then hand what is ready to ``sink``.

        Returns whether every socket was read to the end.
        """
        waits = interrupts.wait_begins()  # a Ctrl-C may end this wait: nothing is half read
        try:
            # Rounded up: rounded down, a wait of under 1 ms polled without waiting until
            # its deadline (a pump woken for a step deadline spun for that last ms).
            events = dict(self.poller.poll(max(0, math.ceil(timeout_s * 1000))))
        finally:
            if waits:
                interrupts.STATE.waiting = False
        drained = True
        for side in (self.local, self.remote):
            if side is None:
                continue
            if side.pull in events:
                drained &= _drain(side.pull, sink.on_result, side.remote)
            if side.router in events:
                drained &= _drain(side.router, _Control(sink), side.remote)
        if self.handshakes.monitors:
            self._read_handshakes(events)
        for fd in events:
            if isinstance(fd, int):
                sink.on_fd(fd)
        return drained

    def _read_handshakes(self, events: dict[Any, int]) -> None:
        """Take the TCP sockets' handshake events; trim the allocator once they stop."""
        watch = self.handshakes
        ready = [monitor for monitor in watch.monitors if monitor in events]
        if not ready and not watch.pending:  # the usual poll: nothing to look at
            return
        now = time.monotonic()
        for monitor in ready:
            watch.read(monitor, now)
        watch.maybe_trim(now)

    def close(self, leaving: Sequence[bytes] = (), wait_s: float = 0.0) -> None:
        """Close every socket, then stop the ZAP handler (never the other way round).

        ``leaving``: the remote workers just told CLOSE. The remote ROUTER
        stays open until each has read it and left, ``wait_s`` at most. A
        linger was not enough: it waits for the CLOSE to leave, not for the
        worker to read it, and libzmq drops a message a worker has received
        but not yet read when the connection ends under it (the worker's
        DEALER is ``IMMEDIATE``; docs/DESIGN_NOTES.md). The worker then took
        the pool for gone and served the next pool with its env as it was.
        Then every socket closes dropping what it holds, a Ctrl-C during the
        wait included.
        """
        try:
            if leaving:
                self._await_departures(leaving, wait_s)
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self.beacon is not None:
            self.beacon.stop()
        self.handshakes.close()
        for side in (self.local, self.remote):
            if side is not None:
                side.router.close(linger=0)
                side.pull.close(linger=0)
        if self.auth is not None:  # its own sockets live in this context: before destroy()
            self.auth.stop()
        self.context.destroy(linger=0)


def _connected(router: zmq.Socket, peer: bytes, probe: bytes) -> bool:
    """Whether ``router`` still routes to ``peer`` (``probe`` is sent to find out)."""
    try:
        send_frames(router, [peer, probe], zmq.NOBLOCK)
    except zmq.ZMQError as err:
        return err.errno == zmq.EAGAIN  # EHOSTUNREACH: its connection is gone
    return True


#: How often :meth:`Broker.close` looks whether a peer has left: well
#: under the time a remote supervisor takes to start an env process that would
#: connect again under the same identity.
DEPARTURE_PROBE_S = 0.005


def _io_context(batch_sched: bool) -> zmq.Context:
    """A context whose I/O threads, started with its first socket, are batch-scheduled or not.

    libzmq applies ``THREAD_SCHED_POLICY`` as each of its threads starts; see
    :attr:`PoolConfig.io_thread_batch_sched` for why batch scheduling.
    """
    context = zmq.Context()
    sched_batch = getattr(os, "SCHED_BATCH", None)  # Linux only
    if batch_sched and sched_batch is not None:
        context.set(zmq.THREAD_SCHED_POLICY, sched_batch)
    return context


def _enforce_curve(sock: zmq.Socket, keys: ServerKeys, domain: bytes | str) -> None:
    """CURVE server, with every peer checked by the ZAP handler for ``domain`` (refused
    if it is gone).

    Without an enforced ZAP domain libzmq accepts any key when no handler
    answers, as while the pool closes.
    """
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode() if isinstance(domain, str) else domain)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    make_server(sock, keys)


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _drain(sock: zmq.Socket, handle: Callable[[list[zmq.Frame], bool], None], remote: bool) -> bool:
    # Bounded in time as well as in count: a peer's messages may each cost the trainer
    # milliseconds, and the caller's deadline and the supervisor wait until it returns.
    until = time.monotonic() + _DRAIN_SECONDS
    for _ in range(_DRAIN_BATCH):
        try:
            frames = recv_frames(sock)
        except zmq.Again:
            return True
        handle(frames, remote)
        if time.monotonic() > until:
            return False
    return False


class _Control:
    """A ROUTER's messages to the sink: the identity frame apart."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def __call__(self, frames: list[zmq.Frame], remote: bool) -> None:
        self.sink.on_control(frames[0].bytes, frames[1:], remote)
