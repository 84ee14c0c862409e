"""An allow-listed key that never registers, against a pool's remote side.

Findings of session 50's hostile audit, each with the pool under
attack in its own process (:class:`tests.hostile.Victim`) and an honest
local env whose steps must keep coming back:

- a peer that floods REGISTERs and reads none of the REFUSEs: the pool's
  blocking send of a REFUSE stopped the trainer for good;
- a 1 KB header nested a thousand deep: formatting it into an error raised
  ``RecursionError`` out of the user's recv;
- complete messages queued by libzmq between two calls of the trainer: a
  thousand a connection (RCVHWM's default) of 256 KiB each;
- 256 KiB result headers of empty arrays from a key that holds no env,
  unpacked before their sender was checked: 200 steps of a local env took
  13-22 s under 40 a second;
- small malformed REGISTERs as fast as a key can send them, each checked,
  refused and logged.

And of session 61's: 4 KiB headers of 4,000 empty arrays, as fast as a key
can send them: unpacked at once (each array set off the cyclic collector's
walks of torch's objects), 200 steps of a local env took 21 s (HEARTBEATs on
the control port) and 28 s (RESULTs on the results port) instead of 0.1 s.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import hostile
import msgpack
import pytest
import zmq
from hostile import Peer, ScriptedWorker, Victim, client_keys

from tests.netns import free_port_base
from tests.test_network_hardening import HOST, MB, remote_victim
from zmqpool.admission import REGISTER_BURST, REGISTERS_PER_S


def steps_of_env_0(victim: Victim, rounds: int, timeout_s: float, within_s: float = 60) -> list:
    """``rounds`` steps of the victim's local env 0, each with a deadline of ``timeout_s``.

    All of them within ``within_s`` (they take milliseconds each when nothing is wrong).
    """
    victim.command(f'step-envs {{"envs": [0], "timeout": {timeout_s}, "rounds": {rounds}}}')
    return victim.wait("stepped_envs", timeout_s=within_s)["rounds"]


@contextlib.contextmanager
def victim_with_a_remote_worker(tmp_path, key_dir, port: int, context) -> Iterator[Victim]:
    """A victim with a local env 0 and a remote slot (frame limit 256 KiB, as ``remote_spec``
    sets it) held by an honest scripted worker of key 0; key 1 is the attacker's."""
    with remote_victim(
        tmp_path, key_dir, port, remote_envs=1, local=[{"env_id": 0}], remote_spec={}
    ) as victim:
        honest = ScriptedWorker(
            context, victim.hello, HOST, port, client_keys(key_dir, 0), b"honest-remote"
        )
        try:
            welcome = honest.register(timeout_s=60, until=lambda: victim.seen("construct_failed"))
            assert welcome is not None, honest.refusals[-2:]
            victim.wait("constructed", timeout_s=60)
            yield victim
        finally:
            honest.close()


def steps_under_flood(
    victim: Victim, sock: zmq.Socket, frame: bytes, per_second: float | None, within_s: float
) -> tuple[list[dict], float]:
    """200 steps of the victim's env 0 while ``sock`` sends ``frame`` ``per_second`` times a
    second, or as fast as the pool takes them (None); the rounds and their time. Closes ``sock``.
    """
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # the pool's queue for us is full: it is reading
                stop.wait(0.0005)
            if per_second is not None:
                stop.wait(1 / per_second)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        if per_second is None:
            stop.wait(1.0)  # the flood under way, queues full
        started = time.monotonic()
        rounds = steps_of_env_0(victim, rounds=200, timeout_s=30, within_s=within_s)
        return rounds, time.monotonic() - started
    finally:
        stop.set()
        thread.join(5)
        sock.close(0)


def answered(rounds: list[dict]) -> int:
    return sum(1 for r in rounds if "0" in r["results"] and not r["errors"])


def test_a_peer_that_reads_no_refusal_cannot_stop_the_trainer(tmp_path, key_dir, context):
    """60,000 malformed REGISTERs, none of the REFUSEs read: every step still comes back."""
    port = free_port_base(HOST)
    with remote_victim(tmp_path, key_dir, port, remote_envs=0, local=[{"env_id": 0}]) as victim:
        victim.wait("constructed", timeout_s=60)
        deaf = context.socket(zmq.DEALER)
        deaf.linger, deaf.identity, deaf.rcvhwm, deaf.sndhwm = 0, b"deaf", 1, 0
        deaf.setsockopt(zmq.RCVBUF, 4096)  # before connecting: the kernel holds little for it
        deaf.curve_publickey, deaf.curve_secretkey, deaf.curve_serverkey = client_keys(key_dir, 1)
        deaf.connect(f"tcp://{HOST}:{port}")
        malformed = victim.hello.header("REGISTER", {"reg": {}})
        for _ in range(60_000):
            deaf.send(malformed)
        rounds = steps_of_env_0(victim, rounds=100, timeout_s=5)
        deaf.close(0)
    assert answered(rounds) == 100, [r for r in rounds if r["errors"]][:1]


