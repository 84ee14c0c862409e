"""A Ctrl-C at any line of a pool call loses no request and answers none twice.

A real SIGINT is raised (``signal.raise_signal``) at the k-th line the pool's
own code runs during a send and the recv after it, for k over every line such
a pair runs: between two frames of a message, between a reply's match and its
delivery, between a request's bookkeeping and its send. The pool holds the
interrupt back to a safe point, then raises it: a send it interrupts has been
made, and a recv it interrupts puts back what it took. Every request is then
answered exactly once, with the env's own count of its steps.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import zmqpool
from tests.conftest import FAST, counting_kwargs
from zmqpool import ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv, FaultyEnv

NUM_ENVS = 2
_POOL_CODE = str(Path(zmqpool.__file__).parent)
#: Lines a send and recv of one env run here, about (measured: ~300): k sweeps past it.
_SWEEP = range(1, 700, 3)


class LineInterrupter:
    """While active, a real SIGINT at the ``at``-th line run in the pool's own modules."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.lines = 0

    def __enter__(self) -> LineInterrupter:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(None)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self._line if frame.f_code.co_filename.startswith(_POOL_CODE) else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                signal.raise_signal(signal.SIGINT)  # the handler runs here, at this line
        return self._line


class Books:
    """What each env was sent and answered: exactly once, in its own step order."""

    def __init__(self) -> None:
        self.awaited: dict[int, float] = {}
        self.steps = [0] * NUM_ENVS
        self.sent = 0

    def actions(self, envs: list[int]) -> TensorDict:
        values = [(self.sent + k + 1) / 1000 for k in range(len(envs))]
        return TensorDict({"action": torch.tensor(values).unsqueeze(-1)}, [len(envs)])

    def sent_to(self, envs: list[int], actions: TensorDict) -> None:
        self.awaited.update(zip(envs, actions["action"][:, 0].tolist(), strict=True))
        self.sent += len(envs)

    def answered(self, result: TensorDict) -> None:
        for row, env in enumerate(list(result["env_index"])):
            assert env in self.awaited, f"env {env} answered twice or unasked"
            action = self.awaited.pop(env)
            self.steps[env] += 1
            env_id, count, last_action = result["next", "observation"][row, :3].tolist()
            assert (env_id, count) == (env, self.steps[env])
            assert last_action == pytest.approx(action)


@pytest.fixture(scope="module")
def interrupted_pool():
    if threading.current_thread() is not threading.main_thread():
        pytest.fail("a SIGINT is handled in the main thread only: run this test in it")
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=counting_kwargs(NUM_ENVS), config=FAST)
    try:
        pool.reset()
        yield pool
    finally:
        pool.close()


def test_ctrl_c_at_any_line_of_a_send_or_recv_loses_nothing(interrupted_pool):
    pool, books = interrupted_pool, Books()
    interrupts = {"send": 0, "recv": 0}
    rounds_reached = 0
    for at in _SWEEP:
        idle = [env for env in range(NUM_ENVS) if env not in books.awaited]
        with LineInterrupter(at) as tracer:
            if idle:
                actions = books.actions(idle)
                try:
                    pool.async_step_send(actions, env_index=idle)
                except KeyboardInterrupt:
                    interrupts["send"] += 1
                    resend_unless_made(pool, actions, idle)
                books.sent_to(idle, actions)
            try:
                books.answered(pool.async_step_recv(min_get=1, timeout=10))
            except KeyboardInterrupt:
                interrupts["recv"] += 1
        rounds_reached += tracer.lines >= at
    while books.awaited:  # every request still in flight is answered, once
        books.answered(pool.async_step_recv(min_get=1, timeout=10))
    assert sum(books.steps) == books.sent
    assert interrupts["send"] > 20 and interrupts["recv"] > 20, interrupts
    assert rounds_reached == sum(interrupts.values())  # each SIGINT raised, none swallowed


def resend_unless_made(pool: ZMQAsyncEnvPool, actions: TensorDict, envs: list[int]) -> None:
    """An interrupted send was made in full or not at all: its envs busy, or all idle."""
    try:
        pool.async_step_send(actions, env_index=envs)  # not made: made now
    except RuntimeError as err:
        assert "still processing" in str(err), err  # made: every env of it is busy


def test_the_callers_own_handler_is_wrapped_and_called(interrupted_pool):
    """The pool wraps whatever handler is current when a call starts, and calls it once."""
    calls: list[int] = []

    def mine(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, mine)
    try:
        action = TensorDict({"action": torch.zeros(1, 1)}, [1])
        interrupted_pool.async_step_send(action, env_index=[0])
        with LineInterrupter(5):
            result = interrupted_pool.async_step_recv(min_get=1, timeout=10)
        assert calls == [signal.SIGINT]  # once, when the recv was done
        assert list(result["env_index"]) == [0]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_a_pool_call_a_ctrl_c_is_raised_at_once(interrupted_pool):
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_a_sync_call_interrupted_anywhere_leaves_the_next_one_working(interrupted_pool):
    """As with ``SerialEnv``: after a Ctrl-C in ``step`` or ``reset``, the next call runs.

    A sync call holds the interrupt to its end, waits included, so it leaves
    nothing in flight; the next call, of the other kind, finds the pool idle
    (a step interrupted in its wait used to leave every later sync call
    refused, "Some envs are still processing").
    """
    pool, actions = interrupted_pool, TensorDict({"action": torch.zeros(NUM_ENVS, 1)}, [NUM_ENVS])
    interrupted = {"step": 0, "reset": 0}
    pool.reset()
    for at in range(1, 400, 9):
        with LineInterrupter(at):
            try:
                pool.step(actions.clone())
            except KeyboardInterrupt:
                interrupted["step"] += 1
        after = pool.reset()  # the other kind: nothing of the step is left to take
        assert after["observation"][:, :2].tolist() == [[0.0, 0.0], [1.0, 0.0]]
        with LineInterrupter(at):
            try:
                pool.reset()
            except KeyboardInterrupt:
                interrupted["reset"] += 1
        after = pool.step(actions.clone())["next"]  # one step from a reset, whichever ran
        assert after["observation"][:, :2].tolist() == [[0.0, 1.0], [1.0, 1.0]]
    assert interrupted["step"] > 10 and interrupted["reset"] > 10, interrupted


