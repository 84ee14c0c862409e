"""Figures for Ray-hosted envs: Ray start-up, pool construction, kill-to-truncation, throughput.

    python scripts/ray_bench.py [--envs 2] [--seconds 3]

Starts a local Ray cluster (``ray.init(num_cpus=...)``), then, in one run:

- builds a pool whose envs are all Ray actors (``RayWorkers``) and times it;
- steps it asynchronously (``min_get=1``) for ``--seconds`` and reports env-steps/s;
- SIGKILLs one actor's process and times until its env answers with the
  restart truncation (Ray restarts the actor, which rejoins its slot);
- steps a pool of as many local envs the same way, for the ratio.

Throughput is reported as a ratio (Ray-hosted / local), never asserted: these
machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import ray
import torch
from tensordict import TensorDict

from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.ray_workers import RayWorkers
from zmqpool.testing import CountingEnv

CONFIG = PoolConfig(register_timeout_s=120.0)


def actions(n: int) -> TensorDict:
    return TensorDict({"action": torch.zeros(n, 1)}, [n])


def steps_per_s(pool: ZMQAsyncEnvPool, seconds: float) -> float:
    """An async trainer's loop: resend to whichever envs answered."""
    n = pool.num_envs
    pool.reset()
    pool.async_step_send(actions(n), env_index=list(range(n)))
    done_steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        out = pool.async_step_recv(min_get=1)
        idx = [int(i) for i in out["env_index"]]
        done_steps += len(idx)
        pool.async_step_send(actions(len(idx)), env_index=idx)
    rate = done_steps / (time.perf_counter() - start)
    pool.async_step_recv(min_get=n, max_get=n, timeout=60.0)
    return rate


def kill_to_truncation(pool: ZMQAsyncEnvPool, workers: RayWorkers) -> float:
    """SIGKILL actor 0 (env 0) with a step in flight; seconds until env 0's truncation."""
    pool.reset()
    victim = workers.actor_pids()[0]
    pool.async_step_send(actions(1), env_index=[0])
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    pool.async_step_recv(min_get=1, timeout=120.0)
    assert pool.last_restarted_envs == [0], pool.last_restarted_envs
    return time.monotonic() - killed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--envs", type=int, default=2, help="envs in each pool")
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="stepping time per pool, seconds"
    )
    parser.add_argument("--num-cpus", type=int, default=2, help="the local Ray cluster's CPUs")
    args = parser.parse_args()
    figures: dict[str, float] = {}

    started = time.monotonic()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    figures["ray_start_s"] = time.monotonic() - started
    try:
        workers = RayWorkers(
            "zmqpool.testing:CountingEnv", count=args.envs, num_cpus=args.num_cpus / args.envs
        )
        started = time.monotonic()
        pool = ZMQAsyncEnvPool([], remote_workers=workers, bind="tcp://127.0.0.1:*", config=CONFIG)
        figures["ray_pool_construction_s"] = time.monotonic() - started
        try:
            figures["ray_steps_per_s"] = steps_per_s(pool, args.seconds)
            figures["kill_to_truncation_s"] = kill_to_truncation(pool, workers)
        finally:
            pool.close()
    finally:
        ray.shutdown()

    started = time.monotonic()
    local = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{}] * args.envs, config=CONFIG)
    figures["local_pool_construction_s"] = time.monotonic() - started
    try:
        figures["local_steps_per_s"] = steps_per_s(local, args.seconds)
    finally:
        local.close()
    figures["ray_over_local_throughput"] = figures["ray_steps_per_s"] / figures["local_steps_per_s"]
    for name, value in figures.items():
        print(f"{name:28s} {value:10.2f}")
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
