"""Benchmark zmqpool against torchrl's and gymnasium's env pools, side by side.

One run steps the same envs through every pool and prints env-steps/second,
zmqpool's speed-up over each other row, and PASS/MISS against the project's
targets (informational: a MISS never changes the exit code; a row that fails
to run does, after every other row has run and the reports are written).

Scenarios (``--num-envs`` envs, 4 by default, unless stated):

- ``cheap``: :class:`~zmqpool.testing.CountingEnv` with a ``(4,)`` float32
  observation, so the transport is all there is to measure;
- ``pixel``: a ``(3, 84, 84)`` uint8 observation;
- ``1mib``: a ``(262144,)`` float32 observation (1 MiB), also in GB/s, with a
  bare pyzmq round trip of the same payload as the floor;
- ``latency``: each step sleeps uniformly in 0-4 ms; zmqpool's throughput is
  reported as a fraction of the ideal ``num_envs / 2 ms`` and of
  ``num_envs x`` the serial row's rate (the envs' step time as measured,
  ``time.sleep``'s overshoot and torchrl's own step included);
- ``roundtrip``: one env; the median latency of a single step through zmqpool
  against a bare pyzmq round trip carrying the same payload;
- ``batch32``: 64 cheap envs, 16 per worker process, a loop whose recvs use
  ``min_get=32`` (the results per recv are reported): the trainer's CPU per
  env-step when recvs return 32 or more results;
- ``mdp``: the cheap env in the loop a trainer writes: each result's
  ``step_mdp`` (its next observations and done flags as the root) goes back
  with the action set in it, so each command carries the observation too,
  as in the issue's own measurements;
- ``cartpole``: gymnasium's ``CartPole-v1``, ``AsyncVectorEnv`` of
  ``gymnasium.make`` (which autoresets) against zmqpool over torchrl's
  ``GymEnv`` stepped with ``async_step_and_maybe_reset_*``, random actions;
- ``scale16`` ... ``scale1024`` (only with ``--scale`` or ``--scenarios scale``):
  16, 128, 512 and 1024 envs whose steps sleep 40-60 ms, 16 envs per worker in
  zmqpool and in torchrl's shm pool; steps/s as a share of the ideal
  ``num_envs / 50 ms``, trainer CPU per env-step, start-up (construction and
  first reset), close, and memory per env (PSS of the process tree from
  ``/proc/PID/smaps_rollup``). A row whose estimated memory does not fit in
  ``MemAvailable`` is skipped with its reason printed.

Any row whose trainer process ran a full garbage collection in its measured
window says how many, and their CPU per env-step (part of the trainer's).

Rows: ``zmqpool`` (``ZMQAsyncEnvPool``), ``torchrl-queue`` and ``torchrl-shm``
(torchrl's ``AsyncEnvPool``, multiprocessing backend) all run the loop a
trainer runs: send an action to every env, then repeatedly
``async_step_recv(min_get=1)`` and send new actions to the envs that came
back. ``parallelenv`` is torchrl's ``ParallelEnv`` stepped synchronously,
``zmqpool-sync`` zmqpool's synchronous ``pool.step(td)`` the same way,
``zmqpool-packed`` (cheap) the ``zmqpool`` row's envs all in one worker process
(``envs_per_worker=num_envs``; the line under the table sets its CPU per
env-step and results per recv beside the ``zmqpool`` row's),
``zmqpool-inline`` (batch32) zmqpool without env threads (``PoolConfig(env_threads=False)``:
each worker steps its envs in turn and answers a call's commands in one message),
``serial`` the same envs stepped one after another in this process,
``gym-async`` gymnasium's ``AsyncVectorEnv`` (``step_async``/``step_wait``) of
the numpy twin :class:`~zmqpool.benchenvs.CountingGymEnv`, ``gym-serial`` that
twin stepped in this process, and ``bare-zmq`` a ROUTER/DEALER request with a
PUSH/PULL reply to echo subprocesses, one request in flight per peer.

Three hand-written pyzmq pools of the scenario's own envs set a bar beside
zmqpool's: ``zmq-floor`` (cheap, pixel, 1mib, latency, roundtrip) is
``bare-zmq`` whose peers (:func:`zmqpool.benchfloor.floor_peer`) step their
``CountingEnv`` as zmqpool's workers do (``workers.hosting.step_next``) and
answer with its observation, reward and done as raw frames, the trainer
receiving and resending and building no tensors; ``zmq-plain`` (cheap) is the
same with a trainer side written plainly as a pool: each recv's replies
stacked into a TensorDict with its ``env_index``, then the loop the pool rows
run; ``zmq-lean`` (cheap) returns zmqpool's own result (``action`` and all five
leaves of ``"next"``) built with the least Python tensordict allows (one
``torch.frombuffer`` per leaf over its joined rows, ``TensorDict._new_unsafe``),
then the same loop: what returning these TensorDicts costs a trainer in Python
at the least, however its transport is written. None has request ids, checks
or restarts. Each is judged on every target of zmqpool's in its scenario, in
zmqpool's place, and a line under the table per target says whether it meets
it: a target ``zmq-floor`` misses is beyond a pool that crosses processes
through ZeroMQ on this machine and does nothing else, one ``zmq-lean`` misses
is beyond any trainer that hands the user these TensorDicts built in Python,
and one a hand-written row meets and zmqpool misses is zmqpool's own gap. The
JSON's ``floor_targets`` holds those verdicts (``as``: the row judged).

Every row measures env-steps for ``--seconds`` of wall time after a warm-up,
and (on Linux) the CPU time and context switches of every thread of the
process tree (this process and its workers) per env-step;
building the pool and its first reset are not counted. Actions carry only the
``action`` key (``mdp``: the result's ``step_mdp`` with its action); results are
not copied further.

Before the rows, the run times one :class:`~zmqpool.testing.CountingEnv` step
in its own process, back to back and after sleeping 1 ms and 50 ms, and
prints the ratios (the *idle penalty*: what running in short bursts between
sleeps costs this machine, as every pool's processes do), then, for each
scale scenario, how many CPUs the envs' own steps need at the ideal rate at
the cold cost, and how many the row's own CPU per env-step (trainer and
workers, as measured) needs there: the most of the ideal rate this machine
allows at that cost. The JSON's ``meta.idle_penalty`` holds the figures.
It also bounces a byte through a pipe to another process and back and prints
what a round trip takes, wall and CPU (the *wake cost*: every message of a
pool wakes a thread blocked on it; ``meta.wake_cost``).

``--repeat N`` runs the whole plan N times, interleaved: round 1 measures every
(scenario, row) once in plan order, then round 2 again, and so on, so a row and
its reference alternate in time and the machine's drift hits both. Each row of
the table is then the median of its runs that measured (every figure on its
own: steps/s, CPU, switches, latency, GB/s, start-up, close, PSS ...), and
ratios and targets are judged on those medians as on a single run. A repeated
row says so in its ``detail`` cell (``median of 3 (4,010-4,190)``: its runs'
range of steps/s; ``median of 2 of 3`` if a run failed or was skipped). The
JSON rows gain ``runs`` (the runs measured and combined), ``rounds`` (tried),
``steps_per_s_min``/``steps_per_s_max`` and ``individual_runs`` (each run's own
row, errors and skips included); ``meta.repeat`` is N. Without it (N = 1) the
table is a single run's, ``runs``/``rounds`` are 1 (``runs`` 0 for a row that
failed), the spread is null and there is no ``individual_runs``. Any failed run
makes the exit code 1.

Usage::

    python scripts/bench.py --scale            # every row of the issue, one run (~7 min)
    python scripts/bench.py                    # all but the scale rows, ~3 s per row
    python scripts/bench.py --quick --scale    # a smoke run, under a minute
    python scripts/bench.py --scenarios cheap,1mib,scale128 --repeat 3   # medians of 3 rounds
    python scripts/bench.py --scenarios cheap,roundtrip --rows zmqpool,torchrl-shm \\
        --json bench_results/run.json --plot bench_results/run.png
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
import torchrl
import zmq
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import AsyncEnvPool, EnvBase, GymEnv, ParallelEnv
from torchrl.envs.utils import step_mdp

# Measure the checkout this script lives in, whichever zmqpool is installed
# (an editable install may point at another clone); workers inherit sys.path.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from zmqpool import benchenvs, benchfloor  # noqa: E402
from zmqpool.argtypes import positive_int, positive_seconds  # noqa: E402
from zmqpool.assembly import env_index_stack  # noqa: E402
from zmqpool.benchenvs import STOP, CountingGymEnv  # noqa: E402
from zmqpool.benchfloor import REPLY_KEYS, env_kwargs_to_json  # noqa: E402
from zmqpool.testing import CountingEnv  # noqa: E402

Tick = Callable[[], int]
"""One unit of work of a row: steps some envs and returns how many env-steps it did."""
RowFn = Callable[["Scenario", "Config"], contextlib.AbstractContextManager[Tick]]

REF = "zmqpool"
ALL_ROWS = (
    "zmqpool",
    "torchrl-queue",
    "torchrl-shm",
    "parallelenv",
    "serial",
    "gym-async",
    "gym-serial",
    "bare-zmq",
    "zmqpool-tcp",
    "zmqpool-sync",
    "zmqpool-inline",
    "zmqpool-packed",
    "zmq-floor",
    "zmq-plain",
    "zmq-lean",
)
#: The row of zmqpool whose envs all live in one worker process (``envs_per_worker=num_envs``).
PACKED = "zmqpool-packed"
#: A hand-written pyzmq pool of the same envs (:class:`ZmqFloor`): what the transport allows.
FLOOR = "zmq-floor"
#: The same peers, the trainer side returning pool-shaped results, written plainly
#: (:class:`PlainZmqPool`).
PLAIN = "zmq-plain"
#: The same peers, the trainer side returning zmqpool's own result built with the least
#: Python tensordict allows (:class:`LeanZmqPool`).
LEAN = "zmq-lean"
#: The hand-written rows judged on zmqpool's targets in its place (:func:`floor_text`).
HAND_WRITTEN = (FLOOR, PLAIN, LEAN)
POOL_ROWS = ALL_ROWS[:5]
#: Rows that run :class:`AsyncLoop` (or the cartpole loop): their ticks are recvs.
ASYNC_ROWS = frozenset(
    {
        "zmqpool",
        "torchrl-queue",
        "torchrl-shm",
        "zmqpool-tcp",
        "zmqpool-inline",
        PACKED,
        *HAND_WRITTEN,
    }
)


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    """What the envs look like and which rows step them."""

    name: str
    obs_shape: tuple[int, ...]
    rows: tuple[str, ...]
    obs_dtype: torch.dtype = torch.float32
    step_sleep_s: tuple[float, float] = (0.0, 0.0)
    num_envs: int | None = None  # None: --num-envs
    report_gbps: bool = False
    #: ``"counting"``: :class:`CountingEnv`; ``"cartpole"``: gymnasium's CartPole-v1.
    env: str = "counting"
    #: ``min_get`` of the async loop's recvs.
    min_get: int = 1
    #: envs per worker process of the async pools (``None``: ``--envs-per-worker``).
    envs_per_worker: int | None = None
    #: a scale row: also start-up, close and memory (PSS) per env.
    scale: bool = False
    #: the async loop sends ``step_mdp`` of each result with its action set (what a
    #: trainer's loop sends: observations and done flags too), not a fresh action batch.
    mdp: bool = False

    @property
    def payload_bytes(self) -> int:
        """Bytes of one observation."""
        return int(np.prod(self.obs_shape)) * self.obs_dtype.itemsize

    def envs(self, cfg: Config) -> int:
        return self.num_envs or cfg.num_envs

    def per_worker(self, cfg: Config) -> int:
        return self.envs_per_worker or cfg.envs_per_worker

    def workers(self, cfg: Config) -> int:
        """Worker processes of an async pool (zmqpool's or torchrl's) in this scenario."""
        return -(-self.envs(cfg) // self.per_worker(cfg))

    def row_timeout_s(self, cfg: Config) -> float:
        """The row watchdog: scale rows start and close many workers on 2 cores."""
        return max(cfg.row_timeout_s, 900.0) if self.scale else cfg.row_timeout_s

    def ideal_steps_per_s(self, num_envs: int) -> float | None:
        """``num_envs / mean step latency`` for sleeping envs, else ``None``."""
        mean_sleep = sum(self.step_sleep_s) / 2
        return num_envs / mean_sleep if mean_sleep > 0 else None

    def env_kwargs(self, num_envs: int) -> list[dict[str, Any]]:
        """``CountingEnv`` kwargs per env; defaults left out so they stay plain data."""
        extra: dict[str, Any] = {"obs_shape": self.obs_shape}
        if self.obs_dtype != torch.float32:
            extra["obs_dtype"] = self.obs_dtype
        if self.step_sleep_s[1] > 0:
            extra["step_sleep_s"] = self.step_sleep_s
        return [{"env_id": i, **extra} for i in range(num_envs)]


#: Env counts of the scale scenarios (``--scale``), and of their ``--quick`` version.
SCALE_ENVS = (16, 128, 512, 1024)
QUICK_SCALE_ENVS = (16,)
#: The scale scenarios' envs per worker process (zmqpool's and torchrl's shm pool alike).
SCALE_PER_WORKER = 16
#: What a scale row's step sleeps (uniform): ideal is ``num_envs / 50 ms``.
SCALE_SLEEP_S = (0.040, 0.060)


def build_scenarios(quick: bool) -> dict[str, Scenario]:
    """The scenario table; ``quick`` shrinks payloads and keeps the rows that matter most.

    The scale scenarios (``scale16`` ... ``scale1024``) are in it; :func:`select`
    runs them only when asked to.
    """
    pixel = (3, 16, 16) if quick else (3, 84, 84)
    big = (16_384,) if quick else (262_144,)
    cheap_rows = (
        *POOL_ROWS,
        "zmqpool-sync",
        "zmqpool-tcp",
        PACKED,
        "gym-async",
        "gym-serial",
        *HAND_WRITTEN,
    )
    scenarios = [
        Scenario("cheap", (4,), cheap_rows),
        Scenario("pixel", pixel, (*POOL_ROWS, FLOOR), obs_dtype=torch.uint8),
        Scenario("1mib", big, (*POOL_ROWS, "zmqpool-tcp", "bare-zmq", FLOOR), report_gbps=True),
        Scenario("latency", (4,), (*POOL_ROWS, FLOOR), step_sleep_s=(0.0, 0.004)),
        Scenario("roundtrip", (4,), ("zmqpool", "bare-zmq", FLOOR), num_envs=1),
        Scenario(
            "batch32",
            (4,),
            ("zmqpool", "torchrl-shm", "zmqpool-inline"),
            num_envs=64,
            min_get=32,
            envs_per_worker=16,
        ),
        Scenario("cartpole", (4,), ("zmqpool", "gym-async"), env="cartpole"),
        Scenario("mdp", (4,), ("zmqpool", "torchrl-shm"), mdp=True),
    ]
    scenarios += [
        Scenario(
            f"scale{n}",
            (4,),
            ("zmqpool", "torchrl-shm"),
            step_sleep_s=SCALE_SLEEP_S,
            num_envs=n,
            envs_per_worker=SCALE_PER_WORKER,
            scale=True,
        )
        for n in SCALE_ENVS
    ]
    if quick:
        scenarios = [
            replace(s, rows=QUICK_ROWS.get(s.name, s.rows))
            for s in scenarios
            if s.name in QUICK_ROWS or s.scale
        ]
    return {s.name: s for s in scenarios}


#: ``--quick``'s rows: every row function runs once somewhere, the cheapest reference elsewhere.
QUICK_ROWS: dict[str, tuple[str, ...]] = {
    "cheap": (
        "zmqpool",
        "torchrl-shm",
        "parallelenv",
        "serial",
        "zmqpool-sync",
        PACKED,
        "gym-async",
        "gym-serial",
        *HAND_WRITTEN,
    ),
    "pixel": ("zmqpool", "serial"),
    "1mib": ("zmqpool", "bare-zmq"),
    "latency": ("zmqpool", "serial"),
    "roundtrip": ("zmqpool", "bare-zmq"),
    "batch32": ("zmqpool", "zmqpool-inline"),
    "cartpole": ("zmqpool", "gym-async"),
    "mdp": ("zmqpool", "torchrl-shm"),
}
#: ``--scenarios scale`` stands for the scale scenarios (with ``--quick``: 16 envs only).
SCALE_ALIAS = "scale"


def select(
    table: dict[str, Scenario], picked: list[str] | None, scale: bool, quick: bool
) -> list[Scenario]:
    """The scenarios to run: ``picked`` (``scale`` expanded) or every non-scale one,
    plus the scale ones with ``scale`` (``--scale``)."""
    scale_names = [
        n for n, sc in table.items() if sc.scale and (not quick or sc.num_envs in QUICK_SCALE_ENVS)
    ]
    wanted = picked or [n for n, sc in table.items() if not sc.scale]
    if scale and SCALE_ALIAS not in wanted:
        wanted = [*wanted, SCALE_ALIAS]
    names_: list[str] = []
    for n in wanted:
        for m in scale_names if n == SCALE_ALIAS else [n]:
            if m not in names_:
                names_.append(m)
    return [table[n] for n in names_ if n in table]


@dataclass(frozen=True)
class Config:
    """How long and how wide each row runs."""

    seconds: float
    warmup_s: float
    num_envs: int
    recv_timeout_s: float = 30.0
    row_timeout_s: float = 300.0
    #: envs per worker process of the async pools (zmqpool's and torchrl's alike).
    envs_per_worker: int = 1


@dataclass
class RowResult:
    """One row's measurement (or the error that stopped it)."""

    scenario: str
    row: str
    num_envs: int
    payload_bytes: int
    envs_per_worker: int = 1
    steps: int = 0
    seconds: float = 0.0
    construct_s: float = 0.0
    steps_per_s: float = 0.0
    gb_per_s: float | None = None
    median_latency_us: float | None = None
    ideal_steps_per_s: float | None = None
    #: CPU time (every thread of this process and of its descendants) per env-step.
    cpu_us_per_step: float | None = None
    #: The part of ``cpu_us_per_step`` spent in this (the trainer's) process.
    trainer_cpu_us_per_step: float | None = None
    #: Context switches (voluntary + involuntary, same threads) per env-step.
    switches_per_step: float | None = None
    #: Results per ``async_step_recv`` (async loop rows): env-steps over recvs.
    results_per_recv: float | None = None
    #: This (the trainer's) process's full garbage collections in the measured window,
    #: and their CPU per env-step (part of ``trainer_cpu_us_per_step``).
    full_collections: int | None = None
    gc_us_per_step: float | None = None
    #: Scale rows: closing the pool (draining in-flight steps included).
    close_s: float | None = None
    #: Scale rows: PSS of the process tree (trainer + descendants), total and the trainer's.
    pss_mb: float | None = None
    trainer_pss_mb: float | None = None
    #: Scale rows: ``pss_mb / num_envs``.
    pss_mb_per_env: float | None = None
    #: Why the row was not run (printed; e.g. not enough free memory). Not an error.
    skipped: str | None = None
    error: str | None = None
    #: ``--repeat``: the runs of this cell measured and combined (their medians above),
    #: out of ``rounds`` attempted; a run that errored or was skipped is not counted.
    runs: int = 1
    rounds: int = 1
    #: ``--repeat`` > 1: the slowest and fastest of the ``runs`` measured (``None``: one run).
    steps_per_s_min: float | None = None
    steps_per_s_max: float | None = None


