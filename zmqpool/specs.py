"""Env specs as plain data: the wire form of torchrl ``TensorSpec`` trees.

This module owns one translation: a torchrl spec (in practice ``env.specs``, a
:class:`~torchrl.data.Composite` holding ``output_spec`` and ``input_spec``)
to and from plain data that ``msgpack.packb(..., use_bin_type=True)`` carries:
dicts with str keys, lists, str, int, float, bool, bytes and None. Nothing is
pickled, so a peer can send data, never code.

A spec is a dict whose ``"class"`` is the torchrl class name; its other keys
are exactly the ones listed for that class (a missing or extra key is an
error)::

    Unbounded{Continuous,Discrete}   shape, device, dtype
    Bounded{Continuous,Discrete}     shape, device, dtype, low: T | E, high: T | E
    Categorical        shape, device, dtype, n: int (-1: undefined), mask: T | None
    Binary             shape, device, dtype, mask: T | None
    OneHot             shape, device, dtype, n: int, use_register: bool, mask: T | None
    MultiCategorical   shape, device, dtype, nvec: T, remove_singleton: bool, mask: T | None
    MultiOneHot        shape, device, dtype, nvec: [int], use_register: bool, mask: T | None
    NonTensor          shape, device, dtype: str | None, example_data: plain | None,
                       batched: bool, feature_dims: int | None (None when batched)
    Composite          shape, device, entries: {str: spec | None},
                       names: [str | None] | None, step_mdp_static: bool,
                       and only when set: data_cls: "module:qualname"
    StackedComposite   dim: int, specs: [Composite spec, ...]  (heterogeneous stack)
    Stacked            dim: int, specs: [leaf spec, ...]       (heterogeneous stack)

``shape`` is a list of ints, ``device`` is None or ``"cpu"``, ``dtype`` a name
from :mod:`zmqpool.layout`'s dtype whitelist (``"float32"``, ``"bfloat16"``,
``"bool"``...). ``T`` is a tensor ``{"dtype": str, "shape": [int], "data":
bytes}``: its elements' raw little-endian bytes in C order, so every dtype
crosses bit-exactly. ``E`` is a tensor sent broadcast, the same dict plus
``"expand": [int]``: ``data`` holds the tensor of ``shape`` that expands
(size-1 dims repeated, as :meth:`torch.Tensor.expand`) to ``expand``. Bounds
use it: torchrl expands scalar bounds to the spec's full shape, so a uint8
image's would otherwise cost a byte per pixel each; scalar bounds travel as
one element, per-channel bounds as one per channel. The encoder shrinks only
dims along which every slice is bitwise equal, so the expansion is exact.
``example_data`` travels only if it is plain data
(None, bool, int, float, str, bytes, lists, dicts with str keys); anything
else (a tensor, a tuple, an object) is dropped on encode.

A ``Composite.data_cls`` travels by name, and only ``TensorDict`` (what
torchrl's ``PendulumEnv`` declares for its ``params``) or a tensorclass's (what
torchrl's ``EnvWithTensorClass`` declares): ``data_cls`` is absent when it
is None, so such specs are the bytes they were before it existed (a peer
that predates it refuses the key, cleanly). It is looked up as
:func:`zmqpool.classnames.resolve_tensorclass` does for the wire's tensordicts,
never imported: a malformed name, or one naming anything but a tensorclass
whose fields include every entry, is a ``ProtocolError``; a class not loaded
in this process gives the spec ``data_cls=None`` and one
:class:`~zmqpool.classnames.TensorclassNotLoadedWarning` naming the module to
import (its values then arrive as plain TensorDicts too).

Decoding trusts nothing: every malformed input raises
:class:`~zmqpool.errors.ProtocolError` naming the spec's path and the field.
Shapes are capped at :data:`~zmqpool.limits.MAX_DIMS` dims (a wire leaf's limit:
the tensors a spec describes travel as leaves) and :data:`~zmqpool.limits.MAX_NUMEL`
elements, the tensor leaves of one tree (all but NonTensor) at ``MAX_NUMEL``
elements and :data:`~zmqpool.limits.MAX_SPEC_BYTES` bytes together, and spec
nesting at :data:`~zmqpool.limits.MAX_DEPTH` (all in :mod:`zmqpool.limits`). Tensors are sized
from the bytes actually received, except what is materialised from a shape
alone: ``Unbounded``'s low/high (torchrl's doing) and a broadcast bound, which
must expand to its leaf's shape exactly (checked before anything is
allocated); the tree's element budget, which counts each leaf's shape, bounds
both however many leaves a message lists. Masks and ``nvec`` travel element by
element only: their size is not tied to a leaf's counted shape (a mask's), or
torchrl builds a Python object per element (``nvec``'s), so they must cost the
sender what they cost us.
Encoding refuses, with a ``ProtocolError``, what decoding would refuse: other
spec classes, a ``Composite.data_cls`` that is neither ``TensorDict`` nor a
tensorclass (or has a name no peer would accept), a non-CPU device, dims below -1 (-1 is
torchrl's "varies from step to step", and crosses).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data.tensor_specs import (
    Binary,
    Bounded,
    BoundedContinuous,
    BoundedDiscrete,
    Categorical,
    Composite,
    MultiCategorical,
    MultiOneHot,
    NonTensor,
    OneHot,
    Stacked,
    StackedComposite,
    TensorSpec,
    Unbounded,
    UnboundedContinuous,
    UnboundedDiscrete,
)

from zmqpool.classnames import resolve_tensorclass, tensorclass_fields, tensorclass_name
from zmqpool.errors import ProtocolError
from zmqpool.layout import dtype_from_name, dtype_name
from zmqpool.limits import MAX_DEPTH, MAX_DIMS, MAX_NUMEL, MAX_SPEC_BYTES, is_int

__all__ = ["spec_from_data", "spec_to_data"]

_CPU = torch.device("cpu")
_TENSOR_KEYS = frozenset({"dtype", "shape", "data"})
_BROADCAST_KEYS = _TENSOR_KEYS | {"expand"}
_LEAF_KEYS = frozenset({"shape", "device", "dtype"})
_MSGPACK_INT_RANGE = (-(2**63), 2**64 - 1)


def spec_to_data(spec: TensorSpec) -> dict[str, Any]:
    """Plain data (dicts, lists, str, int, float, bool, bytes, None only) that msgpack
    can pack with use_bin_type=True.

    Raises:
        ProtocolError: the spec holds something that cannot cross the wire (a spec
            class not listed in this module's docstring, a ``data_cls`` that is not a
            tensorclass, a non-CPU device, a negative dim, an unlisted dtype); the
            message names where.
    """
    return _encode(spec, _At())


def spec_from_data(data: Any, max_bytes: int = MAX_SPEC_BYTES) -> TensorSpec:
    """Inverse of spec_to_data.

    ``max_bytes``: what the decoded spec may cost the trainer, counted as
    torchrl materialises it (a bounded leaf's low and high at full shape, and
    the zero the pool builds to size its frames), before anything is built.

    Raises:
        ProtocolError: ``data`` is malformed (wrong types, unknown class or dtype,
            missing or extra keys, bytes that do not match a tensor's dtype and
            shape, shapes or nesting over the caps, values torchrl refuses); the
            message names the spec's path and the field.
    """
    return _decode(data, _At(budget=[MAX_NUMEL, max_bytes], max_bytes=max_bytes))


# ---------------------------------------------------------------- dispatch


@dataclasses.dataclass(frozen=True)
class _At:
    """Where in the spec tree we are: names errors, bounds nesting and total size."""

    path: tuple[str, ...] = ()
    #: Elements and bytes the tree's tensor leaves may still hold, shared by the whole tree.
    budget: list[int] = dataclasses.field(default_factory=lambda: [MAX_NUMEL, MAX_SPEC_BYTES])
    #: the byte budget it started with, for messages
    max_bytes: int = dataclasses.field(default_factory=lambda: MAX_SPEC_BYTES)

    def child(self, key: str) -> _At:
        if len(self.path) >= MAX_DEPTH:
            raise self.error(f"specs nest deeper than {MAX_DEPTH} levels")
        return _At((*self.path, _clip(key, 40)), self.budget, self.max_bytes)

    def charge(self, shape: Sequence[int], dtype: torch.dtype, boxed: bool = False) -> None:
        """Counts a (checked) tensor leaf against the tree's element and byte budgets.

        What the trainer builds of it: the zero it sizes frames with, and for a
        ``boxed`` leaf (``Bounded``, ``Unbounded``) the box's low and high too,
        each at the leaf's full shape.
        """
        numel = static_numel(shape)
        self.budget[0] -= numel
        self.budget[1] -= numel * dtype.itemsize * (3 if boxed else 1)
        if self.budget[0] < 0:
            raise self.error(f"the spec's tensor leaves hold more than {MAX_NUMEL} elements")
        if self.budget[1] < 0:
            raise self.error(
                f"the spec's tensor leaves would cost more than {self.max_bytes} bytes "
                "once built (low, high and a zero of each leaf; zmqpool.limits.MAX_SPEC_BYTES, "
                "PoolConfig.max_remote_spec_bytes for remote workers)"
            )

    def error(self, message: str) -> ProtocolError:
        where = "/".join(self.path) or "<root>"
        return ProtocolError(f"spec at {where}: {message}")


@dataclasses.dataclass(frozen=True)
class _Codec:
    """How one spec class becomes data (``encode``) and back (``decode``)."""

    keys: frozenset[str]
    encode: Callable[[Any, _At], dict[str, Any]]
    decode: Callable[[Mapping[str, Any], _At], TensorSpec]
    #: Keys that may be absent (sent only when set).
    optional: frozenset[str] = frozenset()


def _encode(spec: Any, at: _At) -> dict[str, Any]:
    codec = _CODECS.get(type(spec))
    if codec is None:
        raise at.error(
            f"cannot encode a {type(spec).__name__} spec; supported: {', '.join(_BY_NAME)}"
        )
    return {"class": type(spec).__name__, **codec.encode(spec, at)}


def _decode(data: Any, at: _At) -> TensorSpec:
    if not isinstance(data, Mapping):
        raise at.error(f"a spec must be a dict, got {type(data).__name__}")
    name = data.get("class")
    if not isinstance(name, str) or name not in _BY_NAME:
        raise at.error(f"unknown spec class {_short(name)}; known: {', '.join(_BY_NAME)}")
    codec = _BY_NAME[name]
    _check_keys(at, data, codec.keys | {"class"}, name, codec.optional)
    return codec.decode(data, at)


def _call(at: _At, build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs a torchrl constructor on checked values; whatever it refuses is a ProtocolError."""
    try:
        return build(*args, **kwargs)
    except Exception as err:  # torchrl validates with Value/Type/Runtime/Index errors alike
        raise at.error(f"torchrl refused it: {type(err).__name__}: {_clip(str(err), 300)}") from err


