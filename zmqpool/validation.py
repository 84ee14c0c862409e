"""Checks on what the trainer hands the pool, run before anything is sent.

A drop-in must take what torchrl's pool takes: torchrl hands the caller's
tensors to the env as they are, and envs cope (torchrl's own tests step
``CountingEnv``'s int8 action spec with float32 ones). So by default only
what can never work is refused, at the send, in the trainer's own stack,
naming what is wrong:

- ``TypeError``: an env index that is not an integer;
- ``IndexError``: an env index out of range (``-N`` to ``-1`` count from
  the end, as a Python list's do, and name envs ``N-1`` to ``0``);
- ``ValueError``: a repeated env index;
- :class:`~zmqpool.errors.BatchSizeMismatchError` (a ``ValueError`` and the
  ``RuntimeError`` torchrl's pool raises): a tensordict whose leading batch
  dimension does not match the env indices;
- :class:`~zmqpool.errors.MissingKeyError` (a ``ValueError`` and the
  ``KeyError`` the env would raise): a missing action key.

``set_seed``'s seed (:func:`seed_argument`) must be None or an integer that
msgpack carries (numpy's and 0-d tensors' too): a ``TypeError`` or
:class:`~zmqpool.errors.ProtocolError` (a ``ValueError``) says which it is not.

A reset's keywords (:func:`reset_kwargs`) must be a dict of names to plain
data (what msgpack carries there and back), as small as a header allows:
a ``TypeError`` or :class:`~zmqpool.errors.ProtocolError` (a ``ValueError``)
names what is not.

With ``strict=True`` (``PoolConfig(strict_inputs=True)``), an opt-in, an
action (or a state entry, when present) of another dtype or shape than the
spec is refused as well, as ``ValueError``.

What is expected is worked out once per input spec (:class:`StepInputSpec`)
and cached, so a check is a few microseconds per step.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from zmqpool.codec import plain_data_and_size
from zmqpool.errors import BatchSizeMismatchError, InputError, MissingKeyError, ProtocolError
from zmqpool.limits import MAX_RESET_KWARGS_BYTES

__all__ = [
    "StepInputSpec",
    "check_env_indices",
    "check_step_input",
    "env_index_arg",
    "reset_kwargs",
    "seed_argument",
    "step_input_spec",
]

#: The key the pool writes into every tensordict; not the trainer's to provide.
_ENV_INDEX_KEY = "env_index"


def check_env_indices(env_indices: Any, num_envs: int) -> list[int]:
    """The env indices as a list of ints, refused if not integers, out of range or repeated.

    Takes what :func:`env_index_arg` takes; one env's index is a list of one.

    Example:
        >>> check_env_indices([2, 0], num_envs=4)
        [2, 0]
        >>> check_env_indices([-1, 0], num_envs=4)  # from the end, as a list's
        [3, 0]
        >>> check_env_indices([0, 4], num_envs=4)
        Traceback (most recent call last):
        ...
        IndexError: env index 4 is out of range for a pool of 4 envs (0 to 3, or -4 to -1)
    """
    indices = _checked(env_indices, num_envs)
    return [indices] if isinstance(indices, int) else indices


def env_index_arg(env_index: Any, num_envs: int) -> int | list[int] | None:
    """An ``env_index=`` argument as the pool takes it: None, one env's int, or a list of ints.

    An integer of any kind names one env (Python's, numpy's, a 0-d integer
    tensor or array); a sequence of them, a 1-d integer numpy array or tensor,
    several (a set, in its iteration order, as torchrl's pool reads it). A
    negative index counts from the end, as a Python list's does
    (``-1`` is env ``N-1``), and is returned as that env's index: results,
    busy envs and an env's own channel know each env by one number.
    Refused, naming what is wrong: ``TypeError`` for anything not integers (a
    float, a bool: a boolean mask is not a list of envs), and for a string or
    a tensor of more dims; ``IndexError`` for an index out of range (below
    ``-N`` or above ``N-1``); ``ValueError`` for an env named twice.

    Example:
        >>> env_index_arg(np.array([2, 0]), num_envs=4)
        [2, 0]
        >>> env_index_arg(torch.tensor(3), num_envs=4)
        3
        >>> env_index_arg(-1, num_envs=4)
        3
        >>> env_index_arg(torch.tensor([0.0, 1.0]), num_envs=4)
        Traceback (most recent call last):
        ...
        TypeError: env indices must be integers, got a tensor of torch.float32
    """
    return None if env_index is None else _checked(env_index, num_envs)


def _checked(env_index: Any, num_envs: int) -> int | list[int]:
    """:func:`env_index_arg` of anything but None."""
    # The usual call, a list of Python ints, is checked in C: no Python code per index.
    if type(env_index) is list and set(map(type, env_index)) == _INT_ONLY:
        indices = list(env_index)  # the caller's list may change after the call
    else:
        one = _one_index(env_index)
        if one is not None:
            return _in_range([one], num_envs)[0]
        indices = [_as_index(i) for i in _index_items(env_index)]
    given = indices
    indices = _in_range(indices, num_envs)
    if len(set(indices)) != len(indices):
        repeated = sorted({i for i in indices if indices.count(i) > 1})
        raise ValueError(
            f"env indices {given} repeat env {repeated}: an env takes one request at a time"
        )
    return indices


_INT_ONLY = {int}


def _one_index(value: Any) -> int | None:
    """``value`` as one env's index if it is a single integer (a bool: ``TypeError``); else None."""
    if type(value) is int:
        return value
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return _as_index(value) if value.ndim == 0 else None
    if isinstance(value, (bool, np.bool_)) or hasattr(value, "__index__"):
        return _as_index(value)  # numpy's integers, and whatever says it is one; a bool raises
    return None  # it may be a sequence


def _index_items(value: Any) -> list[Any]:
    """The items of a sequence of env indices (still to be checked), or ``TypeError``."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 1:
            raise TypeError(f"env indices must be one-dimensional, got shape {tuple(value.shape)}")
        _check_integer_dtype(value)
        return value.tolist()
    sequence = type(value) is list or (  # type() first: an ABC's isinstance runs Python code
        not isinstance(value, (str, bytes)) and isinstance(value, Sequence)
    )
    # A set too, in its iteration order, as torchrl's pool pairs it with the rows.
    if not sequence and not isinstance(value, (set, frozenset)):
        raise TypeError(f"env indices must be an int or a list of ints, got {value!r}")
    return list(value)


def _check_integer_dtype(value: torch.Tensor | np.ndarray) -> None:
    if isinstance(value, torch.Tensor):
        integer = not (value.dtype.is_floating_point or value.dtype.is_complex)
        integer = integer and value.dtype is not torch.bool
    else:
        integer = value.dtype.kind in "iu"
    if not integer:
        kind = "tensor" if isinstance(value, torch.Tensor) else "numpy array"
        raise TypeError(f"env indices must be integers, got a {kind} of {value.dtype}")


def _in_range(indices: list[int], num_envs: int) -> list[int]:
    """``indices``, negative ones counted from the end (``-1``: ``N-1``); ``IndexError`` if out
    of range. The usual call, indices from 0 to N-1, costs a ``min`` and a ``max``."""
    if indices and (min(indices) < 0 or max(indices) >= num_envs):
        bad = next((i for i in indices if not -num_envs <= i < num_envs), None)
        if bad is not None:
            raise IndexError(
                f"env index {bad} is out of range for a pool of {num_envs} envs "
                f"(0 to {num_envs - 1}, or -{num_envs} to -1)"
            )
        return [i + num_envs if i < 0 else i for i in indices]
    return indices


def _as_index(value: Any) -> int:
    """An integer of any kind as an int; a bool, float or tensor of either is refused."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        _check_integer_dtype(value)
    elif isinstance(value, (bool, np.bool_)):
        # torchrl's pool takes True for env 1: here it is more likely a mask's item.
        raise TypeError(f"env indices must be integers, got {value!r} (a bool)")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"env indices must be integers, got {value!r}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class Expected:
    """One entry a step input holds: its dtype (None: non-tensor) and per-env shape."""

    key: str | tuple[str, ...]
    role: str  # "action" (required) or "state" (checked when present)
    dtype: torch.dtype | None
    shape: tuple[int, ...]  # without the pool's env dim; -1: envs differ, any size

    @property
    def required(self) -> bool:
        return self.role == "action"


class StepInputSpec:
    """What a step input must hold, worked out once from a pool's input spec.

    Args:
        input_spec: the pool's stacked ``input_spec`` (a ``Composite`` with
            ``full_action_spec`` and ``full_state_spec``, env dim first).
        num_envs: the pool's number of envs.
        strict: also refuse entries whose dtype or shape is not the spec's.

    Example:
        >>> from zmqpool.testing import CountingEnv
        >>> specs = torch.stack([CountingEnv(env_id=i).specs for i in range(2)])
        >>> check = StepInputSpec(specs["input_spec"], num_envs=2)
        >>> from tensordict import TensorDict
        >>> check(TensorDict({"action": torch.zeros(2, 1)}, [2]), [1, 0])
        [1, 0]
    """

    def __init__(self, input_spec: Any, num_envs: int, strict: bool = False) -> None:
        self.num_envs = num_envs
        self.strict = strict
        actions = _entries(input_spec, "full_action_spec", "action")
        states = _entries(input_spec, "full_state_spec", "state") if strict else []
        self.expected = tuple(actions + states)

    def __call__(self, td: TensorDictBase, env_indices: Any) -> list[int]:
        """Check ``td`` for ``env_indices``; return the indices as a list of ints.

        With a list of indices, ``td`` has one row per index (its leading batch
        dim); with a single int, ``td`` is that env's own tensordict. The
        indices are taken as :func:`env_index_arg` takes them.
        """
        indices = _checked(env_indices, self.num_envs)
        if isinstance(indices, int):  # made an int, never a bool
            self._check_rows([td])
            return [indices]
        self.check_batch(td, indices)
        return indices

    def check_batch(self, td: TensorDictBase, indices: list[int]) -> None:
        """Check ``td``, one row per env of ``indices`` (checked already, as
        :func:`env_index_arg` returns them): the pool's send, which checked them."""
        if td.batch_size[:1] != (len(indices),):
            raise BatchSizeMismatchError(
                f"the tensordict's batch size {tuple(td.batch_size)} does not match the "
                f"{len(indices)} env indices {indices}: its first dim must be {len(indices)}"
            )
        lazy = type(td) is not TensorDict and isinstance(td, LazyStackedTensorDict)
        if lazy and td.stack_dim == 0:
            self._check_rows(td.tensordicts)  # row by row: no stacking copies
        else:
            for expected in self.expected:
                _check_entry(td, expected, (len(indices),), self.strict)

    def _check_rows(self, rows: Sequence[TensorDictBase]) -> None:
        for row in rows:
            for expected in self.expected:
                _check_entry(row, expected, (), self.strict)


def _entries(input_spec: Any, group: str, role: str) -> list[Expected]:
    if group not in input_spec.keys():  # noqa: SIM118 (`in` is False on a StackedComposite)
        return []
    spec = input_spec[group]
    entries = []
    for key in spec.keys(include_nested=True, leaves_only=True):
        if key == _ENV_INDEX_KEY:
            continue
        leaf = spec[key]
        shape = tuple(int(size) for size in leaf.shape[1:])
        entries.append(Expected(key, role, leaf.dtype, shape))
    return entries


def _check_entry(
    td: TensorDictBase, expected: Expected, lead: tuple[int, ...], strict: bool
) -> None:
    path = _as_path(expected.key)
    if not strict or expected.dtype is None:  # a non-tensor entry: present is all we can say
        if not _present(td, path):
            _missing(expected, lead)
        return
    values = _values_at(td, path, lead + expected.shape)
    if values is None:
        _missing(expected, lead)
        return
    for value, want in values:
        _check_value(value, want, expected)


def _missing(expected: Expected, lead: tuple[int, ...]) -> None:
    """Refuse an input without ``expected``, if the envs need it."""
    if expected.required:
        raise MissingKeyError(
            f"the step input has no {expected.role} {expected.key!r}: expected a "
            f"{expected.dtype} tensor of shape {lead + expected.shape}"
        )


def _present(td: Any, path: tuple[str, ...]) -> bool:
    """Whether ``td`` has an entry at ``path`` (in every member, across a lazy stack).

    What :func:`_values_at` finds, without getting the entry itself: a check
    of presence alone (the default) runs for every send, and ``get`` is most
    of its cost.
    """
    node = td
    last = len(path) - 1
    for depth, name in enumerate(path):
        plain = type(node) is TensorDict  # first: an ABC's isinstance runs Python code
        if not plain and isinstance(node, LazyStackedTensorDict):
            return all(_present(member, path[depth:]) for member in node.tensordicts)
        # keys(): what `in` (TensorDictBase.__contains__) asks, without the call in between.
        if not (plain or isinstance(node, TensorDictBase)) or name not in node.keys():  # noqa: SIM118
            return False
        if depth < last:
            node = node.get(name)
    return True


def _as_path(key: str | tuple[str, ...]) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else key


def _values_at(
    td: Any, path: tuple[str, ...], want: tuple[int, ...]
) -> list[tuple[Any, tuple[int, ...]]] | None:
    """The entry at ``path`` with the shape it should have; None if absent.

    Where the path crosses a lazy stack (a heterogeneous env's agents), each
    member is looked at alone, with the stacked dim taken out of the shape: a
    ``get`` through the stack would try to stack members whose shapes differ.
    """
    node = td
    for depth, name in enumerate(path):
        if isinstance(node, LazyStackedTensorDict):
            return _values_across(node, path[depth:], want)
        if not isinstance(node, TensorDictBase) or name not in node:
            return None
        if depth == len(path) - 1:
            return [(node.get(name), want)]
        node = node.get(name)
    return None


def _values_across(
    stack: LazyStackedTensorDict, path: tuple[str, ...], want: tuple[int, ...]
) -> list[tuple[Any, tuple[int, ...]]] | None:
    dim = stack.stack_dim  # a leaf's shape starts with its tensordict's batch size
    member_want = want[:dim] + want[dim + 1 :]
    found: list[tuple[Any, tuple[int, ...]]] = []
    for member in stack.tensordicts:
        values = _values_at(member, path, member_want)
        if values is None:
            return None
        found += values
    return found


def _check_value(value: Any, want: tuple[int, ...], expected: Expected) -> None:
    if not isinstance(value, torch.Tensor):
        raise InputError(
            f"{expected.role} {expected.key!r}: expected a {expected.dtype} tensor, "
            f"got {type(value).__name__}"
        )
    if value.dtype != expected.dtype:
        raise InputError(
            f"{expected.role} {expected.key!r}: expected dtype {expected.dtype}, "
            f"got {value.dtype} (shape {tuple(value.shape)})"
        )
    _check_shape(value.shape, want, expected)


def _check_shape(shape: torch.Size, want: tuple[int, ...], expected: Expected) -> None:
    if shape == want:
        return
    fits = len(shape) == len(want) and all(w in (-1, s) for s, w in zip(shape, want, strict=True))
    if not fits:
        raise InputError(
            f"{expected.role} {expected.key!r}: expected shape {want}, got {tuple(shape)}"
            + (" (-1: any size)" if -1 in want else "")
        )


_CACHE: dict[tuple[int, int, bool], tuple[Any, StepInputSpec]] = {}
_CACHE_SIZE = 32


def check_step_input(
    td: TensorDictBase,
    env_indices: Any,
    input_spec: Any,
    num_envs: int,
    strict: bool = False,
) -> list[int]:
    """Refuse a step input the envs cannot take, before it is sent; return the indices.

    The expectations are computed once per ``input_spec`` object and cached
    (specs of a pool do not change after it is built).

    Example:
        >>> from zmqpool.testing import CountingEnv
        >>> from tensordict import TensorDict
        >>> spec = torch.stack([CountingEnv(env_id=i).specs for i in range(2)])["input_spec"]
        >>> check_step_input(TensorDict({"action": torch.zeros(1, 1)}, [1]), [1], spec, 2)
        [1]
        >>> td = TensorDict({"action": torch.zeros(1, 1, dtype=torch.float64)}, [1])
        >>> check_step_input(td, [1], spec, 2)  # the env gets it as it is
        [1]
        >>> check_step_input(td, [1], spec, 2, strict=True)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        zmqpool.errors.InputError: action 'action': expected dtype torch.float32,
        got torch.float64 (shape (1, 1))
    """
    return step_input_spec(input_spec, num_envs, strict)(td, env_indices)


def step_input_spec(input_spec: Any, num_envs: int, strict: bool = False) -> StepInputSpec:
    """The :class:`StepInputSpec` of ``input_spec``, worked out once per spec object."""
    key = (id(input_spec), num_envs, strict)
    cached = _CACHE.get(key)
    if cached is None or cached[0] is not input_spec:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        # The spec is kept alive with its expectations, so its id cannot be reused.
        cached = (input_spec, StepInputSpec(input_spec, num_envs, strict))
        _CACHE[key] = cached
    return cached[1]


def reset_kwargs(kwargs: dict[str, Any], num_envs: int) -> list[dict[str, Any]] | None:
    """Each env's keywords for its reset, as ``SerialEnv`` hands them out; None if none has any.

    ``reset(seed=3)`` gives every env ``seed=3``; ``list_of_kwargs`` (one dict
    per env) gives each its own, the other keywords added to each (the
    caller's dicts are not changed, where ``SerialEnv`` updates them). Each
    env's travel in its command's header, so they must be plain data.

    Example:
        >>> reset_kwargs({"list_of_kwargs": [{"seed": 1}, {}], "options": None}, 2)
        [{'seed': 1, 'options': None}, {'options': None}]
        >>> reset_kwargs({}, 2) is None
        True
    """
    kwargs = dict(kwargs)
    per_env = kwargs.pop("list_of_kwargs", None)
    if per_env is None:
        per_env = [kwargs] * num_envs
    elif len(per_env) != num_envs:
        raise InputError(f"list_of_kwargs has {len(per_env)} dicts for a pool of {num_envs} envs")
    else:
        per_env = [{**_names_to_values(each, env), **kwargs} for env, each in enumerate(per_env)]
    if not any(per_env):
        return None
    # Names checked: **kwargs gives str keys, and list_of_kwargs' dicts were checked above.
    return [_crossing(each, env) for env, each in enumerate(per_env)]


def _names_to_values(kwargs: Any, env: int) -> dict[str, Any]:
    if not isinstance(kwargs, dict) or not all(type(name) is str for name in kwargs):
        raise TypeError(
            f"the reset keywords of env {env} must be a dict of names, not {kwargs!r:.80}"
        )
    return kwargs


def _crossing(kwargs: dict[str, Any], env: int) -> dict[str, Any]:
    data, size = {}, 0
    for name, value in kwargs.items():  # each checked on its own, to name the one refused
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.item()  # reset(seed=torch.tensor(3)): the number, as an env takes it
        data[name], packed = plain_data_and_size(value, (f"reset keyword {name!r} of env {env}",))
        size += packed
    if size > MAX_RESET_KWARGS_BYTES:
        raise ProtocolError(
            f"the reset keywords of env {env} pack to {size} bytes, over the "
            f"{MAX_RESET_KWARGS_BYTES} a command's header carries: they cannot cross the wire"
        )
    return data


#: The integers msgpack carries: a seed outside them cannot reach an env.
_WIRE_INT_MIN, _WIRE_INT_MAX = -(2**63), 2**64 - 1


def seed_argument(seed: Any) -> int | None:
    """``set_seed``'s seed as the int its command carries; refused before anything is sent.

    Any integer goes as it is (``np.int64(7)``, ``torch.tensor(7)`` and
    ``True`` as the int they hold, as torchrl's seed chain takes them); the
    env judges its value (a negative seed is its ``ValueError``, as in
    ``SerialEnv``). Not an integer is a ``TypeError``; an integer msgpack
    cannot carry, a :class:`~zmqpool.errors.ProtocolError` (a ``ValueError``).

    Example:
        >>> seed_argument(np.int64(7)), seed_argument(None)
        (7, None)
    """
    if seed is None:
        return None
    try:
        value = operator.index(seed)
    except TypeError:
        raise TypeError(
            f"set_seed's seed must be an integer or None, got {seed!r:.80} "
            f"(a {type(seed).__name__})"
        ) from None
    if not _WIRE_INT_MIN <= value <= _WIRE_INT_MAX:
        raise ProtocolError(
            f"set_seed's seed {value} is outside the integers a command carries "
            f"([-2**63, 2**64 - 1]): it cannot cross the wire"
        )
    return value
