"""A hostile peer's toolbox, and a victim pool in a process of its own.

Attack tests measure the pool from outside (its memory, its log, what its
ports answer), so the pool under attack runs in a subprocess:
:class:`Victim` starts this file as a script (``python tests/hostile.py
serve SPEC``), which builds a :class:`~zmqpool.ZMQAsyncEnvPool` and reports on
stdout, one JSON object a line:

- ``{"event": "ready", "pid": ..., "version": ..., "commands": {...}, "spec": ...}``
  before construction starts: the pool's pid, its protocol version, its
  command numbers and the specs of a default ``CountingEnv`` (base64 of
  msgpack), so that hostile peers speak the victim's own zmqpool, whichever
  copy the test process imported;
- ``{"event": "constructed", "remote_endpoint": ..., "seconds": ...}`` or
  ``{"event": "construct_failed", "type": ..., "error": ...}``;
- then, for each line read on stdin: ``step`` (one step of every env, with a
  deadline: ``stepped`` or ``step_failed``), ``step-envs {"envs": [...],
  "timeout": s, "rounds": n}`` (rounds of a step of those envs, each env's
  result or error recorded: ``stepped_envs``), the same in two halves,
  ``send-envs {"envs": [...]}`` (``sent`` or ``send_failed``) and
  ``collect-envs {"envs": [...], "timeout": s}`` (``collected``; the timeout
  counts from the send), ``malloc-trim`` (glibc's ``malloc_trim(0)``:
  ``trimmed``), ``roster`` (each worker's and
  env's phase: ``roster``), ``revoke KEY`` (``pool.revoke_worker_key``:
  ``revoked`` or ``revoke_failed``), ``sockets`` (the options of every
  live ZeroMQ socket of the process: ``sockets``), ``zap-stop`` (fault
  injection: stop the process's ZAP handler threads: ``zap_stopped``),
  ``close-pool`` (``pool.close()``, the serving goes on: ``pool_closed``; the
  next command's call starts the pool again), ``close`` (``closed``); at
  end of file on stdin the pool is closed, and construction still waiting is
  interrupted (the pool then releases what it started).

Its log (``LOG LEVEL logger: message``, one record a line) goes to stderr,
which :class:`Victim` writes to a file.

Hostile peers, trainer side:

- :func:`raw_zmtp_flood`: a plain TCP client that sends a ZMTP 3.0 greeting
  and one long command frame announcing ``announce`` bytes, then streams
  ``stream`` bytes of it (never the whole frame), without any key;
- :func:`peer_mechanism`: the security mechanism a port answers a greeting with;
- :class:`Peer`: a pyzmq DEALER (with CURVE, with an authorized key, an
  unknown one from :func:`zmq.curve_keypair`, or none) that sends REGISTER,
  FAILED or any header, and can watch its own handshake (socket monitor);
- :class:`ScriptedWorker`: a remote worker played by hand (registers, reads
  commands, answers them with chosen frames, or never);
- :func:`rss_bytes`, :func:`peak_rss_bytes`, :func:`cpu_seconds`,
  :func:`listening_ports`.

Every wait here has a deadline.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import errno
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

HERE = Path(__file__).resolve()

# ---------------------------------------------------------------- processes, ports, memory


def _status_bytes(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise ProcessLookupError(f"no {field} for pid {pid} (a zombie?)")


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS``), in bytes."""
    return _status_bytes(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int:
    """Peak resident set size of process ``pid`` so far (``VmHWM``), in bytes."""
    return _status_bytes(pid, "VmHWM")


def cpu_seconds(pid: int) -> float:
    """CPU time process ``pid`` has used so far (utime + stime of ``/proc/PID/stat``), in s."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _hex_ip(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """The TCP ``(ip, port)`` pairs process ``pid`` listens on (``/proc/net/tcp*`` by inode)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: LISTEN
                    continue
                ip, port = fields[1].split(":")
                found.append((_hex_ip(ip), int(port, 16)))
    return sorted(found)


def settled_rss(pid: int, timeout_s: float = 3.0) -> int:
    """RSS once it stops moving (two readings 100 ms apart within 1 MB), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    last = rss_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = rss_bytes(pid)
        if abs(now - last) < 1 << 20:
            return now
        last = now
    return last


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """Poll ``condition()`` until it returns something truthy; AssertionError after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


# ---------------------------------------------------------------- raw ZMTP


SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
GREETING_BYTES = 64
#: Frame flags: 0x02 LONG (an 8-byte size follows), 0x04 COMMAND.
LONG_COMMAND = 0x06


def zmtp_greeting(mechanism: bytes = b"CURVE", as_server: bool = False) -> bytes:
    """The 64-byte ZMTP 3.0 greeting: signature, version 3.0, mechanism, as-server, filler."""
    if len(mechanism) > 20:
        raise ValueError("a ZMTP mechanism name has at most 20 bytes")
    greeting = SIGNATURE + bytes([3, 0]) + mechanism.ljust(20, b"\x00")
    greeting += bytes([1 if as_server else 0]) + b"\x00" * 31
    assert len(greeting) == GREETING_BYTES
    return greeting


def _recv_exactly(sock: socket.socket, count: int, deadline: float) -> bytes:
    data = b""
    while len(data) < count:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            raise TimeoutError(f"got {len(data)} of {count} bytes before the deadline")
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(data)} of {count} bytes")
        data += chunk
    return data


