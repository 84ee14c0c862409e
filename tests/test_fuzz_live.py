"""Hostile peers on a real pool's sockets while the trainer steps.

A test peer (plain zmq sockets) connects to the pool's results PULL and its
ROUTER and sends thousands of bad messages (junk, truncated and mistyped
headers, other protocol versions, unknown commands, wrong frame counts,
layouts claiming 10 GB, env indices out of range, stale and future sequence
numbers, results forged with a wrong or empty token for requests in flight,
REGISTER garbage, batches that are malformed, forged, nested or carry
another worker's results, joined rows that are malformed, forged or list
another worker's env), interleaved with the trainer's real async steps (random
subsets, ``min_get=1``). The pool must not crash, must hand the trainer only
results from the registered workers (each result names its env, its step
count and the action it was sent: a forged one shows), must count every drop,
and must answer every real step exactly once.

Then the worker side: a malformed command handed to ``Worker.handle`` is
refused (dropped, or answered with an error) and the env lives on.

The last tests pin down fixes made after a first fuzzing round: drops are
logged (throttled), control messages from unknown identities are counted,
and a peer cannot take over a live worker's envs.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import time
from typing import Any

import msgpack
import pytest
import torch
import zmq
from tensordict import TensorDict

from tests.conftest import FAST
from tests.exactly_once import ExactlyOnce
from workers.hosting import EnvHost
from workers.loop import Worker
from zmqpool import ZMQAsyncEnvPool
from zmqpool.codec import Decoder, Encoder
from zmqpool.protocol import Failed, FailureKind, Refuse, Register, Welcome
from zmqpool.specs import spec_to_data
from zmqpool.testing import CountingEnv
from zmqpool.wire import (
    PROTOCOL_VERSION,
    Command,
    Header,
    Row,
    batch_messages,
    encode_message,
    pack_rows,
    split_batch,
)

NUM_ENVS = 4
STEPS = 600  # real env steps
HOSTILE = 8000  # hostile messages, spread over the steps
FORGED_ID = 1000  # a forged observation says it comes from env 1000 + env


@pytest.fixture(scope="module")
def pool():
    p = ZMQAsyncEnvPool(
        CountingEnv,
        # A little latency, so forged replies often arrive while the real one is awaited.
        create_env_kwargs=[{"env_id": i, "step_sleep_s": (0.0, 0.002)} for i in range(NUM_ENVS)],
        envs_per_worker=2,
        config=FAST,
    )
    yield p
    p.close()


# ---------------------------------------------------------------- the hostile peer


def forged_next(env: int) -> TensorDict:
    """What a real step of ``env`` returns, with numbers no real step produces."""
    flag = torch.zeros(1, dtype=torch.bool)
    observation = torch.tensor([FORGED_ID + env, 10**6, 0.0, 0.0])
    return TensorDict(
        {
            "observation": observation,
            "reward": torch.ones(1),
            "done": flag,
            "terminated": flag,
            "truncated": flag,
        },
        batch_size=[],
    )


class HostilePeer:
    """Plain sockets on the pool's endpoints, and a generator of bad messages for each."""

    def __init__(self, pool: ZMQAsyncEnvPool, seed: int = 0) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.context = zmq.Context()
        self.push = self._socket(zmq.PUSH, pool.runtime.broker.local.results_ep)
        # Frames of megabytes on their own connection: a MAXMSGSIZE on the pool's side
        # drops the connection (and what is queued on it) instead of the message.
        self.big_push = self._socket(zmq.PUSH, pool.runtime.broker.local.results_ep)
        self.dealers = [
            # Fresh identities: a ROUTER refuses one still held by a closing connection.
            self._socket(
                zmq.DEALER,
                pool.runtime.broker.local.router_ep,
                b"evil%d-" % i + os.urandom(4).hex().encode(),
            )
            for i in range(3)
        ]
        self.sent: collections.Counter[str] = collections.Counter()
        self.replies: collections.Counter[str] = collections.Counter()

    def _socket(self, kind: int, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.linger = 0
        sock.sndhwm = 0  # never block and never drop: everything sent reaches the pool
        if identity is not None:
            sock.identity = identity
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        self.context.destroy(linger=0)

    # -------------------------------------------------------- sending

    def send_some(self, count: int) -> None:
        for _ in range(count):
            if self.rng.random() < 0.005:  # megabytes: now and then
                name = self.rng.choice(sorted(self.BIG))
            else:
                name = self.rng.choice([*sorted(set(self.RESULTS) - self.BIG), *self.CONTROL])
            if name in self.RESULTS:
                frames = self.RESULTS[name](self)
                big = max(len(f) for f in frames) > 1 << 16
                (self.big_push if big else self.push).send_multipart(frames, copy=True)
            else:
                frames = self.CONTROL[name](self)
                self.rng.choice(self.dealers).send_multipart(frames, copy=True)
            self.sent[name] += 1

    def read_replies(self) -> None:
        for dealer in self.dealers:
            while dealer.poll(0):
                header = Header.decode(dealer.recv_multipart()[0])
                self.replies[header.command.name] += 1

    # -------------------------------------------------------- helpers

    def _env(self) -> int:
        return self.rng.randrange(NUM_ENVS)

    def _awaited_seq(self, env: int) -> int:
        """The seq the pool awaits for ``env`` (or will give its next request)."""
        slot = self.pool.runtime.ledger.slots[env]
        return slot.in_flight[0].seq if slot.in_flight else slot.next_seq

    def _stale_seq(self, env: int) -> int:
        """A seq the pool is sure not to await: one already answered (or none ever issued)."""
        return max(0, self._awaited_seq(env) - 1 - self.rng.randrange(3))

    def _token(self, env: int) -> bytes:
        link = self.pool.runtime.roster.envs[env].link
        return link.token if link is not None else b""

    def _forged(self, header: Header, env: int) -> list[Any]:
        # A fresh encoder announces the layout in full, as a new connection would.
        return encode_message(header, [Encoder().encode(forged_next(env))])

    def _valid_header(self) -> bytes:
        env = self._env()
        return Header(Command.RESULT, env, self._awaited_seq(env), os.urandom(16)).encode()

    # -------------------------------------------------------- on the results socket

    def junk_bytes(self) -> list[Any]:
        return [self.rng.randbytes(self.rng.randrange(0, 64))]

    def truncated_header(self) -> list[Any]:
        header = self._valid_header()
        return [header[: self.rng.randrange(len(header))]]

    def mistyped_header(self) -> list[Any]:
        fields = [PROTOCOL_VERSION, int(Command.RESULT), 0, 1, b"", [], None]
        fields[self.rng.randrange(7)] = self.rng.choice(["0", -5, 2.5, [1], {"a": 1}, None, b"x"])
        return [msgpack.packb(fields, use_bin_type=True)]

    def other_version(self) -> list[Any]:
        env = self._env()
        version = self.rng.choice([0, PROTOCOL_VERSION + 1, 2**40])
        header = Header(
            Command.RESULT, env, self._awaited_seq(env), self._token(env), version=version
        )
        return self._forged(header, env)

    def unknown_command(self) -> list[Any]:
        command = self.rng.choice([0, 11, 99, 2**31])
        return [msgpack.packb([PROTOCOL_VERSION, command, 0, 1, b"", [], None])]

    def command_on_results_socket(self) -> list[Any]:
        command = self.rng.choice(
            [Command.STEP, Command.REGISTER, Command.HEARTBEAT, Command.CLOSE]
        )
        return [Header(command, self._env(), 1).encode()]

    def forged_wrong_token(self) -> list[Any]:
        env = self._env()
        # Empty, random, or the token of the other worker (envs 0, 1 | 2, 3), which does
        # not host this env.
        token = self.rng.choice([b"", os.urandom(16), self._token((env + 2) % NUM_ENVS)])
        return self._forged(Header(Command.RESULT, env, self._awaited_seq(env), token), env)

    def forged_error(self) -> list[Any]:
        env = self._env()
        body = Failed("forged error", "", FailureKind.ENV).to_body()
        token = self.rng.choice([b"", os.urandom(16)])
        return [Header(Command.ERROR, env, self._awaited_seq(env), token, body=body).encode()]

    def env_out_of_range(self) -> list[Any]:
        env = self.rng.choice([-1, NUM_ENVS, NUM_ENVS + 7, 2**40, -(2**63)])
        return self._forged(Header(Command.RESULT, env, 1, self._token(0)), 0)

    def stale_seq_real_token(self) -> list[Any]:
        env = self._env()
        return self._forged(
            Header(Command.RESULT, env, self._stale_seq(env), self._token(env)), env
        )

    def future_seq_real_token(self) -> list[Any]:
        env = self._env()
        seq = self._awaited_seq(env) + self.rng.choice([10**6, 2**62])
        return self._forged(Header(Command.RESULT, env, seq, self._token(env)), env)

    def wrong_frame_count(self) -> list[Any]:
        env = self._env()
        frames = self._forged(Header(Command.RESULT, env, self._awaited_seq(env), b"x"), env)
        return frames[:1] if self.rng.random() < 0.5 else [*frames, b"extra", b""]

    def huge_layout(self) -> list[Any]:
        env = self._env()
        layout = {"b": [], "t": [[["observation"], "float32", [10**10], True]], "n": []}
        body = {"L": {0: layout}}
        header = Header(Command.RESULT, env, self._awaited_seq(env), b"", (0,), body)
        return [header.encode(), b"\0" * 64]

    def big_junk_frame(self) -> list[Any]:
        return [self._valid_header(), bytes(2 << 20)]

    def big_junk_header(self) -> list[Any]:
        return [bytes(64 << 20 if self.rng.random() < 0.05 else 2 << 20)]

    def _batch(self, env: int, token: bytes, messages: list[list[Any]], sizes=None) -> list[Any]:
        flat = [bytes(memoryview(f).cast("B")) for m in messages for f in m]
        body = {"n": [len(m) for m in messages], "len": sizes or [len(f) for f in flat]}
        return [Header(Command.BATCH, env, 0, token, body=body).encode(), b"".join(flat)]

    def malformed_batch(self) -> list[Any]:
        env = self._env()
        inner = self._forged(Header(Command.RESULT, env, self._awaited_seq(env), b"x"), env)
        sizes = [len(memoryview(f).cast("B")) for f in inner]
        sizes[-1] += self.rng.choice([-1, 1, 1000])  # the sizes do not add up to the frame
        return self._batch(env, self._token(env), [inner], sizes)

    def batch_wrong_token(self) -> list[Any]:
        env = self._env()
        inner = self._forged(Header(Command.RESULT, env, self._awaited_seq(env), b""), env)
        return self._batch(env, self.rng.choice([b"", os.urandom(16)]), [inner])

    def batch_for_another_worker(self) -> list[Any]:
        # A worker's batch (its token, its env) carrying a result for the other worker's
        # env, with that env's real token and awaited seq: only the batch's link stops it.
        env = self._env()
        other = (env + 2) % NUM_ENVS  # hosted by the other worker (envs 0, 1 | 2, 3)
        inner = self._forged(
            Header(Command.RESULT, other, self._awaited_seq(other), self._token(other)), other
        )
        return self._batch(env, self._token(env), [inner])

    def batch_inside_batch(self) -> list[Any]:
        env = self._env()
        nested = self._batch(env, self._token(env), [[Header(Command.HEARTBEAT).encode()]])
        return self._batch(env, self._token(env), [nested])

    def _results(self, envs: list[int], token: bytes) -> list[Any]:
        """A RESULTS message of ``envs``' awaited seqs, each row a forged step."""
        encoder = Encoder()
        rows = [
            Row(Command.RESULT, e, self._awaited_seq(e), [encoder.encode(forged_next(e))])
            for e in envs
        ]
        return pack_rows(rows, token)

    def results_for_another_worker(self) -> list[Any]:
        # A worker's RESULTS (its token, its env first) with a row for the other worker's
        # env at that env's awaited seq: only the check of every env's link stops it.
        env = self._env()
        return self._results([env, (env + 2) % NUM_ENVS], self._token(env))

    def results_wrong_token(self) -> list[Any]:
        env = self._env()
        return self._results([env, env ^ 1], self.rng.choice([b"", os.urandom(16)]))

    def malformed_results(self) -> list[Any]:
        env = self._env()
        frames = self._results([env, env ^ 1], self._token(env))
        fields = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        body = fields[6]
        broken = self.rng.choice(["one row", "lengths", "twice", "not first", "extra", "seq"])
        if broken == "one row":
            body = {"envs": body["envs"][:1], "seqs": body["seqs"][:1]}
        elif broken == "lengths":
            body["seqs"] = body["seqs"][:1]
        elif broken == "twice":
            body["envs"] = [env, env]
        elif broken == "not first":
            body["envs"] = body["envs"][::-1]
        elif broken == "extra":
            body["L"] = {}
        else:
            body["seqs"] = [body["seqs"][0], -1]
        fields[6] = body
        return [msgpack.packb(fields, use_bin_type=True), *frames[1:]]

    RESULTS = {
        "results_for_another_worker": results_for_another_worker,
        "results_wrong_token": results_wrong_token,
        "malformed_results": malformed_results,
        "junk_bytes": junk_bytes,
        "truncated_header": truncated_header,
        "mistyped_header": mistyped_header,
        "other_version": other_version,
        "unknown_command": unknown_command,
        "command_on_results_socket": command_on_results_socket,
        "forged_wrong_token": forged_wrong_token,
        "forged_error": forged_error,
        "env_out_of_range": env_out_of_range,
        "stale_seq_real_token": stale_seq_real_token,
        "future_seq_real_token": future_seq_real_token,
        "wrong_frame_count": wrong_frame_count,
        "huge_layout": huge_layout,
        "big_junk_frame": big_junk_frame,
        "big_junk_header": big_junk_header,
        "malformed_batch": malformed_batch,
        "batch_wrong_token": batch_wrong_token,
        "batch_for_another_worker": batch_for_another_worker,
        "batch_inside_batch": batch_inside_batch,
    }

    # -------------------------------------------------------- on the ROUTER

    def ctl_junk(self) -> list[Any]:
        return self.junk_bytes()

    def ctl_unknown_command(self) -> list[Any]:
        return self.unknown_command()

    def ctl_worker_command(self) -> list[Any]:
        command = self.rng.choice([Command.STEP, Command.RESULT, Command.WELCOME, Command.PING])
        return [Header(command, self._env(), 1).encode()]

    def ctl_other_version(self) -> list[Any]:
        return [Header(Command.REGISTER, body={"reg": {}}, version=PROTOCOL_VERSION + 1).encode()]

    def ctl_register_garbage(self) -> list[Any]:
        reg = self.rng.choice(
            [
                None,
                5,
                {},
                {"envs": [0, 1]},
                {"envs": "all", "specs": [1], "pid": "me"},
                {"envs": [0, 1], "specs": [{"class": "Nope"}] * 2, "pid": 1},
                {"envs": list(range(10**4)), "specs": [None]},
            ]
        )
        body = self.rng.choice([None, {"reg": reg}, {"x": reg}])
        return [Header(Command.REGISTER, body=body).encode(), *([b"junk"] * self.rng.randrange(2))]

    CONTROL = {
        "ctl_junk": ctl_junk,
        "ctl_unknown_command": ctl_unknown_command,
        "ctl_worker_command": ctl_worker_command,
        "ctl_other_version": ctl_other_version,
        "ctl_register_garbage": ctl_register_garbage,
    }

    #: what the pool counts as dropped (at most, for frames a MAXMSGSIZE may stop before
    #: the pool sees them), and what it answers with a REFUSE
    BIG = {"big_junk_frame", "big_junk_header"}
    COUNTED = (set(RESULTS) - BIG) | {
        "ctl_junk",
        "ctl_unknown_command",
        "ctl_worker_command",
    }
    REFUSED = {"ctl_other_version", "ctl_register_garbage"}


@pytest.fixture
def peer(pool):
    p = HostilePeer(pool)
    yield p
    p.close()


def wait_for(condition, pump, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        pump()
    return True


# ---------------------------------------------------------------- the live fuzz


def test_hostile_traffic_never_crashes_forges_or_loses_a_step(pool, peer):
    dropped_before = sum(pool.runtime.ledger.dropped.values())
    refused_before = pool.runtime.ledger.refused
    # Hostile messages interleaved with the real steps, a few at a time.
    driver = ExactlyOnce(pool, NUM_ENVS, STEPS, random.Random(1))
    driver.run(between=lambda: peer.send_some(min(15, HOSTILE - sum(peer.sent.values()))))
    peer.send_some(HOSTILE - sum(peer.sent.values()))  # the rest, if the steps were quick

    # Every bad message reached the pool and was counted (or refused), none was delivered.
    counted = sum(n for name, n in peer.sent.items() if name in HostilePeer.COUNTED)
    big = sum(n for name, n in peer.sent.items() if name in HostilePeer.BIG)
    refused = sum(n for name, n in peer.sent.items() if name in HostilePeer.REFUSED)

    def pump():
        pool.runtime.pump(0.05)
        peer.read_replies()

    def all_seen() -> bool:
        drops = sum(pool.runtime.ledger.dropped.values()) - dropped_before
        return drops >= counted and peer.replies["REFUSE"] >= refused

    assert wait_for(all_seen, pump), (pool.runtime.ledger.dropped, peer.replies, peer.sent)
    wait_for(lambda: False, pump, timeout_s=0.3)  # let the megabyte frames settle
    drops = sum(pool.runtime.ledger.dropped.values()) - dropped_before
    assert counted <= drops <= counted + big, pool.runtime.ledger.dropped
    assert peer.replies["WELCOME"] == 0 and set(peer.replies) <= {"REFUSE"}
    assert pool.runtime.ledger.refused - refused_before == refused  # counted, not dropped
    assert sum(peer.sent.values()) >= HOSTILE
    # Counted by fixed reasons: sizes and ids a peer chose (malformed_batch's) would
    # make every message a reason of its own, an entry and a first-time log line.
    numbered = [reason for reason in pool.runtime.ledger.dropped if any(map(str.isdigit, reason))]
    assert not numbered, numbered
    print(f"\nhostile messages: {dict(peer.sent)}\ndropped: {pool.runtime.ledger.dropped}")

    # The pool is whole: a synchronous step of every env is each env's next step.
    td = pool.step(TensorDict({"action": torch.zeros(NUM_ENVS, 1)}, [NUM_ENVS]))
    assert td["next", "observation"][:, 1].tolist() == [c + 1 for c in driver.count]
    assert td["next", "observation"][:, 0].tolist() == list(range(NUM_ENVS))


def test_a_peer_speaking_another_version_is_told_why(pool, peer):
    dealer = peer.dealers[0]
    dealer.send(Header(Command.REGISTER, body={"reg": {}}, version=PROTOCOL_VERSION + 1).encode())
    assert wait_for(lambda: dealer.poll(0), lambda: pool.runtime.pump(0.05))
    header = Header.decode(dealer.recv())
    assert header.command == Command.REFUSE
    assert f"version {PROTOCOL_VERSION + 1}" in Refuse.from_body(header.body).err


def test_drops_are_logged(pool, peer, caplog):
    caplog.set_level(logging.DEBUG, logger="zmqpool")
    peer.push.send(b"\xc1 not a header")
    before = sum(pool.runtime.ledger.dropped.values())
    assert wait_for(
        lambda: sum(pool.runtime.ledger.dropped.values()) > before,
        lambda: pool.runtime.pump(0.05),
    )
    assert any("drop" in record.getMessage() for record in caplog.records)


def test_control_messages_from_unknown_identities_are_counted(pool, peer):
    before = sum(pool.runtime.ledger.dropped.values())
    dealer = peer.dealers[1]
    dealer.send(Header(Command.HEARTBEAT).encode())
    forged = Failed("forged", "", FailureKind.MAKER)
    dealer.send(Header(Command.FAILED, 0, body=forged.to_body()).encode())
    assert wait_for(
        lambda: sum(pool.runtime.ledger.dropped.values()) >= before + 2,
        lambda: pool.runtime.pump(0.05),
        timeout_s=1.0,
    )


# ---------------------------------------------------------------- ZMQ's own limit


def test_maxmsgsize_is_per_frame_and_read_when_the_socket_binds(tmp_path):
    """What ``max_message_bytes`` feeds: a frame over MAXMSGSIZE disconnects its sender
    before anything is allocated, but only on endpoints bound after the option was set."""
    context = zmq.Context()
    try:
        pull = context.socket(zmq.PULL)
        pull.linger = 0
        before, after = f"ipc://{tmp_path}/before", f"ipc://{tmp_path}/after"
        pull.setsockopt(zmq.MAXMSGSIZE, 1000)
        pull.bind(before)  # takes the limit
        pull.setsockopt(zmq.MAXMSGSIZE, -1)
        pull.bind(after)  # does not: options are copied at bind time

        def deliver(endpoint: str, frames: list[bytes]) -> list[list[int]]:
            push = context.socket(zmq.PUSH)
            push.linger = 0
            push.connect(endpoint)
            push.send_multipart(frames)
            got = []
            while pull.poll(300):
                got.append([len(f) for f in pull.recv_multipart()])
            push.close()
            return got

        assert deliver(before, [bytes(1001)]) == []  # refused
        assert deliver(before, [bytes(1000)] * 3) == [[1000] * 3]  # per frame, not per message
        assert deliver(after, [bytes(5000)]) == [[5000]]
    finally:
        context.destroy(linger=0)


# ---------------------------------------------------------------- the worker side


class FakePush:
    """Stands in for the worker's PUSH socket: keeps what would be sent."""

    def __init__(self) -> None:
        self.sent: list[list[Any]] = []
        self._parts: list[bytes] = []

    def send_multipart(self, frames, copy=True) -> None:
        self.sent.append([bytes(memoryview(f).cast("B")) for f in frames])

    def send(self, frame, flags=0, copy=True) -> None:
        self._parts.append(bytes(memoryview(frame).cast("B")))
        if not flags & zmq.SNDMORE:  # the last frame of a message
            self.sent.append(self._parts)
            self._parts = []

    def close(self, linger=None) -> None:
        """The worker closes its PUSH itself (it no longer ``destroy()``s its context)."""


@pytest.fixture
def worker(tmp_path):
    env = CountingEnv(env_id=7)
    w = Worker(router=f"ipc://{tmp_path}/nobody", identity=b"w0", host=EnvHost({0: env}))
    w.push = FakePush()
    w.token = b"t" * 16
    w.pool_side_decoder = Decoder()  # the pool's decoder of this worker's replies
    yield w
    w.close()


def command(header: Header, td: TensorDict | None, encoder: Encoder) -> list[bytes]:
    parts = [] if td is None else [encoder.encode(td)]
    return [bytes(memoryview(f).cast("B")) for f in encode_message(header, parts)]


def reply_of(worker: Worker) -> tuple[Header, TensorDict | None]:
    frames = worker.push.sent.pop()
    header = Header.decode(frames[0])
    if header.command == Command.ERROR:
        return header, None
    return header, worker.pool_side_decoder.decode(header, frames[1:])[0].to_tensordict()


def step(worker: Worker, encoder: Encoder, seq: int, action: float = 0.25) -> TensorDict:
    td = TensorDict({"action": torch.tensor([action])}, [])
    assert worker.handle(command(Header(Command.STEP, 0, seq), td, encoder))
    header, out = reply_of(worker)
    assert header.command == Command.RESULT and header.seq == seq and header.token == worker.token
    assert out is not None
    return out


def test_malformed_commands_are_refused_and_the_env_lives_on(worker):
    encoder = Encoder()
    env = worker.host.envs[0]
    assert step(worker, encoder, 1)["observation"][:2].tolist() == [7.0, 1.0]
    action = TensorDict({"action": torch.tensor([0.5])}, [])
    huge = {"b": [], "t": [[["action"], "float32", [10**10], True]], "n": []}
    dropped = [  # not even a header: nothing to answer
        [b""],
        [b"\xc1"],
        [Header(Command.STEP, 0, 2).encode()[:-3]],
        [Header(Command.STEP, 0, 2, version=PROTOCOL_VERSION + 1).encode()],
        [msgpack.packb([PROTOCOL_VERSION, 99, 0, 2, b"", [], None])],
    ]
    answered = {  # a header: answered with an error for that seq
        "not hosted": command(Header(Command.STEP, 5, 2), action, encoder),
        "not an env command": command(Header(Command.RESULT, 0, 2), action, encoder),
        "registration command": command(Header(Command.REGISTER, 0, 2), None, encoder),
        "too many frames": [*command(Header(Command.STEP, 0, 2), action, encoder), b"x"],
        "too few frames": command(Header(Command.STEP, 0, 2), action, encoder)[:1],
        "unknown layout": [Header(Command.STEP, 0, 2, layouts=(77,)).encode()],
        "10 GB layout": [Header(Command.STEP, 0, 2, layouts=(9,), body={"L": {9: huge}}).encode()],
        "no input": command(Header(Command.STEP, 0, 2), None, encoder),
        "bad seed": command(Header(Command.SEED, 0, 2, body={"seed": "x"}), None, encoder),
        "garbage body": command(Header(Command.STEP, 0, 2, body={"L": 5}), action, encoder),
    }
    for frames in dropped:
        assert worker.handle(frames)
    assert worker.dropped == len(dropped) and not worker.push.sent
    for what, frames in answered.items():
        assert worker.handle(frames), what
        header, _ = reply_of(worker)
        assert header.command == Command.ERROR and header.seq == 2, what
        failed = Failed.from_body(header.body)
        assert header.token == worker.token and failed.err, what
        # PROTOCOL, not ENV: with on_env_error="restart" an ENV error restarts the worker.
        assert failed.kind is FailureKind.PROTOCOL, what
    assert worker.handle([Header(Command.PING).encode()]) and not worker.push.sent
    # The same env, its state intact: none of the bad commands reached it.
    assert worker.host.envs[0] is env
    assert step(worker, encoder, 3)["observation"][:2].tolist() == [7.0, 2.0]
    # A well-formed step the env cannot take is the env's error, and the env lives on too.
    assert worker.handle(command(Header(Command.STEP, 0, 4), TensorDict({}, []), encoder))
    header, _ = reply_of(worker)
    assert header.command == Command.ERROR and "env raised" in Failed.from_body(header.body).err
    assert worker.host.envs[0] is env
    assert step(worker, encoder, 5)["observation"][:2].tolist() == [7.0, 4.0]
    assert not worker.handle([Header(Command.CLOSE).encode()])  # CLOSE still closes


def two_env_worker(tmp_path, env_threads: bool, slow_second: bool = False) -> Worker:
    sleep = {"step_sleep_s": (0.02, 0.02)} if slow_second else {}
    host = EnvHost({0: CountingEnv(env_id=7), 1: CountingEnv(env_id=8, **sleep)})
    w = Worker(f"ipc://{tmp_path}/nobody", b"w0", host, env_threads=env_threads)
    w.push = FakePush()
    w.token = b"t" * 16
    return w


def batch_of_steps(encoder: Encoder, seqs: dict[int, int], action: float = 0.25) -> list[Any]:
    td = TensorDict({"action": torch.tensor([action])}, [])
    messages = [command(Header(Command.STEP, env, seq), td, encoder) for env, seq in seqs.items()]
    [batch] = batch_messages(messages, -1)
    return batch


def replies_in(message: list[bytes], max_messages: int = 2) -> list[list[Any]]:
    """A BATCH reply's messages (each its frames); a lone reply as a batch of one."""
    header = Header.decode(message[0])
    if header.command != Command.BATCH:
        return [message]
    return split_batch(header, message[1:], max_messages)


def test_a_batch_run_inline_is_answered_by_one_batch(tmp_path):
    worker, decoder, encoder = two_env_worker(tmp_path, env_threads=False), Decoder(), Encoder()
    try:
        assert worker.handle(batch_of_steps(encoder, {0: 1, 1: 1}))
        [message] = worker.push.sent  # one message for both replies
        header = Header.decode(message[0])
        assert header.command == Command.BATCH and header.token == worker.token
        assert header.env in worker.host.envs  # names the worker to the pool
        observed = {}
        for reply in replies_in(message):
            inner = Header.decode(reply[0])
            assert (inner.command, inner.seq, inner.token) == (Command.RESULT, 1, worker.token)
            observed[inner.env] = decoder.decode(inner, reply[1:])[0].to_tensordict()
        assert {e: td["observation"][:2].tolist() for e, td in observed.items()} == {
            0: [7.0, 1.0],
            1: [8.0, 1.0],
        }
    finally:
        worker.close()


def test_rows_of_one_layout_are_answered_joined(tmp_path):
    """Once the layout is announced, a batch's replies are one RESULTS: rows joined.

    The layout is announced by a lone step (not a batch), so no env has a step
    time on record and no reply is sent early, however slow this machine.
    """
    worker, decoder, encoder = two_env_worker(tmp_path, env_threads=False), Decoder(), Encoder()
    try:
        action = TensorDict({"action": torch.tensor([0.25])}, [])
        assert worker.handle(command(Header(Command.STEP, 1, 1), action, encoder))
        [announcing] = worker.push.sent
        decoder.decode(Header.decode(announcing[0]), announcing[1:])
        worker.push.sent.clear()
        assert worker.handle(batch_of_steps(encoder, {1: 2, 0: 1}))
        [message] = worker.push.sent
        header = Header.decode(message[0])
        assert (header.command, header.env, header.token) == (Command.RESULTS, 1, worker.token)
        assert header.body == {"envs": [1, 0], "seqs": [2, 1]}  # in the batch's order
        rows = decoder.decode_rows(header, message[1:], 2)
        observed = [parts[0].to_tensordict()["observation"][:2].tolist() for parts in rows]
        assert observed == [[8.0, 2.0], [7.0, 1.0]]
    finally:
        worker.close()


def joined_steps(encoder: Encoder, seqs: dict[int, int], action: float = 0.25) -> list[Any]:
    """One COMMANDS stepping ``seqs``' envs (the action's layout announced already)."""
    td = TensorDict({"action": torch.tensor([action])}, [])
    rows = [Row(Command.STEP, env, seq, [encoder.encode(td)]) for env, seq in seqs.items()]
    message = pack_rows(rows, b"")
    assert Header.decode(message[0]).command == Command.COMMANDS, "the layout was not announced"
    return [bytes(memoryview(f).cast("B")) for f in message]


def announced(worker: Worker, encoder: Encoder, decoder: Decoder) -> None:
    """A lone step of env 1 announces the action's layout to the worker, and its reply's to us."""
    action = TensorDict({"action": torch.tensor([0.25])}, [])
    assert worker.handle(command(Header(Command.STEP, 1, 1), action, encoder))
    deadline = time.monotonic() + 10.0  # an env thread replies when its env is done
    while not worker.push.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    [reply] = worker.push.sent
    decoder.decode(Header.decode(reply[0]), reply[1:])
    worker.push.sent.clear()


def test_joined_commands_run_as_if_each_had_come_alone(tmp_path):
    """A COMMANDS is one command per row, each with its seq: answered as a batch would be,
    alone or inside a BATCH."""
    worker, decoder, encoder = two_env_worker(tmp_path, env_threads=False), Decoder(), Encoder()
    try:
        announced(worker, encoder, decoder)
        assert worker.handle(joined_steps(encoder, {1: 2, 0: 1}))
        [message] = worker.push.sent
        header = Header.decode(message[0])
        assert header.command == Command.RESULTS
        assert header.body == {"envs": [1, 0], "seqs": [2, 1]}  # in the rows' order
        rows = decoder.decode_rows(header, message[1:], 2)
        observed = [parts[0].to_tensordict()["observation"][:2].tolist() for parts in rows]
        assert observed == [[8.0, 2.0], [7.0, 1.0]]
        worker.push.sent.clear()
        # Inside a BATCH, beside a command that is not joined: both run, in order.
        seed = command(Header(Command.SEED, 0, 3, body={"seed": 5}), None, Encoder())
        [batch] = batch_messages([joined_steps(encoder, {0: 2, 1: 3}), seed], -1)
        assert Header.decode(batch[0]).command == Command.BATCH
        assert worker.handle(batch)
        # Usually one message; two if an env's last step took over a millisecond of wall
        # time (a busy machine), when the replies kept so far go before it runs.
        answered = [(h.command, h.env, h.seq) for m in worker.push.sent for h in _headers_of(m)]
        assert answered == [(Command.RESULT, 0, 2), (Command.RESULT, 1, 3), (Command.RESULT, 0, 3)]
    finally:
        worker.close()


def _headers_of(message: list[bytes]) -> list[Header]:
    """Every reply in ``message`` (a BATCH, a RESULTS or a lone reply) as a header per env."""
    headers = []
    for reply in replies_in(message, max_messages=4):
        header = Header.decode(reply[0])
        if header.command != Command.RESULTS:
            headers.append(header)
            continue
        for env, seq in zip(header.body["envs"], header.body["seqs"], strict=True):
            headers.append(Header(Command.RESULT, env, seq, header.token))
    return headers


def test_malformed_joined_commands_are_dropped_or_answered_and_the_envs_live_on(tmp_path):
    """A COMMANDS header that fails its checks is dropped whole; frames that do not match its
    layout answer each env with an error; an env the worker does not host is that row's error."""
    worker, decoder, encoder = two_env_worker(tmp_path, env_threads=False), Decoder(), Encoder()
    try:
        announced(worker, encoder, decoder)
        good = joined_steps(encoder, {0: 1, 1: 2})
        body = Header.decode(good[0]).body
        layouts = Header.decode(good[0]).layouts

        def joined(body: dict[str, Any], env: int = 0) -> bytes:
            return Header(Command.COMMANDS, env, 0, layouts=layouts, body=body).encode()

        dropped = [
            [joined({"envs": [0, 1], "seqs": [1, 2]}), *good[1:]],  # no command
            [joined({**body, "c": int(Command.SEED)}), *good[1:]],
            [joined({**body, "c": int(Command.COMMANDS)}), *good[1:]],
            [joined({**body, "c": 99}), *good[1:]],
            [joined({**body, "envs": [0, 0]}), *good[1:]],
            [joined({**body, "envs": [0, 1, 5], "seqs": [1, 2, 1]}), *good[1:]],  # 3 rows, 2 envs
            [joined({**body, "envs": [1, 0]}, env=0), *good[1:]],  # not the header's env first
            [joined({**body, "h": 1}), *good[1:]],  # held replies are asked for with true only
            [joined({**body, "h": [True] * 1000}), *good[1:]],
            [joined({**body, "x": True}), *good[1:]],  # a key the wire does not know
        ]
        for frames in dropped:
            assert worker.handle(frames)
        assert worker.dropped == len(dropped) and not worker.push.sent
        for frames in ([good[0], good[1][:-1]], [good[0]], [joined(body), good[1], b"x"]):
            assert worker.handle(frames)
            [message] = worker.push.sent
            worker.push.sent.clear()
            errors = _headers_of(message)
            assert [(h.command, h.env, h.seq) for h in errors] == [
                (Command.ERROR, 0, 1),
                (Command.ERROR, 1, 2),
            ]
            kinds = {Failed.from_body(h.body).kind for h in map(Header.decode, _frames0(message))}
            assert kinds == {FailureKind.PROTOCOL}
        # A row for an env this worker does not host is that row's error alone.
        assert worker.handle(joined_steps(encoder, {0: 1, 5: 1}))
        [message] = worker.push.sent
        worker.push.sent.clear()
        assert [(h.command, h.env) for h in _headers_of(message)] == [
            (Command.RESULT, 0),
            (Command.ERROR, 5),
        ]
        # The envs live on: their state is what the good steps made it.
        assert worker.handle(joined_steps(encoder, {0: 2, 1: 2}))
        [message] = worker.push.sent
        rows = decoder.decode_rows(Header.decode(message[0]), message[1:], 2)
        observed = [parts[0].to_tensordict()["observation"][:2].tolist() for parts in rows]
        assert observed == [[7.0, 2.0], [8.0, 2.0]]
    finally:
        worker.close()


def _frames0(message: list[bytes]) -> list[bytes]:
    """The header frame of each reply in ``message``."""
    return [reply[0] for reply in replies_in(message, max_messages=4)]


def test_a_kept_reply_does_not_wait_on_a_slow_env(tmp_path):
    """Run inline, a batch's replies go together; but once env 1 is known to take 20 ms a
    step, env 0's reply goes before env 1 runs, not after."""
    worker, encoder = two_env_worker(tmp_path, env_threads=False, slow_second=True), Encoder()
    try:
        assert worker.handle(batch_of_steps(encoder, {0: 1, 1: 1}))
        assert len(worker.push.sent) == 1  # env 1's speed unknown yet: one message
        worker.push.sent.clear()
        assert worker.handle(batch_of_steps(encoder, {0: 2, 1: 2}))
        envs = [[Header.decode(m[0]).env for m in replies_in(s)] for s in worker.push.sent]
        assert envs == [[0], [1]]
    finally:
        worker.close()


def test_with_env_threads_each_reply_goes_when_it_is_ready(tmp_path):
    worker, encoder = two_env_worker(tmp_path, env_threads=True), Encoder()
    try:
        assert worker.handle(batch_of_steps(encoder, {0: 1, 1: 1}))
        deadline = time.monotonic() + 10.0
        while len(worker.push.sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        headers = [Header.decode(m[0]) for m in worker.push.sent]
        assert sorted((h.command, h.env) for h in headers) == [
            (Command.RESULT, 0),
            (Command.RESULT, 1),
        ]
    finally:
        worker.close()


@pytest.mark.parametrize("env_threads", [False, True])
def test_a_worker_of_several_envs_asks_for_a_calls_commands_as_one_message(tmp_path, env_threads):
    """With env threads too: its main thread decodes a COMMANDS once and hands each row to its
    env's thread, which replies as its env is done (a RESULT each)."""
    worker, decoder, encoder = two_env_worker(tmp_path, env_threads), Decoder(), Encoder()
    try:
        assert worker.registration().batches
        announced(worker, encoder, decoder)
        assert worker.handle(joined_steps(encoder, {0: 1, 1: 2}))
        deadline = time.monotonic() + 10.0
        while env_threads and len(worker.push.sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        answered = sorted(
            (h.command, h.env, h.seq) for m in worker.push.sent for h in _headers_of(m)
        )
        assert answered == [(Command.RESULT, 0, 1), (Command.RESULT, 1, 2)]
        if env_threads:  # one by one, as each env is done
            assert [Header.decode(m[0]).command for m in worker.push.sent] == [Command.RESULT] * 2
    finally:
        worker.close()
    one = Worker(f"ipc://{tmp_path}/nobody", b"w1", EnvHost({0: CountingEnv()}), env_threads=True)
    try:
        assert not one.registration().batches  # one env: nothing to join
    finally:
        one.close()


def test_malformed_batches_are_dropped_and_the_envs_live_on(tmp_path):
    worker, encoder = two_env_worker(tmp_path, env_threads=False), Encoder()
    try:
        good = batch_of_steps(encoder, {0: 1, 1: 1})  # announces the action's layout
        assert worker.handle(good)
        worker.push.sent.clear()
        header = Header.decode(good[0])
        counts, sizes = header.body["n"], header.body["len"]
        dropped = [
            [Header(Command.BATCH, body={"n": counts, "len": [*sizes[:-1], 1]}).encode(), good[1]],
            [good[0], good[1] + b"x"],
            [good[0]],
            # three messages for a worker of two envs
            [Header(Command.BATCH, body={"n": [1, 1, 1], "len": [0, 0, 0]}).encode(), b""],
        ]
        for frames in dropped:
            assert worker.handle(frames)
        assert worker.dropped == len(dropped) and not worker.push.sent
        # A batch inside a batch is dropped; the batch's other command is answered.
        step1 = command(
            Header(Command.STEP, 1, 2), TensorDict({"action": torch.ones(1)}, []), encoder
        )
        [nested] = batch_messages([good[:1], step1], -1)
        assert worker.handle(nested)
        assert worker.dropped == len(dropped) + 1
        [only] = worker.push.sent
        assert [(h.env, h.seq) for h in map(Header.decode, [m[0] for m in replies_in(only)])] == [
            (1, 2)
        ]
        worker.push.sent.clear()
        # CLOSE inside a batch closes, once what came before it is answered.
        step0 = command(
            Header(Command.STEP, 0, 3), TensorDict({"action": torch.ones(1)}, []), encoder
        )
        [closing] = batch_messages([step0, [Header(Command.CLOSE).encode()]], -1)
        assert not worker.handle(closing)
        assert [Header.decode(m[0]).seq for m in worker.push.sent] == [3]
    finally:
        worker.close()


# ---------------------------------------------------------------- identity takeover


def test_a_peer_cannot_take_over_a_live_workers_envs(pool):
    # Last in this file: if it ever fails, it leaves the module's pool broken.
    context = zmq.Context()
    try:
        identity = pool.runtime.roster.envs[0].link.identity  # b"w0": in /proc/<pid>/cmdline
        thief = context.socket(zmq.DEALER)
        thief.linger = 0
        thief.identity = identity
        thief.connect(pool.runtime.broker.local.router_ep)
        specs = [spec_to_data(CountingEnv().specs)] * 2
        # A well-formed REGISTER, as the real worker's own: refused all the same.
        reg = Register(os.getpid(), "thief", (0, 1), False, os.urandom(8), None, tuple(specs))
        thief.send(Header(Command.REGISTER, body=reg.to_body()).encode())
        seen = Thief(thief)
        wait_for(lambda: seen.welcome is not None, lambda: seen.pump(pool), timeout_s=1.0)
        pool.async_step_send(TensorDict({"action": torch.zeros(1, 1)}, [1]), env_index=[0])
        out = None
        deadline = time.monotonic() + 3.0
        while out is None and time.monotonic() < deadline:
            seen.pump(pool)
            with contextlib.suppress(TimeoutError):
                out = pool.async_step_recv(min_get=1, timeout=0.05)
        assert seen.welcome is None, "the pool gave its token to a second worker"
        assert not seen.commands, f"a command for env 0 went to the thief: {seen.commands}"
        assert out is not None, "env 0 no longer answers"
        assert out["next", "observation"][0, 0].item() == 0, "a forged result was delivered"
    finally:
        context.destroy(linger=0)


class Thief:
    """Reads what the pool sends to a stolen identity; answers commands with forgeries."""

    def __init__(self, dealer: zmq.Socket) -> None:
        self.dealer = dealer
        self.welcome: Welcome | None = None
        self.commands: list[str] = []
        self.push: zmq.Socket | None = None

    def pump(self, pool: ZMQAsyncEnvPool) -> None:
        pool.runtime.pump(0.02)
        while self.dealer.poll(0):
            header = Header.decode(self.dealer.recv_multipart()[0])
            if header.command == Command.WELCOME:
                self.welcome = Welcome.from_body(header.body)
                self.push = self.dealer.context.socket(zmq.PUSH)
                self.push.linger = 0
                self.push.connect(self.welcome.results)
            elif header.command == Command.STEP:
                self.commands.append(f"STEP seq {header.seq}")
                self._forge(header)

    def _forge(self, command: Header) -> None:
        if self.push is None or self.welcome is None:
            return
        header = Header(Command.RESULT, command.env, command.seq, self.welcome.token)
        self.push.send_multipart(encode_message(header, [Encoder().encode(forged_next(0))]))
