"""Between the caller's tensordicts and the wire: what a request carries, what a recv returns.

- :meth:`Assembler.payloads`: what is sent for each env of a batch (everything
  but ``env_index``; a ``"next"`` goes too, as an env in-process sees it: torchrl's
  ``step`` keeps what it holds that the env does not set). The pool keeps it as the request's
  input too: a step's result is rebuilt from it, so the caller's tensordict is
  not held while the env runs.
- :meth:`Assembler.assemble`: replies in, torchrl's result out: a step's
  result is its inputs with ``"next"`` set, stacked over the envs, sorted by
  env index, carrying ``env_index`` as a ``NonTensorStack``.

Where this is hot (a cheap env's step costs the pool more here than the env
costs its worker), it avoids per-env TensorDicts: a dense batch is packed
into one frame per env in one pass (:class:`~zmqpool.batching.RowPacker`), and
parts that share a layout, whether replies or the inputs kept from a send, are
stacked straight from their frames (:func:`~zmqpool.batching.stack_parts`).
Everything else (lazy stacks, per-env TensorDicts of synthesized restarts)
takes tensordict's own stacking, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
)
from tensordict.utils import expand_as_right

from zmqpool.batching import RowPacker, stack_parts
from zmqpool.codec import ZERO_COPY_THRESHOLD, DecodedPart, check_crossable
from zmqpool.state import Reply
from zmqpool.synthesis import next_root_after_restart, truncated_next
from zmqpool.wire import Command

ENV_INDEX = "env_index"
#: Commands whose result is the input root with "next" set (a raw step returns "next" itself).
_WITH_NEXT = (Command.STEP, Command.STEP_AND_MAYBE_RESET)
#: Where a worker puts the input root an env edited in place (after the usual parts).
_EDITED_ROOT_PART = {Command.STEP: 1, Command.STEP_AND_MAYBE_RESET: 2}

#: What a request carries and a reply holds: frames (the fast path) or a tensordict.
Part: TypeAlias = DecodedPart | TensorDictBase


class Assembler:
    """Builds payloads and results for one pool.

    Args:
        stack: the pool's ``stack`` (``"dense"``, ``"maybe_dense"``, ``"lazy"``).
        stack_func: the matching tensordict stacking function.
        child_specs: each env's ``specs``, to synthesize restart truncations.
        zero_copy_threshold: leaves at least this large get a frame of their own.
        device: the envs' device, if they share one: results carry it, as the
            envs' own tensordicts and their stack do (built from bytes, they
            would have none).
    """

    def __init__(
        self,
        stack: str,
        stack_func: Callable,
        child_specs: Sequence[Any],
        zero_copy_threshold: int = ZERO_COPY_THRESHOLD,
        device: torch.device | None = None,
    ) -> None:
        self.dense = stack == "dense"
        self.stack_func = stack_func
        self.child_specs = child_specs
        self.packer = RowPacker(zero_copy_threshold)
        self.device = device

    # ------------------------------------------------------------ sending

    def payloads(self, batch: TensorDictBase) -> Sequence[Part]:
        """A payload per env of ``batch`` (its first dim), without ``env_index``."""
        rows = self._packed_rows(batch) if self.dense else None
        if rows is not None:
            return rows
        payloads = batch.exclude(ENV_INDEX).unbind(0)
        for payload in payloads:
            check_crossable(payload)  # before any is sent: refuse the batch, not half of it
        return payloads

    def _packed_rows(self, batch: TensorDictBase) -> list[DecodedPart] | None:
        # Only a plain CPU TensorDict of tensors packs exactly as the stack of its
        # rows would come back; anything else keeps its TensorDicts.
        if type(batch) is not TensorDict or batch.device not in (None, _CPU):
            return None
        return self.packer.pack(batch, exclude=(ENV_INDEX,))

    # ------------------------------------------------------------ receiving

    def assemble(self, replies: list[Reply]) -> tuple[TensorDictBase, TensorDictBase | None]:
        """torchrl's result (and, for step_and_maybe_reset, the next root) for sorted replies."""
        command = replies[0].pending.command
        idx, nexts = [], []
        for reply in replies:  # one pass: this runs for every env-step
            if reply.pending.command != command:
                raise RuntimeError("cannot stack replies to different commands in one recv")
            idx.append(reply.env)
            nexts.append(reply.parts[0] if not reply.synthesized else self.next_part(reply))
        if command in _WITH_NEXT:
            root = self.stack([self.input_part(r) for r in replies])
            _attach(root, "next", self.stack(nexts))
        else:
            root = self.stack(nexts)
        self.set_env_index(root, idx)
        if command != Command.STEP_AND_MAYBE_RESET:
            return root, None
        next_root = self.stack_roots(replies)
        self.set_env_index(next_root, idx)
        return root, next_root

    def assemble_one(self, reply: Reply) -> tuple[TensorDictBase, TensorDictBase | None]:
        """torchrl's result on an env's own channel: that env's tensordict, not a stack.

        It has the env's own batch size and carries ``env_index`` as a
        ``NonTensorData``, so the caller can set an action on it and send it
        straight back with ``env_index=``.
        """
        command = reply.pending.command
        if command in _WITH_NEXT:
            root = self._one(self.input_part(reply))
            root.set("next", self._one(self.next_part(reply)))
        else:
            root = self._one(self.next_part(reply))
        _set_one_index(root, reply.env)
        if command != Command.STEP_AND_MAYBE_RESET:
            return root, None
        next_root = self._one(self.root_part(reply))
        _set_one_index(next_root, reply.env)
        return root, next_root

    def _one(self, part: Part) -> TensorDictBase:
        td = _as_tensordict(part)
        if self.device is not None and td.device != self.device:
            td = td.to(self.device)
        return td

    def edited_roots(self, replies: list[Reply]) -> TensorDictBase | None:
        """The result roots stacked, if an env edited its input in place; else None."""
        if not any(self.input_part(r) is not r.pending.inputs for r in replies):
            return None
        return self.stack([self.input_part(r) for r in replies])

    def stack_next(self, replies: list[Reply]) -> TensorDictBase:
        return self.stack([self.next_part(r) for r in replies])

    def stack_roots(self, replies: list[Reply]) -> TensorDictBase:
        return self.stack([self.root_part(r) for r in replies])

    def input_part(self, reply: Reply) -> Part:
        """The root of a step's result: what the request sent, or the env's edit of it.

        A worker sends the root back (a part after the usual ones) only when
        the env changed its input in place, as some auto-resetting envs do.
        """
        edited = _EDITED_ROOT_PART.get(reply.pending.command)
        if edited is not None and not reply.synthesized and len(reply.parts) > edited:
            return reply.parts[edited]
        inputs = reply.pending.inputs
        assert inputs is not None
        return inputs

    def next_part(self, reply: Reply) -> Part:
        """The reply's first part; for a restarted env, the truncation built from its reset."""
        if not reply.synthesized:
            return reply.parts[0]
        reset = reply.parts[0].to_tensordict()
        return truncated_next(self.child_specs[reply.env], reset)

    def root_part(self, reply: Reply) -> Part:
        """step_and_maybe_reset's next root; for a restarted env, its reset state."""
        if not reply.synthesized:
            return reply.parts[1]
        result = _as_tensordict(self.input_part(reply)).exclude(ENV_INDEX, "next")
        result.set("next", self.next_part(reply))
        return next_root_after_restart(result, reply.parts[0].to_tensordict())

    def stack(self, parts: list[Any]) -> TensorDictBase:
        if self.dense and _one_layout(parts):
            stacked: TensorDictBase = stack_parts(parts)
        else:
            tds = [_as_tensordict(p) for p in parts]
            if self.device is not None:  # a lazy stack refuses parts of unlike devices
                tds = [td if td.device == self.device else td.to(self.device) for td in tds]
            stacked = self.stack_tds(tds)
        if self.device is not None and stacked.device != self.device:
            stacked = stacked.to(self.device)
        return stacked

    def stack_tds(self, tds: list[Any]) -> TensorDictBase:
        result = self.stack_func(tds)
        if isinstance(result, LazyStackedTensorDict):
            result = result.clone()  # do not keep the caller's input tensordicts alive
        return result

    def set_env_index(self, td: TensorDictBase, idx: list[int]) -> None:
        """``td["env_index"] = NonTensorStack(*idx)`` (expanded to ``td``'s batch dims)."""
        indices = env_index_stack(idx)
        if indices.shape != td.shape:
            indices = expand_as_right(indices, td)
        _attach(td, ENV_INDEX, indices)


