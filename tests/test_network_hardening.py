"""Attacks on the trainer's network side, measured from outside the pool.

Each test is one finding of the network-hardening review: the pool under
attack runs in its own process (:class:`tests.hostile.Victim`), so its
memory, its log and what its ports answer are measured as an attacker or an
operator would see them, through the public API only (the pool's arguments,
``remote_endpoint``, its log, its RSS, its sockets' behaviour). A pool bound
on ``tcp://127.0.0.1:P`` listens on P (ROUTER), P+1 (results PULL) and P+2
(the beacon's ROUTER, where workers ask for the pool's heartbeats). Keys:
workers 0 and 1 are authorized, worker 2 and any :func:`zmq.curve_keypair`
are not (``key_dir`` in conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

import hostile
import msgpack
import pytest
import zmq
from hostile import Peer, Victim, client_keys, unknown_keys, wait_until

from tests.netns import free_port_base
from zmqpool.limits import MAX_HEADER_BYTES, MIN_REMOTE_PIECE_BYTES
from zmqpool.protocol import Failed, FailureKind, Ping
from zmqpool.remote_failures import MAX_KEYS, RemoteFailures
from zmqpool.wire import Command, Header

HOST = "127.0.0.1"
MB = 1 << 20

#: Timings that keep the victim waiting for registrations for the whole test.
WAITING = {"register_timeout_s": 60.0, "close_timeout_s": 1.0}


def remote_victim(tmp_path, key_dir, port, remote_envs=1, **kwargs) -> Victim:
    victim = Victim(
        tmp_path / "pool.log",
        remote_envs=remote_envs,
        bind=f"tcp://{HOST}:{port}",
        curve_keys=key_dir,
        config=kwargs.pop("config", WAITING),
        **kwargs,
    )
    try:
        victim.wait_listening([port, port + 1, port + 2])
    except BaseException:
        victim.stop()
        raise
    return victim


def outcome(peer: Peer) -> list[str]:
    """The peer's handshake events, once it has any verdict (success, failure, disconnect)."""
    events = peer.events()
    verdicts = {"EVENT_HANDSHAKE_SUCCEEDED", "EVENT_DISCONNECTED"}
    return events if any(e in verdicts or "FAILED" in e for e in events) else []


