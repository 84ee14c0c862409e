"""Replies from several threads: whoever holds the socket sends what the others queued.

:class:`workers.replies.ReplyQueue` on its own (threads, no sockets), then a
worker whose env threads reply while another env's reply is being sent: theirs
go after it, joined, and their threads go on stepping meanwhile.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import zmq
from tensordict import TensorDict

from workers.hosting import EnvHost
from workers.loop import Worker
from workers.replies import ReplyQueue
from zmqpool.codec import Decoder, Encoder
from zmqpool.testing import CountingEnv
from zmqpool.wire import Command, Header, encode_message, split_batch

WAIT_S = 10.0


class Sink:
    """A ``send`` for the queue: records each call's entries."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def __call__(self, entries: list[Any]) -> None:
        self.calls.append(list(entries))


def _in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_a_reply_that_finds_the_socket_free_goes_at_once_alone():
    sink = Sink()
    queue = ReplyQueue(sink)
    queue.put("a")
    queue.put("b")
    assert sink.calls == [["a"], ["b"]]


def test_replies_put_while_the_socket_is_held_go_after_it_together_in_order():
    sink = Sink()
    queue = ReplyQueue(sink)
    with queue.holding():
        first = _in_thread(queue.put, "a")
        first.join(WAIT_S)
        second = _in_thread(queue.put, "b")
        second.join(WAIT_S)
        # Neither thread waited for the socket: both returned while it was held.
        assert not first.is_alive() and not second.is_alive()
        assert sink.calls == []
    assert sink.calls == [["a", "b"]]


def test_replies_queued_while_a_holder_fails_still_go():
    sink = Sink()
    queue = ReplyQueue(sink)
    with pytest.raises(RuntimeError), queue.holding():
        _in_thread(queue.put, "a").join(WAIT_S)
        raise RuntimeError("the socket could not be replaced")
    assert sink.calls == [["a"]]


def test_a_failed_send_reaches_its_caller_and_the_queue_goes_on():
    calls: list[list[str]] = []

    def send(entries: list[str]) -> None:
        calls.append(entries)
        if "bad" in entries:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)

    queue = ReplyQueue(send)
    with pytest.raises(zmq.ZMQError):
        queue.put("bad")
    queue.put("good")
    assert calls == [["bad"], ["good"]]


def test_every_reply_from_many_threads_is_sent_once_in_each_threads_order():
    sent: list[tuple[int, int]] = []
    queue: ReplyQueue[tuple[int, int]] = ReplyQueue(sent.extend)
    threads, per_thread = 8, 500

    def reply(thread: int) -> None:
        for i in range(per_thread):
            queue.put((thread, i))

    running = [_in_thread(reply, t) for t in range(threads)]
    for thread in running:
        thread.join(WAIT_S)
    assert not any(t.is_alive() for t in running)
    assert sorted(sent) == [(t, i) for t in range(threads) for i in range(per_thread)]
    for t in range(threads):
        assert [i for who, i in sent if who == t] == list(range(per_thread))


# ------------------------------------------------------------ a worker's env threads


class SignallingEnv(CountingEnv):
    """Says when each step starts; its second step waits until it is let go.

    It returns the same output tensors every step, written in place (as envs
    with preallocated buffers do): its second step overwrites the first's
    output before it waits, so a reply whose bytes were not taken when its
    step ended would carry the second step's values.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started = [threading.Event(), threading.Event()]
        self.let_second_go = threading.Event()
        self.out: TensorDict | None = None

    def _step(self, tensordict):
        n = min(self.count, 1)
        out = super()._step(tensordict)
        if self.out is None:
            self.out = out
        else:
            self.out.update_(out)
        self.started[n].set()
        if n == 1:
            self.let_second_go.wait(WAIT_S)
        return self.out


class GatedPush:
    """The worker's PUSH: keeps what is sent; the first message waits for ``gate``."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []
        self.sending_first = threading.Event()
        self.gate = threading.Event()
        self._parts: list[bytes] = []

    def send(self, frame, flags=0, copy=True) -> None:
        self._parts.append(bytes(memoryview(frame).cast("B")))
        if flags & zmq.SNDMORE:
            return
        if not self.sent:
            self.sending_first.set()
            self.gate.wait(WAIT_S)
        self.sent.append(self._parts)
        self._parts = []

    def close(self, linger=None) -> None:
        """The worker closes its PUSH itself."""


