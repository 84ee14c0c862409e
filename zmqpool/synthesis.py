"""The reply a step gets when its env was restarted under it: a truncation caused by a restart.

The step never happened, so there is no real transition to return. What an
RL loop needs instead is the end of the episode and the start of the next:
``next`` is the fresh reset observation with ``done=True``,
``truncated=True``, ``terminated=False`` and a zero reward (truncation, not
termination: a value target should bootstrap, not treat the state as
terminal). For ``step_and_maybe_reset`` the next root is that reset state, so
a collector carries on.

Built from the env's specs, so the synthesized tensordict has the same keys,
shapes and dtypes as a real one and stacks with the other envs' results.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase
from torchrl.envs.utils import step_mdp


def truncated_next(spec: Any, reset: TensorDictBase) -> TensorDictBase:
    """The ``"next"`` subtree of a step answered by a restart.

    Args:
        spec: the env's ``specs`` (a Composite with ``output_spec``).
        reset: the restarted env's reset tensordict.
    """
    output = spec["output_spec"]
    nxt = output["full_observation_spec"].zero()
    nxt.update(output["full_reward_spec"].zero())
    done = output["full_done_spec"].zero()
    for key in done.keys(True, True):
        leaf = key if isinstance(key, str) else key[-1]
        if leaf in ("done", "truncated"):
            done.get(key).fill_(True)
    nxt.update(done)
    for key in nxt.keys(True, True):
        if key in reset.keys(True, True) and key not in done.keys(True, True):
            nxt.set(key, reset.get(key).to(nxt.get(key).dtype))
    return nxt


def next_root_after_restart(result: TensorDictBase, reset: TensorDictBase) -> TensorDictBase:
    """What ``step_and_maybe_reset`` returns as the next root: step_mdp, then the reset state."""
    root = step_mdp(result, exclude_action=False, keep_other=True)
    root.update(reset.select(*root.keys(True, True), strict=False))
    return root
