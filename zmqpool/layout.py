"""Layouts: how one tensordict lies in a message's frames, and the checks that it is one.

A :class:`Layout` is what a part's header entry refers to and what a
decoder trusts nothing before checking; its fields and their wire form
(``"b"``, ``"t"``, ``"n"``, ``"s"``, ``"k"``, ``"z"``, ``"c"``) are described,
once, in :mod:`zmqpool.wire`. This module owns the layout itself and its wire
form (:meth:`Layout.to_data`, :meth:`Layout.from_data`), placing leaves in
frames (:func:`build_layout`), every check that a layout is a tree a
tensordict can be, the dtypes that may travel (:func:`dtype_name`,
:func:`dtype_from_name`), and the largest frame a peer's layouts allow
(:func:`max_message_bytes`). It knows nothing of tensors' values: turning
tensordicts into frames is :mod:`zmqpool.codec`'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from zmqpool.classnames import parse_class_name, resolve_tensorclass, tensorclass_fields
from zmqpool.errors import ProtocolError
from zmqpool.limits import (
    MAX_DIM_SIZE,
    MAX_DIMS,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    MAX_KEY_DEPTH,
    MAX_KEY_NAME,
    MAX_LEAF_BYTES,
    MAX_LEAVES,
    described,
    is_int,
)

#: Packed leaves start at multiples of this many bytes (so any dtype's view is aligned).
ALIGN = 16

#: The dtypes that cross the wire, by name; no other exists for a peer.
_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    # One byte each: their bytes travel as any other's (numpy has none of them).
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
}
#: The name each wire dtype travels as (a layout's ``"t"``, a spec's ``dtype``).
DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_from_name(name: Any) -> torch.dtype:
    """The torch dtype called ``name``; only the whitelisted ones exist."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"unknown dtype {described(name)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name ``dtype`` travels as; a ProtocolError if it cannot travel."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot cross the wire") from None


Key = tuple[str, ...]
Branch = tuple[Key, tuple[int, ...]]
#: A lazy stack: its key path (``()``: the part itself), stack_dim, member count.
LazyNode = tuple[Key, int, int]
#: A tensorclass: its key path (``()``: the part itself) and wire name, ``"module:qualname"``.
ClassNode = tuple[Key, str]


@dataclasses.dataclass(frozen=True, slots=True)
class Leaf:
    """One tensor of a part: where its bytes are and what they mean."""

    key: Key
    dtype: torch.dtype
    shape: tuple[int, ...]
    own_frame: bool
    frame: int  # index among the part's frames
    offset: int  # byte offset inside that frame
    nbytes: int


# A decoder's layouts are interned weakly (zmqpool.codec), so that what one peer
# announced lives only as long as its decoder holds it: slots need weakref_slot
# (Python 3.11); 3.10 keeps an instance dict instead, which weak references allow.
_WEAKLY_REFERABLE: dict[str, bool] = (
    {"slots": True, "weakref_slot": True} if sys.version_info >= (3, 11) else {}
)


