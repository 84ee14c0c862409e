"""torchrl's partial steps: a ``"_step"`` mask in a sync ``step`` steps only the envs it selects.

``EnvBase.rollout(..., break_when_any_done=False)`` writes one (``True`` for
the envs still running) so that envs that are done wait for the others, and
``SerialEnv`` honours it: it steps the selected envs, and gives the others a
``"next"`` that repeats their root (zeros where the root has no such entry,
such as the reward). torchrl's pool sends every row to its env and then fails
to stack ``"next"`` with the mask's rows. The functions here are that
``SerialEnv`` behaviour, on the pool's rows.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

STEP_MASK = "_step"


def masked_envs(mask: torch.Tensor, num_envs: int) -> list[int]:
    """The envs ``mask`` selects; a mask must select whole envs, as ``SerialEnv``'s must.

    Raises:
        TypeError: the mask is not boolean (an integer tensor would index rows).
        ValueError: its elements do not split into one group per env, or it
            selects some elements of an env's own batch and not others.
    """
    if mask.dtype is not torch.bool:
        raise TypeError(f"the {STEP_MASK!r} mask must be a boolean tensor, got {mask.dtype}")
    if mask.numel() % num_envs:
        raise ValueError(
            f"the {STEP_MASK!r} mask of shape {tuple(mask.shape)} does not split into "
            f"{num_envs} envs"
        )
    rows = mask.reshape(num_envs, -1)
    if not bool((rows == rows[:, :1]).all()):
        raise ValueError(
            f"the {STEP_MASK!r} mask must select whole envs: a pool steps each env's "
            "batch as one; put the partial-step logic inside the env to select some "
            "of its batch's elements"
        )
    return rows[:, 0].nonzero().flatten().tolist()


def fill_unstepped(
    stepped_next: TensorDictBase, root: TensorDictBase, envs: list[int]
) -> TensorDictBase:
    """``"next"`` for every env: ``stepped_next``'s rows at ``envs``; elsewhere ``root``'s values.

    Keys that the root lacks (the reward) are zeros in the envs not stepped,
    as ``SerialEnv`` leaves them.
    """
    full = stepped_next.new_zeros(root.batch_size)
    for key in stepped_next.keys(True, True):
        held = root.get(key, None)
        if isinstance(held, torch.Tensor) and held.shape == full.get(key).shape:
            full.set(key, held.clone())
    full[torch.tensor(envs, dtype=torch.long)] = stepped_next
    return full
