"""A worker trusts its trainer no further than its envs need (real processes, real sockets).

Hostile peers written here: a fake "trainer" holding no keys that answers the
worker's TCP connection with a ZMTP greeting and a frame header announcing
1 GiB (libzmq reads the CURVE handshake with the socket's frame decoder before
anyone is authenticated), and a fake trainer that welcomes the worker with
heartbeats that are not heartbeats. The worker is ``python -m workers`` in a
subprocess, with CURVE keys made by ``zmqpool keygen``; its memory is read from
outside (``/proc/PID/status``). Key files: secrets stay out of reprs, and a
secret others may read is refused.

Every wait has a deadline. The worker subprocess imports the same zmqpool as
this test (its ``PYTHONPATH`` is passed on), so the file can be run against
another checkout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils import z85

import zmqpool
from tests import warm
from zmqpool.security import ClientKeys, ServerKeys, make_server
from zmqpool.wire import Command, Header

#: Where the zmqpool under test lives: the worker subprocess imports the same one.
ROOT = Path(zmqpool.__file__).resolve().parent.parent
#: A worker imports torchrl and builds its env before it connects: seconds, more when loaded.
START_S = 60.0
#: The frame the hostile peer announces, and how much of it it sends.
ANNOUNCED = 1 << 30
STREAMED = 200 << 20
#: The most a worker's memory may grow while a peer streams STREAMED bytes at it.
MAX_GROWTH_MB = 50
BEAT_S = 0.2


# ---------------------------------------------------------------- helpers


def status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for pid {pid}")


class PeakMemory:
    """How much a process's resident memory peaked above what it was at the start.

    Resets the kernel's peak (``VmHWM``, by writing 5 to ``clear_refs``), so a
    buffer allocated and freed between two looks is counted all the same.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        self.start = status_mb(pid, "VmRSS")

    def growth(self) -> float:
        return status_mb(self.pid, "VmHWM") - self.start


@contextlib.contextmanager
def worker_process(endpoint: str, keys: Path, log: Path) -> Iterator[warm.WarmProcess]:
    """A remote worker (one CountingEnv, this process), beating every BEAT_S."""
    argv = [sys.executable, "-m", "workers", "--connect", endpoint]
    argv += ["--env", "zmqpool.testing:CountingEnv", "--single-process"]
    argv += ["--server-key", str(keys / "server.key")]
    argv += ["--client-key", str(keys / "workers" / "worker-0.key_secret")]
    argv += ["--heartbeat-interval", str(BEAT_S), "--identity", "hardened"]
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    with log.open("w") as err:
        proc = warm.popen(argv, stderr=err, env=env, cwd=ROOT)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    return sock