def _one_layout(parts: list[Any]) -> bool:
    """Whether every part is a :class:`DecodedPart` of one layout (stacked from frames)."""
    first = parts[0]
    if not isinstance(first, DecodedPart):
        return False
    layout = first.layout
    for part in parts:  # a loop, not all() over a generator: it runs for every env-step
        if not isinstance(part, DecodedPart) or part.layout is not layout:
            return False
    return True


def _set_one_index(td: TensorDictBase, env: int) -> None:
    td.set(ENV_INDEX, NonTensorData(env, batch_size=td.batch_size))


def _attach(td: TensorDictBase, key: str, value: TensorDictBase) -> None:
    """``td.set(key, value)`` for a tensordict value, skipping validation that has nothing to do.

    For a plain TensorDict without device or dim names, and a value of its
    batch size without names, ``set``'s validation (~4 us, three times per
    send and recv) returns the value as it is; anything else goes through
    ``set``, with its conversions and errors (a locked tensordict raises
    either way).
    """
    plain = type(td) is TensorDict and td.device is None and not td._has_names()
    if plain and value.batch_size == td.batch_size and not _has_names(value):
        td._set_str(key, value, inplace=False, validated=True)
    else:
        td.set(key, value)


def _has_names(value: TensorDictBase) -> bool:
    # The stacks passed here come from env_index_stack, without names; asking one walks its items.
    return type(value) is not NonTensorStack and value._has_names()