# --------------------------------------------------------------------------- async pool rows


def action_td(num: int) -> TensorDict:
    """A fresh batch of actions (the pools write ``env_index`` into what they are sent)."""
    return TensorDict({"action": torch.zeros(num, 1)}, batch_size=[num])


def env_indices(result: TensorDictBase) -> list[int]:
    """The ``env_index`` entries of a pool result as ints (tensor or non-tensor stack)."""
    index = result.get("env_index")
    if isinstance(index, torch.Tensor):
        return [int(i) for i in index.reshape(-1).tolist()]
    if hasattr(index, "tolist"):
        index = index.tolist()
    return [int(i) for i in index]


class AsyncLoop:
    """A trainer's loop on an async pool: keep every env busy, resend as results arrive."""

    def __init__(
        self, pool: Any, num_envs: int, timeout_s: float, min_get: int = 1, mdp: bool = False
    ) -> None:
        self.pool = pool
        self.num_envs = num_envs
        self.timeout_s = timeout_s
        self.min_get = min_get
        self.mdp = mdp
        first = pool.reset()
        if mdp:  # what every later round sends: one set of keys in every batch of inputs
            first.set("action", torch.zeros(num_envs, 1))
        else:
            first = action_td(num_envs)
        pool.async_step_send(first, env_index=list(range(num_envs)))

    def __call__(self) -> int:
        # No ``timeout`` here: torchrl treats it as a deadline and, once ``min_get``
        # results are in, keeps collecting until it expires. The row watchdog bounds this.
        result = self.pool.async_step_recv(min_get=self.min_get)
        done = env_indices(result)
        self.pool.async_step_send(self._next_input(result, len(done)), env_index=done)
        return len(done)

    def _next_input(self, result: TensorDictBase, count: int) -> TensorDictBase:
        if not self.mdp:
            return action_td(count)
        td = step_mdp(result)  # the next observations and done flags become the root
        td.set("action", torch.zeros(count, 1))  # the policy's output
        return td

    def drain(self) -> None:
        """Collect the steps still in flight so the pool closes idle."""
        n = self.num_envs
        self.pool.async_step_recv(min_get=n, max_get=n, timeout=self.timeout_s)


@contextlib.contextmanager
def async_pool_row(
    make_pool: Callable[[], Any], num_envs: int, cfg: Config, min_get: int = 1, mdp: bool = False
) -> Iterator[Tick]:
    """Build a pool, yield its :class:`AsyncLoop`, always close it."""
    pool = make_pool()
    try:
        loop = AsyncLoop(pool, num_envs, cfg.recv_timeout_s, min_get, mdp)
        yield loop
        loop.drain()
    finally:
        pool.close()


def zmqpool_class() -> type:
    """``zmqpool.ZMQAsyncEnvPool``, imported late so the other rows run without it."""
    pool_cls = getattr(importlib.import_module("zmqpool"), "ZMQAsyncEnvPool", None)
    if pool_cls is None:
        raise RuntimeError("zmqpool.ZMQAsyncEnvPool does not exist (yet)")
    return pool_cls


def make_zmqpool(sc: Scenario, num_envs: int, **pool_kwargs: Any) -> Any:
    return zmqpool_class()(
        [CountingEnv] * num_envs, create_env_kwargs=sc.env_kwargs(num_envs), **pool_kwargs
    )


def zmqpool_row(sc: Scenario, cfg: Config) -> contextlib.AbstractContextManager[Tick]:
    if sc.env == "cartpole":
        return cartpole_zmqpool_row(sc, cfg)
    num_envs = sc.envs(cfg)
    make = partial(make_zmqpool, sc, num_envs, envs_per_worker=sc.per_worker(cfg))
    return async_pool_row(make, num_envs, cfg, sc.min_get, sc.mdp)


@contextlib.contextmanager
def zmqpool_sync_row(sc: Scenario, cfg: Config) -> Iterator[Tick]:
    """zmqpool's synchronous ``pool.step(td)``: every env, one batch per tick, like ParallelEnv.

    Each tick steps a fresh action batch, as a policy's output would be (``step``
    writes ``"next"`` into its input, which a second step would send again).
    """
    num_envs = sc.envs(cfg)
    pool = make_zmqpool(sc, num_envs, envs_per_worker=sc.per_worker(cfg))
    try:
        pool.reset()
        yield lambda: pool.step(action_td(num_envs)).batch_size[0]
    finally:
        pool.close()


def zmqpool_tcp_row(
    sc: Scenario, cfg: Config, tcp_kwargs: dict[str, Any]
) -> contextlib.AbstractContextManager[Tick]:
    """zmqpool with its workers connecting over TCP loopback instead of ipc.

    ``zmqpool / zmqpool-tcp`` is the price of TCP on one host; across hosts the
    network adds its own.
    """
    num_envs = sc.envs(cfg)
    make = partial(make_zmqpool, sc, num_envs, envs_per_worker=sc.per_worker(cfg), **tcp_kwargs)
    return async_pool_row(make, num_envs, cfg, sc.min_get, sc.mdp)


