"""One pool, several threads: what torchrl's threading pool allows, on real processes and sockets.

torchrl documents each env's own channel as safe for concurrent collector
threads (``AsyncBatchedCollector`` runs a thread per env), and its pool lets
one thread send while another receives. ZeroMQ sockets are not thread-safe:
before the pool's gate (:mod:`zmqpool.gate`) this aborted libzmq, hung, or
mixed two threads' frames into one malformed command. Each scenario runs on
torchrl's ``AsyncEnvPool(backend="threading")`` too, as the oracle.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torchrl.envs import AsyncEnvPool

from tests.conformance import counting_makers
from zmqpool import PoolClosedError, PoolConfig, ZMQAsyncEnvPool
from zmqpool.gate import Gate
from zmqpool.state import Kind
from zmqpool.testing import CountingEnv

NUM_ENVS = 3
ROUNDS = 60
JOIN_TIMEOUT_S = 60.0
CONFIG = PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0)


@pytest.fixture(scope="module")
def pools():
    makers = counting_makers(NUM_ENVS, max_steps=10**9)
    oracle = AsyncEnvPool(makers, backend="threading")
    ours = ZMQAsyncEnvPool(makers, config=CONFIG)
    yield {"oracle": oracle, "zmqpool": ours}
    ours.close()
    oracle.close()


def run_threads(targets: list[Callable[[], None]]) -> list[str]:
    """Run each target in a thread; the errors they raised (and any thread still running)."""
    errors: list[str] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    errors += [f"{thread.name} still running" for thread in threads if thread.is_alive()]
    return errors


@pytest.mark.parametrize("which", ["oracle", "zmqpool"])
def test_a_thread_per_env_on_its_own_channel(pools, which):
    """AsyncBatchedCollector's pattern: each thread resets and steps its own env, at once."""
    pool = pools[which]
    seen: dict[int, list[float]] = {}

    def drive(env: int) -> None:
        pool.async_reset_send(env_index=env)
        td = pool.async_reset_recv(env_index=env)
        counts = seen.setdefault(env, [])
        for _ in range(ROUNDS):
            td["action"] = torch.ones(1, dtype=torch.int8)
            pool.async_step_and_maybe_reset_send(td, env_index=env)
            result, td = pool.async_step_and_maybe_reset_recv(env_index=env)
            assert int(result["env_index"]) == env
            counts.append(float(result["next", "observation"].item()))

    errors = run_threads([lambda env=env: drive(env) for env in range(NUM_ENVS)])
    assert not errors, errors
    # CountingEnv counts from env's start value: every step of each env, once, in order.
    assert seen == {env: [env + k for k in range(1, ROUNDS + 1)] for env in range(NUM_ENVS)}


def step_each_env_when_ready(pool, root, ready: queue.Queue[int], total: int) -> None:
    """A producer: every env's first step, then each env's next as ``ready`` names it."""
    for env in range(NUM_ENVS):
        ready.put(env)
    for _ in range(total):
        env = ready.get(timeout=JOIN_TIMEOUT_S)
        row = root[[env]].exclude("env_index")
        row["action"] = torch.ones(1, 1, dtype=torch.int8)
        pool.async_step_send(row, env_index=[env])


@pytest.mark.parametrize("which", ["oracle", "zmqpool"])
def test_one_thread_sends_while_another_receives(pools, which):
    """A producer sends each env's next step as soon as a consumer has its result."""
    pool = pools[which]
    root = pool.reset()
    ready: queue.Queue[int] = queue.Queue()
    received: list[tuple[int, float]] = []
    total = ROUNDS * NUM_ENVS

    def produce() -> None:
        step_each_env_when_ready(pool, root, ready, total)

    def consume() -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(received) < total and time.monotonic() < deadline:
            try:
                out = pool.async_step_recv(min_get=1, timeout=5.0)
            except RuntimeError as err:  # nothing in flight yet: the producer is behind
                assert "Cannot await" in str(err)
                time.sleep(0.001)
                continue
            for env, obs in zip(out["env_index"], out["next", "observation"], strict=True):
                received.append((int(env), float(obs.item())))
                ready.put(int(env))

    errors = run_threads([consume, produce])
    assert not errors, errors
    # CountingEnv counts in the env: every step of each env, once (which env goes next
    # depends on which reply came first, so each env's share of the steps varies).
    assert len(received) == total
    for env in range(NUM_ENVS):
        counts = sorted(obs for e, obs in received if e == env)
        start = float(root["observation"][env].item())
        assert counts == [start + k for k in range(1, len(counts) + 1)], env