@dataclasses.dataclass(frozen=True, **_WEAKLY_REFERABLE)
class Layout:
    """How one tensordict is laid out in frames (the format: :mod:`zmqpool.wire`).

    ``branches`` are the nested tensordicts with a batch size of their own (or
    no keys), deepest first; ``stacked`` says, per non-tensor key, whether it
    holds a ``NonTensorStack``; ``nontensor_batches`` is the batch size of the
    tensordict each non-tensor key lives in (derived, not sent); ``lazy`` the
    lazy stacks, whose members are the branches ``(*key, "#i")``; ``classes``
    the tensorclasses, each the part or a branch, and ``class_types`` their
    classes (derived, not sent: on a decoder's layouts, None where the class is
    not loaded, and the value then comes back a plain TensorDict).
    """

    batch_size: tuple[int, ...]
    leaves: tuple[Leaf, ...]
    nontensor_keys: tuple[Key, ...]
    packed_nbytes: int
    frame_sizes: tuple[int, ...]
    branches: tuple[Branch, ...] = ()
    stacked: tuple[bool, ...] = ()
    nontensor_batches: tuple[tuple[int, ...], ...] = ()
    lazy: tuple[LazyNode, ...] = ()
    classes: tuple[ClassNode, ...] = ()
    class_types: tuple[type | None, ...] = ()
    # Derived from frame_sizes, once: a sender reads them for every part it sends.
    largest_frame: int = dataclasses.field(init=False, compare=False, repr=False)
    frames_nbytes: int = dataclasses.field(init=False, compare=False, repr=False)
    notes: dict[Any, Any] = dataclasses.field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "largest_frame", max(self.frame_sizes, default=0))
        object.__setattr__(self, "frames_nbytes", sum(self.frame_sizes))

    @property
    def num_frames(self) -> int:
        return len(self.frame_sizes)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "b": list(self.batch_size),
            "t": [
                [list(leaf.key), dtype_name(leaf.dtype), list(leaf.shape), leaf.own_frame]
                for leaf in self.leaves
            ],
            "n": [list(key) for key in self.nontensor_keys],
        }
        if self.branches:
            data["s"] = [[list(key), list(batch)] for key, batch in self.branches]
        if any(self.stacked):
            data["k"] = [i for i, stacked in enumerate(self.stacked) if stacked]
        if self.lazy:
            data["z"] = [[list(key), dim, count] for key, dim, count in self.lazy]
        if self.classes:
            data["c"] = [[list(key), name] for key, name in self.classes]
        return data

    @classmethod
    def from_data(cls, data: Any) -> Layout:
        """Rebuild and validate a layout received from a peer."""
        if not isinstance(data, dict) or not _LAYOUT_KEYS <= set(data) <= _LAYOUT_ALL_KEYS:
            raise ProtocolError("a layout is a map with keys b, t, n (and optionally s, k, z, c)")
        batch_size = _shape(data["b"], "layout batch size")
        if not isinstance(data["t"], list) or len(data["t"]) > MAX_LEAVES:
            raise ProtocolError(f"a layout has a list of at most {MAX_LEAVES} leaves")
        if not isinstance(data["n"], list) or len(data["n"]) > MAX_LEAVES:
            raise ProtocolError("a layout's non-tensor keys must be a short list")
        specs = [_leaf_spec(item) for item in data["t"]]
        nontensor = tuple(_key(item) for item in data["n"])
        branches = _branches(data.get("s", []))
        stacked = _stacked(data.get("k", []), len(nontensor))
        lazy = _lazy_nodes(data.get("z", []))
        classes = _class_nodes(data["c"]) if "c" in data else ()
        layout = build_layout(batch_size, specs, nontensor, branches, stacked, lazy, classes)
        # Looked up only once the layout is known to be a tree: a refused one warns of nothing.
        return _with_class_types(layout) if classes else layout


_LAYOUT_KEYS = frozenset("btn")
_LAYOUT_ALL_KEYS = frozenset("btnskzc")


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise ProtocolError(f"{what} must be a list of at most {MAX_DIMS} sizes")
    if not all(is_int(v) and 0 <= v < MAX_DIM_SIZE for v in value):
        raise ProtocolError(f"{what} must hold non-negative integers")
    _check_extent(value, what)
    return tuple(value)


def _check_extent(shape: Sequence[int], what: str) -> None:
    # Zeros count as ones: torch computes strides from the other dims all the same.
    if math.prod(max(size, 1) for size in shape) > MAX_LEAF_BYTES:
        raise ProtocolError(f"{what} {list(shape)} is too large")


def _key(value: Any) -> Key:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_KEY_DEPTH:
        raise ProtocolError(f"a key path is a list of 1 to {MAX_KEY_DEPTH} strings")
    if not all(isinstance(part, str) and 0 < len(part) <= MAX_KEY_NAME for part in value):
        raise ProtocolError("key path parts must be non-empty strings")
    return tuple(value)


def _leaf_spec(item: Any) -> tuple[Key, torch.dtype, tuple[int, ...], bool]:
    if not isinstance(item, list) or len(item) != 4 or not isinstance(item[3], bool):
        raise ProtocolError("a layout leaf is [key, dtype, shape, own_frame]")
    return _key(item[0]), dtype_from_name(item[1]), _shape(item[2], "leaf shape"), item[3]


def _branches(value: Any) -> list[Branch]:
    if not isinstance(value, list) or len(value) > MAX_LEAVES:
        raise ProtocolError("a layout's nested tensordicts must be a short list")
    if not all(isinstance(item, list) and len(item) == 2 for item in value):
        raise ProtocolError("a nested tensordict is [key path, batch size]")
    return [(_key(key), _shape(batch, "nested batch size")) for key, batch in value]


