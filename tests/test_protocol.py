"""The control messages (:mod:`zmqpool.protocol`): round trips, and refusal of malformed bodies.

No sockets: a body is what ``Header.decode`` hands over, so each message is
checked both as built and after a trip through the header's msgpack.
"""

from __future__ import annotations

import copy
import tracemalloc
from typing import Any

import numpy as np
import pytest
import zmq

from zmqpool.errors import ProtocolError
from zmqpool.protocol import (
    MAX_ERROR_CHARS,
    MAX_TRACEBACK_CHARS,
    MAX_WORKER_ENVS,
    Failed,
    FailureKind,
    Ping,
    Refuse,
    Register,
    Welcome,
    clip_middle,
    recv_frames,
    send_frames,
)
from zmqpool.wire import Command, Header

REGISTER = Register(
    pid=4242,
    host="node-7",
    envs=(0, 1),
    remote=True,
    incarnation=b"\x01" * 8,
    slots=(3, 5),
    specs=({"class": "Composite", "entries": {}}, {"class": "Composite", "entries": {}}),
    batches=True,
    set_state=(True, False),
)
WELCOME = Welcome(
    token=b"t" * 16,
    envs=(3, 5),
    results="tcp://10.0.0.1:5556",
    beats="tcp://10.0.0.1:5557",
    epoch=b"e" * 8,
    heartbeat_interval_s=0.25,
    heartbeat_liveness=7,
    max_frame=1 << 20,
    piece=256 << 10,
)
MESSAGES = [
    (Command.REGISTER, REGISTER),
    (Command.REGISTER, Register(1, "", (0,), False, b"i", None, ({},))),
    (Command.WELCOME, WELCOME),
    (Command.WELCOME, Welcome(b"t", (0,), "ipc:///tmp/r", None, b"e", 1, 1, 64)),
    (Command.REFUSE, Refuse("spec mismatch for env 0: specs/x")),
    (Command.FAILED, Failed("env maker raised", "Traceback ...", FailureKind.MAKER)),
    (Command.FAILED, Failed("too big", "", FailureKind.REGISTER)),
    (Command.ERROR, Failed("env raised: ValueError()", "tb", FailureKind.ENV)),
    (Command.ERROR, Failed("malformed command", "", FailureKind.PROTOCOL)),
    (Command.PING, Ping(b"\x00" * 8)),
]


