"""Where a worker's env threads start to pay: envs that compute, in threads or inline.

A worker with env threads steps inline the envs its judge finds cheap
(``workers/inline.py``): a step that never waited and took at most
``HEAVY_STEP_S`` of CPU. Torch releases the GIL in its ops, so envs whose
steps compute for long run in parallel in their threads; short ones only pay
the threads' hand-offs. This measures both sides of the bar on this machine:
one worker of two :class:`~zmqpool.testing.MatmulEnv`, whose step multiplies
a matrix (``--sizes``: the matrix's side and how many products a step
takes), stepped together (``min_get=2``) with every env in its thread
(``inline_cheap_envs=False``), as judged (the default) and inline
(``env_threads=False``), the three alternated ``--repeats`` times, steps/s
each.

Example:
    python scripts/judge_bar.py
    python scripts/judge_bar.py --sizes 256x4 256x10 --repeats 5 --rounds 300
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from tensordict import TensorDict

from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.testing import MatmulEnv, matrix_products

CONFIGS = {
    "threads": PoolConfig(inline_cheap_envs=False),
    "judged": PoolConfig(),
    "inline": PoolConfig(env_threads=False),
}
WARMUP_ROUNDS = 20


def compute_ms(side: int, products: int, reps: int = 50) -> float:
    """The CPU time of one step's products, in this process, hot."""
    matrix = torch.randn(side, side)
    start = time.thread_time()
    for _ in range(reps):
        matrix_products(matrix, products)
    return (time.thread_time() - start) / reps * 1e3


def steps_per_s(side: int, products: int, config: PoolConfig, rounds: int) -> float:
    kwargs = [{"env_id": i, "side": side, "products": products} for i in range(2)]
    pool = ZMQAsyncEnvPool(
        [MatmulEnv] * 2, create_env_kwargs=kwargs, envs_per_worker=2, config=config
    )
    try:
        pool.reset()
        actions = TensorDict({"action": torch.zeros(2, 1)}, batch_size=[2])
        for _ in range(WARMUP_ROUNDS):
            pool.async_step_send(actions, env_index=[0, 1])
            pool.async_step_recv(min_get=2, timeout=60)
        start = time.perf_counter()
        for _ in range(rounds):
            pool.async_step_send(actions, env_index=[0, 1])
            pool.async_step_recv(min_get=2, timeout=60)
        return 2 * rounds / (time.perf_counter() - start)
    finally:
        pool.close()


def size(text: str) -> tuple[int, int]:
    side, _, products = text.partition("x")
    return int(side), int(products or 1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=size,
        default=[(64, 1), (192, 3), (256, 4), (256, 7)],
        help="the envs' work, each SIDExPRODUCTS: the matrix's side, the products a step takes",
    )
    parser.add_argument("--repeats", type=int, default=3, help="times the three ways alternate")
    parser.add_argument("--rounds", type=int, default=150, help="steps of every env per run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the workers run torch (PoolConfig.worker_torch_threads)
    for side, products in args.sizes:
        rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(args.repeats):
            for name, config in CONFIGS.items():
                rates[name].append(steps_per_s(side, products, config, args.rounds))
        shown = "  ".join(
            f"{name} {'/'.join(f'{rate:.0f}' for rate in values)}" for name, values in rates.items()
        )
        print(f"{side}x{products}, {compute_ms(side, products):.2f} ms a step: {shown} steps/s")


if __name__ == "__main__":
    main()