def _stacked(value: Any, count: int) -> list[bool]:
    if not isinstance(value, list) or not all(is_int(i) and 0 <= i < count for i in value):
        raise ProtocolError("a layout's stacked non-tensor indices must index its non-tensor keys")
    stacked = [False] * count
    for index in value:
        stacked[index] = True
    return stacked


def _lazy_nodes(value: Any) -> list[LazyNode]:
    if not isinstance(value, list) or len(value) > MAX_LEAVES:
        raise ProtocolError("a layout's lazy stacks must be a short list")
    nodes = []
    for item in value:
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError("a lazy stack is [key path, stack_dim, member count]")
        key, dim, count = item
        if not is_int(dim) or not 0 <= dim < MAX_DIMS:
            raise ProtocolError(f"a lazy stack's stack_dim must be in [0, {MAX_DIMS})")
        if not is_int(count) or not 0 < count <= MAX_LEAVES:
            raise ProtocolError(f"a lazy stack has 1 to {MAX_LEAVES} members")
        nodes.append((() if key == [] else _key(key), dim, count))
    return nodes


def _class_nodes(value: Any) -> list[ClassNode]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_LEAVES:
        raise ProtocolError(f"a layout's tensorclasses are a list of 1 to {MAX_LEAVES} entries")
    nodes = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise ProtocolError("a tensorclass is [key path, 'module:qualname']")
        key, name = item
        parse_class_name(name)
        nodes.append((() if key == [] else _key(key), name))
    return nodes


def _with_class_types(layout: Layout) -> Layout:
    """``layout`` with its tensorclasses looked up (:func:`resolve_tensorclass`) and checked.

    A class found must have a field for every key the layout puts under it:
    ``_from_tensordict`` would refuse any other, but only when the part is built.
    """
    found: dict[str, type | None] = {}
    for _, name in layout.classes:
        if name not in found:
            found[name] = resolve_tensorclass(name)
    found_types = tuple(found[name] for _, name in layout.classes)
    children = _children(layout)
    stacks = {key: count for key, _, count in layout.lazy}
    for (key, name), cls in zip(layout.classes, found_types, strict=True):
        if cls is None:
            continue
        extra = sorted(_fields_under(key, children, stacks) - tensorclass_fields(cls))
        if extra:
            raise ProtocolError(
                f"tensorclass {name} at {'/'.join(key) or 'the part'} has no field "
                f"{', '.join(extra[:8])}: this process's class is not the peer's"
            )
    return dataclasses.replace(layout, class_types=found_types)


def _children(layout: Layout) -> dict[Key, set[str]]:
    """The names directly under each key path of ``layout``: one pass over its paths."""
    children: dict[Key, set[str]] = {}
    paths = [leaf.key for leaf in layout.leaves] + [*layout.nontensor_keys]
    for path in paths + [key for key, _ in layout.branches]:
        for depth in range(len(path)):  # at most MAX_KEY_DEPTH each
            children.setdefault(path[:depth], set()).add(path[depth])
    return children


def _fields_under(
    key: Key, children: Mapping[Key, set[str]], stacks: Mapping[Key, int]
) -> set[str]:
    """The names directly under ``key``; under a lazy stack, under any of its members.

    A member is visited once per tensorclass above it, and members are distinct
    branches (checked): the work is bounded by the layout's size.
    """
    count = stacks.get(key)
    if count is None:
        return children.get(key, set())
    members = (_fields_under((*key, member_name(i)), children, stacks) for i in range(count))
    return set().union(*members)


