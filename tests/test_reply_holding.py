"""A worker's replies kept during a message's commands, and when they go before an env steps.

A worker that runs several envs' commands of one message in its main thread
keeps their replies and sends them together at the end (rows joined), but
not past an env that was slow: those kept so far go before it steps, so that
they never wait on it. "Slow" is an env's last command longer than
:data:`workers.loop.HOLD_FOR_S`; when the message asks for its replies to be
held (``"h"`` in a COMMANDS: the pool's last recv waited for several
results), it is both of its last two. One long command of a cheap env (its
process preempted on a busy machine) says little about its next one, and
splitting a message's replies on it costs the pool a message and a wake-up.

A real :class:`~workers.loop.Worker` handles the messages here, without
sockets on the pool's side: its PUSH is a recorder, and its envs note how
many messages had been sent when each step began. The pool's side (which
recvs ask for held replies, and what its messages carry) is checked with a
live pool and with the wire's own functions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zmq
from tensordict import TensorDict

import workers.loop
from workers.hosting import EnvHost
from workers.loop import Worker
from zmqpool import ZMQAsyncEnvPool
from zmqpool.codec import Encoder
from zmqpool.errors import ProtocolError
from zmqpool.testing import CountingEnv
from zmqpool.wire import (
    Command,
    Header,
    Row,
    command_rows,
    encode_message,
    holds_replies,
    joined_messages,
    results_rows,
)

#: The bar for these tests: far above a cheap step on a loaded machine, far below a nap.
HOLD_S = 0.05
NAP_S = (0.2, 0.2)
AWAKE_S = (0.0, 0.0)
WAIT_S = 30.0


class RecordingPush:
    """The worker's PUSH: keeps each message sent, as bytes."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []
        self._parts: list[bytes] = []

    def send(self, frame: Any, flags: int = 0, copy: bool = True) -> None:
        self._parts.append(bytes(memoryview(frame).cast("B")))
        if not flags & zmq.SNDMORE:
            self.sent.append(self._parts)
            self._parts = []

    def close(self, linger: Any = None) -> None:
        """The worker closes its PUSH itself."""


