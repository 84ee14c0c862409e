"""Where the trainer's main thread spends its CPU, phase by phase, in the bench's async loop.

``scripts/bench.py`` reports the trainer's CPU per env-step as one figure;
this splits it. It runs the bench's own loop (:class:`bench.AsyncLoop` on
:class:`bench.CountingEnv`: a recv of at least ``min_get`` results, the
user's ``env_index.tolist()`` and its next input: a fresh action batch, or
``step_mdp`` of the result with actions for the ``mdp`` scenario; a send) on a
``ZMQAsyncEnvPool``, with a thread-CPU timer (``time.thread_time``) around
each phase in :data:`PHASES`, and prints each phase's CPU per env-step,
nested as the calls are. The timers' own cost is in the figures (about a
microsecond a call on a 2-CPU VM), so read them side by side, not against
the bench's.

The envs, their count, envs per worker and ``min_get`` are those of one of
the bench's scenarios (its CountingEnv ones: ``--scenario``), each
overridable.

Example:
    python scripts/trainer_phases.py                    # batch32: 64 envs, 16 a worker, min_get=32
    python scripts/trainer_phases.py --scenario cheap   # 4 envs, 1 a worker, min_get=1
    python scripts/trainer_phases.py --scenario 1mib    # a 1 MiB observation
    python scripts/trainer_phases.py --num-envs 8 --envs-per-worker 4 --min-get 2 --seconds 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import bench  # beside this file: a script's own folder is on its path
import zmq

from zmqpool import (
    PoolConfig,
    ZMQAsyncEnvPool,
    assembly,
    broker,
    indexing,
    intake,
    pool,
    runtime,
    supervisor,
    validation,
)


@dataclasses.dataclass(frozen=True)
class Phase:
    """A callable timed as ``label``, ``depth`` levels below a whole round of the loop."""

    label: str
    owner: Any  # a class or module
    name: str
    depth: int


PHASES = (
    Phase("async_step_recv", pool.ZMQAsyncEnvPool, "async_step_recv", 0),
    Phase("Runtime.collect", runtime.Runtime, "collect", 1),
    Phase("Broker.poll", broker.Broker, "poll", 2),
    Phase("Intake.on_result", intake.Intake, "on_result", 3),
    Phase("recv_frames", broker, "recv_frames", 3),
    Phase("zmq_poll", zmq.Poller, "poll", 3),
    Phase("Supervisor.tick", supervisor.Supervisor, "tick", 2),
    Phase("Assembler.assemble", assembly.Assembler, "assemble", 1),
    Phase("async_step_send", pool.ZMQAsyncEnvPool, "async_step_send", 0),
    Phase("Runtime.send_all", runtime.Runtime, "send_all", 1),
    Phase("Assembler.payloads", assembly.Assembler, "payloads", 1),
    Phase("EnvIndexer.batch", indexing.EnvIndexer, "batch", 1),
    Phase("StepInputSpec.check_batch", validation.StepInputSpec, "check_batch", 1),
    Phase("the user's env_index.tolist()", bench, "env_indices", 0),
    Phase("the user's next input", bench.AsyncLoop, "_next_input", 0),
)

#: The bench's scenarios this loop runs: CountingEnv, not the scale ones (minutes to start).
SCENARIOS = {
    name: scenario
    for name, scenario in bench.build_scenarios(quick=False).items()
    if scenario.env == "counting" and not scenario.scale
}


@contextlib.contextmanager
def timed(phases: Sequence[Phase]) -> Iterator[Counter[str]]:
    """Wrap each phase's callable to add its thread CPU to the counter yielded; restore after."""
    spent: Counter[str] = Counter()
    originals = [(p, getattr(p.owner, p.name)) for p in phases]
    for phase, original in originals:
        setattr(phase.owner, phase.name, _timer(original, phase.label, spent))
    try:
        yield spent
    finally:
        for phase, original in reversed(originals):
            setattr(phase.owner, phase.name, original)


def _timer(original: Callable, label: str, spent: Counter[str]) -> Callable:
    clock = time.thread_time

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += clock() - start

    return wrapper


