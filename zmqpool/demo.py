"""``zmqpool demo``: a local pool stepped the way an asynchronous trainer steps it.

The loop sends an action to every env, then repeatedly takes whichever results
are in (``min_get=1``) and sends new random actions to exactly those envs.
``step_and_maybe_reset`` keeps episodes going: an env whose episode ended
comes back already reset. With ``kill_one``, one worker process is killed with
SIGKILL halfway through, to show the pool's hot restart: the request that was
in flight comes back as a truncation and the worker is replaced.

This module is part of the command line, so it prints; the library logs.

Example:
    >>> from zmqpool.demo import DemoOptions, run_demo
    >>> result = run_demo(DemoOptions(num_envs=2, steps=50, progress=False))  # doctest: +SKIP
    >>> print_report(DemoOptions(num_envs=2, steps=50), result)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch
from tensordict import TensorDictBase
from torchrl.data import Composite
from torchrl.envs import EnvBase
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from workers.hosting import maker_from_name
from zmqpool.config import PoolConfig
from zmqpool.pool import ZMQAsyncEnvPool

DEFAULT_ENV = "zmqpool.demo:cartpole"  # zmqpool.cli.DEFAULT_ENV names it too


def cartpole() -> EnvBase:
    """gymnasium's CartPole-v1 wrapped by torchrl: the demo's default env (nothing to download).

    Example:
        >>> cartpole().batch_size
        torch.Size([])
    """
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def load_env_maker(name: str) -> Callable[[], EnvBase]:
    """Import ``package.module:callable`` and return the callable.

    :func:`workers.hosting.maker_from_name`, as ``python -m workers --env`` checks
    its name: anything wrong is a :class:`ValueError` of one line.

    Example:
        >>> load_env_maker("zmqpool.demo:cartpole").__name__
        'cartpole'
    """
    return maker_from_name(name)


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """What ``zmqpool demo`` runs; the command line's flags, one field each."""

    num_envs: int = 4
    steps: int = 2000
    envs_per_worker: int = 1
    env: str = DEFAULT_ENV
    kill_one: bool = False
    seed: int | None = 0
    #: a step that runs longer than this is hung: its env is restarted (the
    #: pool's ``step_timeout_s``), so no recv waits for ever.
    step_timeout_s: float = 60.0
    #: show a tqdm progress bar (on standard error).
    progress: bool = True
    #: with ``kill_one``: kill once this fraction of the steps is done.
    kill_at: float = 0.5


@dataclasses.dataclass
class EnvTally:
    """What the demo saw of one env: steps, finished episodes and their returns."""

    steps: int = 0
    episodes: int = 0
    truncations: int = 0
    episode_return: float = 0.0
    total_return: float = 0.0

    def record(self, reward: float, done: bool, truncated: bool) -> None:
        self.steps += 1
        self.episode_return += reward
        self.truncations += int(truncated)
        if done:
            self.episodes += 1
            self.total_return += self.episode_return
            self.episode_return = 0.0

    @property
    def mean_return(self) -> float | None:
        return self.total_return / self.episodes if self.episodes else None


@dataclasses.dataclass
class DemoResult:
    """The outcome of :func:`run_demo`."""

    steps: int
    seconds: float
    startup_s: float
    tallies: list[EnvTally]
    stats_table: str | None = None
    restarts_seen: int = 0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("inf")


class Killer:
    """Kills one worker with SIGKILL once, then reports when the pool has replaced it.

    It finds the worker through the pool's public ``worker_processes()``.
    """

    def __init__(self, pool: ZMQAsyncEnvPool, out: Callable[[str], Any]) -> None:
        self.pool = pool
        self.out = out
        self.worker: int | None = None
        self.old_pid = 0
        self.killed_at = 0.0
        self.restarts = 0

    def kill(self) -> None:
        self.worker, process = min(self.pool.worker_processes().items())
        self.old_pid = process.pid
        os.kill(self.old_pid, signal.SIGKILL)
        self.killed_at = time.monotonic()
        self.out(f"killed {self._name()} (pid {self.old_pid}) with SIGKILL")

    def _name(self) -> str:
        return f"worker {self.worker}"

    def check(self) -> None:
        """Say so once the killed worker runs in a new process."""
        if self.worker is None or self.restarts:
            return
        process = self.pool.worker_processes().get(self.worker)
        if process is not None and process.pid != self.old_pid:
            self.restarts += 1
            waited = time.monotonic() - self.killed_at
            self.out(f"{self._name()} restarted: pid {process.pid}, {waited:.2f} s after the kill")


def _random_actions(spec: Composite, root: TensorDictBase, envs: list[int]) -> TensorDictBase:
    """``root`` with a fresh random action for each of ``envs`` (its rows, in order)."""
    return root.update(spec[envs].rand())


def _env_indices(td: TensorDictBase) -> list[int]:
    return [int(i) for i in td.get("env_index").tolist()]


def _record(tallies: list[EnvTally], result: TensorDictBase, envs: list[int]) -> None:
    rewards = result.get(("next", "reward")).reshape(len(envs), -1)[:, 0].tolist()
    dones = result.get(("next", "done")).reshape(len(envs), -1)[:, 0].tolist()
    truncs = result.get(("next", "truncated")).reshape(len(envs), -1)[:, 0].tolist()
    for env, reward, done, trunc in zip(envs, rewards, dones, truncs, strict=True):
        tallies[env].record(float(reward), bool(done), bool(trunc))


