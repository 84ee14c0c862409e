"""The trainer's ZeroMQ I/O threads are batch-scheduled unless the config says otherwise.

Read off the OS (``/proc/self/task`` and ``sched_getscheduler``), not off the
pool: what counts is the policy the kernel applies to the thread.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from tests.conftest import FAST
from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
    reason="SCHED_BATCH and /proc are Linux's",
)

#: libzmq names each I/O thread after it applied its scheduling parameters.
_IO_PREFIX = "ZMQbg/IO/"


def _io_threads() -> dict[int, int]:
    """This process's libzmq I/O threads: thread id -> scheduling policy."""
    found = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/comm") as comm:
                name = comm.read().strip()
            if name.startswith(_IO_PREFIX):
                found[int(entry)] = os.sched_getscheduler(int(entry))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _new_io_policies(before: dict[int, int], timeout_s: float = 10.0) -> set[int]:
    """The policies of the I/O threads started since ``before``, once one has its name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = {tid: policy for tid, policy in _io_threads().items() if tid not in before}
        if new:
            return set(new.values())
        time.sleep(0.01)
    raise AssertionError(f"no new {_IO_PREFIX}* thread within {timeout_s}s")


@pytest.mark.parametrize(
    ("batch_sched", "policy"),
    [(True, getattr(os, "SCHED_BATCH", -1)), (False, getattr(os, "SCHED_OTHER", -1))],
)
def test_the_trainers_io_threads_follow_the_config(batch_sched, policy):
    before = _io_threads()
    config = dataclasses.replace(FAST, io_thread_batch_sched=batch_sched)
    pool = ZMQAsyncEnvPool([CountingEnv], config=config)
    try:
        assert _new_io_policies(before) == {policy}
        assert pool.reset().batch_size == (1,)  # and the pool works under it
    finally:
        pool.close()


def test_batch_scheduling_is_the_default():
    assert PoolConfig().io_thread_batch_sched is True
    with pytest.raises(ValueError, match="io_thread_batch_sched must be a bool"):
        PoolConfig(io_thread_batch_sched=1)  # type: ignore[arg-type]
