"""Random subsets, min_get=1, hundreds of steps: nothing lost, duplicated or misrouted."""

from __future__ import annotations

import random

import torch
from tensordict import TensorDict

from tests.conftest import NUM_ENVS

STEPS = 600


def test_async_random_subsets_deliver_every_step_exactly_once(pool):
    rng = random.Random(0)
    pool.reset()
    count = [0] * NUM_ENVS  # steps each env has taken since the reset
    awaited: dict[int, float] = {}  # env -> the action value it was sent
    sent = received = 0
    while received < STEPS or awaited:
        idle = [e for e in range(NUM_ENVS) if e not in awaited]
        subset = sorted(rng.sample(idle, rng.randint(0, len(idle)))) if idle else []
        if subset and sent < STEPS:
            actions = [(sent + k + 1) / 10_000 for k in range(len(subset))]
            td = TensorDict({"action": torch.tensor(actions).unsqueeze(-1)}, [len(subset)])
            pool.async_step_send(td, env_index=subset)
            awaited.update(zip(subset, actions, strict=True))
            sent += len(subset)
        if not awaited:
            continue
        out = pool.async_step_recv(min_get=1, timeout=30)
        for row, env in enumerate(int(i) for i in out["env_index"]):
            observation = out["next", "observation"][row]
            assert env in awaited, f"env {env} answered a request it never got"
            count[env] += 1
            assert observation[0].item() == env  # routed to the right env
            assert observation[1].item() == count[env]  # no step lost or doubled
            assert abs(observation[2].item() - awaited.pop(env)) < 1e-6  # its own action
            received += 1
    assert not awaited and sum(count) == received
