"""What a request in flight leaves for the trainer's cyclic garbage collector.

A request lives from its send to its reply, often across many of the
collector's young collections: each object it keeps that the collector
tracks is promoted to the oldest generation and counts toward the next full
collection, which walks every object torch and torchrl made (~400,000, a
stall of 100-200 ms). So a request keeps two such objects, its record and
its row; the rows' bytes, the empty non-tensor values and the channel are
objects the collector does not track, or one shared by every request.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq
from tensordict import TensorDict

from zmqpool import ZMQAsyncEnvPool
from zmqpool.batching import RowPacker
from zmqpool.codec import ZERO_COPY_THRESHOLD, Decoder, Encoder
from zmqpool.wire import Command, Header, Row, joined_messages

REPO = Path(__file__).resolve().parents[1]
NUM_ENVS = 8
#: A request's record and its row. Measured: 12 objects for 8 requests (the previous
#: call's result, freed meanwhile, offsets the call's own); 45 when each request also kept
#: its channel, a view and two lists; 20 with only the channel back.
PER_REQUEST = 2


def test_a_packed_row_holds_nothing_the_collector_tracks_but_itself():
    batch = TensorDict({"action": torch.arange(6.0).reshape(3, 2)}, [3])
    rows = RowPacker().pack(batch)
    assert rows is not None
    gc.collect()  # untracks tuples that hold only untracked objects
    for row in rows:
        assert not gc.is_tracked(row.buffers)
        assert not any(gc.is_tracked(buffer) for buffer in row.buffers)
        assert not gc.is_tracked(row.nontensor)
    assert [row.to_tensordict()["action"].tolist() for row in rows] == batch["action"].tolist()


def test_requests_in_flight_keep_few_objects_for_the_collector():
    # Counted in an interpreter of its own: in this one, a pool an earlier test left
    # open (conftest's session-scoped one) makes objects from its threads during the
    # rounds (after tests/test_pool_api.py: 7, 61, 12, 3, 12; a CI run: 17-19 in every
    # round, where the same code alone makes 12).
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_ROUNDS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=COUNT_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    grown = json.loads(proc.stdout.splitlines()[-1])
    # The first round also makes what every later round reuses (layouts, stats). The
    # least of the others: what a send keeps shows in every round, while another
    # thread may make a few objects during any one (a round of 17 among 11s, once).
    assert min(grown[1:]) <= PER_REQUEST * NUM_ENVS, grown


#: Five rounds of :func:`_objects_kept_by_a_send` on a pool of its own; prints their counts.
COUNT_ROUNDS = """
import json
from tests.test_collector_load import NUM_ENVS, _objects_kept_by_a_send
from zmqpool import ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

kwargs = [{"env_id": i} for i in range(NUM_ENVS)]
pool = ZMQAsyncEnvPool(
    [CountingEnv] * NUM_ENVS, create_env_kwargs=kwargs, envs_per_worker=NUM_ENVS // 2
)
try:
    pool.reset()
    print(json.dumps([_objects_kept_by_a_send(pool) for _ in range(5)]))
finally:
    pool.close()
"""
#: An interpreter's imports and a pool's start on a loaded 2-core machine, with room.
COUNT_TIMEOUT_S = 180


def _objects_kept_by_a_send(pool: ZMQAsyncEnvPool) -> int:
    """Objects the collector tracks, more after an async send to every env than before.

    No reply is read in between: the trainer takes replies in only while it
    calls the pool, so every request is still in flight when counted.
    """
    actions = TensorDict({"action": torch.zeros(NUM_ENVS, 1)}, [NUM_ENVS])
    gc.collect()
    before = len(gc.get_objects())
    pool.async_step_send(actions, env_index=list(range(NUM_ENVS)))
    del actions  # the caller's batch, with the env_index the send wrote into it
    gc.collect()
    grown = len(gc.get_objects()) - before
    result = pool.async_step_recv(min_get=NUM_ENVS, max_get=NUM_ENVS, timeout=30)
    assert sorted(result["env_index"]) == list(range(NUM_ENVS))
    return grown


@pytest.fixture
def pair():
    """Two connected sockets: frames received without a copy are zmq's, as the pool's are."""
    ctx = zmq.Context()  # its own: an inproc name is free again once the context ends
    send, recv = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    send.bind("inproc://collector-load")
    recv.connect("inproc://collector-load")
    yield send, recv
    send.close(linger=0)
    recv.close(linger=0)
    ctx.term()


def _through(pair, frames: list) -> tuple[Header, list]:
    send, recv = pair
    send.send_multipart(frames)
    assert recv.poll(5000), "the message did not arrive"
    received = recv.recv_multipart(copy=False)
    return Header.decode(received[0].buffer), received[1:]


def _result(value: float, large: bool = False) -> TensorDict:
    td = TensorDict({"obs": torch.full((3,), value), "done": torch.tensor([value > 1])}, [])
    if large:  # a leaf of its own frame, sent and received without a copy
        td["pixels"] = torch.full((ZERO_COPY_THRESHOLD,), int(value), dtype=torch.uint8)
    return td


@pytest.mark.parametrize("own", [True, False])
def test_a_trainer_s_reply_owns_its_small_frames_and_views_its_large_ones(pair, own):
    encoder, decoder = Encoder(), Decoder(own_small_frames=own)
    row = Row(Command.RESULT, 0, 1, [encoder.encode(_result(2.0, large=True))])
    header, frames = _through(pair, row.message(b""))
    [part] = decoder.decode(header, frames)
    small, large = part.buffers
    assert type(small) is (bytes if own else memoryview)
    assert type(large) is memoryview  # never copied
    td = part.to_tensordict()
    assert td["obs"].tolist() == [2.0] * 3 and td["done"].tolist() == [True]
    assert td["pixels"].unique().tolist() == [2]


def test_rows_joined_come_apart_as_bytes_the_collector_does_not_track(pair):
    encoder, decoder = Encoder(), Decoder(own_small_frames=True)
    announce = Row(Command.RESULT, 0, 1, [encoder.encode(_result(0.0))])
    decoder.decode(*_through(pair, announce.message(b"")))
    rows = [Row(Command.RESULT, env, 2, [encoder.encode(_result(float(env)))]) for env in (1, 2, 3)]
    [message] = joined_messages(rows, b"")
    header, frames = _through(pair, message)
    parts = [row[0] for row in decoder.decode_rows(header, frames, 3)]
    del frames
    gc.collect()
    for part in parts:
        assert not gc.is_tracked(part.buffers) and not gc.is_tracked(part.nontensor)
    assert [p.to_tensordict()["obs"].tolist() for p in parts] == [[v] * 3 for v in (1.0, 2.0, 3.0)]
