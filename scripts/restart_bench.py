"""Hot restart, measured: how long a killed env is out, and what the healthy envs do meanwhile.

Two numbers, from one pool of CountingEnvs stepped in a ``min_get=1`` loop:

- restart latency: from SIGKILL of a worker in the middle of a step to the
  synthesized truncation reply for that step (median and max over ``--kills``);
- healthy throughput: env-steps/s of the *other* envs from the kill to that
  reply, against the same envs in a loop of ``--window`` s with no kill.

Run: ``python scripts/restart_bench.py [--kills 10] [--num-envs 4] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

import torch
from tensordict import TensorDict

from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.testing import CountingEnv

STEP_S = 0.002  # each step sleeps this long, so a kill lands inside a step
#: a kill with no truncation this long after it missed the step; the script kills again.
MISSED_KILL_S = 5.0
GIVE_UP_S = 60.0


def make_pool(num_envs: int, fork_server: bool) -> ZMQAsyncEnvPool:
    config = PoolConfig(max_restarts=1000, restart_backoff_s=0.0, fork_server=fork_server)
    kwargs = [{"env_id": i, "step_sleep_s": (STEP_S, STEP_S)} for i in range(num_envs)]
    return ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs, config=config)


def send(pool: ZMQAsyncEnvPool, envs: list[int]) -> None:
    td = TensorDict({"action": torch.zeros(len(envs), 1)}, [len(envs)])
    pool.async_step_send(td, env_index=envs)


def kill_victim(pool: ZMQAsyncEnvPool, victim: int) -> float:
    """SIGKILL ``victim``'s worker half-way through the step it was just sent; when."""
    time.sleep(STEP_S / 2)
    pid = pool.worker_pid(victim)
    assert pid is not None, f"env {victim} has no local worker process"
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def run_loop(pool: ZMQAsyncEnvPool, seconds: float, victim: int, kill: bool) -> tuple[float, float]:
    """Step all envs; with ``kill``, SIGKILL the victim's worker mid-step and stop at its reply.

    Returns the steps/s of the envs other than ``victim`` over the window, and
    the kill-to-truncation latency (nan without a kill).
    """
    num_envs = pool.num_envs
    send(pool, list(range(num_envs)))
    start, healthy, latency = time.monotonic(), 0, float("nan")
    killed_at = kill_victim(pool, victim) if kill else start
    while (kill and latency != latency) or (not kill and time.monotonic() - start < seconds):
        if kill and time.monotonic() - killed_at > MISSED_KILL_S:
            # On a loaded machine the step may have ended before the kill: the worker
            # died idle and came back with nothing in flight to truncate. Again.
            if time.monotonic() - start > GIVE_UP_S:
                raise RuntimeError(f"no kill of env {victim}'s worker landed in a step")
            killed_at = kill_victim(pool, victim)
        # No timeout: it is a deadline that would hold the healthy envs' results back
        # until the victim's truncation (deadline batching); the pool restarts the victim.
        out = pool.async_step_recv(min_get=1)
        envs = [int(i) for i in out["env_index"]]
        if victim in pool.last_restarted_envs:
            latency = time.monotonic() - killed_at
        healthy += sum(1 for e in envs if e != victim)
        send(pool, envs)
    elapsed = time.monotonic() - start
    pool.async_step_recv(min_get=num_envs, timeout=120)  # drain
    return healthy / elapsed, latency


def measure(args: argparse.Namespace, fork_server: bool) -> dict[str, float]:
    pool = make_pool(args.num_envs, fork_server)
    try:
        pool.reset()
        baseline, during, latencies = [], [], []
        for k in range(args.kills):
            victim = k % args.num_envs
            baseline.append(run_loop(pool, args.window, victim, kill=False)[0])
            rate, latency = run_loop(pool, args.window, victim, kill=True)
            during.append(rate)
            latencies.append(latency)
    finally:
        pool.close()
    return {
        "restart_latency_median_s": statistics.median(latencies),
        "restart_latency_max_s": max(latencies),
        "healthy_steps_per_s_without_restart": statistics.median(baseline),
        "healthy_steps_per_s_during_restart": statistics.median(during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--kills", type=int, default=10, help="workers killed (SIGKILL) per row, one at a time"
    )
    parser.add_argument("--num-envs", type=int, default=4, help="envs in each pool")
    parser.add_argument("--window", type=float, default=1.0, help="seconds per measured loop")
    parser.add_argument(
        "--no-fresh-interpreter",
        action="store_true",
        help="skip the row whose workers start fresh interpreters (fork_server=False)",
    )
    parser.add_argument("--json", help="write the results here (JSON)")
    args = parser.parse_args()
    rows = {"fork server": measure(args, fork_server=True)}
    if not args.no_fresh_interpreter:
        args.kills = min(args.kills, 3)  # a fresh interpreter needs seconds to come back
        rows["fresh interpreter"] = measure(args, fork_server=False)
    for name, row in rows.items():
        print(f"{name}:")
        for key, value in row.items():
            print(f"  {key:<40} {value:10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
