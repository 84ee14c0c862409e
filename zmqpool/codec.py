"""The codec: tensordicts to frames and back, on both sides of the wire.

This module owns turning one tensordict into a part's frames
(:class:`Encoder`, which announces each :class:`~zmqpool.layout.Layout` once
per connection) and a message's frames back into parts (:class:`Decoder`,
which checks every frame against its announced layout before touching it),
parts into tensordicts (:func:`tensordict_from_leaves`), lazy stacks and
tensorclasses included, and what a worker asks of a tensordict before sending
it (:func:`check_crossable`, :func:`leaf_state`). The format it speaks is
described, once, in :mod:`zmqpool.wire`; the layouts it lays tensors out by
are :mod:`zmqpool.layout`'s. Both sides use it; batching rows and replies is
the trainer's alone (:mod:`zmqpool.batching`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import numpy as np
import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_tensorclass,
)

from zmqpool.classnames import clipped, is_non_tensor_class, tensorclass_name
from zmqpool.errors import ProtocolError
from zmqpool.layout import (
    ALIGN,
    DTYPE_NAMES,
    Branch,
    ClassNode,
    Key,
    Layout,
    LazyNode,
    Leaf,
    build_layout,
    layout_footprint,
    member_name,
)
from zmqpool.limits import (
    MAX_FRAME_BYTES,
    MAX_LAYOUT_ID,
    MAX_NONTENSOR_BYTES,
    MAX_NONTENSOR_ITEMS,
    MAX_PEER_LAYOUT_BYTES,
    described,
    is_int,
)

if TYPE_CHECKING:
    from zmqpool.wire import Header

#: Leaves of at least this many bytes travel as their own zero-copy frame.
#: Measured with ``scripts/bench.py --probe-threshold`` (CPU per message, sender
#: and receiver, a leaf packed against in its own frame; docs/PERFORMANCE.md):
#: below 64 KiB its own frame costs 1-12% more, from 64 KiB it saves 10%, at
#: 1 MiB 78%. 64 KiB is also pyzmq's ``COPY_THRESHOLD``: below it, pyzmq copies
#: a "zero-copy" frame anyway, so a frame of its own only adds a frame.
ZERO_COPY_THRESHOLD = 64 * 1024


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16: numpy has no such type
        return None


#: The numpy twin of each wire dtype (None where numpy has none): numpy slices
#: and copies small arrays several times faster than torch dispatches ops.
NUMPY_DTYPES = {dtype: _numpy_dtype(dtype) for dtype in DTYPE_NAMES}


# ---------------------------------------------------------------- encoding


@dataclasses.dataclass(slots=True)
class EncodedPart:
    """A tensordict ready to send: its layout (and id on the connection), frames and
    non-tensor values. The frames are laid out by ``layout``: their sizes are its
    ``frame_sizes``."""

    layout_id: int
    new_layout: dict[str, Any] | None
    frames: Sequence[Any]
    nontensor: list[Any] | None
    layout: Layout


class Encoder:
    """Turns tensordicts into frames; remembers the layouts it announced.

    One encoder per connection: a layout is announced in full the first time
    it is used and referred to by id afterwards. ``forget()`` after the peer
    was replaced (a re-registration), so layouts are announced again.

    A leaf of ``zero_copy_threshold`` bytes or more gets a frame of its own.
    ``copy_own_frames=False`` (a worker's replies) sends it without a copy:
    ZeroMQ reads the tensor when it writes the message out, later. ``True``
    (the pool's commands) copies it here: a caller's tensor is the caller's
    to change once the send returns, and the env must get it as it was then.
    """

    def __init__(
        self, zero_copy_threshold: int = ZERO_COPY_THRESHOLD, copy_own_frames: bool = False
    ) -> None:
        self.zero_copy_threshold = zero_copy_threshold
        self.copy_own_frames = copy_own_frames
        # signature (a tensordict's) or Layout (a packed part's) -> (layout id, layout)
        self._ids: dict[tuple | Layout, tuple[int, Layout]] = {}
        self._announced: set[int] = set()
        # id(layout) -> (layout id, layout): the layout is held, so the id stays its own.
        self._by_layout: dict[int, tuple[int, Layout]] = {}
        # (batch size, ((name, dtype, shape), ...)) -> (layout id, layout): see _encode_flat.
        self._flat_ids: dict[tuple, tuple[int, Layout]] = {}

    def forget(self) -> None:
        self._announced.clear()

    def encode(
        self, td: TensorDictBase | DecodedPart, dtypes: DeclaredDtypes | None = None
    ) -> EncodedPart:
        """``td``'s frames; a :class:`DecodedPart` (a packed row) is already frames.

        ``dtypes``: what the env's specs declare. A leaf of another dtype is sent
        cast to its spec's, as ``SerialEnv`` and ``ParallelEnv`` return it (they
        copy each output into a buffer made from the specs); which leaves is
        worked out once per layout (noted on it).
        """
        if isinstance(td, DecodedPart):
            return self._encode_part(td)
        if type(td) is TensorDict:  # a worker's every reply: see _encode_flat
            part = self._encode_flat(td, dtypes)
            if part is not None:
                return part
        flat = flatten(td)
        tensors = flat.tensors
        signature: tuple = (
            tuple(td.batch_size),
            # A torch.Size equals and hashes as the tuple of its sizes: no copy needed.
            tuple([(key, t.dtype, t.shape) for key, t in tensors]),
            tuple(flat.nontensor_keys),
            tuple(flat.stacked),
            tuple(flat.branches),
        )
        if flat.lazy:  # a longer signature: never equal to one without lazy stacks
            signature += (tuple(flat.lazy),)
        if flat.classes:  # tagged: never equal to a lazy stack's
            signature += (("c", tuple(flat.classes)),)
        layout_id, layout = self._layout_for(signature, flat, td.batch_size)
        self._note_flat(td, flat, (layout_id, layout))
        if dtypes is not None:
            casts = layout.notes.get(dtypes.key)
            if casts is None:
                casts = layout.notes[dtypes.key] = () if flat.classes else dtypes.casts(layout)
            if casts:  # an env off its specs' dtypes: rare, and not the cheapest path
                return self.encode(_cast(td, casts))
        frames = _pack(layout, [t for _, t in tensors], self.copy_own_frames)
        values = [_plain(v, k) for k, v in zip(flat.nontensor_keys, flat.nontensor, strict=True)]
        announced = None if layout_id in self._announced else self._announce(layout_id, layout)
        return EncodedPart(layout_id, announced, frames, values or None, layout)

    def _encode_flat(self, td: TensorDict, dtypes: DeclaredDtypes | None) -> EncodedPart | None:
        """:meth:`encode` of a TensorDict of dense tensors only, no branches, whose
        layout this encoder built before (None: anything else, or a first time).

        A cheap env's step output is such a tensordict, every step: its layout is
        found by its entries' names, dtypes and shapes alone, without
        :func:`flatten`'s walk and signature (230 of a worker's ~3,860 Python
        opcodes a STEP). The layout is the one :meth:`encode` built for the same
        entries (it is noted here by :meth:`_note_flat`), so the frames are the same.
        """
        entries = []
        tensors = []
        for name, value in td.items():
            if type(value) is not torch.Tensor or value.layout is not _STRIDED:
                return None  # a branch, a non-tensor, a subclass, a sparse tensor...
            entries.append((name, value.dtype, value.shape))
            tensors.append(value)
        known = self._flat_ids.get((td.batch_size, tuple(entries)))
        if known is None:
            return None
        layout_id, layout = known
        if dtypes is not None:
            casts = layout.notes.get(dtypes.key)
            if casts is None or casts:  # not worked out yet, or leaves off their specs' dtypes
                return None
        frames = _pack(layout, tensors, self.copy_own_frames)
        announced = None if layout_id in self._announced else self._announce(layout_id, layout)
        return EncodedPart(layout_id, announced, frames, None, layout)

    def _note_flat(self, td: TensorDictBase, flat: _Flat, known: tuple[int, Layout]) -> None:
        """Let :meth:`_encode_flat` find ``known`` for tensordicts like ``td`` (a plain
        TensorDict of top-level dense tensors only)."""
        if type(td) is not TensorDict or flat.nontensor_keys or flat.branches:
            return
        if any(len(key) > 1 for key, _ in flat.tensors):  # a nested tensordict's leaves
            return
        entries = tuple((key[0], t.dtype, t.shape) for key, t in flat.tensors)
        self._flat_ids[(td.batch_size, entries)] = known

    def _encode_part(self, part: DecodedPart) -> EncodedPart:
        layout = part.layout
        known = self._by_layout.get(id(layout))
        if known is None or known[1] is not layout:
            # Keyed by the layout itself: its frames are laid out already, maybe
            # by another threshold than ours, so a tensordict's id will not do.
            known = self._ids.setdefault(layout, (len(self._ids), layout))
            self._by_layout[id(layout)] = (known[0], layout)
        layout_id = known[0]
        nontensor = list(part.nontensor) if part.nontensor else None
        announced = None if layout_id in self._announced else self._announce(layout_id, layout)
        return EncodedPart(layout_id, announced, part.buffers, nontensor, layout)

    def retract(self, parts: Sequence[EncodedPart]) -> None:
        """``parts`` were not sent after all: the layouts they announced are announced again."""
        for part in parts:
            if part.new_layout is not None:
                self._announced.discard(part.layout_id)

    def _announce(self, layout_id: int, layout: Layout) -> dict[str, Any] | None:
        """The layout in full the first time its id is used on this connection, else None."""
        if layout_id in self._announced:
            return None
        self._announced.add(layout_id)
        return layout.to_data()

    def _layout_for(self, signature, flat: _Flat, batch_size) -> tuple[int, Layout]:
        known = self._ids.get(signature)
        if known is not None:
            return known
        specs = [
            (key, t.dtype, tuple(t.shape), t.numel() * t.element_size() >= self.zero_copy_threshold)
            for key, t in flat.tensors
        ]
        layout = build_layout(
            tuple(batch_size),
            specs,
            tuple(flat.nontensor_keys),
            flat.branches,
            flat.stacked,
            flat.lazy,
            *_named(flat.classes),
        )
        known = (len(self._ids), layout)
        self._ids[signature] = known
        return known


class DeclaredDtypes(Protocol):
    """The dtypes an env's specs declare for its output leaves (:mod:`zmqpool.conformity`)."""

    #: the same for every env of the same declared dtypes: where a layout notes its casts
    key: str

    def casts(self, layout: Layout) -> tuple[tuple[Key, torch.dtype], ...]:
        """The leaves of ``layout`` of another dtype than declared, with the declared one."""
        ...