def test_two_threads_receiving_on_the_batch_channel_with_deadlines_share_every_result(pools):
    """Two consumers recv on the batch channel with a deadline while a producer steps each
    env again as its result comes: each result goes to one of them, once, and a recv
    returns at least ``min_get`` results or raises ``RuntimeError``.

    A recv that had its ``min_get`` made way for the other thread while it batched
    until its deadline; the other took the results, and the first built a result
    from none (``IndexError``) or from fewer than ``min_get`` (thread-sharing audit).
    torchrl's threading pool hands the same results to both threads: not compared.
    A third thread takes ``stats(reset=True)`` meanwhile: its ``items`` add up to
    every result (it read and cleared them outside the gate, losing some).
    """
    pool = pools["zmqpool"]
    root = pool.reset()
    pool.stats(reset=True)
    counted: list[int] = []
    ready: queue.Queue[int] = queue.Queue()
    received: list[tuple[int, float]] = []
    total = 4 * ROUNDS * NUM_ENVS
    done = threading.Event()

    def produce() -> None:
        step_each_env_when_ready(pool, root, ready, total)
        done.set()

    def consume() -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not (done.is_set() and len(received) >= total) and time.monotonic() < deadline:
            try:
                out = pool.async_step_recv(min_get=1, timeout=0.05)
            except (RuntimeError, TimeoutError):  # the other took them, or none in flight yet
                time.sleep(0.001)
                continue
            assert out.batch_size[0] >= 1
            for env, obs in zip(out["env_index"], out["next", "observation"], strict=True):
                received.append((int(env), float(obs.item())))
                ready.put(int(env))

    def watch() -> None:
        while not (done.is_set() and len(received) >= total):
            counted.append(pool.stats(reset=True)["items"])

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: the races come in a short run
    try:
        errors = run_threads([consume, consume, produce, watch])
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors
    assert len(received) == total
    assert sum(counted) + pool.stats(reset=True)["items"] == total
    for env in range(NUM_ENVS):
        counts = sorted(obs for e, obs in received if e == env)
        start = float(root["observation"][env].item())
        assert counts == [start + k for k in range(1, len(counts) + 1)], env


class SlowSeedEnv(CountingEnv):
    """zmqpool's CountingEnv whose ``set_seed`` takes ``seed_s`` seconds."""

    def __init__(self, env_id: int = 0, seed_s: float = 0.0) -> None:
        super().__init__(env_id=env_id)
        self.seed_s = seed_s

    def _set_seed(self, seed):
        time.sleep(self.seed_s)
        return super()._set_seed(seed)


def test_a_reset_on_an_envs_own_channel_is_refused_while_another_thread_seeds():
    """set_seed waits for env 0's seed, making way for other threads: one resets env 1 on
    its own channel, where env 1's seed reply will come. The reset is refused; the seed
    chain is SerialEnv's. The reset went out, and the two took each other's replies
    (set_seed returned None, the reset's recv a seed; review)."""
    makers = [{"env_id": 0, "seed_s": 1.0}, {"env_id": 1}]
    pool = ZMQAsyncEnvPool(SlowSeedEnv, create_env_kwargs=makers, config=CONFIG)
    refused: list[str] = []

    def reset_env_1() -> None:
        time.sleep(0.3)  # set_seed is waiting for env 0 by then
        try:
            pool.async_reset_send(env_index=1)
        except RuntimeError as err:
            refused.append(str(err))

    try:
        pool.reset()
        other = threading.Thread(target=reset_env_1)
        other.start()
        seed = pool.set_seed(100)
        other.join(timeout=JOIN_TIMEOUT_S)
        assert refused and "while set_seed is under way" in refused[0], refused
        assert seed == CountingEnv().set_seed(CountingEnv().set_seed(100))
    finally:
        pool.close()