def build_layout(
    batch_size: Sequence[int],
    leaf_specs: Iterable[tuple[Key, torch.dtype, tuple[int, ...], bool]],
    nontensor_keys: tuple[Key, ...] = (),
    branches: Sequence[Branch] = (),
    stacked: Sequence[bool] | None = None,
    lazy: Sequence[LazyNode] = (),
    classes: Sequence[ClassNode] = (),
    class_types: Sequence[type | None] = (),
) -> Layout:
    """Assign frames and offsets (packed leaves first, in frame 0 if any, then one frame
    each) and check that the keys, shapes and batch sizes make a tensordict.

    ``classes`` are the tensorclasses (key, wire name), ``class_types`` their
    classes where known (an encoder's); a decoder's are looked up afterwards.
    """
    leaves, packed_nbytes, frame_sizes = _place(leaf_specs)
    for leaf in leaves:  # refused here, before a request that could never be sent is opened
        if leaf.dtype not in DTYPE_NAMES:
            raise ProtocolError(
                f"entry {'/'.join(leaf.key)} has dtype {leaf.dtype}, which cannot cross the wire"
            )
    stacked = tuple(stacked) if stacked is not None else (False,) * len(nontensor_keys)
    deepest_first = tuple(sorted(branches, key=lambda branch: -len(branch[0])))
    lazy = tuple(lazy)
    nontensor_batches = _check_tree(
        tuple(batch_size), leaves, nontensor_keys, deepest_first, stacked, lazy
    )
    classes = tuple(classes)
    if classes:
        _check_classes(classes, deepest_first)
    return Layout(
        tuple(batch_size),
        leaves,
        nontensor_keys,
        packed_nbytes,
        frame_sizes,
        deepest_first,
        stacked,
        nontensor_batches,
        lazy,
        classes,
        tuple(class_types) if class_types else (None,) * len(classes),
    )


def _check_classes(classes: tuple[ClassNode, ...], branches: tuple[Branch, ...]) -> None:
    """Each tensorclass is the part or a branch (whose batch size is then known), once."""
    keys = [key for key, _ in classes]
    if len(set(keys)) != len(keys):
        raise ProtocolError("a tensorclass appears twice at one key")
    owners = {key for key, _ in branches}
    for key in keys:
        if key and key not in owners:
            raise ProtocolError(
                f"tensorclass at {'/'.join(key)} is not a nested tensordict of the layout"
            )