def zmqpool_inline_row(sc: Scenario, cfg: Config) -> contextlib.AbstractContextManager[Tick]:
    """zmqpool with ``PoolConfig(env_threads=False)``: a worker steps its envs in its main thread.

    A worker's commands of one call then run one after another and their
    replies go back as one message; with env threads (the default) each reply
    goes when its env is done.
    """
    config = importlib.import_module("zmqpool").PoolConfig(env_threads=False)
    num_envs = sc.envs(cfg)
    make = partial(make_zmqpool, sc, num_envs, envs_per_worker=sc.per_worker(cfg), config=config)
    return async_pool_row(make, num_envs, cfg, sc.min_get, sc.mdp)


def zmqpool_packed_row(sc: Scenario, cfg: Config) -> contextlib.AbstractContextManager[Tick]:
    """zmqpool's async loop with every env in one worker process (defaults otherwise).

    The same envs and loop as the ``zmqpool`` row, which hosts one env per
    worker as torchrl's pools do: beside it, what a message's fixed costs (a
    worker's wake-up, its reads and sends, a recv's call) weigh in a cheap step.
    """
    num_envs = sc.envs(cfg)
    make = partial(make_zmqpool, sc, num_envs, envs_per_worker=num_envs)
    return async_pool_row(make, num_envs, cfg, sc.min_get, sc.mdp)


def row_envs_per_worker(sc: Scenario, row: str, cfg: Config) -> int:
    """Envs per worker process of ``row`` in ``sc`` (the packed row: all of them)."""
    return sc.envs(cfg) if row == PACKED else sc.per_worker(cfg)


def torchrl_pool_row(
    sc: Scenario, cfg: Config, exchange: str
) -> contextlib.AbstractContextManager[Tick]:
    num_envs = sc.envs(cfg)
    make_pool = partial(
        AsyncEnvPool,
        [CountingEnv] * num_envs,
        backend="multiprocessing",
        exchange=exchange,
        create_env_kwargs=sc.env_kwargs(num_envs),
        envs_per_worker=sc.per_worker(cfg),
    )
    return async_pool_row(make_pool, num_envs, cfg, sc.min_get, sc.mdp)


# --------------------------------------------------------------------------- CartPole-v1

#: Random CartPole actions are drawn up front, this many batches, and cycled through.
ACTION_BATCHES = 64


class CartPoleLoop:
    """A trainer's loop on zmqpool over torchrl's ``GymEnv("CartPole-v1")``.

    Episodes end every few dozen steps: each env steps with
    ``async_step_and_maybe_reset_send`` (the worker resets a done env and
    returns its next root), as a torchrl collector steps a pool. Actions are
    random one-hot (the spec's encoding), drawn up front.
    """

    def __init__(self, pool: Any, num_envs: int, timeout_s: float, seed: int = 0) -> None:
        self.pool = pool
        self.num_envs = num_envs
        self.timeout_s = timeout_s
        gen = torch.Generator().manual_seed(seed)
        choice = torch.randint(0, 2, (ACTION_BATCHES, num_envs), generator=gen)
        dtype = pool.action_spec.dtype
        self.actions = torch.nn.functional.one_hot(choice, 2).to(dtype)
        self.count = 0
        pool.reset()
        self._send(list(range(num_envs)))

    def _send(self, envs: list[int]) -> None:
        self.count += 1
        action = self.actions[self.count % ACTION_BATCHES, envs]
        td = TensorDict({"action": action}, batch_size=[len(envs)])
        self.pool.async_step_and_maybe_reset_send(td, env_index=envs)

    def __call__(self) -> int:
        result, _next_root = self.pool.async_step_and_maybe_reset_recv(min_get=1)
        done = env_indices(result)
        self._send(done)
        return len(done)

    def drain(self) -> None:
        n = self.num_envs
        self.pool.async_step_and_maybe_reset_recv(min_get=n, max_get=n, timeout=self.timeout_s)


@contextlib.contextmanager
def cartpole_zmqpool_row(sc: Scenario, cfg: Config) -> Iterator[Tick]:
    num_envs = sc.envs(cfg)
    make_env = partial(GymEnv, "CartPole-v1")
    pool = zmqpool_class()([make_env] * num_envs, envs_per_worker=sc.per_worker(cfg))
    try:
        loop = CartPoleLoop(pool, num_envs, cfg.recv_timeout_s)
        yield loop
        loop.drain()
    finally:
        pool.close()


@contextlib.contextmanager
def cartpole_gym_async_row(sc: Scenario, cfg: Config) -> Iterator[Tick]:
    """gymnasium's ``AsyncVectorEnv`` of ``gymnasium.make("CartPole-v1")`` (it autoresets)."""
    num_envs = sc.envs(cfg)
    fns = [partial(gymnasium.make, "CartPole-v1") for _ in range(num_envs)]
    venv = gymnasium.vector.AsyncVectorEnv(fns, context="fork")
    try:
        venv.reset(seed=0)
        rng = np.random.default_rng(0)
        actions = rng.integers(0, 2, (ACTION_BATCHES, num_envs))
        count = 0

        def tick() -> int:
            nonlocal count
            count += 1
            venv.step_async(actions[count % ACTION_BATCHES])
            venv.step_wait(timeout=cfg.recv_timeout_s)
            return num_envs

        yield tick
    finally:
        venv.close(timeout=cfg.recv_timeout_s, terminate=True)


# --------------------------------------------------------------------------- sync rows


@contextlib.contextmanager
def parallel_env_row(sc: Scenario, cfg: Config) -> Iterator[Tick]:
    """torchrl's ``ParallelEnv``: one synchronous ``step`` of all workers per tick."""
    num_envs = sc.envs(cfg)
    env = ParallelEnv(num_envs, CountingEnv, create_env_kwargs=sc.env_kwargs(num_envs))
    try:
        env.reset()
        actions = action_td(num_envs)
        yield lambda: env.step(actions).batch_size[0]
    finally:
        env.close(raise_if_closed=False)


def step_serially(envs: list[EnvBase], tds: list[TensorDict]) -> int:
    for env, td in zip(envs, tds, strict=True):
        env.step(td)
    return len(envs)


@contextlib.contextmanager
def serial_row(sc: Scenario, cfg: Config) -> Iterator[Tick]:
    """The same envs in this process, ``env.step`` one after another: no pool at all."""
    envs = [CountingEnv(**kwargs) for kwargs in sc.env_kwargs(sc.envs(cfg))]
    try:
        for env in envs:
            env.reset()
        tds = [TensorDict({"action": torch.zeros(1)}) for _ in envs]
        yield partial(step_serially, envs, tds)
    finally:
        for env in envs:
            env.close()


@contextlib.contextmanager
def gym_async_row(sc: Scenario, cfg: Config) -> Iterator[Tick]:
    """gymnasium's ``AsyncVectorEnv`` of the numpy twin, all envs per ``step_async``/``wait``.

    ``context="fork"`` is gymnasium's own default on Linux; importing torchrl
    switched this process's default to spawn, which would only add start-up time.
    """
    if sc.env == "cartpole":
        with cartpole_gym_async_row(sc, cfg) as tick:
            yield tick
        return
    num_envs = sc.envs(cfg)
    fns = [partial(CountingGymEnv, env_id=i) for i in range(num_envs)]
    venv = gymnasium.vector.AsyncVectorEnv(fns, context="fork")
    try:
        venv.reset(seed=0)
        actions = np.zeros((num_envs, 1), dtype=np.float32)

        def tick() -> int:
            venv.step_async(actions)
            venv.step_wait(timeout=cfg.recv_timeout_s)
            return num_envs

        yield tick
    finally:
        venv.close(timeout=cfg.recv_timeout_s, terminate=True)


def step_gym_serially(envs: list[CountingGymEnv], action: np.ndarray) -> int:
    for env in envs:
        env.step(action)
    return len(envs)


@contextlib.contextmanager
def gym_serial_row(sc: Scenario, cfg: Config) -> Iterator[Tick]:
    """The numpy twin stepped in this process, one env after another."""
    envs = [CountingGymEnv(env_id=i) for i in range(sc.envs(cfg))]
    try:
        for i, env in enumerate(envs):
            env.reset(seed=i)
        yield partial(step_gym_serially, envs, np.zeros(1, dtype=np.float32))
    finally:
        for env in envs:
            env.close()


# --------------------------------------------------------------------------- bare pyzmq


# Runs benchenvs.py by path, so the peer skips the zmqpool package's (torch) imports.
ECHO_BOOT = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


class BareZmqEcho:
    """The transport floor: a ROUTER sends each echo peer (a subprocess running
    :func:`zmqpool.benchenvs.echo_peer`) an action-sized request over DEALER; the
    peer answers with an observation-sized payload over PUSH to our PULL.
    """

    REQUEST = np.zeros(1, dtype=np.float32).tobytes()

    def __init__(self, num_peers: int, nbytes: int, timeout_s: float) -> None:
        self.timeout_ms = int(timeout_s * 1000)
        self.tmpdir = tempfile.mkdtemp(prefix="zmqpool-bench-")
        self.ctx = zmq.Context()
        self.router = self._bind(zmq.ROUTER, "router")
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.pull = self._bind(zmq.PULL, "pull")
        self.peers = [str(i).encode() for i in range(num_peers)]
        self.procs = [self._spawn_peer(peer, nbytes) for peer in self.peers]

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{self.tmpdir}/{name}")
        return sock

    def _spawn_peer(self, peer: bytes, nbytes: int) -> subprocess.Popen:
        addrs = [sock.getsockopt_string(zmq.LAST_ENDPOINT) for sock in (self.router, self.pull)]
        args = [benchenvs.__file__, *addrs, peer.decode(), str(nbytes)]
        return subprocess.Popen([sys.executable, "-c", ECHO_BOOT, *args], cwd=self.tmpdir)

    def _poll(self, sock: zmq.Socket) -> None:
        if not sock.poll(self.timeout_ms):
            raise TimeoutError(f"bare-zmq: nothing within {self.timeout_ms} ms")

    def start(self) -> None:
        """Wait for every peer's hello, then put one request in flight per peer."""
        for _ in self.peers:
            self._poll(self.router)
            self.router.recv_multipart()
        self.send(self.peers)

    def send(self, peers: list[bytes]) -> None:
        for peer in peers:
            self.router.send_multipart([peer, self.REQUEST])

    def __call__(self) -> int:
        """Wait for one reply, take any others already there, resend to those peers."""
        self._poll(self.pull)
        done = [self.pull.recv_multipart(copy=False)[0].bytes]
        while self.pull.poll(0):
            done.append(self.pull.recv_multipart(copy=False)[0].bytes)
        self.send(done)
        return len(done)

    def close(self) -> None:
        for peer in self.peers:
            with contextlib.suppress(zmq.ZMQError):
                self.router.send_multipart([peer, STOP])
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@contextlib.contextmanager
def bare_zmq_row(sc: Scenario, cfg: Config) -> Iterator[Tick]:
    echo = BareZmqEcho(sc.envs(cfg), sc.payload_bytes, cfg.recv_timeout_s)
    try:
        echo.start()
        yield echo
    finally:
        echo.close()


class ZmqFloor(BareZmqEcho):
    """What a hand-written pyzmq pool reaches with the scenario's envs: :class:`BareZmqEcho`'s
    sockets, each peer a :func:`zmqpool.benchfloor.floor_peer` that steps its own
    ``CountingEnv`` as zmqpool's workers do and replies with raw frames.

    The trainer side only receives and resends, building no tensors: an upper
    bound on any pool that runs these envs in worker processes on this machine.
    """

    #: The leaves of each step's ``"next"`` a peer sends back, in this order.
    reply_keys: tuple[str, ...] = REPLY_KEYS

    def __init__(self, env_kwargs: list[dict[str, Any]], timeout_s: float) -> None:
        self.env_kwargs = env_kwargs
        super().__init__(len(env_kwargs), 0, timeout_s)

    def _spawn_peer(self, peer: bytes, nbytes: int) -> ForkedPeer:  # type: ignore[override]
        addrs = [sock.getsockopt_string(zmq.LAST_ENDPOINT) for sock in (self.router, self.pull)]
        kwargs = env_kwargs_to_json(self.env_kwargs[int(peer)])
        argv = [*addrs, peer.decode(), kwargs, ",".join(self.reply_keys)]
        process = floor_peers().Process(target=benchfloor.main, args=(argv,), daemon=True)
        process.start()
        return ForkedPeer(process)