def _cast(td: TensorDictBase, casts: Sequence[tuple[Key, torch.dtype]]) -> TensorDictBase:
    """``td`` with the leaves named cast; the env's own tensordict is left as it is."""
    td = td.clone(recurse=False)
    for key, dtype in casts:
        td.set(key, td.get(key).to(dtype))
    return td


class _Flat:
    """A tensordict's leaves in key order, and what its tree needs beyond their keys.

    A plain class: one is made for every tensordict encoded (each reply a
    worker sends, each batch the pool packs), and a dataclass's seven
    ``default_factory`` calls cost three times these literals.
    """

    __slots__ = ("branches", "classes", "lazy", "nontensor", "nontensor_keys", "stacked", "tensors")

    def __init__(self) -> None:
        self.tensors: list[tuple[Key, torch.Tensor]] = []
        self.nontensor_keys: list[Key] = []
        self.nontensor: list[Any] = []
        self.stacked: list[bool] = []
        self.branches: list[Branch] = []
        self.lazy: list[LazyNode] = []
        self.classes: list[tuple[Key, type]] = []


def flatten(td: TensorDictBase) -> _Flat:
    flat = _Flat()
    if type(td) is TensorDict:  # the usual part, told without an ABC's isinstance (Python code)
        _walk(td, (), tuple(td.batch_size), flat)
        return flat
    if not isinstance(td, TensorDictBase):  # a tensorclass part
        td = _unwrap(td, (), flat)
    if isinstance(td, LazyStackedTensorDict) and not isinstance(td, NonTensorStack):
        _walk_lazy(td, (), flat)
    else:
        _walk(td, (), tuple(td.batch_size), flat)
    return flat