def _greet(sock: socket.socket, mechanism: bytes, deadline: float) -> bytes:
    """Send our greeting, read the peer's; its mechanism (NUL padding stripped)."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    sock.sendall(zmtp_greeting(mechanism))
    theirs = _recv_exactly(sock, GREETING_BYTES, deadline)
    if theirs[0] != 0xFF or theirs[9] != 0x7F:
        raise ConnectionError(f"not a ZMTP greeting: {theirs[:10]!r}")
    return theirs[12:32].rstrip(b"\x00")


def peer_mechanism(host: str, port: int, timeout_s: float = 5.0) -> bytes | None:
    """The mechanism the ZMTP port ``host:port`` greets with (``b"CURVE"``, ``b"NULL"``), or None.

    Only the signature and major version are sent: libzmq then sends its whole
    greeting, before it could object to a mechanism of ours. None: the peer
    closed or said nothing in time (no ZMTP spoken there).
    """
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(zmtp_greeting()[:11])
            theirs = _recv_exactly(sock, GREETING_BYTES, deadline)
    except (OSError, TimeoutError, ConnectionError):
        return None
    if theirs[0] != 0xFF or theirs[9] != 0x7F:
        return None
    return theirs[12:32].rstrip(b"\x00")


@dataclasses.dataclass
class Flood:
    """One raw connection holding part of a long frame in the peer's memory.

    The peer holds what it received until it gives up on the handshake (its
    handshake timeout) or until :meth:`close`.
    """

    sock: socket.socket | None
    peer_mechanism: bytes | None
    announced: int
    sent: int = 0
    closed_by_peer: bool = False
    error: str = ""

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None


def raw_zmtp_flood(
    host: str,
    port: int,
    mechanism: bytes = b"CURVE",
    announce: int = 1 << 30,
    stream: int = 300 << 20,
    timeout_s: float = 20.0,
    chunk: int = 1 << 20,
) -> Flood:
    """Connect without a key, greet, announce a long command frame, stream part of it.

    The greeting names ``mechanism`` (as-server 0); after the peer's
    greeting the client sends one command frame header (flags 0x06, then
    ``announce`` as 8 bytes big-endian) and ``stream`` zero bytes of its body
    (at most ``announce - 1``, so the frame never completes), in ``chunk``s,
    until done, the peer closes or refuses, or ``timeout_s`` passes (greeting
    included: a peer that never greets costs at most that). The connection is
    left open (the caller closes it) so that whatever the peer buffered stays
    buffered while it is measured.
    """
    deadline = time.monotonic() + timeout_s
    stream = min(stream, announce - 1)
    flood = Flood(None, None, announce)
    try:
        flood.sock = sock = socket.create_connection((host, port), timeout=timeout_s)
        flood.peer_mechanism = _greet(sock, mechanism, deadline)
        sock.sendall(bytes([LONG_COMMAND]) + announce.to_bytes(8, "big"))
        zeros = memoryview(bytes(chunk))
        while flood.sent < stream and time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                flood.sent += sock.send(zeros[: min(chunk, stream - flood.sent)])
            except TimeoutError:
                continue  # the peer reads slowly: try again until the deadline
    except (ConnectionError, BrokenPipeError) as err:
        flood.closed_by_peer, flood.error = True, f"{type(err).__name__}: {err}"
    except OSError as err:
        flood.closed_by_peer = err.errno in (errno.ECONNRESET, errno.EPIPE)
        flood.error = f"{type(err).__name__}: {err}"
    return flood


# ---------------------------------------------------------------- ZeroMQ peers


@dataclasses.dataclass(frozen=True)
class Hello:
    """What the victim told us of its zmqpool: protocol version, commands, a good spec."""

    version: int
    commands: dict[str, int]
    spec: dict[str, Any]

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> Hello:
        spec = msgpack.unpackb(base64.b64decode(event["spec"]), raw=False, strict_map_key=False)
        return cls(event["version"], dict(event["commands"]), spec)

    def header(self, command: str, body: Any = None, env: int = -1, version: int | None = None):
        """Frame 0 of a message, packed as zmqpool's wire does (``[version, command, ...]``)."""
        fields = [self.version if version is None else version, self.commands[command], env, 0]
        return msgpack.packb([*fields, b"", [], body], use_bin_type=True)

    def register_body(
        self,
        specs: list[Any] | None = None,
        *,
        slots: list[int] | None = None,
        incarnation: bytes | None = None,
        remote: bool = True,
        batches: bool = False,
    ) -> dict[str, Any]:
        """A REGISTER body as a remote worker builds it (default: one env of ``spec``).

        ``batches``: ask for a call's commands in one message (a victim of protocol 3 on).
        """
        specs = [self.spec] if specs is None else specs
        reg = {
            "pid": os.getpid(),
            "host": "hostile",
            "envs": list(range(len(specs))),
            "remote": remote,
            "incarnation": incarnation or os.urandom(8),
            "slots": slots,
            "specs": specs,
        }
        if self.version >= 3:  # before it, a REGISTER had no such key
            reg["batches"] = batches
        if self.version >= 12:  # likewise
            reg["set_state"] = [False] * len(specs)
        return {"reg": reg}

    def decode(self, frame: bytes) -> dict[str, Any]:
        """A reply's header as ``{"command": name, "body": ...}`` (name None if unknown)."""
        fields = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        names = {value: name for name, value in self.commands.items()}
        return {"command": names.get(fields[1]), "body": fields[6], "fields": fields}


