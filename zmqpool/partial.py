"""torchrl's partial steps and resets: a mask in a sync call reaches only the envs it selects.

A ``"_step"`` mask in a sync ``step`` steps only the envs it selects.

``EnvBase.rollout(..., break_when_any_done=False)`` writes one (``True`` for
the envs still running) so that envs that are done wait for the others, and
``SerialEnv`` honours it: it steps the selected envs, and gives the others a
``"next"`` that repeats their root (zeros where the root has no such entry,
such as the reward). torchrl's pool sends every row to its env and then fails
to stack ``"next"`` with the mask's rows. The functions here are that
``SerialEnv`` behaviour, on the pool's rows.

A ``"_reset"`` mask in ``_reset`` (``TransformedEnv``'s ``maybe_reset``, a
collector's, ``reset(td)``) resets only the envs it selects, as ``SerialEnv``
does; the others are not contacted, and ``EnvBase.reset`` keeps their values
from its input. torchrl's pool sends the whole batch to every env, and an env
that ignores the mask (almost every unbatched env) is reset mid-episode
without a done flag, or raises (gymnasium's: "Partial resets are not handled
at this level").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDictBase
from torchrl.envs.utils import _aggregate_end_of_traj

STEP_MASK = "_step"
RESET_MASK = "_reset"


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


def envs_to_reset(
    tensordict: TensorDictBase, reset_keys: Sequence, num_envs: int
) -> list[int] | None:
    """The envs a reset of ``tensordict`` asks for, as ``SerialEnv`` reads them; None: all.

    Its root ``"_reset"``, or else every reset key (nested ones too); an env
    is reset if any element of its mask is set. No reset key at all: every env.
    """
    needs = tensordict.get(RESET_MASK, None)
    if needs is None:
        needs = _aggregate_end_of_traj(tensordict, reset_keys=list(reset_keys))
    if not isinstance(needs, torch.Tensor):  # no reset keys: a plain reset
        return None
    rows = needs.reshape(num_envs, -1).any(-1)
    if bool(rows.all()):
        return None
    return rows.nonzero().flatten().tolist()


def fill_unreset(
    reset_rows: TensorDictBase | None, zeros: TensorDictBase, envs: list[int]
) -> TensorDictBase:
    """A dense reset's output for every env: ``reset_rows`` at ``envs``, zeros elsewhere.

    ``zeros``: what ``SerialEnv`` gives an env it does not reset (its
    observation spec's zeros), used as it is when no env was reset;
    ``EnvBase.reset`` then keeps those envs' values from its input.
    """
    if reset_rows is None:
        return zeros
    full = reset_rows.new_zeros(zeros.batch_size)
    full[torch.tensor(envs, dtype=torch.long)] = reset_rows
    return full


def unreset_rows(
    reset_rows: TensorDictBase | None, zeros: Sequence[TensorDictBase], envs: list[int]
) -> list[TensorDictBase]:
    """A lazy reset's rows, one per env: ``reset_rows``' at ``envs``, ``zeros[i]`` elsewhere."""
    rows = list(zeros)
    if reset_rows is not None:
        for env, row in zip(envs, reset_rows.unbind(0), strict=True):
            rows[env] = row
    return rows