@dataclasses.dataclass
class Split:
    """One measured window: env-steps, rounds, the main thread's CPU, and each phase's."""

    steps: int
    rounds: int
    wall_s: float
    main_cpu_s: float
    phases: dict[str, float]

    def per_step_us(self, seconds: float) -> float:
        return 1e6 * seconds / self.steps


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the loop runs: a bench scenario's envs, so many, so many a worker, its ``min_get``."""

    scenario: bench.Scenario
    num_envs: int
    envs_per_worker: int
    min_get: int

    def __str__(self) -> str:
        return (
            f"{self.scenario.name}: {self.num_envs} envs, {self.envs_per_worker} a worker, "
            f"min_get={self.min_get}"
        )


def measure(workload: Workload, seconds: float, warmup_s: float, config: PoolConfig) -> Split:
    """Run the bench's loop ``warmup_s`` untimed, then ``seconds`` with every phase timed.

    Each window is the bench's own :func:`bench.measure` of the loop.
    """
    num_envs = workload.num_envs
    window = bench.Config(seconds=seconds, warmup_s=0.0, num_envs=num_envs)
    with timed(PHASES) as spent:
        envs = ZMQAsyncEnvPool(
            [bench.CountingEnv] * num_envs,
            create_env_kwargs=workload.scenario.env_kwargs(num_envs),
            envs_per_worker=workload.envs_per_worker,
            config=config,
        )
        try:
            loop = bench.AsyncLoop(envs, num_envs, 60.0, workload.min_get, workload.scenario.mdp)
            bench.measure(loop, dataclasses.replace(window, seconds=warmup_s))
            spent.clear()
            cpu = time.thread_time()
            measured = bench.measure(loop, window)
            cpu = time.thread_time() - cpu
            phases = dict(spent)
            loop.drain()
        finally:
            envs.close()
    return Split(measured.steps, len(measured.tick_s), measured.seconds, cpu, phases)


def report(split: Split) -> str:
    rate = split.steps / split.wall_s
    main_us = split.per_step_us(split.main_cpu_s)
    lines = [
        f"{split.steps:,} env-steps in {split.wall_s:.1f} s ({rate:,.0f}/s), "
        f"{split.steps / split.rounds:.1f} results a recv",
        f"{'the main thread, all of it':40s} {main_us:7.1f} us/env-step",
    ]
    for phase in PHASES:
        label = "  " * phase.depth + phase.label
        lines.append(f"{label:40s} {split.per_step_us(split.phases.get(phase.label, 0.0)):7.1f}")
    return "\n".join(lines)


def workload(args: argparse.Namespace) -> Workload:
    """The scenario's sizes as the bench runs them (4 envs, 1 a worker, unless it says) or given."""
    scenario = SCENARIOS[args.scenario]
    cfg = bench.Config(seconds=args.seconds, warmup_s=args.warmup, num_envs=4)
    return Workload(
        scenario,
        args.num_envs or scenario.envs(cfg),
        args.envs_per_worker or scenario.per_worker(cfg),
        args.min_get or scenario.min_get,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="batch32",
        help="scripts/bench.py's scenario whose loop is timed",
    )
    parser.add_argument("--num-envs", type=int, help="envs in the pool (unset: the scenario's)")
    parser.add_argument(
        "--envs-per-worker", type=int, help="envs per worker process (unset: the scenario's)"
    )
    parser.add_argument(
        "--min-get", type=int, help="results each recv waits for (unset: the scenario's)"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="the timed window, seconds")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds run before it")
    parser.add_argument(
        "--no-env-threads", action="store_true", help="PoolConfig(env_threads=False)"
    )
    args = parser.parse_args(argv)
    work = workload(args)
    config = PoolConfig(env_threads=not args.no_env_threads)
    split = measure(work, args.seconds, args.warmup, config)
    print(f"{work}, env threads {'off' if args.no_env_threads else 'on'}")
    print(report(split))


if __name__ == "__main__":
    main()