def _place(
    specs: Iterable[tuple[Key, torch.dtype, tuple[int, ...], bool]],
) -> tuple[tuple[Leaf, ...], int, tuple[int, ...]]:
    packed_nbytes, own, placed = 0, [], list[Leaf]()
    for key, dtype, shape, own_frame in specs:
        nbytes = _nbytes(dtype, shape)
        if own_frame:
            own.append(len(placed))
            placed.append(Leaf(key, dtype, shape, True, -1, 0, nbytes))
            continue
        packed_nbytes = -(-packed_nbytes // ALIGN) * ALIGN
        placed.append(Leaf(key, dtype, shape, False, 0, packed_nbytes, nbytes))
        packed_nbytes += nbytes
    frame_sizes = [packed_nbytes] if len(own) < len(placed) else []
    for index in own:
        frame_sizes.append(placed[index].nbytes)
        placed[index] = dataclasses.replace(placed[index], frame=len(frame_sizes) - 1)
    if max(frame_sizes, default=0) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a frame of more than {MAX_FRAME_BYTES} bytes")
    return tuple(placed), packed_nbytes, tuple(frame_sizes)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    _check_extent(shape, "leaf shape")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_LEAF_BYTES:
        raise ProtocolError(f"a leaf of {nbytes} bytes exceeds the {MAX_LEAF_BYTES} byte limit")
    return nbytes


def _check_tree(
    batch_size: tuple[int, ...],
    leaves: tuple[Leaf, ...],
    nontensor_keys: tuple[Key, ...],
    branches: tuple[Branch, ...],
    stacked: tuple[bool, ...],
    lazy: tuple[LazyNode, ...] = (),
) -> tuple[tuple[int, ...], ...]:
    """Refuse what no tensordict can be; the batch size each non-tensor key lives in."""
    owners = dict(branches)
    if len(owners) != len(branches) or len(stacked) != len(nontensor_keys):
        raise ProtocolError("a nested tensordict appears twice, or stack flags do not match")
    paths = sorted([leaf.key for leaf in leaves] + [*nontensor_keys, *owners])
    _check_prefix_free(paths, owners)
    # A lazy stack's members have its batch size without stack_dim, not a longer one.
    members = _check_lazy(batch_size, owners, lazy, paths) if lazy else _NO_MEMBERS
    for key, batch in branches:
        if key not in members:
            _check_starts_with(batch, _batch_of(key, owners, batch_size), key, "batch size")
    for leaf in leaves:
        _check_starts_with(leaf.shape, _batch_of(leaf.key, owners, batch_size), leaf.key, "shape")
    batches = tuple(_batch_of(key, owners, batch_size) for key in nontensor_keys)
    for key, batch, is_stack in zip(nontensor_keys, batches, stacked, strict=True):
        if is_stack and (not batch or 0 in batch):
            raise ProtocolError(f"non-tensor stack {'/'.join(key)} needs a non-empty batch")
    return batches


_NO_MEMBERS: frozenset[Key] = frozenset()


def _check_lazy(
    batch_size: tuple[int, ...],
    owners: Mapping[Key, tuple[int, ...]],
    lazy: tuple[LazyNode, ...],
    paths: list[Key],
) -> frozenset[Key]:
    """Refuse lazy stacks that are not ``count`` members of one batch size; their members."""
    nodes = {key: (dim, count) for key, dim, count in lazy}
    if len(nodes) != len(lazy):
        raise ProtocolError("a lazy stack appears twice")
    # Every member is a distinct branch: this bounds the loops below by the layout's size.
    if sum(count for _, _, count in lazy) > len(owners):
        raise ProtocolError("lazy stacks claim more members than the layout has branches")
    members = set()
    for key, (dim, count) in nodes.items():
        name = "/".join(key) or "the part"
        batch = owners.get(key) if key else batch_size
        if batch is None:
            raise ProtocolError(f"lazy stack {name} is not a nested tensordict of the layout")
        if dim >= len(batch) or batch[dim] != count:
            raise ProtocolError(
                f"lazy stack {name} of batch size {list(batch)} cannot stack {count} members "
                f"at dim {dim}"
            )
        member_batch = batch[:dim] + batch[dim + 1 :]
        for i in range(count):
            member = (*key, member_name(i))
            if owners.get(member) != member_batch:
                raise ProtocolError(
                    f"member {i} of lazy stack {name} must be a nested tensordict of batch size "
                    f"{list(member_batch)}"
                )
            members.add(member)
    depths = sorted({len(key) for key in nodes})
    for path in paths:
        for depth in depths:
            if depth >= len(path):
                break
            if path[:depth] in nodes and path[: depth + 1] not in members:
                stack = "/".join(path[:depth]) or "the part"
                raise ProtocolError(
                    f"key {'/'.join(path)} lies in lazy stack {stack} but in none of its members"
                )
    return frozenset(members)


def member_name(index: int) -> str:
    """The synthetic key of a lazy stack's member ``index``."""
    return f"#{index}"


def _check_prefix_free(paths: list[Key], branches: Mapping[Key, Any]) -> None:
    # Sorted, a path is directly followed by the paths it is a prefix of (if any).
    for a, b in itertools.pairwise(paths):
        if a == b:
            raise ProtocolError(f"key {'/'.join(a)} appears twice")
        if b[: len(a)] == a and a not in branches:
            raise ProtocolError(f"key {'/'.join(a)} is both a leaf and a branch")


def _batch_of(
    key: Key, branches: Mapping[Key, tuple[int, ...]], root: tuple[int, ...]
) -> tuple[int, ...]:
    """The batch size of the tensordict ``key`` lives in: its deepest declared ancestor's."""
    for depth in range(len(key) - 1, 0, -1):
        batch = branches.get(key[:depth])
        if batch is not None:
            return batch
    return root


def _check_starts_with(shape: tuple[int, ...], batch: tuple[int, ...], key: Key, what: str) -> None:
    if shape[: len(batch)] != batch:
        raise ProtocolError(
            f"{what} {list(shape)} of {'/'.join(key)} does not start with its batch size "
            f"{list(batch)}"
        )


def max_message_bytes(
    layouts: Iterable[Layout], headroom: float = 2.0, header_bytes: int = MAX_HEADER_BYTES
) -> int:
    """A ZMQ ``MAXMSGSIZE`` (a per-frame limit) for a peer that sends these layouts.

    The largest frame such a peer can send is its header (at most
    ``header_bytes``, :data:`MAX_HEADER_BYTES` by default) or a tensor frame,
    and no tensor frame is larger than all of a layout's leaves packed,
    whatever the zero-copy threshold.
    ``headroom`` multiplies the latter: a frame over the limit disconnects the
    peer and loses its reply, so the limit must not be tight (an env may return
    leaves its spec does not declare). Layouts of specs:
    :func:`zmqpool.codec.layout_of` ``(spec.zero())``.

    Example:
        >>> from tensordict import TensorDict
        >>> from zmqpool.codec import layout_of
        >>> image = layout_of(TensorDict({"pixels": torch.zeros(3, 1024, 1024)}, []))
        >>> max_message_bytes([image]) == 2 * 3 * 1024 * 1024 * 4
        True
        >>> max_message_bytes([]) == MAX_HEADER_BYTES
        True
    """
    largest = max((_all_packed_nbytes(layout) for layout in layouts), default=0)
    return max(header_bytes, math.ceil(largest * headroom))


def _all_packed_nbytes(layout: Layout) -> int:
    return sum(-(-leaf.nbytes // ALIGN) * ALIGN for leaf in layout.leaves)


# ---------------------------------------------------------------- what a layout costs to keep

#: Bytes of a layout's own fixed fields and tuples (its dataclass, ``notes``, ...).
_LAYOUT_BYTES = 1024
#: Bytes of a :class:`Leaf` (slots and GC header) and of its place in the layout's tuple.
_LEAF_BYTES = 96
#: Bytes of an empty tuple (a key path, a shape, an entry) and of each item it holds:
#: 8 for the pointer, 32 for an int that may not be one of the small ones CPython shares.
_TUPLE_BYTES, _ITEM_BYTES, _INT_BYTES = 48, 8, 32
#: Bytes of an empty ASCII string (CPython's compact ones: one more a character).
_STR_BYTES = 49


def layout_footprint(layout: Layout) -> int:
    """Roughly the bytes ``layout`` keeps alive in this process: an upper estimate (by 1.1-2x).

    Worked out once, when a peer announces a layout (a decoder holds them to
    :data:`~zmqpool.limits.MAX_PEER_LAYOUT_BYTES`), from the objects
    :meth:`Layout.from_data` builds: a key path's names are strings of their
    own per entry (msgpack does not share them), so deep keys of short names
    cost some 20 times their wire size.

    Example:
        >>> from tensordict import TensorDict
        >>> from zmqpool.codec import layout_of
        >>> small = layout_of(TensorDict({"observation": torch.zeros(4)}, []))
        >>> 1024 < layout_footprint(small) < 2048
        True
    """
    # In bulk, a few passes over the entries: it runs for every layout a peer announces.
    leaves, branches = layout.leaves, layout.branches
    keys = [leaf.key for leaf in leaves]
    keys += layout.nontensor_keys
    keys += [key for key, _ in branches]
    keys += [key for key, _, _ in layout.lazy]
    keys += [key for key, _ in layout.classes]
    shapes = [leaf.shape for leaf in leaves]
    shapes += layout.nontensor_batches
    shapes += [batch for _, batch in branches]
    entries = len(layout.nontensor_keys) + len(branches) + len(layout.lazy) + len(layout.classes)
    return (
        _LAYOUT_BYTES
        + len(leaves) * _LEAF_BYTES
        + entries * (_TUPLE_BYTES + 4 * _ITEM_BYTES + 2 * _INT_BYTES)
        + len(keys) * _TUPLE_BYTES
        + _names_bytes([name for key in keys for name in key])
        + len(shapes) * _TUPLE_BYTES
        + sum(map(len, shapes)) * (_ITEM_BYTES + _INT_BYTES)
        + _names_bytes([name for _, name in layout.classes])
    )


def _names_bytes(names: list[str]) -> int:
    """What strings ``names``, each an object of its own, take, with their pointers."""
    if "".join(names).isascii():  # the usual case, told in one pass
        return len(names) * (_ITEM_BYTES + _STR_BYTES + 15) + sum(map(len, names))
    return sum(_ITEM_BYTES + _str_bytes(name) for name in names)


def _str_bytes(text: str) -> int:
    # CPython's compact strings, rounded up to the allocator's 16 bytes.
    if text.isascii():
        size = _STR_BYTES + len(text)
    else:
        widest = ord(max(text))
        size = (
            73 + len(text)
            if widest < 256
            else 74 + 2 * len(text)
            if widest < 65536
            else 76 + 4 * len(text)
        )
    return -(-size // 16) * 16
