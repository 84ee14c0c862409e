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

import torch
from tensordict import TensorDict

from zmqpool import ZMQAsyncEnvPool
from zmqpool.batching import RowPacker
from zmqpool.testing import CountingEnv

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
    kwargs = [{"env_id": i} for i in range(NUM_ENVS)]
    pool = ZMQAsyncEnvPool(
        [CountingEnv] * NUM_ENVS, create_env_kwargs=kwargs, envs_per_worker=NUM_ENVS // 2
    )
    try:
        pool.reset()
        grown = [_objects_kept_by_a_send(pool) for _ in range(3)]
    finally:
        pool.close()
    # The first round also makes what every later round reuses (layouts, stats).
    assert max(grown[1:]) <= PER_REQUEST * NUM_ENVS, grown


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