def _walk(td: TensorDictBase, prefix: Key, batch: tuple[int, ...], flat: _Flat) -> None:
    for name, value in td.items():
        key = (*prefix, name)
        if isinstance(value, torch.Tensor):
            if value.layout is not torch.strided:  # its bytes are not its values
                raise ProtocolError(
                    f"{'/'.join(key)} is a {value.layout} tensor, which cannot cross the "
                    "wire: only dense (strided) tensors do; send .to_dense()"
                )
            flat.tensors.append((key, value))
        elif isinstance(value, (NonTensorData, NonTensorStack)):
            flat.nontensor_keys.append(key)
            flat.nontensor.append(value)
            flat.stacked.append(isinstance(value, NonTensorStack))
        elif isinstance(value, LazyStackedTensorDict):  # not a NonTensorStack: handled above
            flat.branches.append((key, tuple(value.batch_size)))
            _walk_lazy(value, key, flat)
        elif isinstance(value, TensorDictBase):  # a nested tensordict
            sub = tuple(value.batch_size)
            if sub != batch or not value.keys():
                flat.branches.append((key, sub))
            _walk(value, key, sub, flat)
        else:  # a tensorclass: always a branch, so that the layout can name it
            inner = _unwrap(value, key, flat)
            flat.branches.append((key, tuple(inner.batch_size)))
            if _is_lazy(inner):
                _walk_lazy(inner, key, flat)
            else:
                _walk(inner, key, tuple(inner.batch_size), flat)


def _unwrap(value: Any, key: Key, flat: _Flat) -> TensorDictBase:
    """The tensordict a tensorclass at ``key`` wraps, its class noted in ``flat``.

    A field a tensorclass holds outside its tensordict (tensordict keeps only
    ``None`` there for a user's class) travels as a non-tensor under ``key``.
    """
    cls = type(value)
    if not is_tensorclass(cls) or is_non_tensor_class(cls):
        raise ProtocolError(
            f"entry {'/'.join(key) or '(the root)'} is a {cls.__name__}, which cannot cross "
            "the wire"
        )
    flat.classes.append((key, cls))
    inner = value._tensordict
    for name, data in value._non_tensordict.items():
        if data is not None:
            flat.nontensor_keys.append((*key, name))
            flat.nontensor.append(NonTensorData(data=data, batch_size=inner.batch_size))
            flat.stacked.append(False)
    return inner


def _is_lazy(value: Any) -> bool:
    # A NonTensorStack is a LazyStackedTensorDict too, but it travels as plain data.
    return isinstance(value, LazyStackedTensorDict) and not isinstance(value, NonTensorStack)


def _walk_lazy(lazy: LazyStackedTensorDict, key: Key, flat: _Flat) -> None:
    """A lazy stack's members, each a branch at ``(*key, "#i")``, never densified."""
    members = lazy.tensordicts
    if not members:
        raise ProtocolError(f"lazy stack {'/'.join(key) or '(the root)'} has no members")
    flat.lazy.append((key, lazy.stack_dim, len(members)))
    for i, member in enumerate(members):
        member_key = (*key, member_name(i))
        if not isinstance(member, (TensorDictBase, NonTensorData)) and is_tensorclass(member):
            member = _unwrap(member, member_key, flat)
        if not isinstance(member, TensorDictBase) or isinstance(
            member, (NonTensorData, NonTensorStack)
        ):
            raise ProtocolError(
                f"member {i} of lazy stack {'/'.join(key) or '(the root)'} is a "
                f"{type(member).__name__}, not a tensordict; it cannot cross the wire"
            )
        sub = tuple(member.batch_size)
        flat.branches.append((member_key, sub))
        if _is_lazy(member):
            _walk_lazy(member, member_key, flat)
        else:
            _walk(member, member_key, sub, flat)


def leaf_state(td: TensorDictBase, skip: str = "next") -> tuple:
    """What changes when code edits ``td`` in place: each leaf's key, identity and version.

    Leaves under the top-level key ``skip`` are left out. A worker compares
    this before and after an env's step to tell whether the env wrote into
    its input (then the input travels back: the pool's copy would be stale).
    """
    flat = flatten(td)
    tensors = tuple((key, id(t), t._version) for key, t in flat.tensors if key[0] != skip)
    others = tuple(
        (key, id(v))
        for key, v in zip(flat.nontensor_keys, flat.nontensor, strict=True)
        if key[0] != skip
    )
    return tensors, others


