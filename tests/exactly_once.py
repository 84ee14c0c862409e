"""A trainer's random async loop that checks every step is answered once, by its env.

Shared by the stress test and the live fuzz: it sends random subsets of idle
envs (``CountingEnv``s), takes whatever comes back with ``min_get=1``, and
checks each row: the env was awaited, the observation names that env, its
step count moved by exactly one, and it carries the action that env was sent.
"""

from __future__ import annotations

import random

import torch
from tensordict import TensorDict


class ExactlyOnce:
    def __init__(self, pool, num_envs: int, steps: int, rng: random.Random) -> None:
        self.pool, self.num_envs, self.steps, self.rng = pool, num_envs, steps, rng
        self.count = [0] * num_envs  # steps each env has taken since the reset
        self.awaited: dict[int, float] = {}  # env -> the action value it was sent
        self.sent = self.received = 0

    def run(self, between=lambda: None) -> None:
        """Step until ``steps`` env-steps are sent and answered; ``between`` runs each turn."""
        self.pool.reset()
        while self.received < self.steps:
            between()
            self.send_random()
            if self.awaited:
                self.receive()
        assert not self.awaited and sum(self.count) == self.received == self.steps

    def send_random(self) -> None:
        idle = [e for e in range(self.num_envs) if e not in self.awaited]
        size = self.rng.randint(0, min(len(idle), self.steps - self.sent))
        subset = sorted(self.rng.sample(idle, size))
        if not subset:
            return
        actions = [(self.sent + k + 1) / 10_000 for k in range(len(subset))]
        td = TensorDict({"action": torch.tensor(actions).unsqueeze(-1)}, [len(subset)])
        self.pool.async_step_send(td, env_index=subset)
        self.awaited.update(zip(subset, actions, strict=True))
        self.sent += len(subset)

    def receive(self) -> None:
        out = self.pool.async_step_recv(min_get=1, timeout=30)
        for row, env in enumerate(int(i) for i in out["env_index"]):
            observation = out["next", "observation"][row]
            assert env in self.awaited, f"env {env} answered a request it never got"
            assert observation[0].item() == env, f"a result reached the wrong env: {observation}"
            self.count[env] += 1
            assert observation[1].item() == self.count[env]  # no step lost or doubled
            assert abs(observation[2].item() - self.awaited.pop(env)) < 1e-6  # its own action
            self.received += 1