def with_observation_shape(spec: Any, shape: list[int]) -> Any:
    """A copy of spec data whose ``observation`` leaf has ``shape`` (found wherever it is)."""
    if isinstance(spec, dict):
        copy = {}
        for key, value in spec.items():
            if key == "observation" and isinstance(value, dict) and "shape" in value:
                copy[key] = {**value, "shape": list(shape)}
            else:
                copy[key] = with_observation_shape(value, shape)
        return copy
    if isinstance(spec, list):
        return [with_observation_shape(item, shape) for item in spec]
    return spec


def client_keys(key_dir: str | os.PathLike, worker: int) -> tuple[bytes, bytes, bytes]:
    """``(public, secret, server_public)`` of ``workers/worker-N`` in a ``zmqpool keygen`` dir."""
    root = Path(key_dir)
    server_public, _ = zmq.auth.load_certificate(str(root / "server.key"))
    public, secret = zmq.auth.load_certificate(
        str(root / "workers" / f"worker-{worker}.key_secret")
    )
    assert secret is not None
    return public, secret, server_public


def unknown_keys(key_dir: str | os.PathLike) -> tuple[bytes, bytes, bytes]:
    """A fresh CURVE pair (on nobody's allow-list) and the pool's public key."""
    server_public, _ = zmq.auth.load_certificate(str(Path(key_dir) / "server.key"))
    public, secret = zmq.curve_keypair()
    return public, secret, server_public


_HANDSHAKE_EVENTS = {
    getattr(zmq, name): name
    for name in (
        "EVENT_CONNECTED",
        "EVENT_DISCONNECTED",
        "EVENT_HANDSHAKE_SUCCEEDED",
        "EVENT_HANDSHAKE_FAILED_AUTH",
        "EVENT_HANDSHAKE_FAILED_PROTOCOL",
        "EVENT_HANDSHAKE_FAILED_NO_DETAIL",
    )
    if hasattr(zmq, name)
}