def check_crossable(td: TensorDictBase) -> None:
    """Refuse, naming the entry, a tensordict that the encoder could not put on the wire.

    Its tensors must have a wire dtype and its non-tensors be plain
    (msgpack-able) data; raises :class:`~zmqpool.errors.ProtocolError` (a
    ``ValueError``) otherwise.
    """
    flat = flatten(td)
    for key, tensor in flat.tensors:
        if tensor.dtype not in DTYPE_NAMES:
            raise ProtocolError(
                f"entry {'/'.join(key)} has dtype {tensor.dtype}, which cannot cross the wire"
            )
    packed = 0
    for key, value in zip(flat.nontensor_keys, flat.nontensor, strict=True):
        packed += plain_and_size(value, key)[1]
    if packed > MAX_NONTENSOR_BYTES:
        raise ProtocolError(
            f"the non-tensor values of one env's input pack to {packed} bytes; a message "
            f"carries at most {MAX_NONTENSOR_BYTES} in its header: they cannot cross the wire"
        )
    for key, cls in flat.classes:
        _class_name_at(key, cls)


def _plain(value: Any, path: Key) -> Any:
    """``value``'s data, if msgpack carries it there and back; else a :class:`ProtocolError`."""
    return plain_and_size(value, path)[0]


def plain_and_size(value: Any, path: Key) -> tuple[Any, int]:
    """:func:`_plain`, and the size it packs to.

    Packing is not enough: ``{(1, 2): 0}`` packs, but its key comes back as a
    list, which cannot key a dict, and the peer would drop the whole message.
    """
    data = value.tolist() if isinstance(value, NonTensorStack) else getattr(value, "data", value)
    return plain_data_and_size(data, path)


def plain_data_and_size(data: Any, path: Key) -> tuple[Any, int]:
    """:func:`plain_and_size` of data itself (a non-tensor's value, a reset keyword's)."""
    try:
        return data, _packed_size(data)
    except (TypeError, ValueError, OverflowError):
        pass
    # numpy scalars (an np.int32 a gymnasium info dict holds, say) cross as the
    # Python numbers they hold, as a tuple crosses as a list: converted only
    # once plain packing failed, so plain values pay nothing for it.
    python = _numpy_scalars_as_python(data, 0)
    try:
        return python, _packed_size(python)
    except (TypeError, ValueError, OverflowError):
        raise ProtocolError(
            f"non-tensor value at {'/'.join(path)} of type {type(data).__name__} "
            "is not plain data (msgpack carries it there and back); it cannot cross the wire"
        ) from None


def _packed_size(data: Any) -> int:
    """What ``data`` packs to; raises unless msgpack carries it there and back."""
    packed = msgpack.packb(data, use_bin_type=True)
    msgpack.unpackb(packed, raw=False, strict_map_key=False)
    return len(packed)


def _numpy_scalars_as_python(data: Any, depth: int) -> Any:
    """``data`` with every numpy scalar in it as the Python value it holds.

    Lists, tuples and dicts are walked, :data:`_MAX_PLAIN_DEPTH` levels at most
    (a bound on the recursion, for data a caller made); anything else, and
    anything deeper, is left as it is, for packing to accept or refuse.
    """
    if isinstance(data, np.generic):
        return data.item()
    if depth >= _MAX_PLAIN_DEPTH:
        return data
    if isinstance(data, list | tuple):
        return [_numpy_scalars_as_python(item, depth + 1) for item in data]
    if isinstance(data, dict):
        return {  # a key stays hashable: a tuple key is left for packing to refuse
            k.item() if isinstance(k, np.generic) else k: _numpy_scalars_as_python(v, depth + 1)
            for k, v in data.items()
        }
    return data


#: How deep :func:`_numpy_scalars_as_python` looks: deeper than any plain data
#: an env exchanges, well inside Python's recursion limit.
_MAX_PLAIN_DEPTH = 256


def _pack(layout: Layout, tensors: list[torch.Tensor], copy_own: bool) -> list[Any]:
    # Through numpy: a tensor's array is one call, where torch dispatches a
    # handful of ops per leaf (~50 us for five small leaves, ~10 us this way).
    arrays = [as_array(t) for t in tensors]
    packed, own = _packing(layout)
    frames: list[Any] = []
    if packed:  # the packed frame: the small leaves' bytes, each at its aligned offset
        pieces = []
        for index, padding in packed:
            if padding:
                pieces.append(padding)
            pieces.append(arrays[index].tobytes())  # C order, whatever the strides
        frames.append(b"".join(pieces))
    for index in own:  # sent as it is (copy_own: a copy, made now); a 0-d leaf as 1-d
        if copy_own:  # one copy, C order, whatever the strides
            frames.append(np.array(arrays[index], order="C", copy=True, ndmin=1))
        else:
            frames.append(np.ascontiguousarray(arrays[index]))
    return frames


def _packing(layout: Layout) -> tuple[list[tuple[int, bytes]], list[int]]:
    """How :func:`_pack` lays out ``layout``: its packed leaves (index, and the zeros before
    each), then its own-frame leaves; worked out once per layout (by identity: hashing a
    layout walks all of it), for every tensordict encoded."""
    known = _PACKINGS.get(id(layout))
    if known is not None and known[0] is layout:
        return known[1], known[2]
    packed, own, end = [], [], 0
    for index, leaf in enumerate(layout.leaves):
        if leaf.own_frame:
            own.append(index)
            continue
        packed.append((index, _PADDING[: leaf.offset - end] if leaf.offset > end else b""))
        end = leaf.offset + leaf.nbytes
    if len(_PACKINGS) >= _MAX_PACKINGS:  # layouts are few; a peer's many cost the cache only
        _PACKINGS.clear()
    _PACKINGS[id(layout)] = (layout, packed, own)  # the layout held: its id stays its own
    return packed, own