@pytest.mark.parametrize("ctrl_cs", [1, 2])
def test_a_ctrl_c_while_a_failed_sync_step_settles_leaves_the_next_one_working(ctrl_cs):
    """Env 0 raises at once, env 1 steps for 1.5 s: the step waits for env 1 to drop its
    result (the pool left idle, as SerialEnv), and a Ctrl-C comes meanwhile; with two,
    the second cuts that wait short. The next sync step runs either way.

    The settling ran outside the call's hold on a Ctrl-C: the interrupt cut it short,
    env 1 stayed marked busy, and every sync call after it was refused for good
    ("Some envs are still processing"; remote-failure audit).
    """
    if threading.current_thread() is not threading.main_thread():
        pytest.fail("a SIGINT is handled in the main thread only: run this test in it")
    kwargs = [
        {"env_id": 0, "fault": "raise", "fault_at": 1, "every_episode": False},
        {"env_id": 1, "fault_at": 10**9, "step_sleep_s": (1.5, 1.5)},
    ]
    pool = ZMQAsyncEnvPool(FaultyEnv, create_env_kwargs=kwargs, config=FAST)
    actions = TensorDict({"action": torch.zeros(NUM_ENVS, 1)}, [NUM_ENVS])
    timers = [
        threading.Timer(0.4 + 0.3 * i, os.kill, (os.getpid(), signal.SIGINT))
        for i in range(ctrl_cs)
    ]
    try:
        pool.reset()
        for timer in timers:
            timer.start()
        with pytest.raises(KeyboardInterrupt):
            pool.step(actions.clone())
        for timer in timers:
            timer.join(timeout=5)
        out = pool.step(actions.clone())["next"]
        assert out["observation"][:, 0].tolist() == [0.0, 1.0]
    finally:
        for timer in timers:
            timer.cancel()
        pool.close()


def test_a_ctrl_c_while_the_next_sync_call_settles_an_interrupted_one_leaves_it_settled():
    """A step cut short by two Ctrl-Cs leaves env 1's step in flight for the next sync
    call to drop; one Ctrl-C comes while that next call waits for it. The steps after
    run: the settling is held whole, and one cut short is left for the next call again.
    It ran outside the hold: one Ctrl-C cut it short, and every sync call after it was
    refused for good ("Some envs are still processing"; review).
    """
    if threading.current_thread() is not threading.main_thread():
        pytest.fail("a SIGINT is handled in the main thread only: run this test in it")
    kwargs = [{"env_id": 0}, {"env_id": 1, "step_sleep_s": (1.5, 1.5)}]
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs, config=FAST)
    actions = TensorDict({"action": torch.zeros(NUM_ENVS, 1)}, [NUM_ENVS])
    timers = []

    def ctrl_c_in(seconds: float) -> None:
        timers.append(threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)))
        timers[-1].start()

    try:
        pool.reset()
        ctrl_c_in(0.3)
        ctrl_c_in(0.5)  # the second goes through at once: env 1's step is left in flight
        with pytest.raises(KeyboardInterrupt):
            pool.step(actions.clone())
        ctrl_c_in(0.2)  # while the next step waits for env 1 to drop its result
        with pytest.raises(KeyboardInterrupt):
            pool.step(actions.clone())
        for timer in timers:
            timer.join(timeout=5)
        for _ in range(2):
            assert pool.step(actions.clone())["next", "observation"][:, 0].tolist() == [0.0, 1.0]
    finally:
        for timer in timers:
            timer.cancel()
        pool.close()


_HANDLER_ROUND_TRIP = """
import signal
import subprocess
from zmqpool import ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}])
try:
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
finally:
    pool.close()
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
print("put back")
"""


def test_the_handler_is_put_back_when_the_last_pool_closes():
    done = subprocess.run(
        [sys.executable, "-c", _HANDLER_ROUND_TRIP], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "put back"


_GROUP_CTRL_C = """
from zmqpool import ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

kwargs = [{"env_id": i, "step_sleep_s": (0.2, 0.2)} for i in range(2)]
pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs)
try:
    action = pool.full_action_spec.zero()
    pool.reset()
    try:
        print("stepping", flush=True)
        for _ in range(300):  # a minute: the Ctrl-C comes in its first steps
            pool.step(action)
        print("never interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    pool.step(action)
    print("restarts", [stats["restarts"] for stats in pool.env_stats().values()], flush=True)
finally:
    pool.close()
"""


def test_a_terminals_ctrl_c_reaches_the_trainer_not_its_local_workers():
    """A terminal's Ctrl-C signals the trainer's whole process group: its local workers
    took it too and died (a KeyboardInterrupt in the env's step), and the pool restarted
    them, where a Ctrl-C held back is meant to leave it usable with nothing lost (CLI
    audit). Local workers ignore SIGINT: the trainer decides."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _GROUP_CTRL_C],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # its pool started, or not
        assert ready and proc.stdout.readline().strip() == "stepping", proc.poll()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert out.split("\n")[:2] == ["interrupted", "restarts [0, 0]"], (out, err[-2000:])