def _as_tensordict(part: Part) -> TensorDictBase:
    return part.to_tensordict() if isinstance(part, DecodedPart) else part


_CPU = torch.device("cpu")
_SCALAR = torch.Size(())


def env_index_stack(idx: Sequence[int]) -> NonTensorStack:
    """``NonTensorStack(*idx)``, the same object built at a fraction of the cost.

    Every result carries one, and every batch sent is tagged with one:
    ``NonTensorStack(*idx)`` spends ~15 us per item in ``NonTensorData``'s
    tensorclass ``__init__``, and even ``_new_lazy_unsafe`` reads each item's
    ``batch_size`` through the tensorclass (~1.3 us an item: 59 us for 44).
    For plain ints the state both end in is known, so it is written directly.

    Example:
        >>> env_index_stack([2, 0]).tolist()
        [2, 0]
    """
    if not _FAST_ITEMS:
        return NonTensorStack(*idx)
    return _stack_of_items(_index_items(idx))


def _stack_of_items(items: list[NonTensorData]) -> NonTensorStack:
    """What ``NonTensorStack._new_lazy_unsafe(*items)`` builds for scalar items, directly."""
    stack = NonTensorStack.__new__(NonTensorStack)
    stack.__dict__.update(
        _is_locked=None,
        tensordicts=items,
        stack_dim=0,
        _batch_size=torch.Size((len(items),)),
        hook_out=None,
        hook_in=None,
    )
    return stack


def _index_items(values: Sequence[int]) -> list[NonTensorData]:
    """What ``NonTensorData(data=value)`` builds for each value, without its ``__init__``.

    Each item holds an empty scalar TensorDict, as ``TensorDict._new_unsafe(batch_size=())``
    leaves it, at a third of its cost (no argument handling). One loop for them all:
    this runs twice for every env-step.
    """
    items = []
    new_td, new_item = TensorDict.__new__, NonTensorData.__new__
    for value in values:  # item by item, no keyword arguments: a fifth cheaper than update(**)
        td = new_td(TensorDict)
        state = td.__dict__
        state.update(_EMPTY_STATE)
        state["_tensordict"] = _ENTRIES()
        item = new_item(NonTensorData)
        state = item.__dict__
        state["_tensordict"] = td
        state["_non_tensordict"] = {"data": value, "_is_non_tensor": True, "_metadata": None}
        state["_is_initialized"] = True
        items.append(item)
    return items


#: An empty scalar TensorDict's state, as ``TensorDict._new_unsafe`` leaves it: copied
#: into each new one, whose entries get a fresh mapping of the same type.
_EMPTY_STATE = dict(TensorDict._new_unsafe(batch_size=_SCALAR).__dict__)
_ENTRIES = type(_EMPTY_STATE["_tensordict"])


def _same_state(fast: Any, slow: Any) -> bool:
    if fast.__dict__.keys() != slow.__dict__.keys():
        return False
    if isinstance(slow, NonTensorStack):
        same = {k: v for k, v in fast.__dict__.items() if k != "tensordicts"} == {
            k: v for k, v in slow.__dict__.items() if k != "tensordicts"
        }
        items = zip(fast.tensordicts, slow.tensordicts, strict=True)
        return same and all(_same_state(a, b) for a, b in items)
    if not isinstance(slow, NonTensorData):
        return fast.__dict__ == slow.__dict__
    entries = fast._tensordict._tensordict, slow._tensordict._tensordict
    return (
        fast._non_tensordict == slow._non_tensordict
        and fast._tensordict.__dict__ == slow._tensordict.__dict__
        and type(entries[0]) is type(entries[1])
        and entries[0] is not _EMPTY_STATE["_tensordict"]  # each item's own
    )


def _fast_items_match() -> bool:
    """Whether the shortcut builds what tensordict builds (checked once, at import)."""
    try:
        fast = _stack_of_items(_index_items([0, 1]))
        return _same_state(fast, NonTensorStack(0, 1))
    except Exception:  # another tensordict version: take the documented constructor
        return False


#: False when this tensordict builds ``NonTensorData`` differently: then the slow path.
_FAST_ITEMS = _fast_items_match()