_PACKINGS: dict[int, tuple[Layout, list[tuple[int, bytes]], list[int]]] = {}
_MAX_PACKINGS = 1024
_PADDING = bytes(ALIGN)


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as a numpy array, sharing its memory where torch allows."""
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):
        # It needs grad, has a lazy conj/neg bit, is not on the CPU, or numpy
        # lacks its dtype: its bytes, through torch.
        return _as_bytes_view(tensor).numpy()


def _all_own(layout: Layout) -> bool:
    return all(leaf.own_frame for leaf in layout.leaves)


def _as_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when already contiguous)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    # resolve_*: a lazily conjugated or negated view must travel as its values.
    flat = tensor.resolve_conj().resolve_neg().reshape(-1)
    if flat.stride(0) != 1:  # one or no element: reshape keeps a stride view() refuses
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    return flat.view(torch.uint8)


def layout_of(td: TensorDictBase) -> Layout:
    """The layout of ``td`` with every leaf packed: what :func:`max_message_bytes` sizes.

    Example:
        >>> from tensordict import TensorDict
        >>> layout_of(TensorDict({"obs": torch.zeros(84, 84, 3)}, [])).packed_nbytes
        84672
    """
    flat = flatten(td)
    specs = [(key, t.dtype, tuple(t.shape), False) for key, t in flat.tensors]
    return build_layout(
        tuple(td.batch_size),
        specs,
        tuple(flat.nontensor_keys),
        flat.branches,
        flat.stacked,
        flat.lazy,
        *_named(flat.classes),
    )


def _named(classes: Sequence[tuple[Key, type]]) -> tuple[list[ClassNode], list[type | None]]:
    """A tensordict's tensorclasses as a layout's nodes (key, wire name) and their classes."""
    nodes = [(key, _class_name_at(key, cls)) for key, cls in classes]
    return nodes, [cls for _, cls in classes]


def _class_name_at(key: Key, cls: type) -> str:
    try:
        return tensorclass_name(cls)
    except ProtocolError as err:
        raise ProtocolError(f"entry {'/'.join(key) or '(the root)'}: {err}") from None


# ---------------------------------------------------------------- decoding


#: A part's frame as it holds it: a view on a received frame or a batch, or bytes of its own.
Buffer = memoryview | bytes

#: The non-tensor values of a part that has none: one shared tuple. A list of its own
#: would be one more object for the cyclic collector per part, kept with each request in
#: flight: promoted with it, it brings the trainer's full collections sooner.
NO_VALUES: tuple[Any, ...] = ()


@dataclasses.dataclass(slots=True)
class DecodedPart:
    """A tensordict still in frames: its layout, its frames (sizes checked), its non-tensors.

    Cheap to stack with others of its layout (:func:`zmqpool.batching.stack_parts` reads the
    frames directly); ``tensors``, views on the frames, are made on first use.
    """

    layout: Layout
    buffers: Sequence[Buffer]
    nontensor: Sequence[Any]
    _tensors: list[torch.Tensor] | None = dataclasses.field(default=None, repr=False)

    @property
    def tensors(self) -> list[torch.Tensor]:
        if self._tensors is None:
            self._tensors = _unpack(self.layout, self.buffers)
        return self._tensors

    def to_tensordict(self) -> TensorDictBase:
        """A TensorDict (a LazyStackedTensorDict if the part is one lazy stack, an instance
        of its tensorclass if it is one, and loaded)."""
        return tensordict_from_leaves(self.layout, self.tensors, self.nontensor)


class Decoder:
    """Turns frames back into tensors, checking them against the known layouts.

    One decoder per connection; its layouts are those the peer announced. A
    layout with a frame larger than ``max_frame_bytes`` is refused when it is
    announced (give it the socket's ``MAXMSGSIZE``: nothing larger can arrive),
    and so is one with more than :data:`~zmqpool.limits.MAX_NONTENSOR_ITEMS`
    non-tensor values, and one that would take the layouts held past
    ``max_layout_bytes`` (:data:`~zmqpool.limits.MAX_PEER_LAYOUT_BYTES`, each
    layout's :func:`~zmqpool.layout.layout_footprint` counted once): what one
    peer can make this process keep is that much.

    ``own_small_frames`` (the trainer's): a part keeps a frame smaller than
    :data:`ZERO_COPY_THRESHOLD` as bytes of its own, in a tuple, instead of a
    view on the received frame. A reply waiting for a recv then holds no zmq
    frame, view or list the cyclic collector tracks (see :data:`NO_VALUES`);
    larger frames stay views, not copied.
    """

    def __init__(
        self,
        max_layouts: int = 256,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        own_small_frames: bool = False,
        max_layout_bytes: int = MAX_PEER_LAYOUT_BYTES,
    ) -> None:
        self.max_layouts = max_layouts
        self.max_frame_bytes = max_frame_bytes
        self.max_layout_bytes = max_layout_bytes
        self.own_below = ZERO_COPY_THRESHOLD if own_small_frames else 0
        self._layouts: dict[int, Layout] = {}
        # Each held layout's estimated footprint, by id, and their sum.
        self._footprints: dict[int, int] = {}
        self.layout_bytes = 0
        # A header's layout ids -> what decoding its message needs of them, worked out
        # once: nearly every message repeats the ids of the one before. Cleared
        # whenever a layout is announced (an id may be announced again, as another).
        self._plans: dict[tuple[int, ...], _Plan] = {}

    def learn(self, body: Mapping[str, Any] | None) -> None:
        """Take in the layouts a message announces (before decoding its parts)."""
        announced = (body or {}).get("L")
        if announced is None:
            return
        if not isinstance(announced, dict):
            raise ProtocolError("announced layouts must be a map id -> layout")
        self._plans.clear()
        for layout_id, data in announced.items():
            if not is_int(layout_id) or not 0 <= layout_id < MAX_LAYOUT_ID:
                raise ProtocolError(f"bad layout id {described(layout_id)}")
            if layout_id not in self._layouts and len(self._layouts) >= self.max_layouts:
                raise ProtocolError(f"peer announced more than {self.max_layouts} layouts")
            layout = self._checked(Layout.from_data(data))
            self._hold(layout_id, layout_footprint(layout))
            self._layouts[layout_id] = _intern(layout)

    def _hold(self, layout_id: int, footprint: int) -> None:
        """Count a layout about to be held as ``layout_id`` (replacing any held so);
        refuse it if the layouts held would then take more than ``max_layout_bytes``."""
        held = self.layout_bytes - self._footprints.get(layout_id, 0) + footprint
        if held > self.max_layout_bytes:
            raise ProtocolError(
                f"layout {layout_id} would take the layouts this peer announced to ~{held} "
                f"bytes in memory; at most {self.max_layout_bytes} are kept"
            )
        self._footprints[layout_id] = footprint
        self.layout_bytes = held

    def _checked(self, layout: Layout) -> Layout:
        largest = max(layout.frame_sizes, default=0)
        if largest > self.max_frame_bytes:
            raise ProtocolError(
                f"layout has a frame of {largest} bytes; this connection takes at most "
                f"{self.max_frame_bytes}"
            )
        items = len(layout.nontensor_keys) + sum(
            math.prod(batch)
            for batch, stacked in zip(layout.nontensor_batches, layout.stacked, strict=False)
            if stacked
        )
        if items > MAX_NONTENSOR_ITEMS:
            raise ProtocolError(
                f"layout has {items} non-tensor values; at most {MAX_NONTENSOR_ITEMS} are taken"
            )
        return layout

    def decode(self, header: Header, frames: Sequence[Any]) -> list[DecodedPart]:
        """Split ``frames`` (all frames after the header) into the header's parts."""
        body = header.body
        if body is not None:  # most messages have none: nothing announced, no non-tensors
            self.learn(body)
        plan = self._plan(header.layouts)
        layouts, sizes = plan.layouts, plan.sizes
        if len(frames) != len(sizes):
            expected = len(sizes)
            raise ProtocolError(f"message has {len(frames)} tensor frames, layouts say {expected}")
        nontensor: Sequence[Sequence[Any]]
        if body is None and plan.tensors_only:  # the rest would check what cannot be wrong
            nontensor = [NO_VALUES] * len(layouts)
        else:
            nontensor = _nontensor_lists(body, layouts)
        return _by_part(layouts, _checked_buffers(sizes, frames, self.own_below), nontensor)

    def decode_rows(
        self, header: Header, frames: Sequence[Any], rows: int
    ) -> list[list[DecodedPart]]:
        """A RESULTS message's parts, row by row: views on its joined frames.

        Each frame must be exactly ``rows`` times its layout's size, and its
        layouts known and free of non-tensors (a RESULTS announces nothing and
        carries tensors only): checked before any view is made.
        """
        plan = self._plan(header.layouts)
        if not plan.tensors_only:
            raise ProtocolError("rows joined carry tensors only")
        layouts, sizes = plan.layouts, plan.sizes
        if len(frames) != len(sizes):
            raise ProtocolError(f"message has {len(frames)} frames, layouts say {len(sizes)}")
        joined = [_bytes_view(frame) for frame in frames]
        for buffer, size in zip(joined, sizes, strict=True):
            if buffer.nbytes != rows * size:
                raise ProtocolError(
                    f"joined frame of {buffer.nbytes} bytes where {rows} rows take {rows * size}"
                )
        # Rows under own_below bytes are copied once, then sliced: bytes of their own.
        own = [b.tobytes() if n < self.own_below else b for b, n in zip(joined, sizes, strict=True)]
        if len(own) == 1 and len(layouts) == 1 and sizes[0]:  # one part, one frame: most
            layout, frame, size = layouts[0], own[0], sizes[0]
            starts = range(0, rows * size, size)
            return [[DecodedPart(layout, (frame[at : at + size],), NO_VALUES)] for at in starts]
        out = []
        none = [NO_VALUES] * len(layouts)
        for r in range(rows):
            buffers = tuple([b[r * n : (r + 1) * n] for b, n in zip(own, sizes, strict=True)])
            out.append(_by_part(layouts, buffers, none))
        return out

    def _plan(self, layout_ids: tuple[int, ...]) -> _Plan:
        plan = self._plans.get(layout_ids)
        if plan is None:
            layouts = [self._layout(i) for i in layout_ids]  # raises for an unknown id
            plan = _Plan(
                layouts,
                [size for layout in layouts for size in layout.frame_sizes],
                not any(layout.nontensor_keys for layout in layouts),
            )
            if len(self._plans) >= self.max_layouts:  # ids are few; a peer cycling them is not
                self._plans.clear()
            self._plans[layout_ids] = plan
        return plan

    def _layout(self, layout_id: int) -> Layout:
        layout = self._layouts.get(layout_id)
        if layout is None:
            raise ProtocolError(f"unknown layout id {layout_id}")
        return layout


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """What decoding a message of some layout ids needs: its layouts, each frame's size,
    and whether none of them has non-tensor values. Read only: shared by every message."""

    layouts: list[Layout]
    sizes: list[int]
    tensors_only: bool


#: Equal layouts learned on different connections, as one object: parts from
#: any worker then share a layout by identity (:func:`~zmqpool.batching.stack_parts`'
#: condition). Weakly, by hash: the table keeps no layout alive, so what a peer
#: made this process keep is what its decoder holds (``max_layout_bytes``), and a
#: layout replaced or let go goes from here too. Only an optimisation: two unequal
#: layouts of one hash share nothing (the second is not interned).
_INTERNED: dict[int, weakref.ref[Layout]] = {}


def _intern(layout: Layout) -> Layout:
    key = hash(layout)
    ref = _INTERNED.get(key)
    known = None if ref is None else ref()
    if known is None:
        _INTERNED[key] = weakref.ref(layout, functools.partial(_forget, key))
        return layout
    return known if known == layout else layout


def _forget(key: int, dead: weakref.ref[Layout]) -> None:
    """A layout interned under ``key`` is gone: its entry goes, unless another took it."""
    if _INTERNED.get(key) is dead:
        _INTERNED.pop(key, None)


def _nontensor_lists(body: Mapping[str, Any] | None, layouts: list[Layout]) -> list[list[Any]]:
    lists = None if body is None else body.get("nt")
    if lists is None:
        lists = [[] for _ in layouts]
    if not isinstance(lists, list) or len(lists) != len(layouts):
        raise ProtocolError("non-tensor values must be one list per part")
    for values, layout in zip(lists, layouts, strict=True):
        if not isinstance(values, list) or len(values) != len(layout.nontensor_keys):
            raise ProtocolError("non-tensor values do not match the layout's keys")
        if any(layout.stacked):
            _check_stacks(layout, values)
    return lists


def _check_stacks(layout: Layout, values: list[Any]) -> None:
    stacks = zip(
        layout.nontensor_keys, layout.nontensor_batches, layout.stacked, values, strict=True
    )
    for key, batch, stacked, value in stacks:
        if stacked and not _has_shape(value, batch):
            raise ProtocolError(
                f"non-tensor stack {'/'.join(key)} must be nested lists of shape {list(batch)}"
            )


def _has_shape(value: Any, shape: tuple[int, ...]) -> bool:
    if not shape:
        return True
    if not isinstance(value, list) or len(value) != shape[0]:
        return False
    return all(_has_shape(item, shape[1:]) for item in value)


def frame_buffer(frame: Any) -> memoryview:
    """A received frame's bytes without a copy (a ``zmq.Frame``'s buffer, or bytes as a view).

    Raises :class:`ProtocolError` if it is not bytes-like.
    """
    buffer = getattr(frame, "buffer", frame)
    try:
        return buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    except TypeError:
        raise ProtocolError(f"a frame must be bytes, not {type(frame).__name__}") from None


def _bytes_view(frame: Any) -> memoryview:
    buffer = frame_buffer(frame)
    return buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")


def _checked_buffers(sizes: list[int], frames: Sequence[Any], own_below: int) -> Sequence[Buffer]:
    """Each frame as a view, size checked; those under ``own_below`` bytes copied (a tuple)."""
    buffers: list[Buffer] = []
    for frame, size in zip(frames, sizes, strict=True):
        buffer = frame_buffer(frame)
        if buffer.nbytes != size:
            raise ProtocolError(f"frame of {buffer.nbytes} bytes where the layout says {size}")
        buffers.append(buffer.tobytes() if size < own_below else buffer)
    return tuple(buffers) if own_below else buffers


def _by_part(
    layouts: list[Layout], buffers: Sequence[Buffer], nontensor: Sequence[Sequence[Any]]
) -> list[DecodedPart]:
    """The parts of a message: each layout takes its frames' buffers, in order."""
    if len(layouts) == 1:  # most messages (a step's): every buffer is the one part's
        return [DecodedPart(layouts[0], buffers, nontensor[0])]
    parts, start = [], 0
    for layout, values in zip(layouts, nontensor, strict=True):
        end = start + layout.num_frames
        parts.append(DecodedPart(layout, buffers[start:end], values))
        start = end
    return parts


def _unpack(layout: Layout, buffers: Sequence[Buffer]) -> list[torch.Tensor]:
    """Views on (size-checked) buffers, one per leaf.

    A read-only packed frame (zmq's, or bytes) is copied once, so that its small
    leaves are cheap numpy views; a large leaf's own frame is viewed as it is, no copy.
    """
    views = _views(buffers)
    if views and views[0].readonly and not _all_own(layout):
        views = [memoryview(bytearray(views[0])), *views[1:]]
    if not any(view.readonly for view in views):
        return [_numpy_view(views[leaf.frame], leaf) for leaf in layout.leaves]
    flat = [_as_uint8(view) for view in views]
    return [_torch_view(flat[leaf.frame], leaf) for leaf in layout.leaves]


def _views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """``buffers`` as memoryviews (the trainer's small frames are bytes)."""
    return [b if type(b) is memoryview else memoryview(b) for b in buffers]


def _torch_view(flat: torch.Tensor, leaf: Leaf) -> torch.Tensor:
    return flat[leaf.offset : leaf.offset + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)


def _numpy_view(buffer: memoryview, leaf: Leaf) -> torch.Tensor:
    """A leaf of a writable buffer: one numpy view and ``from_numpy``, a third of torch's ops."""
    dtype = NUMPY_DTYPES[leaf.dtype]
    if dtype is None or not leaf.nbytes:
        return _torch_view(_as_uint8(buffer), leaf)
    array = np.frombuffer(buffer, dtype, leaf.nbytes // dtype.itemsize, leaf.offset)
    return torch.from_numpy(array.reshape(leaf.shape))


def _as_uint8(buffer: memoryview) -> torch.Tensor:
    if buffer.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if not buffer.readonly:  # catch_warnings costs more than the view
        return torch.frombuffer(buffer, dtype=torch.uint8)
    with warnings.catch_warnings():
        # zmq frames are read-only; tensors made from them are never written
        # (the pool copies them into its batch), so torch's warning is noise.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def tensordict_from_leaves(
    layout: Layout,
    tensors: Sequence[torch.Tensor],
    nontensor: Sequence[Any],
    lead: tuple[int, ...] = (),
) -> TensorDictBase:
    """A TensorDict with ``layout``'s keys; ``lead``: extra leading dims (a stack of parts).

    ``nontensor`` holds one value per non-tensor key, already shaped (a
    ``NonTensorData``/``NonTensorStack``) when ``lead`` is given. A layout
    whose part is a lazy stack gives a ``LazyStackedTensorDict``, one whose
    part is a (loaded) tensorclass an instance of it.
    """
    if layout.lazy or layout.classes:
        return _bottom_up(layout, tensors, nontensor, lead)
    nested: dict[str, Any] = {}
    for leaf, tensor in zip(layout.leaves, tensors, strict=True):
        _insert(nested, leaf.key, tensor)
    # The layout is a checked tree whose leaves start with their batch sizes:
    # TensorDict's per-leaf checks would find nothing, and cost ~1 us a leaf
    # (its constructor takes 7 us for a branch of five leaves, _new_unsafe 1).
    for key, batch in layout.branches:  # deepest first: children exist before parents
        branch = _pop_branch(nested, key)
        _insert(nested, key, TensorDict._new_unsafe(branch, batch_size=torch.Size(lead + batch)))
    td = TensorDict._new_unsafe(nested, batch_size=torch.Size(lead + layout.batch_size))
    for i, (key, value) in enumerate(zip(layout.nontensor_keys, nontensor, strict=True)):
        if lead:
            td.set(key, value)
        elif layout.stacked[i]:
            td.set(key, nontensor_stack(value, len(layout.nontensor_batches[i])))
        else:
            td.set_non_tensor(key, value)
    return td


def _bottom_up(
    layout: Layout,
    tensors: Sequence[torch.Tensor],
    nontensor: Sequence[Any],
    lead: tuple[int, ...],
) -> Any:
    """:func:`tensordict_from_leaves` for a layout with lazy stacks or tensorclasses.

    Built bottom up: non-tensors go in with the leaves (set afterwards, a
    member's key path would not resolve through its stack, nor a field's
    through its tensorclass), and every branch is a validated TensorDict, or a
    lazy stack of its members (built before it: deepest first), wrapped in its
    tensorclass if it has one that is loaded.
    """
    nested: dict[str, Any] = {}
    for leaf, tensor in zip(layout.leaves, tensors, strict=True):
        _insert(nested, leaf.key, tensor)
    for i, (key, value) in enumerate(zip(layout.nontensor_keys, nontensor, strict=True)):
        _insert(nested, key, value if lead else _nontensor_value(layout, i, value))
    nodes = {key: (dim, count) for key, dim, count in layout.lazy}
    classes = {
        key: cls
        for (key, _), cls in zip(layout.classes, layout.class_types, strict=True)
        if cls is not None
    }
    for key, batch in layout.branches:
        parent = nested
        for part in key[:-1]:
            parent = parent.setdefault(part, {})
        # In place: the branch keeps its position among its siblings.
        children = parent.get(key[-1], {})
        branch = _subtree(children, nodes.get(key), lead + batch, len(lead))
        parent[key[-1]] = _as_class(classes[key], branch, key) if key in classes else branch
    root = _subtree(nested, nodes.get(()), lead + layout.batch_size, len(lead))
    return _as_class(classes[()], root, ()) if () in classes else root


def _as_class(cls: Any, td: TensorDictBase, key: Key) -> Any:
    """``td`` as an instance of tensorclass ``cls`` (checked: its keys are fields of it)."""
    try:
        return cls._from_tensordict(td)
    except Exception as err:  # its __post_init__, if it has one, may refuse what it finds
        raise ProtocolError(
            f"tensorclass {tensorclass_name(cls)} at {'/'.join(key) or 'the part'} refused "
            f"what was sent: {type(err).__name__}: {clipped(str(err), 300)}"
        ) from err


def _nontensor_value(layout: Layout, index: int, value: Any) -> TensorDictBase:
    batch = layout.nontensor_batches[index]
    if layout.stacked[index]:
        return nontensor_stack(value, len(batch))
    return NonTensorData(data=value, batch_size=batch)


def _subtree(
    children: dict[str, Any], node: tuple[int, int] | None, batch: tuple[int, ...], shift: int
) -> TensorDictBase:
    if node is None:
        return TensorDict(children, batch_size=batch)
    dim, count = node  # the layout was checked: exactly members #0..#count-1, of one batch size
    members = [children[member_name(i)] for i in range(count)]
    return LazyStackedTensorDict(*members, stack_dim=shift + dim)


def _insert(nested: dict[str, Any], key: Key, value: Any) -> None:
    # The layout was checked to be a tree (zmqpool.layout): no key collides.
    for part in key[:-1]:
        nested = nested.setdefault(part, {})
    nested[key[-1]] = value


def _pop_branch(nested: dict[str, Any], key: Key) -> dict[str, Any]:
    for part in key[:-1]:
        nested = nested.setdefault(part, {})
    return nested.pop(key[-1], {})


def nontensor_stack(value: Any, depth: int) -> NonTensorStack:
    """Nested lists, ``depth`` levels deep, as a NonTensorStack (items may be lists too)."""
    if depth == 1:
        return NonTensorStack(*value)
    return NonTensorStack(*(nontensor_stack(item, depth - 1) for item in value))


_STRIDED = torch.strided