def port_of(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def accept(sock: socket.socket, timeout: float) -> socket.socket:
    sock.settimeout(timeout)
    conn, _ = sock.accept()
    return conn


#: ZMTP 3.0 greeting of a CURVE server: signature, version, mechanism, as-server, filler.
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\x01"
GREETING += bytes(64 - len(GREETING))
#: A long command frame (flags: LONG | COMMAND) announcing ANNOUNCED bytes.
HUGE_FRAME = bytes([0x06]) + struct.pack(">Q", ANNOUNCED)


def flood(conn: socket.socket, pid: int) -> tuple[float, bool]:
    """Greet the worker, announce a 1 GiB frame, stream STREAMED bytes of it.

    Returns how much the worker's memory grew (MB) and whether it dropped the
    connection. The growth is watched for a second after the last byte is
    sent: what the kernel still buffers reaches the worker by then.
    """
    memory = PeakMemory(pid)
    conn.settimeout(30)
    chunk = bytes(1 << 20)
    dropped = False
    try:
        conn.sendall(GREETING + HUGE_FRAME)
        for _ in range(STREAMED // len(chunk)):
            conn.sendall(chunk)
    except OSError:  # reset or broken pipe: the worker closed the connection
        dropped = True
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and memory.growth() < MAX_GROWTH_MB:
        time.sleep(0.05)
    growth = memory.growth()
    if not dropped:  # everything sent: has the worker hung up since?
        conn.settimeout(1.0)
        try:
            dropped = _read_until_closed(conn)
        except OSError:
            dropped = True
    print(f"\npeak RSS growth, {STREAMED >> 20} MiB streamed: {growth:.1f} MB; dropped: {dropped}")
    return growth, dropped


def _read_until_closed(conn: socket.socket) -> bool:
    while True:
        try:
            if not conn.recv(1 << 16):
                return True
        except TimeoutError:
            return False


class FakeTrainer:
    """A CURVE ROUTER, PULL and beacon ROUTER that welcome one worker: enough of a pool."""

    def __init__(self, keys: Path) -> None:
        self.context = zmq.Context()
        self.server_keys = ServerKeys.from_dir(keys)
        self.router = self._bound(zmq.ROUTER)
        self.pull = self._bound(zmq.PULL)
        self.beacon = self._bound(zmq.ROUTER)  # where the worker asks for beats
        self.epoch = os.urandom(8)
        self.token = os.urandom(16)
        self.identity: bytes | None = None
        self.heartbeats = 0
        self.registers = 0

    def _bound(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.linger = 0
        make_server(sock, self.server_keys)
        sock.bind("tcp://127.0.0.1:0")
        return sock

    @staticmethod
    def endpoint(sock: zmq.Socket) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def read_router(self, timeout: float) -> Header | None:
        """One message on the ROUTER, counted: a REGISTER, a HEARTBEAT..."""
        if not self.router.poll(int(timeout * 1000)):
            return None
        identity, frame, *_ = self.router.recv_multipart()
        header = Header.decode(frame)
        if header.command == Command.HEARTBEAT:
            self.heartbeats += 1
        elif header.command == Command.REGISTER:
            self.registers += 1
            self.identity = identity
        return header

    def welcome(self, results: str, beats: str) -> None:
        """Wait for the worker's REGISTER and welcome it (a large liveness: never judged lost)."""
        deadline = time.monotonic() + START_S
        while self.identity is None:
            assert time.monotonic() < deadline, "the worker never registered"
            self.read_router(1.0)
        reg = {
            "token": self.token,
            "envs": [0],
            "results": results,
            "beats": beats,
            "epoch": self.epoch,
            "heartbeat_interval_s": BEAT_S,
            "heartbeat_liveness": 100_000,
            "max_frame": 1 << 20,
            "piece": 0,
        }
        welcome = Header(Command.WELCOME, body={"reg": reg}).encode()
        self.router.send_multipart([self.identity, welcome])

    def count_heartbeats(self, more: int, timeout: float) -> int:
        """Read the ROUTER until ``more`` HEARTBEATs came (or the timeout); how many did."""
        start, deadline = self.heartbeats, time.monotonic() + timeout
        while self.heartbeats - start < more and time.monotonic() < deadline:
            self.read_router(max(deadline - time.monotonic(), 0.0))
        return self.heartbeats - start

    def asked(self, timeout: float) -> bytes:
        """The identity of the worker's beats socket, from its first ask for a beat."""
        assert self.beacon.poll(int(timeout * 1000)), "the worker never asked for a beat"
        identity, ask = self.beacon.recv_multipart()
        assert ask == Header(Command.HEARTBEAT).encode(), ask
        return identity

    def close(self) -> None:
        for sock in (self.router, self.pull, self.beacon):
            sock.close()
        self.context.term()


# ---------------------------------------------------------------- memory


def test_a_keyless_fake_trainer_cannot_make_the_workers_dealer_allocate(keys, tmp_path):
    """The DEALER has MAXMSGSIZE (from its env's specs) before it connects: a 1 GiB frame drops."""
    fake = listener()
    with worker_process(f"tcp://127.0.0.1:{port_of(fake)}", keys, tmp_path / "w.log") as proc:
        conn = accept(fake, START_S)
        growth, dropped = flood(conn, proc.pid)
        conn.close()
        assert growth < MAX_GROWTH_MB, f"the worker's memory grew {growth:.0f} MB"
        assert dropped, "the worker kept the connection of a peer announcing a 1 GiB frame"
        # It goes on: it connects again (libzmq would not, after a protocol error), saying why.
        accept(fake, 10.0).close()
        assert proc.poll() is None, (tmp_path / "w.log").read_text()
        assert "dropped for a protocol error" in (tmp_path / "w.log").read_text()
    fake.close()


@pytest.mark.parametrize("socket_name", ["beats", "results"])
def test_a_fake_beats_or_results_endpoint_cannot_make_the_worker_allocate(
    keys, tmp_path, socket_name
):
    """The beats DEALER and the PUSH (results) are capped too: a 1 GiB frame drops."""
    trainer = FakeTrainer(keys)
    fake = listener()
    endpoints = {
        "beats": trainer.endpoint(trainer.beacon),
        "results": trainer.endpoint(trainer.pull),
    }
    endpoints[socket_name] = f"tcp://127.0.0.1:{port_of(fake)}"
    try:
        with worker_process(trainer.endpoint(trainer.router), keys, tmp_path / "w.log") as proc:
            trainer.welcome(endpoints["results"], endpoints["beats"])
            conn = accept(fake, 30.0)
            growth, dropped = flood(conn, proc.pid)
            conn.close()
            assert growth < MAX_GROWTH_MB, f"the worker's memory grew {growth:.0f} MB"
            assert dropped, f"the worker's {socket_name} socket kept a 1 GiB frame's connection"
            accept(fake, 10.0).close()  # and connects again (libzmq would not, after this)
            assert proc.poll() is None, (tmp_path / "w.log").read_text()
            assert "dropped for a protocol error" in (tmp_path / "w.log").read_text()
    finally:
        fake.close()
        trainer.close()


@contextlib.contextmanager
def welcomed_worker(
    keys: Path, log: Path, beats: int
) -> Iterator[tuple[FakeTrainer, warm.WarmProcess]]:
    """A worker process welcomed by a fake trainer, heard beating ``beats`` times."""
    trainer = FakeTrainer(keys)
    try:
        with worker_process(trainer.endpoint(trainer.router), keys, log) as proc:
            trainer.welcome(trainer.endpoint(trainer.pull), trainer.endpoint(trainer.beacon))
            assert trainer.count_heartbeats(beats, 10.0) == beats, log.read_text()
            assert trainer.identity is not None
            yield trainer, proc
    finally:
        trainer.close()


def test_a_command_over_the_limit_its_specs_imply_is_dropped_and_the_worker_serves_on(
    keys, tmp_path
):
    """The DEALER's limit comes from the env's specs (a CountingEnv: under 1 MiB).

    A pool that sends a 128 MiB frame anyway (a trainer of another build, or
    one whose keys were stolen) loses that one command: the worker's memory
    does not grow, and it connects again and answers the next command.
    """
    log = tmp_path / "w.log"
    with welcomed_worker(keys, log, beats=2) as (trainer, proc):
        memory = PeakMemory(proc.pid)
        step = Header(Command.STEP, 0, 1, layouts=(0,)).encode()
        trainer.router.send_multipart([trainer.identity, step, bytes(128 << 20)], copy=False)
        # Until the worker is connected again a command to it is lost: send one every
        # half second, reading the ROUTER meanwhile as a pool does (it then sees the
        # old connection go before the new one comes, and routes to the new one).
        deadline, seq = time.monotonic() + 15.0, 1
        while time.monotonic() < deadline and not trainer.pull.poll(0):
            seq += 1
            seed = Header(Command.SEED, 0, seq, body={"seed": 3}).encode()
            trainer.router.send_multipart([trainer.identity, seed])
            for _ in range(10):
                if trainer.pull.poll(25):
                    break
                trainer.read_router(0.025)
        assert trainer.pull.poll(0), f"the worker stopped answering\n{log.read_text()}"
        replies = [Header.decode(trainer.pull.recv_multipart()[0])]
        while trainer.pull.poll(200):
            replies.append(Header.decode(trainer.pull.recv_multipart()[0]))
        growth = memory.growth()
        print(f"\npeak memory growth for a 128 MiB command: {growth:.1f} MB")
        assert growth < MAX_GROWTH_MB, f"the worker's memory grew {growth:.0f} MB"
        # The oversized STEP never reached the worker's code: no reply to it.
        assert [r.seq for r in replies if r.seq == 1] == [], replies
        assert any(r.command == Command.RESULT and r.seq > 1 for r in replies), replies
        assert proc.poll() is None, log.read_text()


# ---------------------------------------------------------------- heartbeats


def malformed_beats(epoch: bytes) -> list[list[bytes]]:
    """Messages on the beats socket that are no PING of this pool's (one of each kind)."""
    ping = Header(Command.PING, body={"epoch": epoch}).encode()
    other_version = Header(Command.PING, body={"epoch": epoch}, version=99).encode()
    return [
        [b"\xc1 not msgpack at all"],
        [b"\x93\x01\x02"],  # msgpack, not a header
        [Header(Command.STEP, body={"epoch": epoch}).encode()],  # another command
        [Header(Command.PING, body={"epoch": 5}).encode()],  # a bad body
        [Header(Command.PING, body={"epoch": epoch, "x": 1}).encode()],  # an unknown key
        [Header(Command.PING).encode()],  # no body
        [other_version],
        [ping, b"and a frame too many"],
    ]


def test_malformed_beats_are_counted_and_ignored_and_the_worker_serves_on(keys, tmp_path):
    """Garbage on the beats socket: the heartbeat thread lives, the worker serves, few log lines."""
    trainer = FakeTrainer(keys)
    log = tmp_path / "w.log"
    try:
        with worker_process(trainer.endpoint(trainer.router), keys, log) as proc:
            trainer.welcome(trainer.endpoint(trainer.pull), trainer.endpoint(trainer.beacon))
            # The worker asks for beats: from then on its beats socket gets what is sent to it.
            asker = trainer.asked(30.0)
            assert trainer.count_heartbeats(2, 10.0) == 2, log.read_text()
            registers = trainer.registers
            rounds = 16
            ping = Header(Command.PING, body={"epoch": trainer.epoch}).encode()
            for _ in range(rounds):
                for message in malformed_beats(trainer.epoch):
                    trainer.beacon.send_multipart([asker, *message])
                trainer.beacon.send_multipart([asker, ping])  # the real beats go on among them
            sent = rounds * len(malformed_beats(trainer.epoch))
            # The heartbeat thread reads the beats socket between beats: five more beats, it lived.
            beats = trainer.count_heartbeats(5, 10.0)
            assert beats == 5, f"{beats} heartbeats after the malformed beats\n{log.read_text()}"
            assert proc.poll() is None, log.read_text()
            # The worker serves on: a SEED is answered on the results socket.
            assert trainer.identity is not None
            seed = Header(Command.SEED, 0, 7, body={"seed": 3}).encode()
            trainer.router.send_multipart([trainer.identity, seed])
            assert trainer.pull.poll(10_000), log.read_text()
            reply = Header.decode(trainer.pull.recv_multipart()[0])
            assert (reply.command, reply.seq, reply.token) == (Command.RESULT, 7, trainer.token)
            # Nothing malformed made it judge the pool lost or replaced (no new REGISTER).
            trainer.count_heartbeats(1, 2.0)
            assert trainer.registers == registers, log.read_text()
        lines = [
            line for line in log.read_text().splitlines() if "malformed pool heartbeat" in line
        ]
        print(f"\n{sent} malformed beats, {len(lines)} log lines")
        # Each counted, logged at the 1st, 2nd, 4th... one: 8 lines for 128.
        assert sent == 128 and len(lines) == 8, "\n".join(lines)
        assert "(128 so far)" in lines[-1], lines[-1]
    finally:
        trainer.close()


def test_what_is_sent_to_the_heartbeat_dealer_is_not_queued_in_the_worker(keys, tmp_path):
    """The pool sends the heartbeat thread's DEALER nothing, and nothing reads it: libzmq
    queued what came (up to RCVHWM's default of 1,000 messages, of up to a header's
    1 MiB each). 300 messages of ~1 MiB from the pool's key grow the worker by
    less than MAX_GROWTH_MB over the next three beats.
    """
    trainer = FakeTrainer(keys)
    log = tmp_path / "w.log"
    try:
        with worker_process(trainer.endpoint(trainer.router), keys, log) as proc:
            trainer.welcome(trainer.endpoint(trainer.pull), trainer.endpoint(trainer.beacon))
            deadline, beat_identity = time.monotonic() + 30.0, None
            while beat_identity is None and trainer.router.poll(1000):
                assert time.monotonic() < deadline, log.read_text()
                identity, frame, *_ = trainer.router.recv_multipart()
                if Header.decode(frame).command == Command.HEARTBEAT:
                    beat_identity = identity
            assert beat_identity is not None and beat_identity.endswith(b"!hb"), log.read_text()
            memory = PeakMemory(proc.pid)
            junk = bytes((1 << 20) - 1024)
            for _ in range(300):
                trainer.router.send_multipart([beat_identity, junk])
            assert trainer.count_heartbeats(3, 10.0) == 3, log.read_text()
            growth = memory.growth()
            assert proc.poll() is None, log.read_text()
        assert growth < MAX_GROWTH_MB, f"the worker's memory grew {growth:.0f} MB"
    finally:
        trainer.close()


# ---------------------------------------------------------------- key files


def test_reprs_of_loaded_keys_hold_no_secret(keys):
    server = ServerKeys.from_dir(keys)
    client = ClientKeys.from_files(
        str(keys / "server.key"), str(keys / "workers" / "worker-0.key_secret")
    )
    for loaded in (server, client):
        z85_secret = loaded.secret
        raw_secret = z85.decode(z85_secret)
        for text in (repr(loaded), str(loaded)):
            assert z85_secret.decode() not in text and repr(z85_secret) not in text, text
            assert repr(raw_secret) not in text and raw_secret.hex() not in text, text
        assert loaded.public.decode() in repr(loaded)  # the public key still says which keys


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o601], ids=lambda m: f"{m:04o}")
def test_secret_key_files_others_may_read_are_refused(keys, tmp_path, mode):
    """keygen's secrets (0600) load; the same files opened to group or others are refused."""
    copy = tmp_path / "keys"
    copy.mkdir(mode=0o700)
    (copy / "authorized").mkdir(mode=0o700)
    for name in ("server.key", "server.key_secret", "worker-0.key_secret"):
        source = keys / name if name.startswith("server") else keys / "workers" / name
        (copy / name).write_bytes(source.read_bytes())
        (copy / name).chmod(0o600 if "secret" in name else 0o644)
    server_secret, worker_secret = copy / "server.key_secret", copy / "worker-0.key_secret"
    ServerKeys.from_dir(copy)  # 0600: fine
    ClientKeys.from_files(str(copy / "server.key"), str(worker_secret))

    for secret, load in (
        (server_secret, lambda: ServerKeys.from_dir(copy)),
        (
            worker_secret,
            lambda: ClientKeys.from_files(str(copy / "server.key"), str(worker_secret)),
        ),
    ):
        secret.chmod(mode)
        with pytest.raises(PermissionError) as caught:
            load()
        text = str(caught.value)
        assert str(secret) in text and f"{mode:04o}" in text, text
        assert f"chmod 600 {secret}" in text, text
        secret.chmod(0o600)
        load()  # fixed as the message says


def test_the_worker_command_refuses_a_secret_others_may_read(keys, tmp_path):
    """``python -m workers --client-key`` names the file and the fix, and starts nothing."""
    from workers import cli as worker_cli
    from workers import serving

    secret = tmp_path / "worker.key_secret"
    secret.write_bytes((keys / "workers" / "worker-0.key_secret").read_bytes())
    secret.chmod(0o644)
    argv = ["--connect", "tcp://127.0.0.1:9", "--env", "x:y", "--client-key", str(secret)]
    args = worker_cli.build_parser().parse_args([*argv, "--server-key", str(keys / "server.key")])
    with pytest.raises(SystemExit) as caught:
        serving._client_keys(args)
    assert f"chmod 600 {secret}" in str(caught.value.code)