@pytest.mark.parametrize(("command", "message"), MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_a_trip_through_a_header(command, message):
    assert type(message).from_body(message.to_body()) == message
    encoded = Header(command, 3, body=message.to_body()).encode()
    assert type(message).from_body(Header.decode(encoded).body) == message


def test_the_welcome_carries_the_pools_timings():
    assert WELCOME.pool_timeout_s == pytest.approx(0.25 * 7)
    reg = WELCOME.to_body()["reg"]
    assert reg["heartbeat_interval_s"] == 0.25 and reg["heartbeat_liveness"] == 7
    # A whole number of seconds (msgpack: an int) is a float once parsed.
    body = copy.deepcopy(WELCOME.to_body())
    body["reg"]["heartbeat_interval_s"] = 2
    assert Welcome.from_body(body).heartbeat_interval_s == 2.0


def test_failure_kinds_are_their_wire_strings():
    assert FailureKind.REGISTER == "register" and FailureKind("env") is FailureKind.ENV
    body = Failed("x", "", FailureKind.ENV).to_body()
    assert body == {"err": "x", "tb": "", "kind": "env"} and type(body["kind"]) is str
    for own in ("version", "refused"):  # the pool's own findings, never sent
        with pytest.raises(ProtocolError, match="kind"):
            Failed.from_body({"err": "x", "tb": "", "kind": own})


def _with(message: Any, path: tuple[str, ...], value: Any, delete: bool = False) -> Any:
    body = copy.deepcopy(message.to_body())
    node = body
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


MALFORMED = {
    # wrong types
    "register body not a map": (Register, [1], "REGISTER body"),
    "register reg not a map": (Register, {"reg": None}, "REGISTER reg"),
    "register pid a string": (Register, _with(REGISTER, ("reg", "pid"), "me"), "pid"),
    "register pid a bool": (Register, _with(REGISTER, ("reg", "pid"), True), "pid"),
    "register host bytes": (Register, _with(REGISTER, ("reg", "host"), b"h"), "host"),
    "register envs a string": (Register, _with(REGISTER, ("reg", "envs"), "all"), "envs"),
    "register env a float": (Register, _with(REGISTER, ("reg", "envs"), [0, 1.0]), r"envs\[1\]"),
    "register remote an int": (Register, _with(REGISTER, ("reg", "remote"), 1), "remote"),
    "register incarnation str": (Register, _with(REGISTER, ("reg", "incarnation"), "x"), "incarn"),
    "register slots a map": (Register, _with(REGISTER, ("reg", "slots"), {}), "slots"),
    "register spec not a map": (Register, _with(REGISTER, ("reg", "specs"), [{}, 5]), "specs"),
    "welcome token str": (Welcome, _with(WELCOME, ("reg", "token"), "t"), "token"),
    "welcome results bytes": (Welcome, _with(WELCOME, ("reg", "results"), b"ipc://x"), "results"),
    "welcome beats int": (Welcome, _with(WELCOME, ("reg", "beats"), 5), "beats"),
    "welcome interval str": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_interval_s"), "1"),
        "heartbeat_interval_s",
    ),
    "welcome liveness float": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_liveness"), 2.0),
        "heartbeat_liveness",
    ),
    "refuse err bytes": (Refuse, {"err": b"no"}, "REFUSE err"),
    "failed tb none": (Failed, {"err": "x", "tb": None, "kind": "env"}, "tb"),
    "failed kind int": (Failed, {"err": "x", "tb": "", "kind": 1}, "kind"),
    "failed kind unknown": (Failed, {"err": "x", "tb": "", "kind": "oops"}, "kind"),
    "ping epoch str": (Ping, {"epoch": "e"}, "epoch"),
    "ping body none": (Ping, None, "PING body"),
    # missing and extra keys
    "register no reg": (Register, {}, "missing"),
    "register missing pid": (Register, _with(REGISTER, ("reg", "pid"), None, True), "pid"),
    "register extra key": (Register, _with(REGISTER, ("reg", "x"), 1), "unknown keys"),
    "register body extra key": (Register, {**REGISTER.to_body(), "x": 1}, "unknown keys"),
    "welcome missing liveness": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_liveness"), None, True),
        "heartbeat_liveness",
    ),
    "welcome extra key": (Welcome, _with(WELCOME, ("reg", "token2"), b""), "unknown"),
    "refuse missing err": (Refuse, {}, "err"),
    "refuse extra key": (Refuse, {"err": "x", "tb": ""}, "unknown"),
    "failed missing kind": (Failed, {"err": "x", "tb": ""}, "kind"),
    "failed extra key": (Failed, {"err": "x", "tb": "", "kind": "env", "L": {}}, "unknown"),
    "ping extra key": (Ping, {"epoch": b"e", "seed": 1}, "unknown"),
    # oversized strings and lists
    "register host too long": (Register, _with(REGISTER, ("reg", "host"), "h" * 257), "host"),
    "register envs too many": (
        Register,
        _with(REGISTER, ("reg", "envs"), list(range(MAX_WORKER_ENVS + 1))),
        "envs",
    ),
    "register slots too many": (
        Register,
        _with(REGISTER, ("reg", "slots"), [0] * (MAX_WORKER_ENVS + 1)),
        "slots",
    ),
    "register incarnation long": (
        Register,
        _with(REGISTER, ("reg", "incarnation"), bytes(65)),
        "incarnation",
    ),
    "welcome token too long": (Welcome, _with(WELCOME, ("reg", "token"), bytes(65)), "token"),
    "welcome results too long": (
        Welcome,
        _with(WELCOME, ("reg", "results"), "ipc://" + "x" * 2000),
        "results",
    ),
    "refuse err too long": (Refuse, {"err": "x" * (MAX_ERROR_CHARS + 1)}, "err"),
    "failed tb too long": (
        Failed,
        {"err": "x", "tb": "t" * (MAX_TRACEBACK_CHARS + 1), "kind": "env"},
        "tb",
    ),
    # empty where something is needed
    "register no envs": (Register, _with(REGISTER, ("reg", "envs"), []), "envs"),
    "register no specs": (Register, _with(REGISTER, ("reg", "specs"), []), "specs"),
    "register specs != envs": (Register, _with(REGISTER, ("reg", "specs"), [{}]), "specs for"),
    "register batches not a bool": (Register, _with(REGISTER, ("reg", "batches"), 1), "batches"),
    "register set_state != envs": (
        Register,
        _with(REGISTER, ("reg", "set_state"), [True]),
        "set_state for 1 of 2",
    ),
    "register set_state an int": (
        Register,
        _with(REGISTER, ("reg", "set_state"), [True, 1]),
        "set_state",
    ),
    "register set_state a map": (Register, _with(REGISTER, ("reg", "set_state"), {}), "set_state"),
    "register empty incarnation": (
        Register,
        _with(REGISTER, ("reg", "incarnation"), b""),
        "incarnation",
    ),
    "welcome empty token": (Welcome, _with(WELCOME, ("reg", "token"), b""), "token"),
    "welcome no envs": (Welcome, _with(WELCOME, ("reg", "envs"), []), "envs"),
    "welcome empty results": (Welcome, _with(WELCOME, ("reg", "results"), ""), "results"),
    "ping empty epoch": (Ping, {"epoch": b""}, "epoch"),
    # out-of-range ints and numbers
    "register negative pid": (Register, _with(REGISTER, ("reg", "pid"), -1), "pid"),
    "register huge pid": (Register, _with(REGISTER, ("reg", "pid"), 2**63), "pid"),
    "register negative env": (Register, _with(REGISTER, ("reg", "envs"), [0, -1]), "envs"),
    "register huge slot": (Register, _with(REGISTER, ("reg", "slots"), [2**40, 0]), "slots"),
    "welcome env out of range": (Welcome, _with(WELCOME, ("reg", "envs"), [2**31, 0]), "envs"),
    "welcome interval zero": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_interval_s"), 0.0),
        "heartbeat_interval_s",
    ),
    "welcome interval nan": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_interval_s"), float("nan")),
        "heartbeat_interval_s",
    ),
    "welcome interval a day": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_interval_s"), 86400.0),
        "heartbeat_interval_s",
    ),
    "welcome interval a bool": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_interval_s"), True),
        "heartbeat_interval_s",
    ),
    "welcome liveness zero": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_liveness"), 0),
        "heartbeat_liveness",
    ),
    "welcome liveness huge": (
        Welcome,
        _with(WELCOME, ("reg", "heartbeat_liveness"), 10**7),
        "heartbeat_liveness",
    ),
    "welcome max_frame zero": (Welcome, _with(WELCOME, ("reg", "max_frame"), 0), "max_frame"),
    "welcome max_frame a string": (
        Welcome,
        _with(WELCOME, ("reg", "max_frame"), "1024"),
        "max_frame",
    ),
    "welcome piece tiny": (Welcome, _with(WELCOME, ("reg", "piece"), 1), "piece"),
    "welcome piece negative": (Welcome, _with(WELCOME, ("reg", "piece"), -1), "piece"),
    "welcome piece a bool": (Welcome, _with(WELCOME, ("reg", "piece"), False), "piece"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_body_is_refused_naming_the_field(case):
    cls, body, field = MALFORMED[case]
    with pytest.raises(ProtocolError, match=field):
        cls.from_body(body)


def test_a_list_is_measured_before_its_items_are_looked_at():
    # Items of the wrong type in a list too long: the length is what is refused.
    body = _with(REGISTER, ("reg", "envs"), ["x"] * (10 * MAX_WORKER_ENVS))
    with pytest.raises(ProtocolError, match="items"):
        Register.from_body(body)
    body = _with(REGISTER, ("reg", "specs"), [None] * (10 * MAX_WORKER_ENVS))
    with pytest.raises(ProtocolError, match="items"):
        Register.from_body(body)


def test_a_map_of_many_unknown_keys_is_refused_naming_five_and_building_nothing_per_key():
    # A 256 KiB body holds ~43,000 keys: each repr()'d and sorted, then a set of them,
    # took 5x the time its decode did, for an error that names five.
    body = {"err": "x", "tb": "", **{f"k{i:05}": 0 for i in range(50_000)}}
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="missing keys \\['kind'\\], unknown keys") as info:
            Failed.from_body(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value).count("'k0") == 5, str(info.value)
    assert peak < 64 << 10, f"refusing it allocated {peak} bytes"