class Peer:
    """A DEALER (or another ``kind``) a hostile peer drives by hand.

    ``curve``: ``(public, secret, server_public)`` (see :func:`client_keys`,
    :func:`unknown_keys`), or None to speak without security. ``monitor``:
    record the socket's handshake events (:meth:`events`).
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        *,
        curve: tuple[bytes, bytes, bytes] | None = None,
        identity: bytes | None = None,
        kind: int = zmq.DEALER,
        monitor: bool = False,
        reconnect_ivl_ms: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.sock = context.socket(kind)
        self.sock.linger = 0
        self.sock.sndtimeo = 5000
        if identity is not None:
            self.sock.identity = identity
        if curve is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = curve
        if reconnect_ivl_ms is not None:
            self.sock.reconnect_ivl = reconnect_ivl_ms
        if kind == zmq.SUB:
            self.sock.subscribe(b"")
        self._monitor = self.sock.get_monitor_socket() if monitor else None
        self.seen: list[str] = []
        self.sock.connect(endpoint)

    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def reply(self, timeout_s: float) -> bytes | None:
        """The next message's first frame within ``timeout_s``, or None."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.sock.recv_multipart()[0]

    def message(self, timeout_s: float) -> list[bytes] | None:
        """The next message's frames within ``timeout_s``, or None."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.sock.recv_multipart()

    def replies(self) -> list[bytes]:
        """Every message waiting now (first frames)."""
        out = []
        while self.sock.poll(0):
            out.append(self.sock.recv_multipart()[0])
        return out

    def events(self) -> list[str]:
        """Handshake events of this socket so far (names such as ``EVENT_HANDSHAKE_SUCCEEDED``)."""
        while self._monitor is not None and self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            name = _HANDSHAKE_EVENTS.get(event["event"])
            if name:
                self.seen.append(name)
        return self.seen

    def close(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=0)


class ScriptedWorker:
    """A remote worker played by hand: a DEALER (commands), a PUSH (results), a heartbeat DEALER.

    It registers like ``python -m workers`` would (:meth:`register`), reads the
    commands the pool sends it (:meth:`command`) and answers them with whatever
    frames the test chooses (:meth:`send_result`, :meth:`answer` for a real
    tensordict), or never. Its results PUSH connects after the WELCOME, to the
    results endpoint on ``results_port``; :meth:`heartbeat` sends one HEARTBEAT
    from the ``<identity>!hb`` DEALER, as a worker's heartbeat thread does.
    """

    def __init__(
        self,
        context: zmq.Context,
        hello: Hello,
        host: str,
        port: int,
        curve: tuple[bytes, bytes, bytes] | None,
        identity: bytes,
    ) -> None:
        self.context, self.hello, self.curve = context, hello, curve
        self.host, self.port, self.identity = host, port, identity
        self.dealer = Peer(context, f"tcp://{host}:{port}", curve=curve, identity=identity)
        self.push: zmq.Socket | None = None
        self.push_monitor: zmq.Socket | None = None
        self.beat: Peer | None = None
        self.token = b""
        self.envs: list[int] = []
        self.encoder: Any = None
        self.refusals: list[str] = []
        #: The commands of a BATCH the pool sent, not yet returned by :meth:`command`.
        self.queued: collections.deque[dict[str, Any]] = collections.deque()
        #: Each BATCH or COMMANDS received, in order: its command's name and its envs.
        self.batches: list[tuple[str, list[int]]] = []

    def register(
        self,
        body: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
        retry_s: float = 0.25,
        until: Any = None,
        give_up_if_refused: bool = False,
    ) -> dict[str, Any] | None:
        """REGISTER (again every ``retry_s``) until a WELCOME; its body, or None by the deadline.

        REFUSEs are recorded in :attr:`refusals` and retried (or, with
        ``give_up_if_refused``, end it: None); ``until()`` returning true stops
        early (None).
        """
        body = self.hello.register_body() if body is None else body
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.dealer.send(self.hello.header("REGISTER", body))
            stop = min(deadline, time.monotonic() + retry_s)
            while (remaining := stop - time.monotonic()) > 0:
                frame = self.dealer.reply(remaining)
                if frame is None:
                    break
                reply = self.hello.decode(frame)
                if reply["command"] == "REFUSE":
                    self.refusals.append(str(reply["body"]))
                    if give_up_if_refused:
                        return None
                elif reply["command"] == "WELCOME":
                    self._welcomed(reply["body"]["reg"])
                    return reply["body"]
            if until is not None and until():
                return None
        return None

    def _welcomed(self, reg: dict[str, Any]) -> None:
        self.token, self.envs = reg["token"], list(reg["envs"])
        if self.push is None:
            self.push = self.context.socket(zmq.PUSH)
            self.push.linger = 0
            self.push.sndtimeo = 5000
            if self.curve is not None:
                pub, sec, server = self.curve
                self.push.curve_publickey, self.push.curve_secretkey = pub, sec
                self.push.curve_serverkey = server
            # Watched from before the connect, so the handshake's outcome cannot be missed.
            self.push_monitor = self.push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self.push.connect(f"tcp://{self.host}:{self.port + 1}")
        self.encoder = None  # a new connection: layouts are announced again

    def results_connected(self, timeout_s: float) -> bool:
        """True once the results PUSH has finished its (CURVE) handshake, False by the deadline.

        A test that revokes this worker's key must wait for it first: a handshake
        still under way when the key goes is refused, and the PUSH then has no
        peer to send a reply to.
        """
        from zmq.utils.monitor import recv_monitor_message

        assert self.push_monitor is not None, "not welcomed yet"
        if self.push_monitor.poll(int(timeout_s * 1000)):
            event = recv_monitor_message(self.push_monitor)
            return event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        return False

    def command(self, timeout_s: float) -> dict[str, Any] | None:
        """The next command the pool sends (``command``, ``env``, ``seq``, ``body``), or None.

        A BATCH is split into its commands and a COMMANDS into one per row
        (the envs of each such message recorded in :attr:`batches`), returned
        one by one.
        """
        deadline = time.monotonic() + timeout_s
        while not self.queued and (remaining := deadline - time.monotonic()) > 0:
            frames = self.dealer.message(remaining)
            if frames is None:
                return None
            reply = self.hello.decode(frames[0])
            if reply["command"] in ("WELCOME", "REFUSE", "PING"):
                continue
            inner = self._commands(reply, frames)
            if reply["command"] in ("BATCH", "COMMANDS"):
                self.batches.append((reply["command"], [c["env"] for c in inner]))
            self.queued.extend(inner)
        return self.queued.popleft() if self.queued else None

    def _commands(self, message: dict[str, Any], frames: list[bytes]) -> list[dict[str, Any]]:
        """A message's commands (``env`` and ``seq`` set), BATCH and COMMANDS taken apart."""
        if message["command"] == "COMMANDS":
            return self._rows(message)
        if message["command"] != "BATCH":
            return [{**message, "env": message["fields"][2], "seq": message["fields"][3]}]
        return [c for inner in self._split(message, frames) for c in self._commands(*inner)]

    def _rows(self, joined: dict[str, Any]) -> list[dict[str, Any]]:
        """A COMMANDS' commands, one per row, read as the wire docs say."""
        body = joined["body"]
        names = {value: name for name, value in self.hello.commands.items()}
        rows = zip(body["envs"], body["seqs"], strict=True)
        return [{"command": names.get(body["c"]), "env": env, "seq": seq} for env, seq in rows]

    def _split(
        self, batch: dict[str, Any], frames: list[bytes]
    ) -> list[tuple[dict[str, Any], list[bytes]]]:
        """A BATCH's messages (each header decoded, and its frames), as the wire docs say."""
        sizes, joined, at = batch["body"]["len"], frames[1], 0
        pieces = []
        for size in sizes:
            pieces.append(joined[at : at + size])
            at += size
        messages, start = [], 0
        for count in batch["body"]["n"]:
            message = pieces[start : start + count]
            messages.append((self.hello.decode(message[0]), message))
            start += count
        return messages

    def batch_frames(self, messages: list[list[Any]], env: int, token: bytes | None = None):
        """``messages`` (each a header and its frames) as one BATCH from this worker.

        ``env``: the batch header's env (one this worker hosts, for an honest batch).
        """
        flat = [bytes(memoryview(f).cast("B")) for frames in messages for f in frames]
        body = {"n": [len(frames) for frames in messages], "len": [len(f) for f in flat]}
        token = self.token if token is None else token
        fields = [self.hello.version, self.hello.commands["BATCH"], env, 0, token, [], body]
        return [msgpack.packb(fields, use_bin_type=True), b"".join(flat)]

    def results_frames(self, commands: list[dict[str, Any]], tds: list[Any]) -> list[Any]:
        """One RESULTS from this worker answering ``commands`` with ``tds``, rows joined.

        Their layout must have been announced already (by :meth:`answer_frames`):
        a RESULTS announces nothing.
        """
        if self.encoder is None:
            self.encoder = _encoder()
        parts = [self.encoder.encode(td) for td in tds]
        assert all(p.new_layout is None for p in parts), "announce the layout first"
        envs, seqs = [c["env"] for c in commands], [c["seq"] for c in commands]
        fields = [self.hello.version, self.hello.commands["RESULTS"], envs[0], 0, self.token]
        fields += [[parts[0].layout_id], {"envs": envs, "seqs": seqs}]
        columns = zip(*[p.frames for p in parts], strict=True)
        joined = [b"".join(bytes(memoryview(f).cast("B")) for f in column) for column in columns]
        return [msgpack.packb(fields, use_bin_type=True), *joined]

    def result_header(self, env: int, seq: int, layouts=(), body=None, token=None) -> bytes:
        """A RESULT header with this worker's token (or ``token``)."""
        token = self.token if token is None else token
        fields = [self.hello.version, self.hello.commands["RESULT"], env, seq, token]
        return msgpack.packb([*fields, list(layouts), body], use_bin_type=True)

    def send_result(self, frames: list[Any], copy: bool = True) -> None:
        assert self.push is not None, "not welcomed yet"
        self.push.send_multipart(frames, copy=copy)

    def answer(self, command: dict[str, Any], td: Any) -> None:
        """Answer ``command`` with ``td``, encoded by the zmqpool this process imported."""
        self.send_result(self.answer_frames(command, td))

    def answer_frames(self, command: dict[str, Any], td: Any, token: bytes | None = None):
        """The frames that answer ``command`` with ``td`` (with this worker's token, or ``token``).

        Encoded in order: a layout is announced by the first message that uses it.
        """
        from zmqpool.wire import Command, Header, encode_message

        if self.encoder is None:
            self.encoder = _encoder()
        token = self.token if token is None else token
        header = Header(Command.RESULT, command["env"], command["seq"], token)
        return encode_message(header, [self.encoder.encode(td)])

    def heartbeat(self, identity: bytes | None = None) -> None:
        """One HEARTBEAT from the ``<identity>!hb`` DEALER (this worker's own by default)."""
        if self.beat is None:
            hb = (identity or self.identity) + b"!hb"
            self.beat = Peer(
                self.context, f"tcp://{self.host}:{self.port}", curve=self.curve, identity=hb
            )
        self.beat.send(self.hello.header("HEARTBEAT"))

    def close(self) -> None:
        self.dealer.close()
        if self.beat is not None:
            self.beat.close()
        if self.push is not None:
            if self.push_monitor is not None:
                self.push.disable_monitor()
                self.push_monitor.close(linger=0)
            self.push.close(linger=0)


