"""Small, importable torchrl envs for tests, benchmarks and demos.

They live in the package (like ``numpy.testing``) so that every worker, local
or on another machine, can import them by name: ``zmqpool.testing:CountingEnv``.

- :class:`CountingEnv` says who it is: its observation starts with its
  ``env_id``, the step count and the last action, so a result that reached the
  wrong env or was delivered twice shows in the numbers.
- :class:`FaultyEnv` misbehaves on purpose at a chosen step: it raises, exits
  the process, or hangs.
- :class:`MatmulEnv` computes before each step: matrix products, in which
  torch releases the GIL (what a worker's env threads gain from).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

__all__ = ["CountingEnv", "FaultyEnv", "MatmulEnv"]


class CountingEnv(EnvBase):
    """A cheap env whose outputs identify it.

    ``observation[..., :4]`` holds ``(env_id, step_count, last_action, seed)``
    (padded or cut to the observation's size; for integer dtypes the values are
    cast). The reward is ``env_id + step_count`` and the episode ends after
    ``max_steps`` steps.

    Args:
        env_id: a number the env writes into every output.
        obs_shape: the observation's shape, ``(4,)`` by default.
        obs_dtype: the observation's dtype (None: torch's default dtype where it is built).
        max_steps: steps per episode (``None``: never done).
        step_sleep_s: ``(low, high)``: each step sleeps a uniform time in it,
            to model a simulator's latency.
        device: torchrl's env ``device`` (None: none, as by default).

    Example:
        >>> env = CountingEnv(env_id=3)
        >>> td = env.rand_step(env.reset())
        >>> td["next", "observation"][:2].tolist()
        [3.0, 1.0]
    """

    def __init__(
        self,
        env_id: int = 0,
        obs_shape: Sequence[int] = (4,),
        obs_dtype: torch.dtype | None = torch.float32,
        max_steps: int | None = None,
        step_sleep_s: tuple[float, float] = (0.0, 0.0),
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(batch_size=(), device=device)
        self.env_id = env_id
        self.max_steps = max_steps
        self.step_sleep_s = step_sleep_s
        self.obs_shape = torch.Size(obs_shape)
        self.obs_dtype = obs_dtype = obs_dtype or torch.get_default_dtype()
        self.count = 0
        self.seed = -1
        self.observation_spec = Composite(
            observation=Unbounded(shape=self.obs_shape, dtype=obs_dtype)
        )
        self.action_spec = Bounded(-1.0, 1.0, shape=(1,), dtype=torch.float32)
        self.reward_spec = Unbounded(shape=(1,), dtype=torch.float32)
        flag = Categorical(2, shape=(1,), dtype=torch.bool)
        self.done_spec = Composite(done=flag, terminated=flag.clone(), truncated=flag.clone())

    def _observation(self, last_action: float) -> torch.Tensor:
        head = torch.tensor([self.env_id, self.count, last_action, self.seed], dtype=torch.float64)
        flat = torch.zeros(self.obs_shape.numel(), dtype=torch.float64)
        n = min(4, flat.numel())
        flat[:n] = head[:n]
        return flat.reshape(self.obs_shape).to(self.obs_dtype)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        self.count = 0
        return TensorDict(
            {
                "observation": self._observation(0.0),
                "done": torch.zeros(1, dtype=torch.bool),
                "terminated": torch.zeros(1, dtype=torch.bool),
                "truncated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=(),
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        low, high = self.step_sleep_s
        if high > 0:
            time.sleep(random.uniform(low, high))
        self.count += 1
        action = float(tensordict["action"].reshape(-1)[0])
        done = self.max_steps is not None and self.count >= self.max_steps
        flag = torch.tensor([done], dtype=torch.bool)
        return TensorDict(
            {
                "observation": self._observation(action),
                "reward": torch.tensor([self.env_id + self.count], dtype=torch.float32),
                "done": flag,
                "terminated": flag.clone(),
                "truncated": torch.zeros(1, dtype=torch.bool),
            },
            batch_size=(),
        )

    def _set_seed(self, seed: int | None) -> None:
        self.seed = -1 if seed is None else int(seed)


class FaultyEnv(CountingEnv):
    """A :class:`CountingEnv` that misbehaves at step ``fault_at``.

    Args:
        fault: ``"raise"`` (a ``ValueError``), ``"exit"`` (``os._exit(3)``: the
            process dies mid-step) or ``"hang"`` (sleeps ``hang_s``).
        fault_at: the step count (1-based) at which it misbehaves; ``0`` means
            on reset, and in the constructor when ``in_init`` is set.
        every_episode: misbehave at that step of every episode, not just once.
        in_init: raise in the constructor (to test env-maker errors).
    """

    def __init__(
        self,
        env_id: int = 0,
        fault: str = "raise",
        fault_at: int = 1,
        every_episode: bool = True,
        in_init: bool = False,
        hang_s: float = 3600.0,
        **kwargs,
    ) -> None:
        if in_init:
            raise ValueError(f"FaultyEnv {env_id} refuses to be built")
        super().__init__(env_id=env_id, **kwargs)
        self.fault = fault
        self.fault_at = fault_at
        self.every_episode = every_episode
        self.hang_s = hang_s
        self.faulted = False

    def _misbehave(self) -> None:
        if self.faulted and not self.every_episode:
            return
        self.faulted = True
        if self.fault == "raise":
            raise ValueError(f"FaultyEnv {self.env_id} failed at step {self.count}")
        if self.fault == "exit":
            os._exit(3)
        if self.fault == "hang":
            time.sleep(self.hang_s)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        if self.fault_at == 0:
            self._misbehave()
        return super()._reset(tensordict, **kwargs)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.count + 1 == self.fault_at:
            self.count += 1
            self._misbehave()
            self.count -= 1
        return super()._step(tensordict)


class MatmulEnv(CountingEnv):
    """A :class:`CountingEnv` whose step first takes ``products`` products of a
    random ``side`` x ``side`` matrix (each ``tanh``-squashed, so they stay finite).

    Torch releases the GIL in each product, so such envs of one worker compute in
    parallel in their threads (see ``scripts/judge_bar.py``).
    """

    def __init__(self, env_id: int = 0, side: int = 64, products: int = 1, **kwargs) -> None:
        super().__init__(env_id=env_id, **kwargs)
        self.matrix = torch.randn(side, side)
        self.products = products

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        matrix_products(self.matrix, self.products)
        return super()._step(tensordict)


def matrix_products(matrix: torch.Tensor, products: int) -> torch.Tensor:
    """``products`` products of ``matrix`` with itself, each ``tanh``-squashed."""
    out = matrix
    for _ in range(products):
        out = (out @ matrix).tanh_()
    return out