def test_a_header_nested_a_thousand_deep_is_dropped(tmp_path, key_dir, context):
    """On the results port and the control port: dropped, and the honest env's steps go on."""
    port = free_port_base(HOST)
    with remote_victim(tmp_path, key_dir, port, remote_envs=0, local=[{"env_id": 0}]) as victim:
        victim.wait("constructed", timeout_s=60)
        hello = victim.hello
        deep = b"\x91" * 1015 + b"\xc0"  # [[[...[nil]...]]]: msgpack takes it, repr does not
        as_command = (
            b"\x97"
            + msgpack.packb(hello.version)
            + deep
            + msgpack.packb(-1)
            + msgpack.packb(0)
            + msgpack.packb(b"", use_bin_type=True)
            + b"\x90\xc0"
        )
        register = hello.register_body()
        register["reg"]["pid"] = "PLACEHOLDER"
        as_pid = msgpack.packb(
            [hello.version, hello.commands["REGISTER"], -1, 0, b"", [], register],
            use_bin_type=True,
        ).replace(msgpack.packb("PLACEHOLDER"), deep)
        sockets = []
        for kind, target, frames in (
            (zmq.PUSH, port + 1, [as_command]),
            (zmq.DEALER, port, [as_command, as_pid]),
        ):
            sock = context.socket(kind)
            sock.linger, sock.sndtimeo = 0, 5000
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = client_keys(
                key_dir, 1
            )
            sock.connect(f"tcp://{HOST}:{target}")
            sockets.append((sock, frames))
        rounds: list[dict] = []
        for sock, frames in sockets:
            for frame in frames:
                seen = turned_away(victim.log())
                sock.send(frame)
                for _ in range(20):  # the pool reads its sockets only while in a call
                    rounds += steps_of_env_0(victim, rounds=1, timeout_s=10)
                    if turned_away(victim.log()) > seen:
                        break
                assert turned_away(victim.log()) > seen, "the message never reached the pool"
        for sock, _ in sockets:
            sock.close(0)
    assert answered(rounds) == len(rounds) >= 3, rounds


def turned_away(log: str) -> int:
    """Messages the victim logged as dropped or refused (each reason's first is logged)."""
    return log.count("dropped a message") + log.count("refused worker")


def test_libzmq_queues_few_messages_of_a_remote_connection(tmp_path, key_dir, context):
    """Four connections, 200 messages of 256 KiB each, sent while the trainer is not in a call.

    libzmq used to queue a thousand messages a connection: all 200 MB. It now
    stops reading a connection at 64 (``REMOTE_RESULTS_QUEUE``): 64 MB here.
    """
    port = free_port_base(HOST)
    with victim_with_a_remote_worker(tmp_path, key_dir, port, context) as victim:
        assert answered(steps_of_env_0(victim, rounds=3, timeout_s=10)) == 3
        before = hostile.settled_rss(victim.pid)
        frame = b"\x00" * (256 << 10)  # the remote side's frame limit, as remote_spec gives it
        pushes = []
        for _ in range(4):
            push = context.socket(zmq.PUSH)
            push.linger, push.sndhwm = 0, 0  # the attacker's side queues without bound
            push.curve_publickey, push.curve_secretkey, push.curve_serverkey = client_keys(
                key_dir, 1
            )
            push.connect(f"tcp://{HOST}:{port + 1}")
            pushes.append(push)
        for push in pushes:
            for _ in range(200):
                push.send(frame, copy=False)
        held = hostile.settled_rss(victim.pid, timeout_s=15) - before
        rounds = steps_of_env_0(victim, rounds=5, timeout_s=30)
        for push in pushes:
            push.close(0)
    assert held < 130 * MB, f"the trainer took in {held / MB:.0f} MB from 4 connections"
    assert answered(rounds) == 5