def _encoder() -> Any:
    try:
        from zmqpool.codec import Encoder
    except ImportError:  # an older zmqpool kept it in its wire module
        from zmqpool.wire import Encoder  # type: ignore[no-redef]
    return Encoder()


# ---------------------------------------------------------------- the victim


class VictimError(AssertionError):
    pass


class Victim:
    """A pool in a subprocess (this file's ``serve``), driven through stdin and stdout.

    Args:
        log_path: where its stderr (the pool's log) goes.
        local: ``CountingEnv`` kwargs of each local env.
        remote_envs, bind, curve_keys, local_transport: the pool's arguments.
        config: ``PoolConfig`` fields.
        step_timeout_s: the deadline of a ``step`` command.
        env: the local envs' class (``"module:Class"``, default ``CountingEnv``).
        stack: the pool's ``stack``.
        remote_spec: ``CountingEnv`` kwargs whose env's specs are the pool's
            ``remote_spec`` (None: the argument is not passed at all).
    """

    def __init__(
        self,
        log_path: str | os.PathLike,
        *,
        local: Sequence[dict[str, Any]] = (),
        remote_envs: int = 0,
        bind: str | None = None,
        curve_keys: str | os.PathLike | None = None,
        local_transport: str = "ipc",
        config: dict[str, Any] | None = None,
        step_timeout_s: float = 10.0,
        env: str = "zmqpool.testing:CountingEnv",
        stack: str = "dense",
        remote_spec: dict[str, Any] | None = None,
    ) -> None:
        spec = {
            "env": env,
            "stack": stack,
            "remote_spec": remote_spec,
            "local": list(local),
            "remote_envs": remote_envs,
            "bind": bind,
            "curve_keys": None if curve_keys is None else str(curve_keys),
            "local_transport": local_transport,
            "config": config or {},
            "step_timeout_s": step_timeout_s,
        }
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        # Forked warm: a fresh interpreter's torchrl import took seconds of CPU. (Imported
        # here: this file runs as a script too, without the checkout on its path.)
        from tests import warm

        self.proc = warm.popen(
            [sys.executable, str(HERE), "serve", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # PYTHONPATH and all
        )
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name="victim-stdout", daemon=True).start()
        self.ready = self.wait("ready", timeout_s=120)
        self.pid: int = self.ready["pid"]
        self.hello = Hello.from_event(self.ready)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and "event" in event:
                    self._queue.put(event)
        self._queue.put(None)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def _tail(self) -> str:
        return "\n".join(self.log().splitlines()[-15:])

    def wait(self, *names: str, timeout_s: float) -> dict[str, Any]:
        """The next event named one of ``names`` (earlier ones seen are returned first)."""
        for event in self.events:
            if event["event"] in names and not event.get("_taken"):
                event["_taken"] = True
                return event
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise VictimError(f"no {names} from the pool within {timeout_s} s:\n{self._tail()}")
            try:
                event = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if event is None:
                self._queue.put(None)
                raise VictimError(
                    f"the pool process ended (status {self.proc.poll()}) before {names}:\n"
                    f"{self._tail()}"
                )
            self.events.append(event)
            if event["event"] in names:
                event["_taken"] = True
                return event

    def seen(self, name: str) -> dict[str, Any] | None:
        """An event of that name already reported (without waiting), or None."""
        while True:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                break
            if event is None:
                self._queue.put(None)
                break
            self.events.append(event)
        return next((e for e in self.events if e["event"] == name), None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def command(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_listening(self, ports: list[int], timeout_s: float = 60.0) -> None:
        def bound():
            if not self.alive():
                raise VictimError(f"the pool process exited:\n{self._tail()}")
            return set(ports) <= {port for _, port in listening_ports(self.pid)}

        wait_until(bound, timeout_s, f"the pool to listen on {ports}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """End of file on stdin (the pool closes), then SIGKILL if it takes too long."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> Victim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- the victim's side


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _live_sockets() -> list[dict[str, Any]]:
    """Every open ZeroMQ socket of this process, with its security options (read-only)."""
    import gc

    found = []
    names = {zmq.ROUTER: "ROUTER", zmq.PULL: "PULL", zmq.PUB: "PUB", zmq.DEALER: "DEALER"}
    for obj in gc.get_objects():
        if not isinstance(obj, zmq.Socket) or obj.closed:
            continue
        with contextlib.suppress(zmq.ZMQError):
            found.append(
                {
                    "type": names.get(obj.type, str(obj.type)),
                    "endpoint": obj.getsockopt_string(zmq.LAST_ENDPOINT),
                    "curve_server": bool(obj.getsockopt(zmq.CURVE_SERVER)),
                    "zap_enforce_domain": bool(obj.getsockopt(zmq.ZAP_ENFORCE_DOMAIN)),
                    "zap_domain": obj.getsockopt_string(zmq.ZAP_DOMAIN),
                    "maxmsgsize": obj.getsockopt(zmq.MAXMSGSIZE),
                }
            )
    return found


def _stop_authenticators() -> int:
    """Fault injection: stop every pyzmq ZAP handler thread of this process (its public ``stop``).

    What a pool's sockets then do with a CURVE client is up to them: with
    ``ZAP_ENFORCE_DOMAIN`` they refuse it, without it libzmq lets any key in.
    """
    import gc

    from zmq.auth.thread import ThreadAuthenticator

    handlers = [obj for obj in gc.get_objects() if isinstance(obj, ThreadAuthenticator)]
    for handler in handlers:
        handler.stop()
    return len(handlers)


def _result_fields(pool: Any, out: Any) -> dict[str, Any]:
    """What a step's result says of its envs: indices, truncations, restarts."""
    envs = out.get("env_index", None)
    envs = list(range(out.shape[0])) if envs is None else envs.tolist()
    truncated = out.get(("next", "truncated"), None)
    return {
        "envs": envs,
        "truncated": None if truncated is None else truncated.reshape(-1).tolist(),
        "restarted": list(getattr(pool, "last_restarted_envs", [])),
        "obs_shape": list(out["next", "observation"].shape),
    }


def _step_envs(pool: Any, order: dict[str, Any]) -> list[dict[str, Any]]:
    """``order["rounds"]`` rounds: step ``order["envs"]``, then recv (one or more at a time)
    until each env has a result or an error, or ``order["timeout"]`` passes.

    Each round: ``results`` (env -> result fields and seconds), ``errors`` (type,
    message, the env(s) named, seconds), ``seconds``, and ``send_error`` if the
    send itself raised (the rounds stop there).
    """
    rounds = []
    for _ in range(int(order.get("rounds", 1))):
        t0 = time.monotonic()
        error = _send_envs(pool, order["envs"])
        if error:
            rounds.append({"results": {}, "errors": [], "send_error": error})
            break
        rounds.append(_collect_envs(pool, order["envs"], float(order["timeout"]), t0))
    return rounds


def _send_envs(pool: Any, envs: list[int]) -> str | None:
    """Step ``envs`` (one batch); what the send raised, or None."""
    import torch
    from tensordict import TensorDict

    td = TensorDict({"action": torch.full((len(envs), 1), 0.5)}, [len(envs)])
    try:
        pool.async_step_send(td, env_index=list(envs))
    except Exception as err:
        return f"{type(err).__name__}: {str(err)[:500]}"
    return None


def _collect_envs(pool: Any, envs: list[int], timeout: float, t0: float) -> dict[str, Any]:
    """Recv until each of ``envs`` has a result or an error, or ``timeout`` after ``t0``."""
    done: dict[str, Any] = {"results": {}, "errors": []}
    answered: set[int] = set()
    while len(answered) < len(envs):
        remaining = t0 + timeout - time.monotonic()
        if remaining <= 0:
            break
        try:
            out = pool.async_step_recv(min_get=1, timeout=remaining)
        except Exception as err:
            named = getattr(err, "env_indices", None)
            if named is None and getattr(err, "env_index", None) is not None:
                named = [err.env_index]
            answered.update(named or [])
            done["errors"].append(
                {
                    "type": type(err).__name__,
                    "error": str(err)[:500],
                    "envs": named,
                    "seconds": round(time.monotonic() - t0, 3),
                }
            )
            if isinstance(err, TimeoutError) or not named:
                break
            continue
        fields = _result_fields(pool, out)
        for i, env in enumerate(fields["envs"]):
            answered.add(env)
            done["results"][str(env)] = {
                "truncated": None if fields["truncated"] is None else fields["truncated"][i],
                "restarted": env in fields["restarted"],
                "obs_shape": fields["obs_shape"][1:],
                "head": out["next", "observation"][i].reshape(-1)[:2].tolist(),
                "seconds": round(time.monotonic() - t0, 3),
            }
    done["seconds"] = round(time.monotonic() - t0, 3)
    return done


def _malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: free memory the allocator holds goes back to the system."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _roster(pool: Any) -> dict[str, Any]:
    """Each worker's and env's phase, read from ``pool.runtime.roster`` (if the pool has one)."""
    try:
        roster = pool.runtime.roster
        workers = {
            w.identity.decode(errors="replace"): {"phase": w.phase.value, "envs": list(w.envs)}
            for w in roster.workers()
        }
        envs = [e.phase.value for e in roster.envs]
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {"workers": workers, "envs": envs}


def serve(spec_json: str) -> None:
    """The victim: build the pool described by ``spec_json``, report, obey stdin (module doc)."""
    import importlib
    import logging
    import signal

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="LOG %(levelname)s %(name)s: %(message)s"
    )
    spec = json.loads(spec_json)
    import torch
    from tensordict import TensorDict

    from zmqpool import PoolConfig, ZMQAsyncEnvPool
    from zmqpool.specs import spec_to_data
    from zmqpool.testing import CountingEnv
    from zmqpool.wire import PROTOCOL_VERSION, Command

    good = msgpack.packb(spec_to_data(CountingEnv().specs), use_bin_type=True)
    commands = {c.name: int(c) for c in Command}
    _emit(
        "ready",
        pid=os.getpid(),
        version=PROTOCOL_VERSION,
        commands=commands,
        spec=base64.b64encode(good).decode(),
    )
    lines: queue.Queue[str | None] = queue.Queue()
    constructed = threading.Event()

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGUSR1, interrupt)

    def read_stdin() -> None:
        for line in sys.stdin:
            lines.put(line.strip())
        lines.put(None)
        if not constructed.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)  # stop waiting for registrations

    threading.Thread(target=read_stdin, name="stdin", daemon=True).start()
    local = spec["local"]
    module, _, name = spec.get("env", "zmqpool.testing:CountingEnv").partition(":")
    env_class = getattr(importlib.import_module(module), name)
    extra: dict[str, Any] = {}
    if spec.get("remote_spec") is not None:  # only then: older pools have no such argument
        extra["remote_spec"] = CountingEnv(**spec["remote_spec"]).specs
    started = time.monotonic()
    try:
        pool = ZMQAsyncEnvPool(
            env_class if local else [],
            create_env_kwargs=local or None,
            remote_envs=spec["remote_envs"],
            bind=spec["bind"],
            curve_keys=spec["curve_keys"],
            local_transport=spec["local_transport"],
            config=PoolConfig(**spec["config"]),
            stack=spec.get("stack", "dense"),
            **extra,
        )
    except KeyboardInterrupt:
        _emit("construct_aborted")
        return
    except BaseException as err:  # what construction raised is the finding
        _emit("construct_failed", type=type(err).__name__, error=str(err)[:2000])
        return
    constructed.set()
    _emit(
        "constructed",
        remote_endpoint=pool.remote_endpoint,
        seconds=round(time.monotonic() - started, 3),
    )
    sent_at = time.monotonic()
    try:
        while (line := lines.get()) is not None:
            if line == "step":
                n = pool.batch_size[0]
                td = TensorDict({"action": torch.full((n, 1), 0.5)}, [n])
                t0 = time.monotonic()
                try:
                    pool.async_step_send(td, env_index=list(range(n)))
                    out = pool.async_step_recv(min_get=n, timeout=spec["step_timeout_s"])
                except Exception as err:
                    _emit("step_failed", type=type(err).__name__, error=str(err)[:2000])
                    continue
                obs = out["next", "observation"]
                _emit(
                    "stepped",
                    seconds=round(time.monotonic() - t0, 3),
                    shape=list(obs.shape),
                    head=obs.reshape(n, -1)[:, :4].tolist(),
                    **_result_fields(pool, out),
                )
            elif line.startswith("step-envs "):
                _emit("stepped_envs", rounds=_step_envs(pool, json.loads(line[10:])))
            elif line.startswith("send-envs "):
                sent_at = time.monotonic()
                error = _send_envs(pool, json.loads(line[10:])["envs"])
                if error:
                    _emit("send_failed", error=error)
                else:
                    _emit("sent")
            elif line.startswith("collect-envs "):
                order = json.loads(line[13:])
                started_at = time.monotonic() if order.get("fresh") else sent_at
                _emit(
                    "collected", **_collect_envs(pool, order["envs"], order["timeout"], started_at)
                )
            elif line == "malloc-trim":  # what the C allocator keeps, handed back
                _emit("trimmed", released=_malloc_trim())
            elif line == "roster":
                _emit("roster", **_roster(pool))
            elif line.startswith("revoke "):
                try:
                    envs = pool.revoke_worker_key(line[7:])
                except Exception as err:
                    _emit("revoke_failed", type=type(err).__name__, error=str(err)[:2000])
                else:
                    _emit("revoked", envs=list(envs))
            elif line == "sockets":
                _emit("sockets", sockets=_live_sockets())
            elif line == "zap-stop":
                _emit("zap_stopped", count=_stop_authenticators())
            elif line == "close-pool":  # closed, not ended: the next call starts it again
                pool.close()
                _emit("pool_closed")
            elif line == "close":
                break
    finally:
        t0 = time.monotonic()
        pool.close()
        _emit("closed", seconds=round(time.monotonic() - t0, 3))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SPEC_JSON")