def test_a_parsed_message_holds_no_list_of_the_peers():
    body = REGISTER.to_body()
    parsed = Register.from_body(body)
    body["reg"]["envs"].append(9)  # the peer's data, changed after the parse
    assert parsed.envs == (0, 1) and isinstance(parsed.slots, tuple)


def test_failures_and_refusals_are_clipped_to_what_a_pool_accepts():
    failed = Failed.clipped("e" * 10 * MAX_ERROR_CHARS, "t" * 10**6, FailureKind.MAKER)
    assert len(failed.err) <= MAX_ERROR_CHARS and len(failed.tb) <= MAX_TRACEBACK_CHARS
    assert Failed.from_body(failed.to_body()) == failed
    refuse = Refuse.because("r" * 10**5)
    assert Refuse.from_body(refuse.to_body()) == refuse and "characters cut" in refuse.err
    assert clip_middle("short", 10) == "short"


class FakeSocket:
    """Just what the frame helpers call: send/recv of frames that know whether more follow."""

    class Frame:
        def __init__(self, data: bytes, more: bool) -> None:
            self.bytes, self.more = data, more

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, int]] = []
        self.copied: list[bool] = []

    def send(self, data: bytes, flags: int = 0, copy: bool = True) -> None:
        self.sent.append((data, flags))
        self.copied.append(copy)

    def recv(self, flags: int = 0, copy: bool = True) -> FakeSocket.Frame:
        if not self.sent:
            raise zmq.Again()
        data, sent_flags = self.sent.pop(0)
        return FakeSocket.Frame(data, bool(sent_flags & zmq.SNDMORE))