def _step_command(env: int, seq: int, encoder: Encoder) -> list[bytes]:
    td = TensorDict({"action": torch.tensor([0.5])}, [])
    frames = encode_message(Header(Command.STEP, env, seq), [encoder.encode(td)])
    return [bytes(memoryview(f).cast("B")) for f in frames]


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.005)


def test_env_threads_leave_their_replies_to_the_sender_and_they_go_joined(tmp_path):
    envs = {0: CountingEnv(env_id=7), 1: SignallingEnv(env_id=8), 2: SignallingEnv(env_id=9)}
    # Every env in its thread: none steps inline, even one judged cheap (workers.inline).
    worker = Worker(
        f"ipc://{tmp_path}/nobody", b"w0", EnvHost(envs), env_threads=True, inline_cheap=False
    )
    push = worker.push = GatedPush()
    worker.token = b"t" * 16
    encoder, decoder = Encoder(), Decoder()
    try:
        assert worker.handle(_step_command(0, 1, encoder))
        assert push.sending_first.wait(WAIT_S), "env 0's reply was never sent"
        # Env 0's thread holds the socket. Envs 1 and 2 step and reply; their
        # threads do not wait for the socket but go on to their next step
        # (which overwrites their first output in place).
        for env in (1, 2):
            assert worker.handle(_step_command(env, 1, encoder))
            assert worker.handle(_step_command(env, 2, encoder))
        for env in (1, 2):
            assert envs[env].started[1].wait(WAIT_S), f"env {env}'s thread waited for the socket"
        assert len(push.sent) == 0
        push.gate.set()
        _wait_until(lambda: len(push.sent) >= 2, "the queued replies")
        first, joined = push.sent[0], push.sent[1]
        header = Header.decode(first[0])
        assert (header.command, header.env, header.seq) == (Command.RESULT, 0, 1)
        decoder.decode(header, first[1:])  # announces the layout the joined rows use
        header = Header.decode(joined[0])
        assert header.command == Command.RESULTS, "the queued replies went one by one"
        assert sorted(header.body["envs"]) == [1, 2] and header.body["seqs"] == [1, 1]
        rows = decoder.decode_rows(header, joined[1:], 2)
        observed = {
            env: parts[0].to_tensordict()["observation"][:3].tolist()
            for env, parts in zip(header.body["envs"], rows, strict=True)
        }
        assert observed == {1: [8.0, 1.0, 0.5], 2: [9.0, 1.0, 0.5]}
        for env in (1, 2):
            envs[env].let_second_go.set()
        _wait_until(lambda: len(_answered(push.sent)) >= 5, "the second steps' replies")
        answered = _answered(push.sent)
        assert sorted(answered) == [(0, 1), (1, 1), (1, 2), (2, 1), (2, 2)]  # each request once
    finally:
        for env in (1, 2):
            envs[env].let_second_go.set()
        push.gate.set()
        worker.close()


def _answered(sent: list[list[bytes]]) -> list[tuple[int, int]]:
    """(env, seq) of every reply in ``sent``: lone, joined or batched."""
    out: list[tuple[int, int]] = []
    for message in sent:
        header = Header.decode(message[0])
        if header.command == Command.BATCH:
            out += _answered([list(m) for m in split_batch(header, message[1:], 3)])
        elif header.command == Command.RESULTS:
            out += list(zip(header.body["envs"], header.body["seqs"], strict=True))
        else:
            out.append((header.env, header.seq))
    return out
