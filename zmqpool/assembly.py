"""Between the caller's tensordicts and the wire: what a request carries, what a recv returns.

- :meth:`Assembler.payload`: the part of the caller's tensordict that is sent
  for one env (everything but ``env_index`` and a stale ``"next"``).
- :meth:`Assembler.assemble`: replies in, torchrl's result out: a step's
  result is the caller's input with ``"next"`` set, stacked over the envs,
  sorted by env index, carrying ``env_index`` as a ``NonTensorStack``.

Dense stacks of replies that share a layout take the fast path: one
``torch.stack`` per leaf over the received buffers
(:func:`~zmqpool.wire.stack_parts`), no per-env TensorDict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDictBase
from tensordict.utils import expand_as_right

from zmqpool.state import Reply
from zmqpool.synthesis import next_root_after_restart, truncated_next
from zmqpool.wire import Command, DecodedPart, stack_parts

ENV_INDEX = "env_index"
_STEP_COMMANDS = (Command.STEP, Command.STEP_AND_MAYBE_RESET)


class Assembler:
    """Builds payloads and results for one pool.

    Args:
        stack: the pool's ``stack`` (``"dense"``, ``"maybe_dense"``, ``"lazy"``).
        stack_func: the matching tensordict stacking function.
        child_specs: each env's ``specs``, to synthesize restart truncations.
    """

    def __init__(self, stack: str, stack_func: Callable, child_specs: Sequence[Any]) -> None:
        self.dense = stack == "dense"
        self.stack_func = stack_func
        self.child_specs = child_specs

    def payload(self, local: TensorDictBase) -> TensorDictBase:
        return local.exclude(ENV_INDEX, "next")

    def assemble(self, replies: list[Reply]) -> tuple[TensorDictBase, TensorDictBase | None]:
        """torchrl's result (and, for step_and_maybe_reset, the next root) for sorted replies."""
        command = replies[0].pending.command
        if any(r.pending.command != command for r in replies):
            raise RuntimeError("cannot stack replies to different commands in one recv")
        idx = [r.env for r in replies]
        if command in _STEP_COMMANDS:
            root = self.stack_tds([r.pending.inputs for r in replies]).exclude(ENV_INDEX)
            root.set("next", self.stack_next(replies))
        else:
            root = self.stack_next(replies)
        self.set_env_index(root, idx)
        if command != Command.STEP_AND_MAYBE_RESET:
            return root, None
        next_root = self.stack_roots(replies)
        self.set_env_index(next_root, idx)
        return root, next_root

    def stack_next(self, replies: list[Reply]) -> TensorDictBase:
        return self.stack([self.next_part(r) for r in replies])

    def stack_roots(self, replies: list[Reply]) -> TensorDictBase:
        return self.stack([self.root_part(r) for r in replies])

    def next_part(self, reply: Reply) -> DecodedPart | TensorDictBase:
        """The reply's first part; for a restarted env, the truncation built from its reset."""
        if not reply.synthesized:
            return reply.parts[0]
        reset = reply.parts[0].to_tensordict()
        return truncated_next(self.child_specs[reply.env], reset)

    def root_part(self, reply: Reply) -> DecodedPart | TensorDictBase:
        """step_and_maybe_reset's next root; for a restarted env, its reset state."""
        if not reply.synthesized:
            return reply.parts[1]
        assert reply.pending.inputs is not None
        result = reply.pending.inputs.exclude(ENV_INDEX, "next")
        result.set("next", self.next_part(reply))
        return next_root_after_restart(result, reply.parts[0].to_tensordict())

    def stack(self, parts: list[Any]) -> TensorDictBase:
        layout = parts[0].layout if isinstance(parts[0], DecodedPart) else None
        same = all(isinstance(p, DecodedPart) and p.layout is layout for p in parts)
        if same and self.dense:
            return stack_parts(parts)
        tds = [p.to_tensordict() if isinstance(p, DecodedPart) else p for p in parts]
        return self.stack_tds(tds)

    def stack_tds(self, tds: list[Any]) -> TensorDictBase:
        result = self.stack_func(tds)
        if isinstance(result, LazyStackedTensorDict):
            result = result.clone()  # do not keep the caller's input tensordicts alive
        return result

    def set_env_index(self, td: TensorDictBase, idx: list[int]) -> None:
        indices = NonTensorStack(*idx)
        if indices.shape != td.shape:
            indices = expand_as_right(indices, td)
        td.set(ENV_INDEX, indices)