def verdicts(peers: list[Peer], timeout_s: float) -> list[list[str]]:
    """Each peer's handshake events once all have a verdict, or at the deadline (a pool
    that drops a handshake without a word gives none: that is no success either)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(outcome(p) for p in peers):
        time.sleep(0.02)
    return [p.events() for p in peers]


def register_until_answered(
    victim: Victim, peer: Peer, body, timeout_s: float = 30.0, want=("WELCOME", "REFUSE")
):
    """REGISTER (the same incarnation each time) every second until a reply in ``want``.

    None: no such reply by the deadline, or the pool's construction failed.
    """
    hello = victim.hello
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        peer.send(hello.header("REGISTER", body))
        until = min(deadline, time.monotonic() + 1.0)
        while (remaining := until - time.monotonic()) > 0:
            frame = peer.reply(remaining)
            if frame is None:
                break
            reply = hello.decode(frame)
            if reply["command"] in want:
                return reply
        if victim.seen("construct_failed"):
            return None
    return None


# ---------------------------------------------------------------- 1: memory without a key


def test_floods_without_a_key_do_not_grow_the_pools_memory(tmp_path, key_dir):
    """Finding 1: libzmq reads the CURVE handshake with each socket's frame decoder, before ZAP.

    A raw TCP client greets with CURVE and announces one long command frame;
    whatever the socket's MAXMSGSIZE lets through is held until the handshake
    times out. 300 MiB into the results PULL and into the beacon's ROUTER, 8
    connections of 48 MiB into the results PULL (frames a remote reply may
    hold: under ``max_remote_frame_bytes``, which sized the port before replies
    came in pieces), 40 of 2 MiB there (4x its piece, 512 KiB), and 150
    connections of 1 MiB to the ROUTER: the pool's RSS must grow by less than
    64 MB.
    """
    port = free_port_base(HOST)
    floods: list[hostile.Flood] = []
    with remote_victim(tmp_path, key_dir, port) as victim:
        try:
            before = hostile.settled_rss(victim.pid)
            growth, notes = {}, []
            phases = [
                ("results PULL", port + 1, [(1 << 30, 300 * MB)]),
                ("beacon ROUTER", port + 2, [(1 << 30, 300 * MB)]),
                ("results PULL, 48 MiB frames", port + 1, [(48 * MB, 48 * MB)] * 8),
                ("results PULL, 2 MiB frames", port + 1, [(2 * MB, 2 * MB)] * 40),
                ("ROUTER", port, [(MB, MB)] * 150),
            ]
            for name, target, shots in phases:
                start = hostile.settled_rss(victim.pid)
                deadline = time.monotonic() + 30.0  # for the whole phase
                batch = []
                for announce, stream in shots:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    batch.append(
                        hostile.raw_zmtp_flood(HOST, target, b"CURVE", announce, stream, remaining)
                    )
                floods += batch
                growth[name] = hostile.settled_rss(victim.pid) - start
                streamed = sum(f.sent for f in batch) / MB
                dropped = sum(f.closed_by_peer for f in batch)
                notes.append(
                    f"{name} :{target} +{growth[name] / MB:.0f} MB "
                    f"({len(batch)} connection(s), {streamed:.0f} MiB streamed, "
                    f"{dropped} dropped by the pool)"
                )
            total = hostile.settled_rss(victim.pid) - before
        finally:
            for flood in floods:
                flood.close()
    assert victim.seen("construct_failed") is None
    assert total < 64 * MB, (
        f"the pool's RSS grew {total / MB:.0f} MB ({before / MB:.0f} -> "
        f"{(before + total) / MB:.0f} MB) under floods without a key (bound 64 MB): "
        + "; ".join(notes)
    )


def test_a_welcome_takes_a_headers_frame_whatever_the_remote_frame_limit(
    tmp_path, key_dir, context
):
    """``max_remote_frame_bytes`` under the 1 MiB a reply's header may take: WELCOME still
    takes a header's frame (cut into pieces of 256 KiB), so a reply carrying a large
    non-tensor is not dropped as a malformed batch, its request unanswered."""
    port = free_port_base(HOST)
    config = {**WAITING, "max_remote_frame_bytes": 4096}
    with remote_victim(tmp_path, key_dir, port, config=config) as victim:
        honest = Peer(context, f"tcp://{HOST}:{port}", curve=client_keys(key_dir, 0))
        welcome = register_until_answered(victim, honest, victim.hello.register_body())
        honest.close()
    assert welcome is not None and welcome["command"] == "WELCOME", welcome
    reg = welcome["body"]["reg"]
    assert (reg["max_frame"], reg["piece"]) == (MAX_HEADER_BYTES, MIN_REMOTE_PIECE_BYTES), reg


def _curve_socket(context: zmq.Context, kind: int, key_dir, worker: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.linger, sock.sndhwm = 0, 0  # the flood waits in our queue, not dropped by it
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = client_keys(key_dir, worker)
    return sock


def _asks_answered(peer: Peer, ask: bytes, epoch_of, count: int, timeout_s: float) -> int:
    """Ask for a beat ``count`` times; how many were answered with a PING within ``timeout_s``."""
    answered = 0
    for _ in range(count):
        peer.send(ask)
        frame = peer.reply(timeout_s)
        answered += frame is not None and epoch_of(frame) is not None
    return answered


@pytest.mark.parametrize("attack", ["subscriptions", "messages"])
def test_an_authorized_peer_flooding_the_beats_port_does_not_grow_the_pools_memory(
    tmp_path, key_dir, context, attack
):
    """An authorized key sends the beats port 5,000 messages of 900 random bytes (4.3 MiB).

    ``subscriptions``: an XSUB's, as to a PUB. A PUB kept each in its trie, about
    50 bytes of the pool's memory a byte sent (session 53's audit: 17 MB sent,
    +830 MB, held until the peer left). ``messages``: a DEALER's, to what the
    port is now, the beacon's ROUTER, which reads them and lets go. The pool's
    RSS grows by less than 32 MB, an honest worker asking for beats meanwhile
    gets each within 3 s, and the flooder, asking 500 times in a burst, is
    answered once a heartbeat interval at most.
    """
    port = free_port_base(HOST)
    beats = f"tcp://{HOST}:{port + 2}"
    ask = Header(Command.HEARTBEAT).encode()
    with remote_victim(tmp_path, key_dir, port) as victim:
        before = hostile.settled_rss(victim.pid)
        honest = Peer(context, beats, curve=client_keys(key_dir, 0))
        flood = _curve_socket(
            context, zmq.XSUB if attack == "subscriptions" else zmq.DEALER, key_dir, 1
        )
        flood.connect(beats)
        try:
            first = _asks_answered(honest, ask, _ping_epoch, 1, 10.0)
            honest.sock.send_multipart([ask, b"and a frame more"])  # no ask: never answered
            unasked = honest.reply(1.5)
            prefix = b"\x01" if attack == "subscriptions" else b""
            for _ in range(5000):
                flood.send(prefix + os.urandom(900))
            asked_at = time.monotonic()
            for _ in range(500):
                flood.send(ask)
            honest_beats = _asks_answered(honest, ask, _ping_epoch, 3, 3.0)
            growth = hostile.settled_rss(victim.pid) - before
            pings = _drain(flood, 1.0) if attack == "messages" else 0
            intervals = (time.monotonic() - asked_at) / 1.0  # the victim's heartbeat interval
        finally:
            flood.close(linger=0)
            honest.close()
    assert unasked is None, "a message of an ask and one frame more was answered as an ask"
    assert first == 1 and honest_beats == 3, (
        f"the honest worker's asks answered: {first} of 1 before the flood, "
        f"{honest_beats} of 3 during it"
    )
    assert growth < 32 * MB, (
        f"5,000 {attack} from an authorized key grew the pool's RSS by "
        f"{growth / MB:.0f} MB (bound 32 MB)"
    )
    assert pings <= intervals + 1, f"500 asks answered {pings} times in {intervals:.1f} intervals"


def _ping_epoch(frame: bytes) -> bytes | None:
    header = Header.decode(frame)
    return Ping.from_body(header.body).epoch if header.command == Command.PING else None


def _drain(sock: zmq.Socket, quiet_s: float) -> int:
    """Messages read from ``sock`` until none came for ``quiet_s``."""
    count = 0
    while sock.poll(int(quiet_s * 1000)):
        sock.recv_multipart()
        count += 1
    return count


# ---------------------------------------------------------------- 2: local TCP endpoints


def test_local_tcp_endpoints_do_not_let_a_keyless_process_take_a_remote_slot(
    tmp_path, key_dir, context
):
    """Finding 2: with local_transport="tcp", bind and curve_keys, every port needs CURVE.

    A local process with no key lists the pool's listening sockets (as it could
    from /proc/net/tcp): each must greet with CURVE. It sends a remote worker's
    REGISTER to each: none may welcome it, and the remote slot stays empty
    (construction keeps waiting). Refusing the combination (ValueError) is a fix too.
    """
    port = free_port_base(HOST)
    with Victim(
        tmp_path / "pool.log",
        local=[{"env_id": 0}],
        remote_envs=1,
        bind=f"tcp://{HOST}:{port}",
        curve_keys=key_dir,
        local_transport="tcp",
        config=WAITING,
    ) as victim:

        def bound_or_refused():
            refused = victim.seen("construct_failed")
            if refused is not None:
                return refused
            ours = {p for _, p in hostile.listening_ports(victim.pid)}
            return {port, port + 1, port + 2} <= ours

        refused = wait_until(bound_or_refused, 60, "the pool to bind or refuse the combination")
        if isinstance(refused, dict):  # refusing to combine them is a fix too
            assert refused["type"] == "ValueError", refused
            return
        ports = hostile.listening_ports(victim.pid)
        mechanisms = {(ip, p): hostile.peer_mechanism(ip, p) for ip, p in ports}
        hello = victim.hello
        peers = {(ip, p): Peer(context, f"tcp://{ip}:{p}", identity=b"keyless") for ip, p in ports}
        for peer in peers.values():
            peer.send(hello.header("REGISTER", hello.register_body()))
        answers: dict[tuple[str, int], str] = {}
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:  # every peer gets the whole window to be answered
            for where, peer in peers.items():
                frame = peer.reply(0.02)
                if frame is not None:
                    answers[where] = hello.decode(frame)["command"]
        constructed = victim.seen("constructed")
    open_ports = [f"{ip}:{p} ({m})" for (ip, p), m in mechanisms.items() if m != b"CURVE"]
    answered = [f"{ip}:{p} -> {command}" for (ip, p), command in answers.items()]
    welcomed = [where for where, command in answers.items() if command == "WELCOME"]
    assert not open_ports and not welcomed and constructed is None, (
        f"the pool listens on {len(ports)} TCP ports; without CURVE: {open_ports}; "
        f"a keyless REGISTER was answered on: {answered}; "
        f"the remote slot was {'taken: the pool was constructed' if constructed else 'kept'}"
    )


# ---------------------------------------------------------------- 3: ZAP fails closed


def test_unknown_keys_get_nothing_even_without_a_zap_handler(tmp_path, key_dir, context):
    """Finding 3: ZAP must fail closed (ZAP_ENFORCE_DOMAIN and a zap_domain).

    An unknown key gets no reply and no completed handshake while the pool runs.
    Then the pool's ZAP handler is stopped, as Broker.close() used to stop it
    before closing the sockets: an unknown key must still be turned away on
    every port. And every CURVE socket the pool has enforces a ZAP domain.
    """
    port = free_port_base(HOST)
    endpoints = {"ROUTER": (zmq.DEALER, port), "PULL": (zmq.PUSH, port + 1)}
    endpoints["beacon"] = (zmq.DEALER, port + 2)
    with remote_victim(tmp_path, key_dir, port) as victim:
        hello = victim.hello
        stranger = Peer(context, f"tcp://{HOST}:{port}", curve=unknown_keys(key_dir), monitor=True)
        stranger.send(hello.header("REGISTER", hello.register_body()))
        [before] = verdicts([stranger], 5.0)
        early_reply = stranger.reply(1.0)
        honest = Peer(context, f"tcp://{HOST}:{port}", curve=client_keys(key_dir, 0))
        welcome = register_until_answered(victim, honest, hello.register_body())
        assert welcome is not None and welcome["command"] == "WELCOME", welcome
        victim.wait("constructed", timeout_s=20)
        victim.command("sockets")
        sockets = victim.wait("sockets", timeout_s=10)["sockets"]
        victim.command("zap-stop")
        stopped = victim.wait("zap_stopped", timeout_s=20)["count"]
        late = {
            name: Peer(
                context,
                f"tcp://{HOST}:{target}",
                kind=kind,
                curve=unknown_keys(key_dir),
                monitor=True,
            )
            for name, (kind, target) in endpoints.items()
        }
        late["ROUTER"].send(hello.header("REGISTER", hello.register_body()))
        verdicts(list(late.values()), 5.0)
        let_in = [name for name, p in late.items() if "EVENT_HANDSHAKE_SUCCEEDED" in p.events()]
    unenforced = [
        f"{s['type']} {s['endpoint']} (ZAP_ENFORCE_DOMAIN={int(s['zap_enforce_domain'])}, "
        f"zap_domain={s['zap_domain']!r})"
        for s in sockets
        if s["curve_server"] and not (s["zap_enforce_domain"] and s["zap_domain"])
    ]
    assert "EVENT_HANDSHAKE_SUCCEEDED" not in before and early_reply is None, before
    assert not let_in and not unenforced, (
        f"with the pool's ZAP handler stopped ({stopped} handler(s)), an unknown key completed "
        f"the CURVE handshake on {len(let_in)} of 3 ports {let_in}; CURVE sockets that do not "
        f"enforce ZAP: {unenforced}"
    )


# ---------------------------------------------------------------- 4: log flooding


LOGGED = re.compile(r"^LOG (WARNING|ERROR|CRITICAL) ", re.MULTILINE)


def test_refused_registrations_do_not_flood_the_log(tmp_path, key_dir, context):
    """Finding 4: 2,000 refused REGISTERs must not write 2,000 WARNING lines.

    Refusals the pool itself decides come from an authorized key (ZAP stops
    the others first): malformed bodies, another protocol version, slots
    that do not exist, in turn. 100 unknown keys also try to REGISTER: ZAP
    refuses them, and that must not log per attempt either. Then the same
    authorized peer registers properly; once it is welcomed, everything it
    sent before has been handled (one connection is first in, first out).
    At most 44 lines of WARNING or worse may have been logged in all: four
    counts, each logged at powers of two (1, 2, 4 ... 1,024: 11 lines for
    2,000), the refusals' of each of the three kinds from this key, and, past
    the key's REGISTER rate, the drops'.
    """
    port = free_port_base(HOST)
    with remote_victim(tmp_path, key_dir, port) as victim:
        hello = victim.hello
        flooder = Peer(
            context, f"tcp://{HOST}:{port}", curve=client_keys(key_dir, 0), identity=b"flooder"
        )
        bad = [
            hello.header("REGISTER", {"reg": {}}),
            hello.header("REGISTER", hello.register_body(), version=99),
            hello.header("REGISTER", hello.register_body(slots=[7])),
        ]
        refusals = 0
        for i in range(2000):
            flooder.send(bad[i % len(bad)])
            refusals += len(flooder.replies())
        strangers = []
        for _ in range(100):
            stranger = Peer(
                context, f"tcp://{HOST}:{port}", curve=unknown_keys(key_dir), monitor=True
            )
            # At once: its pipe exists from connect() until its handshake is refused. Sent
            # later, under load, a send could find no pipe (between reconnects) and block.
            stranger.send(hello.header("REGISTER", hello.register_body()))
            strangers.append(stranger)
        verdicts(strangers, 10.0)
        for stranger in strangers:
            stranger.close()
        # The flood's refusals may still be coming in: wait for the WELCOME itself.
        sentinel = hello.register_body()
        welcome = register_until_answered(victim, flooder, sentinel, 60, want=("WELCOME",))
        failed = victim.seen("construct_failed")
        assert failed is None and welcome is not None, f"no WELCOME after the flood: {failed}"
        victim.wait("constructed", timeout_s=20)
        lines = LOGGED.findall(victim.log())
        sample = [line for line in victim.log().splitlines() if LOGGED.match(line)][:2]
    assert len(lines) <= 44, (
        f"2,000 refused REGISTERs and 100 unknown keys wrote {len(lines)} lines of WARNING "
        f"or worse to the pool's log (bound 44); e.g. {sample}"
    )


# ---------------------------------------------------------------- 12: CURVE on local endpoints


def test_a_large_local_env_delivers_results_in_a_pool_that_also_binds_tcp(tmp_path, key_dir):
    """Finding 12: local results endpoints bound after the TCP ones must not inherit CURVE.

    An env whose results need frames over 512 KiB gets its own local results
    endpoint; in a pool that also binds TCP with CURVE (no remote envs), a
    step must still come back.
    """
    port = free_port_base(HOST)
    obs = 200_000  # float32: 800 kB a frame, over the default local limit's half
    with remote_victim(
        tmp_path,
        key_dir,
        port,
        remote_envs=0,
        local=[{"env_id": 0, "obs_shape": [obs]}],
        step_timeout_s=8.0,
    ) as victim:
        victim.wait("constructed", timeout_s=60)
        victim.command("step")
        result = victim.wait("stepped", "step_failed", timeout_s=60)
    assert result["event"] == "stepped", (
        f"a local env of {obs * 4 / 1000:.0f} kB observations, in a pool also bound on "
        f"TCP with CURVE, delivered no step result within 8 s: {result['type']}: "
        f"{result['error']}"
    )
    assert result["shape"] == [1, obs] and result["head"][0][:2] == [0.0, 1.0], result


# ---------------------------------------------------------------- 11: construction survives peers


@pytest.mark.parametrize("attack", ["poisoned spec", "FAILED from a registered peer"])
def test_construction_survives_a_hostile_remote_peer(tmp_path, key_dir, context, attack):
    """Finding 11: no spec and no FAILED message from a remote peer may crash construction.

    ``poisoned spec``: a REGISTER whose observation has shape [0, 2**31, 4]
    (valid as a spec, too large as a layout). ``FAILED from a registered
    peer``: a peer takes a remote slot, then reports that its env maker failed.
    Either way the pool refuses or ignores it, stays up (it still answers a
    malformed REGISTER), and is constructed once honest workers register.
    """
    port = free_port_base(HOST)
    with remote_victim(tmp_path, key_dir, port, remote_envs=2) as victim:
        hello = victim.hello
        hostile_peer = Peer(
            context, f"tcp://{HOST}:{port}", curve=client_keys(key_dir, 1), identity=b"hostile"
        )
        if attack == "poisoned spec":
            poison = hostile.with_observation_shape(hello.spec, [0, 2**31, 4])
            poisoned = hello.register_body([poison])
            answer = register_until_answered(victim, hostile_peer, poisoned, timeout_s=10)
            assert answer is None or answer["command"] != "WELCOME", (
                f"the pool welcomed a spec of shape [0, 2**31, 4]: {answer}"
            )
        else:
            answer = register_until_answered(victim, hostile_peer, hello.register_body())
            assert answer is not None and answer["command"] == "WELCOME", answer
            env = answer["body"]["reg"]["envs"][0]
            failed = {"err": "env maker failed (hostile)", "tb": "", "kind": "maker"}
            hostile_peer.send(hello.header("FAILED", failed, env=env))
        # A malformed REGISTER from the same peer, answered after the attack was read
        # (one connection is first in, first out): the honest ones come after both.
        probe = register_until_answered(victim, hostile_peer, {"reg": {}}, timeout_s=10)
        honest = [
            Peer(context, f"tcp://{HOST}:{port}", curve=client_keys(key_dir, 0), identity=name)
            for name in (b"honest-a", b"honest-b")
        ]
        for peer in honest:  # one or two of them are needed, whether the slot was freed or not
            peer.send(hello.header("REGISTER", hello.register_body()))
        result = victim.wait("constructed", "construct_failed", timeout_s=30)
    assert result["event"] == "constructed", (
        f"{attack}: the pool's construction raised {result['type']}: {result['error']}"
        f"{'' if probe else ' (it never answered the REGISTER sent after the attack)'}"
    )


def test_remote_start_failures_are_bounded_and_name_the_latest():
    """A key flooding FAILEDs, or many keys failing, cost a bounded note: the latest are named."""
    failures = RemoteFailures()
    for i in range(10 * MAX_KEYS):
        failed = Failed.clipped(f"error {i}", "", FailureKind.MAKER)
        failures.note(f"key-{i % (2 * MAX_KEYS)}", failed)
    assert len(failures) == MAX_KEYS
    latest = [f"error {i}" for i in range(10 * MAX_KEYS - 1, 10 * MAX_KEYS - 4, -1)]
    assert re.findall(r"error \d+", failures.summary()) == latest


# ---------------------------------------------------------------- heavy headers


@pytest.mark.parametrize("command", ["HEARTBEAT", "REGISTER"])
def test_headers_of_a_million_objects_do_not_stall_a_pool(tmp_path, key_dir, context, command):
    """A header is up to one Python object per byte: 256 KiB of empty msgpack arrays.

    An authorized peer that never registers sends 40 such control messages a
    second while the pool steps its local env 200 times. Unpacked as they came,
    each cost the pool ~250 ms of full garbage collections: not one round was
    done in 30 s. A large HEARTBEAT is now dropped before it is unpacked; a
    large REGISTER is unpacked with the collector paused, and a key gets
    ``LARGE_CONTROL_BYTES_PER_S`` of them.
    """
    port = free_port_base(HOST)
    with remote_victim(tmp_path, key_dir, port, remote_envs=0, local=[{"env_id": 0}]) as victim:
        victim.wait("constructed", timeout_s=60)
        hello = victim.hello
        count = (MB // 4) - 200
        fields = [hello.version, hello.commands[command], -1, 0, b"", [], {"j": []}]
        # The body's empty list, swapped for an array32 of `count` empty arrays.
        junk = msgpack.packb(fields, use_bin_type=True)[:-1]
        junk += b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count
        flooder = Peer(
            context, f"tcp://{HOST}:{port}", curve=client_keys(key_dir, 0), identity=b"heavy"
        )
        stop = threading.Event()

        def flood() -> None:
            while not stop.wait(1 / 40):
                with contextlib.suppress(zmq.Again):
                    flooder.sock.send(junk, zmq.NOBLOCK)

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        try:
            started = time.monotonic()
            victim.command('step-envs {"envs": [0], "timeout": 30, "rounds": 200}')
            rounds = victim.wait("stepped_envs", timeout_s=60)["rounds"]
            took = time.monotonic() - started
        finally:
            stop.set()
            thread.join(5)
    done = sum(1 for r in rounds if "0" in r["results"])
    assert (done, len(rounds)) == (200, 200), rounds[:1]
    assert took < 20, f"200 rounds of a local env took {took:.1f} s under the flood"