def test_large_result_headers_from_a_key_without_an_env_are_not_unpacked(
    tmp_path, key_dir, context
):
    """40 a second, each 256 KiB of empty msgpack arrays naming env 0 with a made-up token."""
    port = free_port_base(HOST)
    with victim_with_a_remote_worker(tmp_path, key_dir, port, context) as victim:
        hello = victim.hello
        count = (256 << 10) - 200
        fields = [hello.version, hello.commands["RESULT"], 0, 0, b"t" * 16, [], {"j": []}]
        junk = msgpack.packb(fields, use_bin_type=True)[:-1]  # the body's list, swapped for
        junk += b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count  # `count` empty arrays
        push = context.socket(zmq.PUSH)
        push.linger = 0
        push.curve_publickey, push.curve_secretkey, push.curve_serverkey = client_keys(key_dir, 1)
        push.connect(f"tcp://{HOST}:{port + 1}")
        rounds, took = steps_under_flood(victim, push, junk, per_second=40, within_s=90)
        assert "wrong token for env" in victim.log()  # the flood reached the pool
    assert answered(rounds) == 200
    assert took < 8, f"200 steps of a local env took {took:.1f} s under the flood"


@pytest.mark.parametrize("bad", ["body", "version"])
def test_a_key_gets_a_bounded_number_of_registrations_read(tmp_path, key_dir, context, bad):
    """1,000 small bad REGISTERs from one key: most are dropped unchecked, none refused twice.

    A REGISTER checked costs the trainer the checks, a REFUSE and a log line (a
    flood of them made 200 local steps take 6.4 s, against 0.2 s); a key
    gets ``REGISTER_BURST`` at once and ``REGISTERS_PER_S`` after that. A
    malformed body, or another protocol version (refused before its body is
    read: it was refused 1,000 times in 1.1 s).
    """
    port = free_port_base(HOST)
    with remote_victim(tmp_path, key_dir, port, remote_envs=0, local=[{"env_id": 0}]) as victim:
        victim.wait("constructed", timeout_s=60)
        peer = Peer(context, f"tcp://{HOST}:{port}", curve=client_keys(key_dir, 1), identity=b"f")
        started = time.monotonic()
        hello = victim.hello
        malformed = {
            "body": hello.header("REGISTER", {"reg": {}}),
            "version": hello.header("REGISTER", hello.register_body(), version=99),
        }[bad]
        for _ in range(1000):
            peer.send(malformed)
        rounds = steps_of_env_0(victim, rounds=50, timeout_s=10)  # the pool reads meanwhile
        refusals = []
        while (frame := peer.reply(1.0)) is not None:
            refusals.append(frame)
        elapsed = time.monotonic() - started
        peer.close()
        assert "REGISTERs from one key beyond its rate" in victim.log()
    assert answered(rounds) == 50
    assert 0 < len(refusals) <= REGISTER_BURST + REGISTERS_PER_S * elapsed, (len(refusals), elapsed)


def empty_arrays_header(hello, command: str, size: int = 4096) -> bytes:
    """A ``size``-byte header of ``command`` whose body holds one list of empty arrays."""
    start = msgpack.packb([hello.version, hello.commands[command], 0, 0, b"t" * 16, []])
    start = b"\x97" + start[1:] + b"\x81\xa1j\xdd"  # 7 fields; a body {"j": [...]}
    count = size - len(start) - 4
    return start + count.to_bytes(4, "big") + b"\x90" * count


@pytest.mark.parametrize(
    ("port_offset", "command", "kind"),
    [(0, "HEARTBEAT", zmq.DEALER), (1, "RESULT", zmq.PUSH)],
    ids=["control", "results"],
)
def test_small_headers_of_empty_arrays_from_a_key_are_not_unpacked(
    tmp_path, key_dir, context, port_offset, command, kind
):
    """From a key holding no env, for as long as 200 steps of a local env take: 0.1 s without.

    The remote side peeks a header over 256 bytes and checks its sender (results),
    or its key's byte budget (control: a HEARTBEAT is under 64 bytes), first.
    """
    port = free_port_base(HOST)
    with remote_victim(tmp_path, key_dir, port, remote_envs=0, local=[{"env_id": 0}]) as victim:
        victim.wait("constructed", timeout_s=60)
        frame = empty_arrays_header(victim.hello, command)
        sock = context.socket(kind)
        sock.linger = 0
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = client_keys(key_dir, 1)
        sock.connect(f"tcp://{HOST}:{port + port_offset}")
        rounds, took = steps_under_flood(victim, sock, frame, per_second=None, within_s=120)
        log = victim.log()
    assert answered(rounds) == 200
    reason = {0: "a large control message that is not a registration", 1: "wrong token for env"}
    assert reason[port_offset] in log  # the flood reached the pool, and was turned away so
    assert took < 8, f"200 steps of a local env took {took:.1f} s under the flood"
