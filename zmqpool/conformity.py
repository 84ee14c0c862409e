"""Replies held to the specs their env registered, once per layout, before anything is stacked.

A reply that contradicts its env's specs would make the stack of a whole
batch fail (or change it), losing every env's result and naming none: a leaf
of another shape than its spec says (an observation of ``[5]`` where the spec
says ``[4]``) or a declared key missing fail the stack; a leaf of another
dtype (float64 where the spec says float32) is silently promoted, every env's
result with it. Each env gets a :class:`ReplyCheck` when it registers: a reply
whose layout contradicts the env's observation, reward or done specs becomes
an :class:`~zmqpool.errors.EnvError` for that env, naming the leaf; the other
envs' replies are untouched. A zmqpool worker casts its env's declared
leaves to the specs' dtypes before it replies (:class:`SpecDtypes`, as
``SerialEnv``'s buffers do), so a dtype is refused here only in a reply that
was not cast (another peer's).

What is held, per part of a reply (its role, by the command it answers):

- every leaf the specs declare, if present: its shape (dims a spec leaves
  dynamic, ``-1``, take any size) and its dtype;
- a step's ``"next"`` (``step``, ``step_and_maybe_reset``'s first part) must
  carry every key the observation, reward and done specs declare; a reset
  (``reset``, a restarted env's reset, ``step_and_maybe_reset``'s next root)
  every observation and done key. torchrl's own envs do (``_step_proc_data``
  and ``reset`` complete the done keys); raw steps and resets (``_step``,
  ``_reset``), and the input roots an env edited, need not.

Leaves the specs do not declare are not refused: an env may return more than
it declares (torchrl's mock envs do). Heterogeneous (lazily stacked) layouts
and specs are held to nothing but the shapes and dtypes of what they declare,
lazy layouts to nothing.

Each layout is judged once per expectation: the verdict is noted on the layout
itself (:attr:`~zmqpool.layout.Layout.notes`), under a key naming the specs'
expectation and the role, so envs of the same specs share it, and it goes
when the decoder lets the layout go. A reply then costs a dict lookup.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torchrl.data import Stacked, StackedComposite

from zmqpool.errors import EnvError
from zmqpool.layout import DTYPE_NAMES, Key, Layout
from zmqpool.wire import Command

if TYPE_CHECKING:
    from zmqpool.state import Pending, Reply

#: The output specs whose leaves a reply carries at their spec's shape and dtype.
_OUTPUT_SPECS = ("full_observation_spec", "full_reward_spec", "full_done_spec")
#: Which of them each role of a reply part must carry every key of.
_REQUIRED = {
    "next": _OUTPUT_SPECS,
    "reset": ("full_observation_spec", "full_done_spec"),
    "loose": (),
}
#: The role of each part of a reply, by the command it answers (parts past these: "loose").
_ROLES: dict[Command, tuple[str, ...]] = {
    Command.STEP: ("next",),
    Command.STEP_AND_MAYBE_RESET: ("next", "reset"),
    Command.RESET: ("reset",),
}
#: A restarted env's reply: the reset sent in the request's stead.
_SYNTH_ROLES = ("reset",)
#: Verdicts one layout keeps before starting afresh (one per spec and role in a pool: few).
_MAX_NOTES = 64
#: The most missing keys a verdict names.
_NAMED = 8

#: A declared leaf: its shape (``-1``: any size) and dtype (None: not a tensor's).
Expected = tuple[tuple[int, ...], torch.dtype | None]


def expected_shapes(spec: Any) -> dict[Key, tuple[int, ...]]:
    """Each declared output leaf's key and shape (an env's ``specs``); {} if it cannot tell."""
    return {key: shape for key, (shape, _) in _declared(spec)[0].items()}


def _declared(spec: Any) -> tuple[dict[Key, Expected], dict[str, tuple[Key, ...]]]:
    """Each declared output leaf's shape and dtype, and the keys of each output spec.

    No keys for a heterogeneous spec (one stacked lazily: its keys are the
    members'); nothing at all if it cannot tell.
    """
    try:
        output = spec["output_spec"]
        leaves: dict[Key, Expected] = {}
        keys: dict[str, tuple[Key, ...]] = {}
        stacked = False
        for name in _OUTPUT_SPECS:
            if name not in output:
                continue
            keys[name] = tuple(_walk(output[name], leaves))
            stacked |= _is_stacked(output[name])
        return leaves, {} if stacked else keys
    except Exception:  # an odd spec: nothing to hold a reply to
        return {}, {}


def _walk(spec: Any, leaves: dict[Key, Expected]) -> list[Key]:
    keys = []
    for key, leaf in spec.items(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        dtype = leaf.dtype if isinstance(leaf.dtype, torch.dtype) else None
        leaves[key] = (tuple(int(d) for d in leaf.shape), dtype)
        keys.append(key)
    return keys


def _is_stacked(spec: Any) -> bool:
    if isinstance(spec, (Stacked, StackedComposite)):
        return True
    return any(
        isinstance(value, (Stacked, StackedComposite))
        for _, value in spec.items(include_nested=True)
    )


class SpecDtypes:
    """The dtypes an env's specs declare for its output leaves: what a worker casts to.

    ``SerialEnv`` and ``ParallelEnv`` copy each output into buffers made from
    the specs, so an env that returns float64 where its spec says float32
    gives float32 there. A worker sends its env's leaves cast the same way
    (:meth:`zmqpool.codec.Encoder.encode`), so such an env runs here too, where
    :class:`ReplyCheck` would make each of its replies an error. torchrl's own
    pool returns the float64 (README, drop-in).
    """

    def __init__(self, spec: Any) -> None:
        leaves, _ = _declared(spec)
        self.dtypes = {key: dtype for key, (_, dtype) in leaves.items() if dtype is not None}
        declared = sorted((key, str(dtype)) for key, dtype in self.dtypes.items())
        # Interned: the envs of one spec share one key object, found by identity.
        self.key = sys.intern(f"declared dtypes {declared!r}")

    def casts(self, layout: Layout) -> tuple[tuple[Key, torch.dtype], ...]:
        """The leaves of ``layout`` of another dtype than declared, each with its spec's."""
        if layout.lazy:
            return ()
        dtypes = self.dtypes
        return tuple(
            (leaf.key, dtypes[leaf.key])
            for leaf in layout.leaves
            if leaf.key in dtypes and leaf.dtype != dtypes[leaf.key]
        )


class ReplyCheck:
    """One env's check of the layouts its replies come in, each layout judged once.

    ``check(layout, pending)`` judges a reply's first part, ``check.part(layout,
    pending, index)`` any; without ``pending`` only the declared leaves'
    shapes and dtypes are held. Each returns what is wrong (naming the leaf;
    the env's :class:`~zmqpool.errors.EnvError` names the env), or None.
    """

    def __init__(self, spec: Any) -> None:
        self.expected, keys = _declared(spec)
        self.shapes = {key: shape for key, (shape, _) in self.expected.items()}
        # An expectation's verdict key -> the keys a part judged under it must carry.
        self._required: dict[str, tuple[Key, ...]] = {}
        role_keys = {
            role: self._verdict_key(role, names, keys) for role, names in _REQUIRED.items()
        }
        self._loose = role_keys["loose"]
        # Each command's parts' verdict keys, in order.
        self._parts = {
            command: tuple(role_keys[role] for role in _ROLES.get(command, ()))
            for command in Command
        }
        self._synth = tuple(role_keys[role] for role in _SYNTH_ROLES)
        self._first = {command: (*keys, self._loose)[0] for command, keys in self._parts.items()}

    def _verdict_key(
        self, role: str, names: tuple[str, ...], keys: dict[str, tuple[Key, ...]]
    ) -> str:
        required = tuple(sorted({key for name in names for key in keys.get(name, ())}))
        expected = sorted((key, shape, str(dtype)) for key, (shape, dtype) in self.expected.items())
        # Interned: the envs of one spec share one key object, found by identity.
        verdict_key = sys.intern(f"reply-check {role} {expected!r} {required!r}")
        self._required[verdict_key] = required
        return verdict_key

    def __call__(self, layout: Layout, pending: Pending | None = None) -> str | None:
        """What is wrong with a reply whose first part is in ``layout``, or None."""
        if pending is None:
            key = self._loose
        elif pending.synth:
            key = self._synth[0]
        else:
            key = self._first[pending.command]
        verdict = layout.notes.get(key)
        if verdict is None:
            verdict = self._noted(layout, key)
        return verdict or None

    def part(self, layout: Layout, pending: Pending, index: int) -> str | None:
        """What is wrong with part ``index`` of a reply to ``pending``, or None."""
        keys = self._synth if pending.synth else self._parts[pending.command]
        key = keys[index] if index < len(keys) else self._loose
        verdict = layout.notes.get(key)
        if verdict is None:
            verdict = self._noted(layout, key)
        return verdict or None

    def _noted(self, layout: Layout, key: str) -> str:
        notes = layout.notes
        if len(notes) >= _MAX_NOTES:
            notes.clear()
        verdict = notes[key] = self._judge(layout, self._required[key])
        return verdict

    def _judge(self, layout: Layout, required: tuple[Key, ...]) -> str:
        """What is wrong with ``layout`` ("" if nothing), the env left unnamed (it is shared)."""
        if layout.lazy or not self.expected:
            return ""
        for leaf in layout.leaves:
            want = self.expected.get(leaf.key)
            if want is None:
                continue
            shape, dtype = want
            if not _fits(leaf.shape, shape):
                return (
                    f"replied with {'/'.join(leaf.key)} of shape {list(leaf.shape)}; "
                    f"its spec says {list(shape)}"
                )
            if dtype is not None and leaf.dtype != dtype:
                return (
                    f"replied with {'/'.join(leaf.key)} of dtype {_name(leaf.dtype)}; "
                    f"its spec says {_name(dtype)}"
                )
        return _missing(layout, required)


def _missing(layout: Layout, required: tuple[Key, ...]) -> str:
    if not required:
        return ""
    present = {leaf.key for leaf in layout.leaves}
    present.update(layout.nontensor_keys)
    missing = ["/".join(key) for key in required if key not in present]
    if not missing:
        return ""
    more = f" and {len(missing) - _NAMED} more" if len(missing) > _NAMED else ""
    return f"replied without {', '.join(missing[:_NAMED])}{more}, which its spec declares"


def _name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


def _fits(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    if len(shape) != len(want):
        return False
    return all(w < 0 or s == w for s, w in zip(shape, want, strict=True))


# ---------------------------------------------------------------- replies of one batch

#: Where a layout's :func:`_structure` is noted (no verdict key starts so).
_STRUCTURE = "structure"
#: What a part's structure is: what torch.stack of tensordicts compares, in key order.
Structure = tuple[Any, ...]


def mark_misfits(replies: Sequence[Reply]) -> None:
    """Of the replies to one recv of a dense pool, those that cannot be stacked with the
    others become their envs' errors, in place, so the others' results are not lost.

    An env may return keys its spec does not declare (:class:`ReplyCheck` lets
    them be), but a dense stack takes one structure: replies whose parts differ
    in keys, or in an undeclared leaf's shape or dtype, cannot be stacked
    together (``torch.stack`` raises, naming no env) or are promoted. The
    structure most replies share is kept (a tie: the one with fewer entries,
    then the lowest env's); each other reply becomes an
    :class:`~zmqpool.errors.EnvError` naming its env and the first key that
    differs. Errors and restarted envs' synthesized replies are left as they are.

    The usual case, every reply's parts in the layouts of the first's (layouts
    are interned), costs a look at each reply; structures are worked out once
    per layout (noted on it).
    """
    if len(replies) < 2 or _one_structure(replies):
        return
    groups: dict[Structure, list[Reply]] = {}
    for reply in replies:
        if reply.error is None and not reply.synthesized and reply.parts:
            groups.setdefault(_reply_structure(reply), []).append(reply)
    if len(groups) < 2:
        return
    kept = min(groups, key=lambda s: (-len(groups[s]), _entries(s), min(r.env for r in groups[s])))
    for structure, members in groups.items():
        if structure is kept:
            continue
        wrong = _difference(structure, kept)
        for reply in members:
            reply.error = EnvError(reply.env, wrong)
            reply.parts = []


def _one_structure(replies: Sequence[Reply]) -> bool:
    """Whether every reply has the first's parts in the very same layouts (a quick look)."""
    parts = replies[0].parts
    if not parts or len(parts) > 2 or replies[0].synthesized:
        return False
    count, head, tail = len(parts), parts[0].layout, parts[-1].layout
    for reply in replies:  # a loop, not all(): it runs for every recv
        parts = reply.parts
        if len(parts) != count or parts[0].layout is not head or parts[-1].layout is not tail:
            return False
    return True


def _reply_structure(reply: Reply) -> Structure:
    """The structures of the parts of ``reply`` that are stacked (its usual ones)."""
    usual = len(_ROLES.get(reply.pending.command, ())) or 1
    return tuple(_structure(part.layout) for part in reply.parts[:usual])


def _structure(layout: Layout) -> Structure:
    """What of ``layout`` a dense stack needs equal in every part: keys, shapes, dtypes,
    nested batch sizes (not where the bytes lie). Noted on the layout, once."""
    known = layout.notes.get(_STRUCTURE)
    if known is None:
        tensors = tuple(sorted((leaf.key, leaf.shape, str(leaf.dtype)) for leaf in layout.leaves))
        values = zip(layout.nontensor_keys, layout.stacked, layout.nontensor_batches, strict=False)
        known = layout.notes[_STRUCTURE] = (
            layout.batch_size,
            tensors,
            tuple(sorted(values)),
            tuple(sorted(layout.branches)),
            layout.lazy,
            layout.classes,
        )
    return known


def _entries(structure: Structure) -> int:
    return sum(len(part[1]) + len(part[2]) + len(part[3]) for part in structure)


def _difference(mine: Structure, kept: Structure) -> str:
    """How a reply of structure ``mine`` differs from the batch's ``kept``, naming a key."""
    for index, (part, other) in enumerate(zip(mine, kept, strict=False)):
        leaves, others = _entries_of(part), _entries_of(other)
        extra = sorted(set(leaves) - set(others))
        if extra:
            return (
                f"replied with {'/'.join(extra[0])} (part {index}), which the other envs' "
                f"replies in this batch do not have: a dense stack takes one structure"
            )
        missing = sorted(set(others) - set(leaves))
        if missing:
            return (
                f"replied without {'/'.join(missing[0])} (part {index}), which the other "
                f"envs' replies in this batch have: a dense stack takes one structure"
            )
        for key, entry in leaves.items():
            if entry != others[key]:
                return (
                    f"replied with {'/'.join(key)} (part {index}) as {entry}, where the other "
                    f"envs' replies in this batch have {others[key]}"
                )
        if part != other:
            return f"replied with a part {index} nested otherwise than the other envs' replies"
    return "replied with another number of parts than the other envs' replies"


def _entries_of(structure: Structure) -> dict[Key, Any]:
    entries: dict[Key, Any] = {key: (list(shape), dtype) for key, shape, dtype in structure[1]}
    entries.update((key, ("non-tensor", stacked)) for key, stacked, _ in structure[2])
    return entries