# ---------------------------------------------------------------- leaf specs


def _leaf_to_data(spec: TensorSpec, at: _At) -> dict[str, Any]:
    shape = _shape_to_data(at, spec.shape)
    at.charge(shape, spec.dtype, boxed=isinstance(spec, (Bounded, Unbounded)))
    return {
        "shape": shape,
        "device": _device_to_data(at, spec.device),
        "dtype": _dtype_to_data(at, spec.dtype),
    }


def _leaf_from_data(
    data: Mapping[str, Any], at: _At, boxed: bool = False
) -> tuple[torch.Size, torch.device | None, torch.dtype]:
    shape = _shape_from_data(at, "shape", data["shape"], dynamic=True)
    dtype = _dtype_from_data(at, "dtype", data["dtype"])
    at.charge(shape, dtype, boxed)
    return shape, _device_from_data(at, data["device"]), dtype


def _unbounded_from_data(domain: str, data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape, device, dtype = _leaf_from_data(data, at, boxed=True)
    return _call(at, Unbounded, shape=shape, device=device, dtype=dtype, domain=domain)


def _bounded_to_data(spec: Bounded, at: _At) -> dict[str, Any]:
    low, high = spec.space.low, spec.space.high
    return {
        **_leaf_to_data(spec, at),
        "low": _broadcast_to_data(at, low),
        "high": _broadcast_to_data(at, high),
    }


def _bounded_from_data(domain: str, data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape, device, dtype = _leaf_from_data(data, at, boxed=True)
    low = _tensor_field(at, data, "low", dtype, shape, broadcast=True)
    high = _tensor_field(at, data, "high", dtype, shape, broadcast=True)
    return _call(at, Bounded, low, high, shape=shape, device=device, dtype=dtype, domain=domain)


def _categorical_to_data(spec: Categorical, at: _At) -> dict[str, Any]:
    return {**_leaf_to_data(spec, at), "n": int(spec.space.n), "mask": _mask_to_data(spec, at)}


def _categorical_from_data(data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape, device, dtype = _leaf_from_data(data, at)
    n = _int_field(at, data, "n", -1, MAX_NUMEL)
    spec = _call(at, Categorical, n, shape=shape, device=device, dtype=dtype)
    return _with_mask(spec, data, at)


def _binary_to_data(spec: Binary, at: _At) -> dict[str, Any]:
    return {**_leaf_to_data(spec, at), "mask": _mask_to_data(spec, at)}


def _binary_from_data(data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape, device, dtype = _leaf_from_data(data, at)
    spec = _call(at, Binary, shape=shape, device=device, dtype=dtype)
    return _with_mask(spec, data, at)


def _one_hot_to_data(spec: OneHot, at: _At) -> dict[str, Any]:
    return {
        **_leaf_to_data(spec, at),
        "n": int(spec.space.n),
        "use_register": bool(spec.use_register),
        "mask": _mask_to_data(spec, at),
    }


def _one_hot_from_data(data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape, device, dtype = _leaf_from_data(data, at)
    n = _int_field(at, data, "n", 0, MAX_NUMEL)
    register = _bool_field(at, data, "use_register")
    spec = _call(at, OneHot, n, shape, device, dtype, use_register=register)
    return _with_mask(spec, data, at)


def _multi_categorical_to_data(spec: MultiCategorical, at: _At) -> dict[str, Any]:
    return {
        **_leaf_to_data(spec, at),
        "nvec": _tensor_to_data(at, spec.nvec),
        "remove_singleton": bool(spec.remove_singleton),
        "mask": _mask_to_data(spec, at),
    }


def _multi_categorical_from_data(data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape, device, dtype = _leaf_from_data(data, at)
    # nvec arrives at the spec's full shape: torchrl builds one Python box per
    # element, so it must cost the sender as many bytes as it costs us objects.
    nvec = _tensor_field(at, data, "nvec", None, shape)
    if nvec.dtype.is_floating_point or nvec.dtype.is_complex or nvec.dtype == torch.bool:
        raise at.error(f"nvec must have an integer dtype, got {dtype_name(nvec.dtype)}")
    if nvec.numel() and bool((nvec < 0).any()):
        raise at.error("nvec has a negative cardinality")
    singleton = _bool_field(at, data, "remove_singleton")
    spec = _call(at, MultiCategorical, nvec, shape, device, dtype, remove_singleton=singleton)
    return _with_mask(spec, data, at)


def _multi_one_hot_to_data(spec: MultiOneHot, at: _At) -> dict[str, Any]:
    return {
        **_leaf_to_data(spec, at),
        "nvec": [int(n) for n in spec.nvec],
        "use_register": bool(spec.use_register),
        "mask": _mask_to_data(spec, at),
    }


def _multi_one_hot_from_data(data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape, device, dtype = _leaf_from_data(data, at)
    nvec = data["nvec"]
    if not isinstance(nvec, list) or not all(_is_int(n, 0, MAX_NUMEL) for n in nvec):
        raise at.error(f"nvec must be a list of ints in [0, {MAX_NUMEL}], got {_short(nvec)}")
    register = _bool_field(at, data, "use_register")
    spec = _call(at, MultiOneHot, nvec, shape, device, dtype, use_register=register)
    return _with_mask(spec, data, at)


def _mask_to_data(spec: Any, at: _At) -> dict[str, Any] | None:
    mask = getattr(spec, "mask", None)
    return None if mask is None else _tensor_to_data(at, mask)


def _with_mask(spec: Any, data: Mapping[str, Any], at: _At) -> TensorSpec:
    if data["mask"] is not None:
        mask = _tensor_field(at, data, "mask", torch.bool, None)
        _call(at, spec.update_mask, mask)
    return spec


def _non_tensor_to_data(spec: NonTensor, at: _At) -> dict[str, Any]:
    batched = bool(getattr(spec, "batched", False))
    example = spec.example_data
    return {
        "shape": _shape_to_data(at, spec.shape),
        "device": _device_to_data(at, spec.device),
        "dtype": None if spec.dtype is None else _dtype_to_data(at, spec.dtype),
        "example_data": example if _is_plain(example, 0) else None,
        "batched": batched,
        "feature_dims": None if batched else int(getattr(spec, "feature_dims", spec.ndim)),
    }


def _non_tensor_from_data(data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape = _shape_from_data(at, "shape", data["shape"], dynamic=True)
    device = _device_from_data(at, data["device"])
    dtype = None if data["dtype"] is None else _dtype_from_data(at, "dtype", data["dtype"])
    example = data["example_data"]
    if not _is_plain(example, 0):
        raise at.error(f"example_data is not plain data: {_short(example)}")
    kwargs = _non_tensor_batching(data, at)
    return _call(at, NonTensor, shape, device, dtype, example_data=example, **kwargs)


def _non_tensor_batching(data: Mapping[str, Any], at: _At) -> dict[str, Any]:
    if _bool_field(at, data, "batched"):
        if data["feature_dims"] is not None:
            raise at.error("feature_dims must be None when batched is true")
        return {"batched": True}
    return {"feature_dims": _int_field(at, data, "feature_dims", 0, MAX_DIMS)}


# ---------------------------------------------------------------- containers


def _composite_to_data(spec: Composite, at: _At) -> dict[str, Any]:
    data_cls = getattr(spec, "data_cls", None)
    names = list(spec.names)
    entries = {
        key: None if sub is None else _encode(sub, at.child(key)) for key, sub in spec.items()
    }
    data = {
        "shape": _shape_to_data(at, spec.shape),
        "device": _device_to_data(at, spec.device),
        "entries": entries,
        "names": names if any(name is not None for name in names) else None,
        "step_mdp_static": bool(spec.step_mdp_static),
    }
    if data_cls is not None:
        data["data_cls"] = _data_cls_to_data(at, data_cls)
    return data


#: ``data_cls=TensorDict`` (what torchrl's ``PendulumEnv`` declares for its ``params``):
#: the class ``zero()`` makes anyway, but specs compare ``data_cls``, so it crosses as itself.
_TENSORDICT_NAME = "tensordict:TensorDict"


def _data_cls_to_data(at: _At, data_cls: Any) -> str:
    if data_cls is TensorDict:
        return _TENSORDICT_NAME
    try:
        return tensorclass_name(data_cls)
    except ProtocolError as err:
        raise at.error(
            f"Composite.data_cls={getattr(data_cls, '__name__', data_cls)} cannot cross the "
            f"wire (only None, TensorDict and tensorclasses do): {err}"
        ) from None


def _data_cls_from_data(at: _At, data: Mapping[str, Any], keys: Any) -> type | None:
    """The tensorclass the spec names (looked up, never imported); None if absent or not loaded."""
    if "data_cls" not in data:
        return None
    if data["data_cls"] == _TENSORDICT_NAME:
        return TensorDict  # takes any entries
    try:
        cls = resolve_tensorclass(data["data_cls"])
    except ProtocolError as err:
        raise at.error(f"data_cls: {err}") from None
    extra = sorted(set(keys) - tensorclass_fields(cls)) if cls is not None else []
    if extra:
        fields = ", ".join(_short(key, 40) for key in extra[:8])
        raise at.error(f"data_cls {data['data_cls']} has no field {fields}")
    return cls


def _composite_from_data(data: Mapping[str, Any], at: _At) -> TensorSpec:
    shape = _shape_from_data(at, "shape", data["shape"], dynamic=True)
    device = _device_from_data(at, data["device"])
    names = _names_from_data(at, data["names"], len(shape))
    static = _bool_field(at, data, "step_mdp_static")
    entries = data["entries"]
    if not isinstance(entries, Mapping) or not all(isinstance(k, str) for k in entries):
        raise at.error("entries must be a dict with str keys")
    data_cls = _data_cls_from_data(at, data, entries)
    children = {key: _entry_from_data(value, at.child(key)) for key, value in entries.items()}
    return _call(at, _build_composite, children, shape, device, names, static, data_cls)


def _entry_from_data(value: Any, at: _At) -> TensorSpec | None:
    return None if value is None else _decode(value, at)


def _build_composite(
    children: dict[str, TensorSpec | None],
    shape: torch.Size,
    device: torch.device | None,
    names: list[str | None] | None,
    static: bool,
    data_cls: type | None = None,
) -> Composite:
    # Names first, children after: Composite(names=...) would otherwise
    # overwrite the nested specs' own names with its own.
    spec = Composite(
        shape=shape, device=device, names=names, step_mdp_static=static, data_cls=data_cls
    )
    for key, child in children.items():
        spec[key] = child
    return spec


def _names_from_data(at: _At, names: Any, ndim: int) -> list[str | None] | None:
    if names is None:
        return None
    if (
        not isinstance(names, list)
        or len(names) != ndim
        or not all(name is None or isinstance(name, str) for name in names)
    ):
        raise at.error(f"names must be None or {ndim} str-or-None items, got {_short(names)}")
    return list(names)


def _stack_to_data(spec: Stacked | StackedComposite, at: _At) -> dict[str, Any]:
    parts = spec.unbind(spec.dim)
    return {
        "dim": int(spec.dim),
        "specs": [_encode(part, at.child(f"[{i}]")) for i, part in enumerate(parts)],
    }


def _stack_from_data(
    cls: type[Stacked | StackedComposite], data: Mapping[str, Any], at: _At
) -> TensorSpec:
    dim = _int_field(at, data, "dim", 0, MAX_DIMS - 1)
    items = data["specs"]
    if not isinstance(items, list) or not items:
        raise at.error("specs must be a non-empty list")
    parts = [_decode(item, at.child(f"[{i}]")) for i, item in enumerate(items)]
    _check_stackable(at, cls, parts, dim)
    return _call(at, cls, *parts, dim=dim)


def _check_stackable(at: _At, cls: type, parts: list[TensorSpec], dim: int) -> None:
    first = parts[0]
    composite = cls is StackedComposite
    if any(isinstance(part, Composite) != composite for part in parts):
        kind = "Composite" if composite else "non-Composite"
        raise at.error(f"a {cls.__name__} stacks {kind} specs only")
    if not composite and any(type(part) is not type(first) for part in parts):
        raise at.error("a Stacked spec stacks specs of one class")
    if any(part.ndim != first.ndim for part in parts) or dim > first.ndim:
        raise at.error(f"cannot stack these shapes along dim {dim}")
    if composite and any(part.shape != first.shape for part in parts):
        raise at.error("a StackedComposite stacks Composites of one shape")
    if first.ndim + 1 > MAX_DIMS or len(parts) * math.prod(first.shape) > MAX_NUMEL:
        raise at.error(f"stacked shape exceeds {MAX_DIMS} dims or {MAX_NUMEL} elements")


# ---------------------------------------------------------------- fields


def _check_keys(
    at: _At,
    data: Mapping[Any, Any],
    keys: frozenset[str],
    what: str,
    optional: frozenset[str] = frozenset(),
) -> None:
    present = set(data)
    missing, extra = keys - present, present - keys - optional
    if missing or extra:
        raise at.error(
            f"{what}: missing keys {sorted(missing)[:8]}, "
            f"unexpected keys [{', '.join(sorted(_short(key, 40) for key in extra)[:8])}]"
        )


def _is_int(value: Any, low: int, high: int) -> bool:
    return is_int(value) and low <= value <= high


def _int_field(at: _At, data: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = data[key]
    if not _is_int(value, low, high):
        raise at.error(f"{key} must be an int in [{low}, {high}], got {_short(value)}")
    return int(value)


def _bool_field(at: _At, data: Mapping[str, Any], key: str) -> bool:
    value = data[key]
    if type(value) is not bool:
        raise at.error(f"{key} must be a bool, got {_short(value)}")
    return value


def _shape_to_data(at: _At, shape: torch.Size) -> list[int]:
    return list(_shape_from_data(at, "shape", [int(size) for size in shape], dynamic=True))


def _shape_from_data(at: _At, what: str, value: Any, dynamic: bool = False) -> torch.Size:
    """A checked shape; with ``dynamic``, a dim may be -1 (torchrl's "varies from step to step")."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_DIMS:
        raise at.error(f"{what} must be a list of at most {MAX_DIMS} ints, got {_short(value)}")
    low = -1 if dynamic else 0
    if not all(_is_int(size, 0, MAX_NUMEL) or (size == low == -1) for size in value):
        raise at.error(f"{what} dims must be ints in [{low}, {MAX_NUMEL}], got {_short(value)}")
    if static_numel(value) > MAX_NUMEL:  # in Python: torch.Size.numel() can overflow
        raise at.error(f"{what} {list(value)} has more than {MAX_NUMEL} elements")
    return torch.Size(value)


def static_numel(shape: Sequence[int]) -> int:
    """Elements of a shape, a dynamic dim (-1) counted as one: what a spec's bounds hold."""
    return math.prod(max(size, 1) if size < 0 else size for size in shape)


def _device_to_data(at: _At, device: Any) -> str | None:
    if device is None:
        return None
    if torch.device(device).type != "cpu":
        raise at.error(f"device {device} cannot cross the wire (only None and cpu); use .cpu()")
    return "cpu"


def _device_from_data(at: _At, value: Any) -> torch.device | None:
    if value is None:
        return None
    if not isinstance(value, str) or value != "cpu":
        raise at.error(f"device must be None or 'cpu', got {_short(value)}")
    return _CPU


def _dtype_to_data(at: _At, dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except ProtocolError as err:
        raise at.error(str(err)) from None


def _dtype_from_data(at: _At, what: str, value: Any) -> torch.dtype:
    try:
        return dtype_from_name(value)
    except ProtocolError:
        raise at.error(f"{what}: unknown dtype {_short(value)}") from None


# ---------------------------------------------------------------- tensors


def _tensor_to_data(at: _At, tensor: torch.Tensor) -> dict[str, Any]:
    # A fresh buffer: .contiguous() may keep a stride-0 view (an expanded
    # size-1 dim), which cannot be viewed as bytes.
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.detach().reshape(-1))
    raw = _little_endian(flat.view(torch.uint8), flat.dtype.itemsize)
    return {
        "dtype": _dtype_to_data(at, flat.dtype),
        "shape": _shape_to_data(at, tensor.shape),
        "data": raw.numpy().tobytes(),
    }


def _broadcast_to_data(at: _At, tensor: torch.Tensor) -> dict[str, Any]:
    """``tensor`` as its smallest part that expands back to it (``E``), or whole (``T``)."""
    base = _broadcast_base(tensor)
    data = _tensor_to_data(at, base)
    if base.shape != tensor.shape:
        data["expand"] = _shape_to_data(at, tensor.shape)
    return data


def _broadcast_base(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` cut to its first slice along each dim whose slices are all bitwise equal.

    Bits, not values: by value, -0.0 == 0.0 would merge bounds that differ (an
    inexact round trip) and NaN != NaN would keep a uniform NaN bound whole.
    Cutting greedily, dim after dim, finds the smallest such tensor: a tensor
    constant along a dim stays so when cut along another.
    """
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.detach().reshape(-1))
    base = flat.reshape(tensor.shape)
    bits = flat.view(torch.uint8).reshape(*tensor.shape, tensor.dtype.itemsize)
    for dim in range(tensor.ndim):
        if bits.shape[dim] < 2:  # nothing to cut (and a 0-size dim has no first slice)
            continue
        first = bits.narrow(dim, 0, 1)
        if torch.equal(bits, first.expand_as(bits)):
            bits, base = first, base.narrow(dim, 0, 1)
    return base


def _tensor_field(
    at: _At,
    data: Mapping[str, Any],
    key: str,
    dtype: torch.dtype | None,
    shape: torch.Size | None,
    broadcast: bool = False,
) -> torch.Tensor:
    """Field ``key``, a ``T`` (or, with ``broadcast``, an ``E``) of this dtype and shape.

    A broadcast tensor is a view until its shape is checked: the copy that
    makes it a real tensor is only allocated for the leaf's own (counted) shape.
    """
    tensor = _tensor_from_data(at, key, data[key], broadcast)
    if dtype is not None and tensor.dtype != dtype:
        raise at.error(f"{key} has dtype {dtype_name(tensor.dtype)}, expected {dtype_name(dtype)}")
    if shape is not None and tensor.shape != shape:
        raise at.error(f"{key} has shape {list(tensor.shape)}, expected {list(shape)}")
    return tensor.clone(memory_format=torch.contiguous_format) if broadcast else tensor


def _tensor_from_data(at: _At, what: str, value: Any, broadcast: bool = False) -> torch.Tensor:
    if not isinstance(value, Mapping):
        raise at.error(f"{what} must be a tensor dict, got {type(value).__name__}")
    expand = broadcast and "expand" in value
    _check_keys(at, value, _BROADCAST_KEYS if expand else _TENSOR_KEYS, what)
    tensor = _whole_tensor_from_data(at, what, value)
    return _expand(at, what, tensor, value["expand"]) if expand else tensor


def _expand(at: _At, what: str, base: torch.Tensor, value: Any) -> torch.Tensor:
    """A view of ``base`` expanded to shape ``value``: nothing is allocated here."""
    shape = _shape_from_data(at, f"{what}.expand", value)
    # torch's rule: as many dims, each of the base's either 1 or the expanded size.
    if len(shape) != base.ndim or any(
        b not in (1, n) for b, n in zip(base.shape, shape, strict=True)
    ):
        raise at.error(f"{what}: shape {list(base.shape)} does not expand to {list(shape)}")
    return base.expand(shape)


def _whole_tensor_from_data(at: _At, what: str, value: Mapping[str, Any]) -> torch.Tensor:
    dtype = _dtype_from_data(at, f"{what}.dtype", value["dtype"])
    shape = _shape_from_data(at, f"{what}.shape", value["shape"])
    raw = value["data"]
    expected = shape.numel() * dtype.itemsize
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != expected:
        got = len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__
        raise at.error(
            f"{what}.data must be {expected} bytes for {dtype_name(dtype)}{list(shape)}, got {got}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    flat = _little_endian(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dtype.itemsize)
    if dtype == torch.bool and bool((flat > 1).any()):
        raise at.error(f"{what}.data holds bool bytes other than 0 and 1")
    return flat.view(dtype).reshape(shape)


def _little_endian(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Native-order bytes to little-endian or back (the same swap both ways)."""
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    return raw.reshape(-1, itemsize).flip(-1).reshape(-1)


# ---------------------------------------------------------------- plain data


def _is_plain(value: Any, depth: int) -> bool:
    """Whether ``value`` survives a msgpack round trip unchanged (exact types only)."""
    if depth > MAX_DEPTH:
        return False
    kind = type(value)
    if value is None or kind in (bool, float, str, bytes):
        return True
    if kind is int:
        return _MSGPACK_INT_RANGE[0] <= value <= _MSGPACK_INT_RANGE[1]
    if kind is list:
        return all(_is_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(type(k) is str and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def _short(value: Any, limit: int = 80) -> str:
    return _clip(repr(value), limit)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- the table


def _codec(
    keys: set[str],
    encode: Callable[[Any, _At], dict[str, Any]],
    decode: Callable[[Mapping[str, Any], _At], TensorSpec],
) -> _Codec:
    return _Codec(frozenset(keys), encode, decode)


_P = functools.partial
_CODECS: dict[type, _Codec] = {
    UnboundedContinuous: _codec(
        set(_LEAF_KEYS), _leaf_to_data, _P(_unbounded_from_data, "continuous")
    ),
    UnboundedDiscrete: _codec(set(_LEAF_KEYS), _leaf_to_data, _P(_unbounded_from_data, "discrete")),
    BoundedContinuous: _codec(
        {*_LEAF_KEYS, "low", "high"}, _bounded_to_data, _P(_bounded_from_data, "continuous")
    ),
    BoundedDiscrete: _codec(
        {*_LEAF_KEYS, "low", "high"}, _bounded_to_data, _P(_bounded_from_data, "discrete")
    ),
    Categorical: _codec({*_LEAF_KEYS, "n", "mask"}, _categorical_to_data, _categorical_from_data),
    Binary: _codec({*_LEAF_KEYS, "mask"}, _binary_to_data, _binary_from_data),
    OneHot: _codec(
        {*_LEAF_KEYS, "n", "use_register", "mask"}, _one_hot_to_data, _one_hot_from_data
    ),
    MultiCategorical: _codec(
        {*_LEAF_KEYS, "nvec", "remove_singleton", "mask"},
        _multi_categorical_to_data,
        _multi_categorical_from_data,
    ),
    MultiOneHot: _codec(
        {*_LEAF_KEYS, "nvec", "use_register", "mask"},
        _multi_one_hot_to_data,
        _multi_one_hot_from_data,
    ),
    NonTensor: _codec(
        {"shape", "device", "dtype", "example_data", "batched", "feature_dims"},
        _non_tensor_to_data,
        _non_tensor_from_data,
    ),
    Composite: _Codec(
        frozenset({"shape", "device", "entries", "names", "step_mdp_static"}),
        _composite_to_data,
        _composite_from_data,
        optional=frozenset({"data_cls"}),
    ),
    StackedComposite: _codec(
        {"dim", "specs"}, _stack_to_data, _P(_stack_from_data, StackedComposite)
    ),
    Stacked: _codec({"dim", "specs"}, _stack_to_data, _P(_stack_from_data, Stacked)),
}
_BY_NAME: dict[str, _Codec] = {cls.__name__: codec for cls, codec in _CODECS.items()}
