"""A trainer's random async loop that checks every step is answered once, by its env.

Shared by the stress test, the live fuzz and the process-death tests: it sends
random subsets of idle envs (``CountingEnv``s), takes whatever comes back with
``min_get=1``, and checks each row: the env was awaited, the observation names
that env, its step count moved by exactly one, and it carries the action that
env was sent.

With ``restarts=True`` a row may also be a restart truncation (the env's
worker died): it must be marked in ``pool.last_restarted_envs`` and look like
one (done and truncated, not terminated, zero reward, the fresh env's reset
observation), and the env counts from 0 again. Without it, a truncation fails
the run as a lost step.
"""

from __future__ import annotations

import random

import torch
from tensordict import TensorDict


class ExactlyOnce:
    def __init__(
        self, pool, num_envs: int, steps: int, rng: random.Random, restarts: bool = False
    ) -> None:
        self.pool, self.num_envs, self.steps, self.rng = pool, num_envs, steps, rng
        self.restarts = restarts
        self.count = [0] * num_envs  # steps each env has taken since the reset
        self.truncations = [0] * num_envs  # restart truncations each env answered with
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
        assert not self.awaited and self.received == self.steps
        if not self.restarts:
            assert sum(self.count) == self.received

    def send_random(self) -> None:
        idle = [e for e in range(self.num_envs) if e not in self.awaited]
        size = self.rng.randint(0, min(len(idle), self.steps - self.sent))
        self.send(sorted(self.rng.sample(idle, size)))

    def send(self, subset: list[int]) -> None:
        """One step for each env of ``subset`` (all idle)."""
        if not subset:
            return
        actions = [(self.sent + k + 1) / 10_000 for k in range(len(subset))]
        td = TensorDict({"action": torch.tensor(actions).unsqueeze(-1)}, [len(subset)])
        self.pool.async_step_send(td, env_index=subset)
        self.awaited.update(zip(subset, actions, strict=True))
        self.sent += len(subset)

    def receive(self) -> None:
        out = self.pool.async_step_recv(min_get=1, timeout=30)
        restarted = set(self.pool.last_restarted_envs)
        assert self.restarts or not restarted, f"envs {sorted(restarted)} were restarted"
        for row, env in enumerate(int(i) for i in out["env_index"]):
            observation = out["next", "observation"][row]
            assert env in self.awaited, f"env {env} answered a request it never got"
            assert observation[0].item() == env, f"a result reached the wrong env: {observation}"
            action = self.awaited.pop(env)
            self.received += 1
            if env in restarted:
                self._check_truncation(out, row)
                self.count[env] = 0
                self.truncations[env] += 1
                continue
            self.count[env] += 1
            assert observation[1].item() == self.count[env]  # no step lost or doubled
            assert abs(observation[2].item() - action) < 1e-6  # its own action

    @staticmethod
    def _check_truncation(out, row: int) -> None:
        nxt = out["next"]
        assert nxt["truncated"][row].item() and nxt["done"][row].item()
        assert not nxt["terminated"][row].item()  # a value target bootstraps
        assert nxt["reward"][row].item() == 0.0
        assert nxt["observation"][row][1].item() == 0.0  # the fresh env's reset observation