def floor_peers() -> Any:
    """Where floor peers come from: multiprocessing's fork server, which imports
    :mod:`zmqpool.benchfloor` (torch, tensordict, torchrl) once per run and forks each
    peer. A fresh interpreter a peer spent about 4 s of CPU on imports, and a row's
    build as long; a peer runs the same code either way."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "zmqpool.benchfloor"])  # before it starts
    return context


class ForkedPeer:
    """A floor peer's process, ended as :meth:`BareZmqEcho.close` ends a ``Popen``."""

    def __init__(self, process: Any) -> None:
        self.process = process

    def wait(self, timeout: float) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("floor peer", timeout)
        return int(self.process.exitcode)

    def kill(self) -> None:
        self.process.kill()


class PlainZmqPool(ZmqFloor):
    """:class:`ZmqFloor` whose trainer side returns what a pool's recv returns and runs the
    loop :class:`AsyncLoop` runs on it: each recv's replies stacked into a TensorDict
    (``"next"``'s observation, reward and done, and ``env_index`` as the
    ``NonTensorStack`` torchrl's pool gives), then ``env_index`` read back and a fresh
    action batch sent, a row to each env.

    No request ids, no checks, no restarts, and tensordict's own ``TensorDict`` and
    ``torch.stack`` where zmqpool has its own assembly: what a drop-in pool
    written plainly, without zmqpool's guarantees, spends. Not a bound: a
    pool's assembly can be cheaper than this one's.
    """

    def __init__(self, env_kwargs: list[dict[str, Any]], timeout_s: float) -> None:
        super().__init__(env_kwargs, timeout_s)
        spec = CountingEnv(**env_kwargs[0]).observation_spec["observation"]
        self.obs_shape, self.obs_dtype = spec.shape, spec.dtype

    def __call__(self) -> int:
        """One round of :class:`AsyncLoop`: a result, its ``env_index`` read, actions sent."""
        done = env_indices(self.recv_result())
        self.send_actions(done, action_td(len(done)))
        return len(done)

    def recv_result(self) -> TensorDict:
        """Wait for one reply, take any others already there: the result of those envs."""
        self._poll(self.pull)
        replies = [self.pull.recv_multipart(copy=False)]
        while self.pull.poll(0):
            replies.append(self.pull.recv_multipart(copy=False))
        return self._result(replies)

    def send_actions(self, envs: list[int], actions: TensorDict) -> None:
        """Send each of ``envs`` its row of ``actions["action"]``."""
        for env, action in zip(envs, actions.get("action").numpy(), strict=True):
            self.router.send_multipart([self.peers[env], action])

    def _result(self, replies: list[list[zmq.Frame]]) -> TensorDict:
        def leaf(i: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
            rows = [torch.frombuffer(bytearray(r[i].buffer), dtype=dtype) for r in replies]
            return torch.stack(rows).reshape(len(replies), *shape)

        nxt = TensorDict(
            {
                "observation": leaf(1, self.obs_dtype, self.obs_shape),
                "reward": leaf(2, torch.float32, torch.Size((1,))),
                "done": leaf(3, torch.bool, torch.Size((1,))),
            },
            batch_size=[len(replies)],
        )
        result = TensorDict({"next": nxt}, batch_size=[len(replies)])
        result.set("env_index", env_index_stack([int(r[0].bytes) for r in replies]))
        return result


class LeanZmqPool(PlainZmqPool):
    """:class:`PlainZmqPool` returning what zmqpool's recv returns for these envs (the
    ``action`` each env was sent, every leaf of ``"next"`` and ``env_index``), built with
    the least Python tensordict allows: per leaf one ``bytearray.join`` of its rows and
    one ``torch.frombuffer``, then ``TensorDict._new_unsafe`` and zmqpool's
    :func:`~zmqpool.assembly.env_index_stack`, with no per-key checks.

    Still no request ids, checks or restarts: it measures what returning these
    TensorDicts to the user's loop costs a trainer in Python at the least, on top
    of :class:`ZmqFloor`'s transport. A compiled transport would pay it too.
    """

    reply_keys = ("observation", "reward", "done", "terminated", "truncated")

    def __init__(self, env_kwargs: list[dict[str, Any]], timeout_s: float) -> None:
        super().__init__(env_kwargs, timeout_s)
        env = CountingEnv(**env_kwargs[0])
        specs = env.full_observation_spec.clone().update(env.full_reward_spec)
        specs.update(env.full_done_spec)
        self.leaf_specs = [(specs[key].dtype, specs[key].shape) for key in self.reply_keys]
        self.action_spec = (env.action_spec.dtype, env.action_spec.shape)
        self.sent: dict[int, bytes] = {}  # each env's last action: the result's root

    def send_actions(self, envs: list[int], actions: TensorDict) -> None:
        """Send each of ``envs`` its row of ``actions["action"]``, and keep it."""
        for env, action in zip(envs, actions.get("action").numpy(), strict=True):
            self.sent[env] = row = action.tobytes()
            self.router.send_multipart([self.peers[env], row])

    def start(self) -> None:
        """As :meth:`ZmqFloor.start`, keeping the first action it sends each env."""
        self.sent = dict.fromkeys(range(len(self.peers)), self.REQUEST)
        super().start()

    def _result(self, replies: list[list[zmq.Frame]]) -> TensorDict:
        n = len(replies)
        batch = torch.Size((n,))
        envs = [int(r[0].bytes) for r in replies]
        nxt = {
            key: _joined_leaf([r[i].buffer for r in replies], n, *spec)
            for i, (key, spec) in enumerate(zip(self.reply_keys, self.leaf_specs, strict=True), 1)
        }
        root = {
            "action": _joined_leaf([self.sent[e] for e in envs], n, *self.action_spec),
            "next": TensorDict._new_unsafe(nxt, batch_size=batch),
            "env_index": env_index_stack(envs),
        }
        return TensorDict._new_unsafe(root, batch_size=batch)


def _joined_leaf(rows: list[Any], n: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """``n`` rows of bytes as one ``[n, *shape]`` tensor: one copy, into memory it owns."""
    return torch.frombuffer(bytearray().join(rows), dtype=dtype).view(n, *shape)


def zmq_floor_row(
    sc: Scenario, cfg: Config, floor_cls: type[ZmqFloor] = ZmqFloor
) -> contextlib.AbstractContextManager[Tick]:
    return _floor_row(floor_cls(sc.env_kwargs(sc.envs(cfg)), cfg.recv_timeout_s))


@contextlib.contextmanager
def _floor_row(floor: ZmqFloor) -> Iterator[Tick]:
    try:
        floor.start()
        yield floor
    finally:
        floor.close()


ROWS: dict[str, RowFn] = {
    "zmqpool": zmqpool_row,
    "torchrl-queue": partial(torchrl_pool_row, exchange="queue"),
    "torchrl-shm": partial(torchrl_pool_row, exchange="shm"),
    "parallelenv": parallel_env_row,
    "serial": serial_row,
    "gym-async": gym_async_row,
    "gym-serial": gym_serial_row,
    "bare-zmq": bare_zmq_row,
    "zmqpool-tcp": partial(zmqpool_tcp_row, tcp_kwargs={"local_transport": "tcp"}),
    "zmqpool-sync": zmqpool_sync_row,
    "zmqpool-inline": zmqpool_inline_row,
    PACKED: zmqpool_packed_row,
    FLOOR: zmq_floor_row,
    PLAIN: partial(zmq_floor_row, floor_cls=PlainZmqPool),
    LEAN: partial(zmq_floor_row, floor_cls=LeanZmqPool),
}


# --------------------------------------------------------------------------- measuring


class RowTimeoutError(TimeoutError):
    """A row ran past ``--row-timeout`` (building, stepping or closing)."""


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Raise :class:`RowTimeoutError` in the main thread if the block outlives ``seconds``."""

    def fire(signum: int, frame: Any) -> None:
        raise RowTimeoutError(f"row did not finish within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Measurement:
    steps: int
    seconds: float
    tick_s: list[float] = field(default_factory=list)
    usage: Usage | None = None
    full_collections: FullCollections | None = None


class FullCollections:
    """Counts this process's full (oldest-generation) garbage collections and their CPU.

    With torch and torchrl imported, one walks some 400,000 objects: 100-250 ms
    of the trainer's CPU here, during which no command is sent. How often they
    come depends on how many objects outlive the young collections: requests in
    flight, replies waiting for a recv, results the loop holds. Used as a
    context manager around the measured window (``gc.callbacks``).
    """

    def __init__(self) -> None:
        self.count = 0
        self.cpu_s = 0.0
        self._started: float | None = None

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.thread_time()  # collections run in the thread that allocates
        elif self._started is not None:
            self.count += 1
            self.cpu_s += time.thread_time() - self._started
            self._started = None


@dataclass(frozen=True)
class Usage:
    """CPU seconds and context switches of this process tree (Linux ``/proc``)."""

    cpu_s: float
    switches: int
    own_cpu_s: float  # this process's share of cpu_s (the trainer's side of a pool)

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            self.cpu_s - other.cpu_s,
            self.switches - other.switches,
            self.own_cpu_s - other.own_cpu_s,
        )


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_usage() -> Usage | None:
    """CPU and context switches of this process and its descendants, every thread counted.

    Worker processes are where a pool spends most of its CPU, so per-step
    figures must count them; ``None`` where there is no ``/proc``. CPU time is
    each process's own total (``/proc/PID/stat``), not the sum of its threads'
    (``/proc/PID/task/TID/stat``): the kernel samples a thread's time at clock
    ticks, and a thread that runs in bursts shorter than a tick (an env thread
    of a worker hosting 16 envs) is undercounted, while the process total is
    scaled to the scheduler's exact runtime. Summing threads missed ~30% of the
    CPU at 512 envs (1.2 cores against the 1.7 that ``/proc/stat`` showed busy).
    Context switches exist per thread only, and are summed.
    """
    if not os.path.isdir("/proc/self/task"):
        return None
    cpu, switches, own = 0, 0, 0
    me = os.getpid()
    for pid in [me, *_descendants(me)]:
        ticks = _cpu_ticks(_read(f"/proc/{pid}/stat"))
        cpu += ticks
        own += ticks if pid == me else 0
        for tid in _listdir(f"/proc/{pid}/task"):
            status = _read(f"/proc/{pid}/task/{tid}/status") or ""
            switches += sum(
                int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line
            )
    return Usage(cpu / _CLOCK_TICKS, switches, own / _CLOCK_TICKS)


def _cpu_ticks(stat: str | None) -> int:
    """utime + stime (clock ticks) from a ``/proc/.../stat`` line; 0 if it has gone."""
    if not stat:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in _listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # the process or thread has gone
        return []


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def measure(tick: Tick, cfg: Config) -> Measurement:
    """Warm up, then count env-steps for ``cfg.seconds`` of wall time, timing every tick."""
    warm_end = time.perf_counter() + cfg.warmup_s
    while time.perf_counter() < warm_end:
        tick()
    out = Measurement(0, 0.0)
    before = tree_usage()
    start = now = time.perf_counter()
    out.full_collections = FullCollections()
    with out.full_collections:
        while now - start < cfg.seconds:
            out.steps += tick()
            after = time.perf_counter()
            out.tick_s.append(after - now)
            now = after
    out.seconds = now - start
    after_usage = tree_usage()
    if before is not None and after_usage is not None:
        out.usage = after_usage - before
    return out


def fill_result(result: RowResult, sc: Scenario, m: Measurement) -> None:
    result.steps, result.seconds = m.steps, m.seconds
    if result.row in ASYNC_ROWS and m.tick_s:
        result.results_per_recv = m.steps / len(m.tick_s)
    result.steps_per_s = m.steps / m.seconds if m.seconds > 0 else 0.0
    if sc.report_gbps:
        result.gb_per_s = result.steps_per_s * sc.payload_bytes / 1e9
    if sc.num_envs == 1 and m.tick_s:
        result.median_latency_us = statistics.median(m.tick_s) * 1e6
    result.ideal_steps_per_s = sc.ideal_steps_per_s(result.num_envs)
    if m.full_collections is not None and m.steps:
        result.full_collections = m.full_collections.count
        result.gc_us_per_step = m.full_collections.cpu_s / m.steps * 1e6
    if m.usage is not None and m.steps:
        result.cpu_us_per_step = m.usage.cpu_s / m.steps * 1e6
        result.trainer_cpu_us_per_step = m.usage.own_cpu_s / m.steps * 1e6
        result.switches_per_step = m.usage.switches / m.steps


def tree_pss_mb() -> tuple[float, float] | None:
    """PSS (MB) of this process and its descendants, and of this process alone.

    From ``/proc/PID/smaps_rollup``; ``None`` where there is none. PSS shares
    each page among the processes mapping it, so forked workers' shared pages
    (torch's libraries, a fork server's heap) are counted once in the sum.
    """
    if not os.path.exists("/proc/self/smaps_rollup"):
        return None
    total, own = 0, 0
    for pid in [os.getpid(), *_descendants(os.getpid())]:
        for line in (_read(f"/proc/{pid}/smaps_rollup") or "").splitlines():
            if line.startswith("Pss:"):
                kb = int(line.split()[1])
                total += kb
                own += kb if pid == os.getpid() else 0
    return total / 1024, own / 1024


def mem_available_mb() -> float | None:
    """``MemAvailable`` of ``/proc/meminfo`` in MB (``None``: not Linux)."""
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return None


#: A worker process's PSS (MB) assumed before a scale row of its pool has been measured:
#: a spawned process that imported torch and torchrl and hosts 16 envs (torchrl's shm
#: workers measured 265 MB here at 128 and 512 envs; zmqpool's forked ones 23-40 MB).
DEFAULT_WORKER_PSS_MB = 280.0
#: Run a scale row only if its estimated memory is below this share of MemAvailable.
MEMORY_HEADROOM = 0.8


def worker_pss_estimate_mb(row: str, done: list[RowResult]) -> float:
    """MB per worker process of ``row``'s pool: its largest measured scale row's, or a guess."""
    measured = [r for r in done if r.row == row and r.pss_mb is not None and r.num_envs > 0]
    if not measured:
        return DEFAULT_WORKER_PSS_MB
    r = max(measured, key=lambda x: x.num_envs)
    workers = -(-r.num_envs // r.envs_per_worker)
    assert r.pss_mb is not None and r.trainer_pss_mb is not None
    return max((r.pss_mb - r.trainer_pss_mb) / workers, 1.0)


def memory_skip_reason(sc: Scenario, row: str, cfg: Config, done: list[RowResult]) -> str | None:
    """Why a scale row would not fit in free memory (``None``: it fits, or not a scale row)."""
    available = mem_available_mb()
    if not sc.scale or available is None:
        return None
    workers = sc.workers(cfg)
    per_worker = worker_pss_estimate_mb(row, done)
    need = workers * per_worker
    if need <= MEMORY_HEADROOM * available:
        return None
    return (
        f"{row} at {sc.envs(cfg)} envs: needs ~{need / 1024:.1f} GB ({workers} workers x "
        f"{per_worker:.0f} MB), {available / 1024:.1f} GB available, skipped"
    )


#: Tensors torchrl's pool shares per env as file descriptors (torch's default sharing),
#: as far as the open-file limit goes: 512 envs fit in 20,000 here, 1024 do not.
FDS_PER_ENV = 32


def fd_skip_reason(sc: Scenario, row: str, cfg: Config) -> str | None:
    """Why a torchrl pool would exhaust the open-file limit (``None``: it fits).

    Past the limit torchrl's pool dies at start-up with "received 0 items of
    ancdata" (measured: 1024 envs against a hard limit of 20,000, which
    :func:`raise_fd_limit` could not raise); ``file_system`` sharing set in the
    trainer and the workers hung instead.
    """
    if not row.startswith("torchrl-") or not sc.scale:
        return None
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = sc.envs(cfg) * FDS_PER_ENV
    if need <= soft:
        return None
    return (
        f"{row} at {sc.envs(cfg)} envs: needs ~{need:,} open files (tensors shared by "
        f"descriptor), the limit is {soft:,} and cannot be raised here; it fails with "
        "'received 0 items of ancdata', skipped"
    )


def run_row(sc: Scenario, row: str, cfg: Config, done: list[RowResult] | None = None) -> RowResult:
    """Build, warm up, measure and close one row; an exception becomes ``error``.

    ``done``: the rows run so far (a scale row estimates its memory from them).
    """
    envs_per_worker = row_envs_per_worker(sc, row, cfg)
    result = RowResult(sc.name, row, sc.envs(cfg), sc.payload_bytes, envs_per_worker)
    result.skipped = fd_skip_reason(sc, row, cfg) or memory_skip_reason(sc, row, cfg, done or [])
    if result.skipped:
        return result
    try:
        with watchdog(sc.row_timeout_s(cfg)):
            start = time.perf_counter()
            with ROWS[row](sc, cfg) as tick:
                result.construct_s = time.perf_counter() - start
                fill_result(result, sc, measure(tick, cfg))
                pss = tree_pss_mb() if sc.scale else None
                if pss is not None:
                    result.pss_mb, result.trainer_pss_mb = pss
                    result.pss_mb_per_env = pss[0] / result.num_envs
                close_start = time.perf_counter()
            if sc.scale:
                result.close_s = time.perf_counter() - close_start
    except Exception as err:
        result.error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return result


def log_row(i: int, total: int, r: RowResult, round_text: str = "") -> None:
    if r.skipped:
        what = f"SKIPPED: {r.skipped}"
    elif r.error:
        what = f"ERROR {r.error}"
    else:
        what = f"{r.steps_per_s:12,.0f} steps/s"
    print(
        f"{round_text}[{i:2d}/{total}] {r.scenario:>9}/{r.row:<13} {what}  "
        f"(built in {r.construct_s:.1f} s)",
        file=sys.stderr,
        flush=True,
    )


def round_text(n: int, repeat: int) -> str:
    """``[round n/N] `` ahead of a progress line; nothing when there is one round."""
    return f"[round {n}/{repeat}] " if repeat > 1 else ""


def run_all(
    scenarios: list[Scenario], rows: set[str], cfg: Config, repeat: int = 1
) -> list[list[RowResult]]:
    """Each (scenario, row) of the plan ``repeat`` times: its runs, per cell in plan order.

    Rounds are interleaved (every cell once, then every cell again) rather than
    each cell ``repeat`` times in a row: a row and its reference then alternate
    in time, so the other load on a shared machine drifts under both alike.
    """
    plan = [(sc, row) for sc in scenarios for row in sc.rows if row in rows]
    cells: list[list[RowResult]] = [[] for _ in plan]
    done: list[RowResult] = []  # every run so far, any round: what scale rows estimate memory from
    for n in range(1, repeat + 1):
        for i, (sc, row) in enumerate(plan, 1):
            result = run_row(sc, row, cfg, done)
            done.append(result)
            cells[i - 1].append(result)
            log_row(i, len(plan), result, round_text(n, repeat))
    return cells


#: What says which cell a run measured (equal in all its runs), why it measured nothing,
#: or how its runs spread: every other field of a :class:`RowResult` is a measured figure.
NOT_FIGURES = frozenset(
    {
        "scenario",
        "row",
        "num_envs",
        "payload_bytes",
        "envs_per_worker",
        "skipped",
        "error",
        "runs",
        "rounds",
        "steps_per_s_min",
        "steps_per_s_max",
    }
)


def figure_fields() -> list[str]:
    """The :class:`RowResult` fields that :func:`combine_runs` takes the median of."""
    return [f.name for f in dataclass_fields(RowResult) if f.name not in NOT_FIGURES]


def median_of(values: list[Any]) -> Any:
    """The median of the values the runs have (``None``: none has one); ints stay ints."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    middle = statistics.median(present)
    return round(middle) if all(isinstance(v, int) for v in present) else middle


def combine_runs(runs: list[RowResult]) -> RowResult:
    """One cell's runs as one row: each figure the median over the runs that measured.

    ``runs``/``rounds`` say how many measured out of how many were tried, and
    ``steps_per_s_min``/``_max`` the spread. A cell with no measuring run keeps
    its first error (else its first skip) as a single run would; a single run is
    returned as it is, so ``--repeat 1`` reports exactly what one run measured.
    """
    measured = [r for r in runs if not r.error and not r.skipped]
    if not measured:
        failed = next((r for r in runs if r.error), runs[0])
        return replace(failed, runs=0, rounds=len(runs))
    if len(runs) == 1:
        return runs[0]
    figures = {name: median_of([getattr(r, name) for r in measured]) for name in figure_fields()}
    rates = [r.steps_per_s for r in measured]
    return replace(
        measured[0],
        **figures,
        runs=len(measured),
        rounds=len(runs),
        steps_per_s_min=min(rates),
        steps_per_s_max=max(rates),
    )


# --------------------------------------------------------------------------- ratios, targets


def by_scenario(results: list[RowResult]) -> dict[str, dict[str, RowResult]]:
    table: dict[str, dict[str, RowResult]] = {}
    for r in results:
        if not r.error and not r.skipped:
            table.setdefault(r.scenario, {})[r.row] = r
    return table


def ratios(results: list[RowResult]) -> dict[tuple[str, str], float]:
    """zmqpool's steps/s over each other row's, per scenario."""
    out = {}
    for name, rows in by_scenario(results).items():
        ref = rows.get(REF)
        for row, r in rows.items():
            if ref and row != REF and r.steps_per_s > 0:
                out[(name, row)] = ref.steps_per_s / r.steps_per_s
    return out


Check = Callable[[dict[str, RowResult]], tuple[float | None, str, bool | None] | None]
"""A target's judge: (value, text, passed) of a scenario's rows; ``passed`` ``None``: reported."""


@dataclass(frozen=True)
class Target:
    """A goal judged on one (scenario, row) cell: ``check`` returns (value, text, passed)."""

    scenario: str
    row: str
    label: str
    check: Check
    #: A throughput target's goal: zmqpool at least this many times ``row``'s steps/s.
    speedup: float | None = None


def speedup_target(scenario: str, row: str, goal: float) -> Target:
    """zmqpool's steps/s at least ``goal`` times ``row``'s, in ``scenario``."""
    return Target(scenario, row, f">={goal:g}x", speedup_at_least(row, goal), goal)


def speedup_at_least(row: str, goal: float) -> Callable[..., tuple[float, str, bool] | None]:
    def check(rows: dict[str, RowResult]) -> tuple[float, str, bool] | None:
        if REF not in rows or row not in rows:
            return None
        value = rows[REF].steps_per_s / rows[row].steps_per_s
        return value, f"{goal_text(value, goal, 2)}x", value >= goal

    return check


def goal_text(
    value: float, goal: float, digits: int, percent: bool = False, at_most: bool = False
) -> str:
    """``value`` with ``digits`` decimals (of a percentage if ``percent``), or the fewest
    more that keep rounding from carrying it across ``goal``: 96.9% against a goal of
    97% reads "96.9%", and 2.9991x against 3x "2.999x", not a missed "97%" or "3.00x"."""
    scale = 100 if percent else 1
    passed = value <= goal if at_most else value >= goal
    for extra in range(4):
        shown = round(value * scale, digits + extra)
        if (shown <= goal * scale if at_most else shown >= goal * scale) == passed:
            break
    places = digits + extra
    return f"{value:.{places}%}" if percent else f"{value:,.{places}f}"


def ideal_fraction_at_least(goal: float, row: str = REF) -> Check:
    """``row``'s steps/s as a share of the scenario's ideal, at least ``goal``."""

    def check(rows: dict[str, RowResult]) -> tuple[float, str, bool] | None:
        ref = rows.get(row)
        if ref is None or not ref.ideal_steps_per_s:
            return None
        value = ref.steps_per_s / ref.ideal_steps_per_s
        text = f"{goal_text(value, goal, 0, percent=True)} of {ref.ideal_steps_per_s:,.0f}/s"
        serial = rows.get("serial")
        if serial is not None and serial.steps_per_s > 0:
            # The envs' real step time (sleep overshoot and torchrl's own step
            # included) is what the serial row measures: num_envs of them in
            # parallel is the best any pool can do with these envs.
            measured = ref.num_envs * serial.steps_per_s
            text += f"; {ref.steps_per_s / measured:.0%} of {measured:,.0f}/s measured in-process"
        return value, text, value >= goal

    return check


def trainer_cpu_at_most(goal_us: float, min_results: float = 0.0) -> Check:
    """zmqpool's trainer CPU per env-step at most ``goal_us``, its recvs returning
    ``min_results`` or more results on average."""

    def check(rows: dict[str, RowResult]) -> tuple[float, str, bool] | None:
        ref = rows.get(REF)
        if ref is None or ref.trainer_cpu_us_per_step is None:
            return None
        value = ref.trainer_cpu_us_per_step
        per_recv = ref.results_per_recv or 0.0
        text = (
            f"{goal_text(value, goal_us, 0, at_most=True)} us/step at {per_recv:.1f} results/recv"
        )
        return value, text, value <= goal_us and per_recv >= min_results

    return check


def ratio_reported(num: str, den: str) -> Check:
    """``num``'s steps/s over ``den``'s, reported without a goal (``passed`` is ``None``)."""

    def check(rows: dict[str, RowResult]) -> tuple[float, str, None] | None:
        if num not in rows or den not in rows or rows[den].steps_per_s <= 0:
            return None
        value = rows[num].steps_per_s / rows[den].steps_per_s
        return value, f"{num} {value:.2f}x {den}", None

    return check


def latency_within_2x(rows: dict[str, RowResult]) -> tuple[float, str, bool] | None:
    ref, bare = rows.get(REF), rows.get("bare-zmq")
    if not ref or not bare or not ref.median_latency_us or not bare.median_latency_us:
        return None
    value = ref.median_latency_us / bare.median_latency_us
    return value, f"latency {goal_text(value, 2.0, 2, at_most=True)}x bare", value <= 2.0


#: The issue's targets, one per (scenario, row) cell it is judged on.
TARGETS = (
    Target("cheap", "zmqpool", "trainer CPU <=100 us/step (min_get=1)", trainer_cpu_at_most(100)),
    speedup_target("cheap", "torchrl-shm", 3.0),
    speedup_target("cheap", "parallelenv", 1.5),
    speedup_target("cheap", "serial", 0.5),
    Target(
        "cheap",
        "zmqpool-sync",
        "sync vs ParallelEnv",
        ratio_reported("zmqpool-sync", "parallelenv"),
    ),
    speedup_target("pixel", "torchrl-shm", 3.0),
    speedup_target("1mib", "torchrl-shm", 1.5),
    Target("latency", "zmqpool", ">=90% of ideal", ideal_fraction_at_least(0.9)),
    Target("roundtrip", "bare-zmq", "zmqpool latency <=2x", latency_within_2x),
    Target(
        "batch32",
        "zmqpool",
        "trainer CPU <=30 us/step (>=32 results/recv)",
        trainer_cpu_at_most(30, min_results=32),
    ),
    Target("cheap", PACKED, "envs in one worker", ratio_reported(PACKED, REF)),
    Target("cartpole", "gym-async", "same CartPole-v1", ratio_reported(REF, "gym-async")),
    Target("mdp", "torchrl-shm", "step_mdp loop", ratio_reported(REF, "torchrl-shm")),
    *(
        Target(f"scale{n}", "zmqpool", ">=97% of ideal", ideal_fraction_at_least(0.97))
        for n in SCALE_ENVS
    ),
)


def judge(results: list[RowResult], as_ref: str = REF) -> list[dict[str, Any]]:
    """Every target whose row ran: its value and PASS/MISS (``None``: not measurable).

    ``as_ref``: judge another row of the scenario in zmqpool's place (:data:`FLOOR`:
    whether a hand-written pyzmq pool of the same envs would meet each target);
    only the scenarios that ran it, and only targets with a goal.
    """
    table = by_scenario(results)
    ran = {(r.scenario, r.row) for r in results}
    out = []
    for t in TARGETS:
        rows = table.get(t.scenario, {})
        if (t.scenario, t.row) not in ran:
            continue
        if as_ref != REF:
            if as_ref not in rows or t.row == as_ref:
                continue
            rows = {**rows, REF: rows[as_ref]}
        verdict = t.check(rows)
        if as_ref != REF and (verdict is None or verdict[2] is None):
            continue
        extra = {} if as_ref == REF else {"as": as_ref}
        value, text, passed = verdict if verdict else (None, "n/a", None)
        out.append(
            {
                "scenario": t.scenario,
                "row": t.row,
                "target": t.label,
                "value": value,
                "text": text,
                "passed": passed,
                **extra,
            }
        )
    return out


# --------------------------------------------------------------------------- reporting


def extra_text(r: RowResult, sc: Scenario | None = None) -> str:
    parts = []
    if r.gb_per_s is not None:
        parts.append(f"{r.gb_per_s:.2f} GB/s")
    if r.ideal_steps_per_s:
        parts.append(f"{r.steps_per_s / r.ideal_steps_per_s:.0%} of ideal")
    if r.median_latency_us is not None:
        parts.append(f"median {r.median_latency_us:,.1f} us")
    packed = r.row == PACKED
    if r.results_per_recv is not None and (sc is None or sc.min_get > 1 or sc.scale or packed):
        min_get = sc.min_get if sc else 1
        parts.append(f"{r.results_per_recv:.1f} results/recv (min_get={min_get})")
    scale = sc is not None and sc.scale
    if packed or scale:
        parts.append(f"{r.envs_per_worker} envs/worker")
    if scale:
        parts.append(f"start-up {r.construct_s:.1f} s")
        if r.close_s is not None:
            parts.append(f"close {r.close_s:.1f} s")
        if r.pss_mb_per_env is not None and r.pss_mb is not None:
            parts.append(f"{r.pss_mb_per_env:.1f} MB/env PSS ({r.pss_mb / 1024:.2f} GB)")
    if r.full_collections and r.gc_us_per_step is not None:
        parts.append(f"{r.full_collections} full GCs ({r.gc_us_per_step:.1f} us/step)")
    return ", ".join(parts)


def runs_text(r: RowResult) -> str:
    """``--repeat`` > 1: how many runs a row's medians are of, and their range of steps/s."""
    if r.rounds == 1:
        return ""
    if not r.runs:
        return f"none of {r.rounds} runs measured"
    of_rounds = "" if r.runs == r.rounds else f" of {r.rounds}"
    spread = ""
    if r.steps_per_s_min is not None and r.steps_per_s_max is not None:
        spread = f" ({r.steps_per_s_min:,.0f}-{r.steps_per_s_max:,.0f})"
    return f"median of {r.runs}{of_rounds}{spread}"


def detail_text(r: RowResult, sc: Scenario | None) -> str:
    """The table's detail cell: the runs combined (if repeated), then the row's extra figures."""
    extra = "" if r.skipped or r.error else extra_text(r, sc)
    return "; ".join(part for part in (runs_text(r), extra) if part)


def cpu_text(r: RowResult) -> str:
    if r.cpu_us_per_step is None or r.trainer_cpu_us_per_step is None:
        return ""
    return f"{r.cpu_us_per_step:,.0f} ({r.trainer_cpu_us_per_step:,.0f})"


def target_text(scenario: str, row: str, verdicts: list[dict[str, Any]]) -> str:
    cells = []
    for v in verdicts:
        if (v["scenario"], v["row"]) == (scenario, row):
            status = {True: "PASS", False: "MISS", None: "n/a"}[v["passed"]]
            if v["passed"] is None and v["value"] is not None:
                status = "reported"
            cells.append(f"{v['target']}: {status} ({v['text']})")
    return "; ".join(cells)


def markdown_table(
    results: list[RowResult],
    verdicts: list[dict[str, Any]],
    scenarios: dict[str, Scenario] | None = None,
) -> str:
    ratio = ratios(results)
    scenarios = scenarios or {}
    lines = [
        "| scenario | row | envs | steps/s | CPU us/step (trainer) | switches/step | detail "
        "| zmqpool / row | target |",
        "|---|---|--:|--:|--:|--:|---|--:|---|",
    ]
    for r in results:
        if r.skipped:
            rate = f"SKIPPED: {r.skipped}"
        elif r.error:
            rate = f"ERROR: {r.error}"
        else:
            rate = f"{r.steps_per_s:,.0f}"
        speedup = f"{ratio[(r.scenario, r.row)]:.3g}x" if (r.scenario, r.row) in ratio else ""
        cells = [
            r.scenario,
            r.row,
            str(r.num_envs),
            rate,
            cpu_text(r),
            "" if r.switches_per_step is None else f"{r.switches_per_step:.1f}",
            detail_text(r, scenarios.get(r.scenario)),
            speedup,
            target_text(r.scenario, r.row, verdicts),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def result_entries(
    results: list[RowResult], cells: list[list[RowResult]] | None
) -> list[dict[str, Any]]:
    """The JSON rows: each combined row, and with ``--repeat`` > 1 every run it combines."""
    entries = [asdict(r) for r in results]
    for entry, runs in zip(entries, cells or [], strict=True):
        if len(runs) > 1:
            entry["individual_runs"] = [asdict(run) for run in runs]
    return entries


def write_json(
    path: Path,
    results: list[RowResult],
    verdicts: list,
    meta: dict,
    cells: list[list[RowResult]] | None = None,
    floor: list | None = None,
) -> None:
    """``results``: one row per cell; ``cells``: the runs behind each (``--repeat``);
    ``floor``: the targets judged on the :data:`HAND_WRITTEN` rows in zmqpool's place."""
    payload = {
        "meta": meta,
        "results": result_entries(results, cells),
        "ratios": [
            {"scenario": s, "row": row, "zmqpool_over_row": v}
            for (s, row), v in ratios(results).items()
        ],
        "targets": verdicts,
        "floor_targets": floor or [],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def plot_bars(ax: Any, results: list[RowResult]) -> None:
    """One bar group per scenario, one colour per row (absent rows leave a gap)."""
    scenarios = list(dict.fromkeys(r.scenario for r in results))
    rows = [row for row in ALL_ROWS if any(r.row == row for r in results)]
    width = 0.8 / max(len(rows), 1)
    for j, row in enumerate(rows):
        cells = [
            (scenarios.index(r.scenario), r.steps_per_s)
            for r in results
            if r.row == row and r.steps_per_s > 0
        ]
        if cells:
            xs, ys = zip(*cells, strict=True)
            ax.bar([x - 0.4 + (j + 0.5) * width for x in xs], ys, width, label=row)
    ax.set_xticks(range(len(scenarios)), scenarios)


def write_plot(path: Path, results: list[RowResult]) -> None:
    """A grouped bar chart of steps/s per scenario and row, log scale (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    plot_bars(ax, results)
    ax.set_yscale("log")
    ax.set_ylabel("env-steps / s")
    ax.set_title("zmqpool benchmark (roundtrip: 1 env, sequential round trips)")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def meta(
    args: argparse.Namespace, cfg: Config, wall_s: float, penalty: IdlePenalty, wake: WakeCost
) -> dict[str, Any]:
    return {
        "idle_penalty": {
            "hot_us": penalty.hot_us,
            "after_idle_us": {str(gap): us for gap, us in penalty.after_idle_us.items()},
        },
        "wake_cost": asdict(wake),
        "argv": sys.argv[1:],
        "config": asdict(cfg),
        "quick": args.quick,
        "repeat": args.repeat,
        "wall_s": wall_s,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "gymnasium": gymnasium.__version__,
        "machine": platform.platform(),
        "open_files_limit": raise_fd_limit(0),
        **measured_code(),
    }


def measured_code() -> dict[str, Any]:
    """Which zmqpool the rows ran: its directory and, in a git checkout, the commit.

    This script puts its own checkout first on ``sys.path``: a run of another
    checkout's code needs that checkout's copy of the script.
    """
    module = importlib.import_module("zmqpool")
    where = Path(module.__file__ or ".").resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(where), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"zmqpool_path": str(where), "zmqpool_commit": commit}


# --------------------------------------------------------------------------- the idle penalty


#: The probe's idle gaps (s): a cheap row's wait for a reply, and a scale row's mean step.
IDLE_GAPS_S = (0.001, sum(SCALE_SLEEP_S) / 2)
#: Steps timed per gap: (back to back, after each gap); ``--quick`` takes a fifth.
IDLE_PROBE_STEPS = (500, 60)


@dataclass(frozen=True)
class IdlePenalty:
    """What one env step costs this machine's CPU, run hot and after its thread slept.

    Every pool runs its Python (and the env's) in short bursts between sleeps:
    a worker waits for its next command, a trainer for its next reply. On a
    machine whose caches are cold again after a short idle (a VM's vCPU, a
    core sharing its caches with other tenants) each burst costs a multiple of
    what a tight loop measures; this puts a figure on that multiple.
    """

    #: median thread CPU (us) of a :class:`CountingEnv` step, steps back to back.
    hot_us: float
    #: the same, each step after its thread slept ``gap_s``: ``{gap_s: us}``.
    after_idle_us: dict[float, float]

    def factor(self, gap_s: float) -> float:
        return self.after_idle_us[gap_s] / self.hot_us


def step_cpu_us(env: EnvBase, td: TensorDictBase, gap_s: float, count: int) -> float:
    """Median thread CPU (us) of ``env.step(td)``, each step after sleeping ``gap_s``."""
    times = []
    for _ in range(count):
        if gap_s:
            time.sleep(gap_s)
        start = time.thread_time_ns()
        env.step(td.clone())
        times.append(time.thread_time_ns() - start)
    return statistics.median(times) / 1e3


def idle_penalty(quick: bool) -> IdlePenalty:
    """Time one cheap env's step in this process, hot and after each of :data:`IDLE_GAPS_S`."""
    hot_steps, idle_steps = (n // 5 if quick else n for n in IDLE_PROBE_STEPS)
    env = CountingEnv(env_id=0, obs_shape=(4,))
    try:
        td = env.reset()
        td.set("action", torch.zeros(env.action_spec.shape))
        hot = step_cpu_us(env, td, 0.0, hot_steps)
        after = {gap: step_cpu_us(env, td, gap, idle_steps) for gap in IDLE_GAPS_S}
    finally:
        env.close()
    return IdlePenalty(hot, after)


def idle_penalty_text(penalty: IdlePenalty) -> str:
    after = ", ".join(
        f"{us:,.0f} us after {gap * 1e3:g} ms asleep ({penalty.factor(gap):.1f}x)"
        for gap, us in penalty.after_idle_us.items()
    )
    hot = f"{penalty.hot_us:,.0f} us of CPU hot"
    return f"idle penalty: a CountingEnv step here takes {hot}, {after}"


# --------------------------------------------------------------------------- the wake cost


#: The wake probe's round trips: (warm-up, timed); ``--quick`` times a fifth.
WAKE_PROBE_ROUNDS = (200, 5000)
#: How long the whole probe may take (its far end's start-up included).
WAKE_PROBE_TIMEOUT_S = 60.0
#: The probe's far end: echoes each byte it reads until its input closes.
_ECHO_BYTES = "import os\nwhile os.read(0, 1):\n    os.write(1, b'x')\n"


@dataclass(frozen=True)
class WakeCost:
    """What handing a message to a process blocked on it costs this machine.

    Each message of a pool wakes a thread that blocked waiting for it: a
    worker for its command, libzmq's I/O threads on both sides, the trainer
    for its reply. The probe bounces a byte through a pipe to another
    process and back: each round trip is one write and one blocking read on
    each side, and nothing else. Where blocking is cheap (an idle CPU that
    polls a while before it halts) a round trip takes a few us; on a VM whose
    idle vCPUs halt at once, each wake-up is an exit to the host.
    """

    #: mean wall time (us) of one round trip.
    round_trip_us: float
    #: this process's CPU (us) per round trip: one write, and one blocking read woken.
    cpu_us: float


def wake_cost(quick: bool) -> WakeCost:
    """Bounce a byte to a fresh echo process :data:`WAKE_PROBE_ROUNDS` times; time it."""
    warmup, rounds = WAKE_PROBE_ROUNDS
    rounds = rounds // 5 if quick else rounds
    echo = subprocess.Popen(
        [sys.executable, "-c", _ECHO_BYTES],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        bufsize=0,
    )
    assert echo.stdin is not None and echo.stdout is not None
    out, back = echo.stdin.fileno(), echo.stdout.fileno()
    try:
        with watchdog(WAKE_PROBE_TIMEOUT_S):  # a blocked read is interrupted, not waited out
            for _ in range(warmup):
                _bounce(out, back)
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            for _ in range(rounds):
                _bounce(out, back)
            wall, cpu = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
    finally:
        echo.stdin.close()  # its read ends: it exits
        try:
            echo.wait(timeout=10)
        except subprocess.TimeoutExpired:
            echo.kill()
            echo.wait(timeout=10)
        echo.stdout.close()
    return WakeCost(wall / rounds / 1e3, cpu / rounds / 1e3)


def _bounce(out: int, back: int) -> None:
    try:
        os.write(out, b"x")
        echoed = os.read(back, 1)
    except BrokenPipeError:
        echoed = b""
    if echoed != b"x":
        raise RuntimeError("the wake probe's echo process ended early")


def wake_cost_text(wake: WakeCost) -> str:
    return (
        f"wake cost: a byte bounced through a pipe to another process and back takes "
        f"{wake.round_trip_us:,.1f} us here, {wake.cpu_us:,.1f} us of this process's CPU "
        f"(one write and one blocking read)"
    )


def scale_budget_text(results: list[RowResult], penalty: IdlePenalty) -> list[str]:
    """Per scale scenario run: the CPUs its envs' own steps need at the ideal rate, cold,
    and those that zmqpool's measured CPU per env-step needs there.

    The first is an estimate from one env's step after a sleep; the second is
    this run's own figure for the trainer and its workers together, and so
    the most of the ideal rate these CPUs allow at that cost.
    """
    cpus = machine_cpus()
    cold_us = penalty.after_idle_us[IDLE_GAPS_S[-1]]
    lines = []
    for r in results:
        if r.row != REF or not r.scenario.startswith("scale") or not r.ideal_steps_per_s:
            continue
        need = r.ideal_steps_per_s * cold_us / 1e6
        lines.append(
            f"{r.scenario}: at the ideal {r.ideal_steps_per_s:,.0f} steps/s the envs' own steps, "
            f"cold ({cold_us:,.0f} us each), need {need:.2f} of this machine's {cpus} CPUs"
            f"{_measured_need_text(r, cpus)}"
        )
    return lines


def _measured_need_text(row: RowResult, cpus: int) -> str:
    """What the row's own CPU per env-step needs at its ideal rate, and the share it allows."""
    if not row.cpu_us_per_step or not row.ideal_steps_per_s:
        return ""
    need = row.ideal_steps_per_s * row.cpu_us_per_step / 1e6
    return (
        f"; at the {row.cpu_us_per_step:,.0f} us of CPU per env-step zmqpool's trainer and "
        f"workers spent, {need:.2f}: at most {min(1.0, cpus / need):.0%} of ideal here"
    )


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity), which its pools share."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def speedup_budget_text(results: list[RowResult], verdicts: list[dict[str, Any]]) -> list[str]:
    """Per throughput target missed: the CPU per env-step it leaves the whole pool, against
    what zmqpool's trainer and workers spent in this run.

    On a machine whose CPUs every process of a pool shares, steps/s can be at
    most CPUs / (CPU per env-step): a target of ``goal`` times another row's
    rate is a budget of CPU per env-step for the trainer and its workers
    together, which the run's own figures either fit or exceed.
    """
    cpus = machine_cpus()
    table = by_scenario(results)
    goals = {(t.scenario, t.row): t.speedup for t in TARGETS if t.speedup is not None}
    lines = []
    for v in verdicts:
        goal = goals.get((v["scenario"], v["row"]))
        rows = table.get(v["scenario"], {})
        ours, other = rows.get(REF), rows.get(v["row"])
        if goal is None or v["passed"] is not False or ours is None or other is None:
            continue
        if not other.steps_per_s or ours.cpu_us_per_step is None:
            continue
        needed = goal * other.steps_per_s
        budget_us = cpus * 1e6 / needed
        spent = ours.cpu_us_per_step
        trainer = ours.trainer_cpu_us_per_step or 0.0
        busy = ours.steps_per_s * spent / (cpus * 1e6)  # the share of the CPUs the row used
        verdict = "over it" if spent > budget_us else "within it: the row waited, not CPU-bound"
        lines.append(
            f"{v['scenario']} {v['target']} {v['row']}: {needed:,.0f} steps/s on {cpus} CPUs "
            f"leaves at most {budget_us:,.0f} us of CPU per env-step for the trainer and its "
            f"workers together; zmqpool spent {spent:,.0f} ({trainer:,.0f} in the trainer, "
            f"{spent - trainer:,.0f} in its workers), {verdict} ({busy:.0%} of the CPUs busy)"
            f"{_serial_text(rows)}"
        )
    return lines


def floor_text(verdicts: list[dict[str, Any]], floor: list[dict[str, Any]]) -> list[str]:
    """Per target a hand-written row (:data:`HAND_WRITTEN`, its name under ``"as"``) was
    judged on in zmqpool's place: its verdict beside zmqpool's.

    A target :data:`FLOOR` misses is beyond a pool of these envs that crosses
    processes through ZeroMQ on this machine and does nothing else; one
    :data:`PLAIN` misses is beyond that pool written plainly to return
    pool-shaped results to the loop a user writes; one :data:`LEAN` misses is
    beyond any pool that returns zmqpool's result built in Python over that
    transport; one any of them meets and zmqpool misses is a gap of zmqpool's own.
    A target zmqpool meets is met, whatever the hand-written row did.
    """
    ours = {(v["scenario"], v["row"], v["target"]): v for v in verdicts}
    lines = []
    for f in floor:
        v = ours.get((f["scenario"], f["row"], f["target"]))
        if v is None:
            continue
        if v["passed"]:
            why = "both meet it" if f["passed"] else f"{REF} meets it, {f['as']} does not"
        elif not f["passed"]:
            why = f"beyond {FLOOR_SCOPE[f['as']]} here"
        else:
            why = f"within the reach of {FLOOR_SCOPE[f['as']]}: the gap is zmqpool's own"
        lines.append(
            f"{f['scenario']} {f['row']} {f['target']}: {f['as']} {_status(f)} ({f['text']}), "
            f"{REF} {_status(v)} ({v['text']}): {why}"
        )
    return lines


#: What a miss of each floor row is beyond.
FLOOR_SCOPE = {
    FLOOR: "a bare pyzmq pool of these envs",
    PLAIN: "a plainly written pyzmq pool of these envs returning pool-shaped results",
    LEAN: "the least Python that returns zmqpool's result of these envs over a bare pyzmq pool",
}


def _status(verdict: dict[str, Any]) -> str:
    return {True: "PASS", False: "MISS", None: "n/a"}[verdict["passed"]]


def packing_text(results: list[RowResult]) -> list[str]:
    """Per scenario with a packed row: its figures beside the one-env-per-worker row's.

    The same envs and loop, hosted by one worker process instead of one each:
    what is left of each figure when a worker's messages carry several envs'
    steps.
    """
    lines = []
    for scenario, rows in by_scenario(results).items():
        ours, packed = rows.get(REF), rows.get(PACKED)
        if ours is None or packed is None or not ours.steps_per_s or not packed.steps_per_s:
            continue
        lines.append(
            f"{scenario}: its {packed.num_envs} envs in one worker process ({PACKED}) ran "
            f"{packed.steps_per_s:,.0f} steps/s, {packed.steps_per_s / ours.steps_per_s:.2f}x "
            f"{REF} with {ours.envs_per_worker} per worker, at {_cpu_and_recvs(packed)} of CPU "
            f"per env-step against {_cpu_and_recvs(ours)}"
        )
    return lines


def _cpu_and_recvs(r: RowResult) -> str:
    """``395 us (155 in the trainer, 2.2 results/recv)``; ``? us`` without CPU figures."""
    if r.cpu_us_per_step is None or r.trainer_cpu_us_per_step is None:
        return "? us"
    per_recv = f", {r.results_per_recv:.1f} results/recv" if r.results_per_recv else ""
    trainer = f"{r.trainer_cpu_us_per_step:,.0f} in the trainer{per_recv}"
    return f"{r.cpu_us_per_step:,.0f} us ({trainer})"


def _serial_text(rows: dict[str, RowResult]) -> str:
    serial = rows.get("serial")
    if serial is None or serial.cpu_us_per_step is None:
        return ""
    return f"; the env's own step, in-process, costs {serial.cpu_us_per_step:,.0f}"


# --------------------------------------------------------------------------- zero-copy threshold


#: Observation sizes the threshold probe tries (bytes).
PROBE_SIZES = tuple(kib << 10 for kib in (1, 4, 16, 32, 48, 64, 128, 256, 1024))
QUICK_PROBE_SIZES = (1 << 10, 64 << 10)
#: Results stacked per recv by the probe's receiver, as the pool stacks replies.
PROBE_STACK = 4


@dataclass
class ProbeResult:
    """CPU per message of one (size, layout) cell of the threshold probe."""

    nbytes: int
    own_frame: bool
    send_us: float
    recv_us: float

    @property
    def total_us(self) -> float:
        return self.send_us + self.recv_us


def probe_td(nbytes: int) -> TensorDict:
    """A result shaped like CountingEnv's: an ``nbytes`` uint8 observation, four small leaves."""
    flag = torch.zeros(1, dtype=torch.bool)
    leaves = {"observation": torch.ones(nbytes, dtype=torch.uint8), "reward": torch.zeros(1)}
    leaves.update(done=flag, terminated=flag.clone(), truncated=flag.clone())
    return TensorDict(leaves, [])


def probe_sender(endpoint: str, nbytes: int, threshold: int, count: int, out: Any) -> None:
    """(A forked child.) Encode and push ``count`` results; send our CPU seconds on ``out``."""
    from zmqpool.codec import Encoder
    from zmqpool.protocol import send_frames
    from zmqpool.wire import Command, Header, encode_message

    torch.set_num_threads(1)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    encoder, td = Encoder(threshold), probe_td(nbytes)
    start = time.process_time()  # every thread: zmq's I/O thread, pyzmq's zero-copy reaper
    for seq in range(count):
        send_frames(push, encode_message(Header(Command.RESULT, 0, seq), [encoder.encode(td)]))
    ctx.destroy(linger=10_000)  # the receiver takes every message: this returns promptly
    out.send(time.process_time() - start)


def probe_receiver(pull: zmq.Socket, count: int, timeout_s: float) -> float:
    """Receive, decode and stack (by :data:`PROBE_STACK`) ``count`` results; our CPU seconds.

    Process CPU: the I/O thread reading the socket counts too (waiting does not).
    """
    from zmqpool.batching import stack_parts
    from zmqpool.codec import Decoder
    from zmqpool.protocol import recv_frames
    from zmqpool.wire import Header

    decoder, parts = Decoder(), []
    start = time.process_time()
    for _ in range(count):
        if not pull.poll(int(timeout_s * 1000)):
            raise TimeoutError("threshold probe: the sender went quiet")
        frames = recv_frames(pull)
        parts += decoder.decode(Header.decode(frames[0].buffer), frames[1:])
        if len(parts) == PROBE_STACK:
            stack_parts(parts)
            parts = []
    return time.process_time() - start


def probe_once(nbytes: int, own_frame: bool, count: int, timeout_s: float) -> ProbeResult:
    """One sender process, this process receiving, over ipc: CPU per message on each side."""
    import multiprocessing

    threshold = nbytes if own_frame else nbytes + 1
    tmpdir = tempfile.mkdtemp(prefix="zmqpool-probe-")
    endpoint = f"ipc://{tmpdir}/probe"
    fork = multiprocessing.get_context("fork")
    mine, theirs = fork.Pipe()
    args = (endpoint, nbytes, threshold, count, theirs)
    sender = fork.Process(target=probe_sender, args=args, daemon=True)
    sender.start()  # before our zmq context exists: a forked one is unusable
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.bind(endpoint)
        recv_s = probe_receiver(pull, count, timeout_s)
        send_s = mine.recv() if mine.poll(timeout_s) else float("nan")
        sender.join(timeout_s)
    finally:
        if sender.is_alive():
            sender.kill()
        ctx.destroy(linger=0)
        shutil.rmtree(tmpdir, ignore_errors=True)
    return ProbeResult(nbytes, own_frame, 1e6 * send_s / count, 1e6 * recv_s / count)


def probe_threshold(sizes: tuple[int, ...], repeats: int, timeout_s: float) -> list[ProbeResult]:
    """Each size packed and in its own frame, alternately, ``repeats`` times; the cheapest of each.

    The minimum over repeats: on a shared machine noise only ever adds time.
    """
    best: dict[tuple[int, bool], ProbeResult] = {}
    for _ in range(repeats):
        for nbytes in sizes:
            count = max(200, min(4000, (256 << 20) // nbytes))
            for own in (False, True):
                r = probe_once(nbytes, own, count, timeout_s)
                key = (nbytes, own)
                if key not in best or r.total_us < best[key].total_us:
                    best[key] = r
    return list(best.values())


def crossover(results: list[ProbeResult]) -> int | None:
    """The smallest size from which a frame of its own is cheaper at every larger size."""
    cells = {(r.nbytes, r.own_frame): r for r in results}
    sizes = sorted({r.nbytes for r in results})
    cheaper = [cells[(n, True)].total_us < cells[(n, False)].total_us for n in sizes]
    for i, n in enumerate(sizes):
        if all(cheaper[i:]):
            return n
    return None


def probe_table(results: list[ProbeResult]) -> str:
    cells = {(r.nbytes, r.own_frame): r for r in results}
    lines = [
        "| observation | packed: send / recv us | own frame: send / recv us | own / packed |",
        "|--:|--:|--:|--:|",
    ]
    for n in sorted({r.nbytes for r in results}):
        packed, own = cells[(n, False)], cells[(n, True)]
        lines.append(
            f"| {n // 1024} KiB | {packed.send_us:.1f} / {packed.recv_us:.1f} "
            f"| {own.send_us:.1f} / {own.recv_us:.1f} | {own.total_us / packed.total_us:.2f} |"
        )
    return "\n".join(lines)


def run_probe(args: argparse.Namespace) -> int:
    sizes = QUICK_PROBE_SIZES if args.quick else PROBE_SIZES
    results = probe_threshold(sizes, 1 if args.quick else 3, timeout_s=30.0)
    print(probe_table(results))
    found = crossover(results)
    where = f"{found // 1024} KiB" if found else f"above {sizes[-1] // 1024} KiB"
    print(f"\na frame of its own is cheaper from {where} (CPU per message, sender + receiver)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"probe": [asdict(r) for r in results], "crossover_bytes": found}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


# --------------------------------------------------------------------------- CLI


def names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of ``choices``."""

    def parse(text: str) -> list[str]:
        picked = [n.strip() for n in text.split(",") if n.strip()]
        unknown = sorted(set(picked) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {choices}")
        return picked

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # `zmqpool bench` runs this script: its usage line then names that command.
    prog = os.environ.get("ZMQPOOL_BENCH_PROG")
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--scenarios",
        type=names((*build_scenarios(False), SCALE_ALIAS)),
        default=None,
        help="comma-separated scenarios (unset: all but the scale ones); "
        "'scale' stands for scale16,scale128,scale512,scale1024 (with --quick: scale16)",
    )
    p.add_argument(
        "--scale",
        action="store_true",
        help="also run the scale scenarios (16-1024 envs sleeping 40-60 ms a step, "
        "16 envs per worker): every row of the issue in one run",
    )
    p.add_argument(
        "--rows", type=names(ALL_ROWS), default=None, help="comma-separated rows (unset: all)"
    )
    p.add_argument(
        "--seconds",
        type=positive_seconds,
        default=None,
        help="measured wall time per row, seconds > 0 (unset: 3, 0.3 with --quick)",
    )
    p.add_argument(
        "--num-envs",
        type=positive_int,
        default=None,
        help="envs per pool (unset: 4, 2 with --quick)",
    )
    p.add_argument(
        "--envs-per-worker",
        type=positive_int,
        default=1,
        help="envs hosted by each worker process of zmqpool's and torchrl's async pools",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny payloads, short rows, a subset of rows, one zmqpool fork server: a smoke run",
    )
    p.add_argument(
        "--row-timeout",
        type=positive_seconds,
        default=300.0,
        help="abort a row (build + run + close) after this many seconds (> 0)",
    )
    p.add_argument(
        "--probe-threshold",
        action="store_true",
        help="instead of the rows: measure where a leaf's own zero-copy frame beats packing it",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        metavar="N",
        help="run the whole plan N times, interleaved (round 1 runs every row once, then "
        "round 2...); report each row's medians and its range of steps/s",
    )
    p.add_argument("--json", type=Path, default=None, help="write all results here (JSON)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace) -> Config:
    # `is None`, not `or`: a value given is a value kept (the parser refuses 0).
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 3.0)
    num_envs = args.num_envs if args.num_envs is not None else (2 if args.quick else 4)
    return Config(
        seconds=seconds,
        warmup_s=min(1.0, max(0.1, seconds / 3)),
        num_envs=num_envs,
        row_timeout_s=args.row_timeout,
        envs_per_worker=args.envs_per_worker,
    )


def raise_fd_limit(wanted: int = 1 << 17) -> tuple[int, int] | None:
    """Raise this process's open-file limit (inherited by every pool's workers).

    torchrl's shm pool passes each shared tensor to its workers as a file
    descriptor (torch's ``file_descriptor`` sharing): at 1024 envs that is more
    than 20,000 descriptors, and past the limit the pool dies with "received 0
    items of ancdata". The soft limit goes to the hard one, or to ``wanted``
    where the hard limit may be raised. Returns the (soft, hard) limits now.
    """
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limits in ((max(soft, wanted), max(hard, wanted)), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def shared_fork_server(quick: bool) -> contextlib.AbstractContextManager[None]:
    """With ``--quick``, zmqpool's rows fork their workers from one fork server.

    A smoke run checks that each row runs, not what a pool costs to start: a
    fork server of its own per row (a torch import, ~2.5 s here) was a third of
    its time. A full run starts each zmqpool row as a user's first pool starts,
    so that start-up stands beside torchrl's.
    """
    if not quick:
        return contextlib.nullcontext()
    try:
        forkservers = importlib.import_module("zmqpool.forkservers")
    except ImportError:  # the rows without zmqpool still run
        return contextlib.nullcontext()
    return forkservers.keep_fork_server()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    if args.probe_threshold:
        return run_probe(args)
    cfg = make_config(args)
    table = build_scenarios(args.quick)
    scenarios = select(table, args.scenarios, args.scale, args.quick)
    start = time.perf_counter()
    penalty = idle_penalty(args.quick)  # first, on a machine no row has loaded yet
    wake = wake_cost(args.quick)
    with shared_fork_server(args.quick):
        cells = run_all(scenarios, set(args.rows or ALL_ROWS), cfg, args.repeat)
    # Ratios and targets judge the medians, through the same code as a single run.
    results = [combine_runs(runs) for runs in cells]
    verdicts = judge(results)
    floor = [v for row in HAND_WRITTEN for v in judge(results, as_ref=row)]
    wall_s = time.perf_counter() - start
    print(markdown_table(results, verdicts, table))
    per_worker = (
        f"; async pools host {cfg.envs_per_worker} envs per worker process (batch32 and scale: 16)"
    )
    all_runs = [run for runs in cells for run in runs]
    for reason in dict.fromkeys(run.skipped for run in all_runs if run.skipped):
        print(f"skipped: {reason}")
    budgets = [
        *scale_budget_text(results, penalty),
        *speedup_budget_text(results, verdicts),
        *packing_text(results),
        *floor_text(verdicts, floor),
    ]
    print("\n" + "\n".join([idle_penalty_text(penalty), wake_cost_text(wake), *budgets]))
    rounds = f" x {args.repeat} rounds (medians)" if args.repeat > 1 else ""
    print(
        f"\n{len(results)} rows{rounds} in {wall_s:.1f} s{per_worker}; targets are informational."
    )
    if args.json:
        run_meta = meta(args, cfg, wall_s, penalty, wake)
        write_json(args.json, results, verdicts, run_meta, cells, floor)
    if args.plot:
        write_plot(args.plot, results)
    # A run that failed fails the bench, even if the other rounds of its row measured.
    return 1 if any(run.error for run in all_runs) else 0


if __name__ == "__main__":
    sys.exit(main())