def test_the_frame_helpers_keep_a_message_whole():
    sock = FakeSocket()
    send_frames(sock, [b"header", b"a", b"b"])  # type: ignore[arg-type]
    assert [flags for _, flags in sock.sent] == [zmq.SNDMORE, zmq.SNDMORE, 0]
    send_frames(sock, [b"next"])  # type: ignore[arg-type]
    assert [f.bytes for f in recv_frames(sock)] == [b"header", b"a", b"b"]  # type: ignore[arg-type]
    assert [f.bytes for f in recv_frames(sock)] == [b"next"]  # type: ignore[arg-type]
    with pytest.raises(zmq.Again):
        recv_frames(sock)  # type: ignore[arg-type]


def test_small_frames_are_sent_copied_and_large_ones_without_a_copy():
    """pyzmq copies a frame under its copy threshold anyway: asking for ``copy=False``
    there only costs more. A large frame, and a large leaf's array, go without a copy."""
    sock = FakeSocket()
    small, large = b"h" * 100, b"x" * zmq.COPY_THRESHOLD
    array = np.zeros(zmq.COPY_THRESHOLD, dtype=np.uint8)
    frames = [small, memoryview(small), large, memoryview(large), array, np.zeros(4)]
    send_frames(sock, frames)  # type: ignore[arg-type]
    assert sock.copied == [True, True, False, False, False, False]
    assert [flags for _, flags in sock.sent] == [zmq.SNDMORE] * 5 + [0]