class NotingEnv(CountingEnv):
    """A CountingEnv that notes how many messages its worker had sent as each step began."""

    def __init__(self, push: RecordingPush, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.push = push
        self.sent_before: list[int] = []

    def _step(self, tensordict):
        self.sent_before.append(len(self.push.sent))
        return super()._step(tensordict)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    monkeypatch.setattr(workers.loop, "HOLD_FOR_S", HOLD_S)
    push = RecordingPush()
    envs = {env: NotingEnv(push, env_id=env) for env in range(3)}
    # Every env's commands in the main thread: no judge of which envs step inline.
    worker = Worker(f"ipc://{tmp_path}/nobody", b"w0", EnvHost(envs), env_threads=False)
    worker.push = push
    worker.token = b"t" * 16
    try:
        yield worker
    finally:
        worker.close()


class Pool:
    """The pool's side: sends a worker the commands a trainer's call would, one message."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.encoder = Encoder()
        self.seq = 0
        self.push: RecordingPush = worker.push  # type: ignore[assignment]

    def step(self, envs: list[int], hold: bool) -> list[list[bytes]]:
        """Step ``envs`` with one message (rows joined once announced; ``hold``: asking for
        the replies to be held); the replies sent."""
        self.seq += 1
        action = TensorDict({"action": torch.tensor([0.5])}, [])
        rows = [Row(Command.STEP, env, self.seq, [self.encoder.encode(action)]) for env in envs]
        before = len(self.push.sent)
        for message in joined_messages(rows, self.worker.token, hold):
            frames = [bytes(memoryview(f).cast("B")) for f in message]
            assert self.worker.handle(frames)
        return self.push.sent[before:]

    def step_alone(self, env: int) -> None:
        self.seq += 1
        action = TensorDict({"action": torch.tensor([0.5])}, [])
        frames = encode_message(Header(Command.STEP, env, self.seq), [self.encoder.encode(action)])
        assert self.worker.handle([bytes(memoryview(f).cast("B")) for f in frames])


def _envs_of(message: list[bytes]) -> list[int]:
    header = Header.decode(message[0])
    if header.command == Command.RESULTS:
        return list(header.body["envs"])
    assert header.command == Command.RESULT, header.command
    return [header.env]


def _warm(pool: Pool) -> None:
    # A first step imports and fills caches, and announces the layouts; then each env
    # has two cheap steps as its last two.
    for env in range(3):
        pool.step_alone(env)
    for _ in range(2):
        assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=True)] == [[0, 1, 2]]


def test_held_one_long_command_of_an_env_does_not_split_the_next_messages_replies(worker):
    pool = Pool(worker)
    _warm(pool)
    env1 = worker.host.envs[1]
    env1.step_sleep_s = NAP_S  # once: a cheap env whose process was held up
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=True)] == [[0, 1, 2]]
    env1.step_sleep_s = AWAKE_S
    # Its last command was long, the one before was not: the replies are still kept.
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=True)] == [[0, 1, 2]]


def test_not_held_one_long_command_of_an_env_sends_the_kept_replies_before_it(worker):
    pool = Pool(worker)
    _warm(pool)
    env1 = worker.host.envs[1]
    env1.step_sleep_s = NAP_S
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=False)] == [[0, 1, 2]]
    env1.step_sleep_s = AWAKE_S
    # The pool takes the first result it can: env 0's goes before env 1 runs again.
    sent_before = len(pool.push.sent)
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=False)] == [[0], [1, 2]]
    assert env1.sent_before[-1] == sent_before + 1, "env 0's reply waited for env 1's step"


def test_held_replies_go_before_an_env_slow_in_its_last_two_commands(worker):
    pool = Pool(worker)
    _warm(pool)
    env1 = worker.host.envs[1]
    env1.step_sleep_s = NAP_S  # from now on, every step
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=True)] == [[0, 1, 2]]
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=True)] == [[0, 1, 2]]
    # Slow in its last two commands: env 0's reply goes before env 1 steps.
    sent_before = len(pool.push.sent)
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=True)] == [[0], [1, 2]]
    assert env1.sent_before[-1] == sent_before + 1, "env 0's reply waited for env 1's step"
    # Awake again: one cheap command is not enough to hold for it (its last two: slow, cheap).
    env1.step_sleep_s = AWAKE_S
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=True)] == [[0], [1, 2]]
    assert [_envs_of(m) for m in pool.step([0, 1, 2], hold=True)] == [[0, 1, 2]]


# ------------------------------------------------------------ the pool's side, and the wire


def _commands_header(hold: bool) -> Header:
    part = Encoder().encode(TensorDict({"action": torch.tensor([0.5])}, []))
    part.new_layout = None  # as if announced before: the rows join
    rows = [Row(Command.STEP, env, 7, [part]) for env in (2, 3)]
    [message] = joined_messages(rows, b"", hold)
    return Header.decode(message[0])


@pytest.mark.parametrize("hold", [False, True])
def test_a_commands_says_whether_its_replies_are_held(hold):
    header = _commands_header(hold)
    assert header.command == Command.COMMANDS
    assert command_rows(header, 4) == (Command.STEP, [2, 3], [7, 7])
    assert holds_replies(header) is hold


@pytest.mark.parametrize("value", [False, 1, "yes", None])
def test_a_commands_whose_h_is_not_true_is_refused(value):
    header = _commands_header(True)
    header.body["h"] = value
    with pytest.raises(ProtocolError, match='"h" must be true'):
        command_rows(header, 4)


def test_results_never_carry_h():
    part = Encoder().encode(TensorDict({"obs": torch.zeros(2)}, []))
    part.new_layout = None
    rows = [Row(Command.RESULT, env, 1, [part]) for env in (0, 1)]
    [message] = joined_messages(rows, b"t", hold=True)
    header = Header.decode(message[0])
    assert header.command == Command.RESULTS
    assert results_rows(header, 2) == ([0, 1], [1, 1])  # refused with any other key


def test_the_pool_asks_for_held_replies_after_a_recv_that_waited_for_several():
    pool = ZMQAsyncEnvPool([CountingEnv] * 4, envs_per_worker=2)
    actions = TensorDict({"action": torch.zeros(2, 1)}, [2])
    try:
        pool.reset()  # a synchronous call waits for every env
        assert pool.runtime.hold_replies
        pool.async_step_send(actions.clone(), env_index=[0, 2])
        taken = pool.async_step_recv(min_get=1, timeout=WAIT_S).batch_size[0]
        assert not pool.runtime.hold_replies  # the first result it can: each as it comes
        if taken < 2:
            pool.async_step_recv(min_get=1, timeout=WAIT_S)
        pool.async_step_send(actions.clone(), env_index=[1, 3])
        assert pool.async_step_recv(min_get=2, timeout=WAIT_S).batch_size[0] == 2
        assert pool.runtime.hold_replies
    finally:
        pool.close()