def _restarted_envs(pool: ZMQAsyncEnvPool, result: TensorDictBase, envs: list[int]) -> list[int]:
    """Envs whose result in this recv a restart made up (any truncation, if the pool can't say)."""
    marked = getattr(pool, "last_restarted_envs", None)
    if marked is not None:
        return list(marked)
    truncs = result.get(("next", "truncated")).reshape(len(envs), -1)[:, 0].tolist()
    return [env for env, trunc in zip(envs, truncs, strict=True) if trunc]


class _Loop:
    """A trainer's loop: send to all, then ``recv(min_get=1)`` and resend to whoever came back."""

    def __init__(self, pool: ZMQAsyncEnvPool, opts: DemoOptions, bar: tqdm) -> None:
        self.pool = pool
        self.opts = opts
        self.bar = bar
        self.tallies = [EnvTally() for _ in range(pool.num_envs)]
        self.killer = Killer(pool, bar.write) if opts.kill_one else None
        # torchrl's pool stacks the child specs on every access (about 1 ms): once is enough.
        self.action_spec = pool.full_action_spec
        self.sent = 0
        self.done = 0

    def send(self, root: TensorDictBase, envs: list[int]) -> None:
        budget = self.opts.steps - self.sent
        if budget < len(envs):  # the last sends: no more steps than asked for
            root, envs = root[:budget], envs[:budget]
        if envs:
            self.pool.async_step_and_maybe_reset_send(
                _random_actions(self.action_spec, root, envs), env_index=envs
            )
            self.sent += len(envs)

    def run(self, root: TensorDictBase) -> None:
        self.send(root, list(range(self.pool.num_envs)))
        while self.done < self.opts.steps:
            # No ``timeout``: it is a deadline that, once one result is in, waits
            # for the rest (deadline batching). Hung steps are the pool's to bound.
            result, next_root = self.pool.async_step_and_maybe_reset_recv(min_get=1)
            envs = _env_indices(result)
            _record(self.tallies, result, envs)
            self._announce_restarts(result, envs)
            self.done += len(envs)
            self.bar.update(len(envs))
            self.send(next_root, envs)
            self._maybe_kill()  # after sending, so the killed worker has a request in flight

    def _announce_restarts(self, result: TensorDictBase, envs: list[int]) -> None:
        if self.killer is None:
            return
        for env in _restarted_envs(self.pool, result, envs):
            self.bar.write(f"env {env}: its in-flight step came back as a truncation (restart)")

    def _maybe_kill(self) -> None:
        if self.killer is None:
            return
        if self.killer.worker is None and self.done >= self.opts.kill_at * self.opts.steps:
            self.killer.kill()
        self.killer.check()


def _stats_table(pool: ZMQAsyncEnvPool) -> str:
    """The pool's own per-env table."""
    return pool.stats_table()


def _pool_restarts(pool: ZMQAsyncEnvPool) -> int:
    return sum(int(row["restarts"]) for row in pool.env_stats().values())


def run_demo(opts: DemoOptions) -> DemoResult:
    """Build a local pool, step it ``opts.steps`` times asynchronously, close it."""
    maker = load_env_maker(opts.env)
    if opts.seed is not None:
        torch.manual_seed(opts.seed)  # the random actions
    start = time.monotonic()
    pool = ZMQAsyncEnvPool(
        [maker] * opts.num_envs,
        envs_per_worker=opts.envs_per_worker,
        config=PoolConfig(step_timeout_s=opts.step_timeout_s),
    )
    try:
        if opts.seed is not None:
            pool.set_seed(opts.seed)  # as SerialEnv: env 0 gets seed, the next what it returned
        root = pool.reset()
        return _measure(pool, opts, root, time.monotonic() - start)
    finally:
        pool.close()


def _measure(
    pool: ZMQAsyncEnvPool, opts: DemoOptions, root: TensorDictBase, startup_s: float
) -> DemoResult:
    bar = tqdm(total=opts.steps, unit="step", disable=None if opts.progress else True)
    with bar, logging_redirect_tqdm():  # the pool's warnings print above the bar
        loop = _Loop(pool, opts, bar)
        began = time.perf_counter()
        loop.run(root)
        seconds = time.perf_counter() - began
    result = DemoResult(opts.steps, seconds, startup_s, loop.tallies, _stats_table(pool))
    restarts = _pool_restarts(pool)
    if restarts is None and loop.killer is not None:
        restarts = loop.killer.restarts
    result.restarts_seen = restarts or 0
    return result


_COLUMNS = (("env", 5), ("steps", 7), ("episodes", 9), ("mean return", 12), ("truncated", 10))


def _row(*cells: object) -> str:
    return " ".join(f"{cell!s:>{width}}" for cell, (_, width) in zip(cells, _COLUMNS, strict=True))


def _fmt_return(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_report(opts: DemoOptions, result: DemoResult, out: TextIO = sys.stdout) -> None:
    """Throughput, then one line per env, then the pool's own table if it has one."""
    workers = -(-opts.num_envs // opts.envs_per_worker)
    print(
        f"\n{result.steps} env-steps in {result.seconds:.2f} s: "
        f"{result.steps_per_s:,.0f} env-steps/s "
        f"({opts.num_envs} envs in {workers} workers; start-up {result.startup_s:.1f} s)",
        file=out,
    )
    print(_row(*(name for name, _ in _COLUMNS)), file=out)
    for env, t in enumerate(result.tallies):
        print(_row(env, t.steps, t.episodes, _fmt_return(t.mean_return), t.truncations), file=out)
    if opts.kill_one:
        print(f"env restarts: {result.restarts_seen}", file=out)  # a worker's envs each count
    if result.stats_table:
        print(f"\npool.stats_table():\n{result.stats_table}", file=out)