def test_close_from_another_thread_ends_a_waiting_recv():
    """A recv waiting without a timeout is ended by close() in another thread, at once."""
    pool = ZMQAsyncEnvPool(counting_makers(1, step_delay=30.0), config=CONFIG)
    pool.reset()
    outcome: queue.Queue[BaseException | None] = queue.Queue()

    def wait_for_a_slow_step() -> None:
        try:
            pool.async_step_send(pool.rand_action()[0], env_index=0)
            pool.async_step_recv(env_index=0)
            outcome.put(None)
        except BaseException as err:
            outcome.put(err)

    thread = threading.Thread(target=wait_for_a_slow_step, daemon=True)
    thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not pool.runtime.awaiting((Kind.STEP, 0)) and time.monotonic() < deadline:
        time.sleep(0.01)  # the runtime's own count, bounded: the step is in flight
    started = time.monotonic()
    pool.close()
    err = outcome.get(timeout=JOIN_TIMEOUT_S)
    assert isinstance(err, PoolClosedError), err
    assert time.monotonic() - started < 15.0  # close is bounded; the 30 s step is not awaited


# ---------------------------------------------------------------- the gate itself


def test_the_gate_hands_itself_to_a_waiting_thread_between_two_slices():
    gate = Gate()
    order: list[str] = []

    def other() -> None:
        with gate:
            order.append("other")

    with gate, gate:  # reentrant, as a sync step's send and recv inside it
        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not gate.shared and time.monotonic() < deadline:
            time.sleep(0.001)  # the gate's own flag: the other thread is waiting
        assert gate.slice_s is not None
        gate.make_way()  # what a recv does between two slices of its wait
        order.append("main")
    thread.join(JOIN_TIMEOUT_S)
    assert order == ["other", "main"]


def test_calls_that_never_overlap_leave_waits_whole():
    """A pool built in one thread and driven in another waits as a single thread's."""
    gate = Gate()
    with gate:
        pass
    thread = threading.Thread(target=lambda: gate.__enter__() and gate.__exit__(None, None, None))
    thread.start()
    thread.join(JOIN_TIMEOUT_S)
    assert not gate.shared and gate.slice_s is None


#: Ctrl-C (SIGINT to the main thread) while the main thread waits for the gate another
#: thread holds; that thread then makes way, as a recv does between two slices.
_INTERRUPTED_WAITING = """
import os, signal, threading
from zmqpool.gate import Gate
gate, held, go, done = Gate(), threading.Event(), threading.Event(), threading.Event()
def holder():
    with gate:
        held.set()
        go.wait(10)
        gate.make_way()  # the interrupted thread no longer waits: nothing to wait for
    done.set()
threading.Thread(target=holder, daemon=True).start()
held.wait(10)
threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    with gate:
        print("entered")
except KeyboardInterrupt:
    print("interrupted")
go.set()
print("holder done" if done.wait(5) else "holder stuck")
"""

#: Ctrl-C while the main thread, two calls deep (a sync step's recv), has made way to
#: another thread and waits to take the gate back.
_INTERRUPTED_MAKING_WAY = """
import os, signal, threading, time
from zmqpool.gate import Gate
gate = Gate()
def other():
    time.sleep(0.1)
    with gate:
        time.sleep(0.5)  # the main thread's Ctrl-C comes while this one holds the gate
threading.Thread(target=other, daemon=True).start()
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    with gate, gate:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            time.sleep(0.001)
            gate.make_way()
    print("not interrupted")
except BaseException as err:
    print(type(err).__name__)
got = threading.Event()
def later():
    with gate:
        got.set()
threading.Thread(target=later, daemon=True).start()
print("later thread got the gate" if got.wait(5) else "gate stuck")
"""


@pytest.mark.parametrize(
    "script, expected",
    [
        (_INTERRUPTED_WAITING, ["interrupted", "holder done"]),
        (_INTERRUPTED_MAKING_WAY, ["KeyboardInterrupt", "later thread got the gate"]),
    ],
    ids=["waiting", "making-way"],
)
def test_ctrl_c_leaves_the_gate_whole(script, expected):
    """A KeyboardInterrupt comes through as itself, and the gate still works after it.

    Before: an interrupted waiter stayed counted, and the holder's make_way spun for
    ever; interrupted while making way, the unwinding released a lock the thread no
    longer held (RuntimeError instead of the interrupt) and the gate stayed broken.
    """
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:2] == expected, out.stdout + out.stderr
