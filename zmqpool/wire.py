"""The wire: how commands, results and tensordicts become ZeroMQ frames.

This module is the contract between the trainer and its workers. It knows
nothing of sockets; both sides import it. Nothing here ever unpickles.

A message is a list of frames::

    frame 0      header: msgpack array
                 [version, command, env, seq, token, layouts, body]
    frame 1..    the tensor frames of each tensordict part, part after part

- ``version`` (int): :data:`PROTOCOL_VERSION`; a peer with another version is
  refused with :class:`~zmqpool.errors.VersionMismatchError`.
- ``command`` (int): a :class:`Command`.
- ``env`` (int): the pool's env index the message is about (-1: the worker).
- ``seq`` (int): the per-env sequence number of the request this message is
  or answers; a reply whose seq is not the one awaited is dropped.
- ``token`` (bytes): the session token the pool gave the worker at
  registration; results must carry it (empty on commands).
- ``layouts`` (list of int): one layout id per tensordict part carried.
- ``body`` (map or nil): the rare fields: ``"L"`` new layouts ``{id: layout}``,
  ``"nt"`` non-tensor values per part, ``"err"``/``"tb"`` an error and its
  traceback, ``"reg"`` registration data, ``"seed"``.

A tensordict part is described by a :class:`Layout`, sent in full once (in
``body["L"]``, the first time its id is used on a connection) and referred to
by id afterwards, so per-step headers stay a few dozen bytes. A layout is a map:
``"b"`` the batch size, ``"t"`` the tensor leaves ``[key path, dtype, shape,
own_frame]``, ``"n"`` the non-tensor key paths, and, only when needed, ``"s"``
the nested tensordicts that have a batch size of their own or no keys
(``[key path, batch size]``) and ``"k"`` the indices of the non-tensor keys
that hold a ``NonTensorStack`` (their value is then a nested list, one item per
batch element) rather than one ``NonTensorData``, ``"z"`` the lazy stacks
and ``"c"`` the tensorclasses (both below). Leaves
smaller than :data:`ZERO_COPY_THRESHOLD` bytes are packed, 16-byte aligned, in
one frame (copying a few bytes is cheaper than a zero-copy frame's
bookkeeping); larger ones travel as their own frame, sent with ``copy=False``
and read with :func:`torch.frombuffer`, without a copy. The receiver
recomputes offsets itself and checks every frame's size against the layout
before touching it.

Lazy stacks. A ``LazyStackedTensorDict`` (heterogeneous envs' per-agent
entries: members with different keys or shapes) travels as its members, never
densified: ``"z"`` lists ``[key path, stack_dim, member count]`` per lazy
stack (key path ``[]``: the part itself is one), and member ``i`` of the stack
at ``P`` is the nested tensordict at the synthetic path ``(*P, "#i")``, its
leaves, non-tensors and branches below it as anywhere else. Such a layout
always lists, in ``"s"``, the stack itself (batch size ``B``, unless it is the
part) and every member (batch size ``B`` without dim ``stack_dim``). The
decoder builds the members bottom up and ``LazyStackedTensorDict``-stacks
them at ``stack_dim``, so a lazy stack comes back lazy, with its stack_dim
and each member's keys, shapes, dtypes, values and non-tensors, lazy stacks
inside lazy stacks and members without keys included (a stack of zero members
cannot be built by tensordict, and is refused on encode). A ``"z"`` entry is
refused unless: ``0 < count <= MAX_LEAVES``, ``0 <= stack_dim < len(B)`` and
``B[stack_dim] == count``; the counts add up to at most the number of
branches; every member ``#0``..``#count-1`` is listed in ``"s"`` with its batch
size; and nothing but those members lies directly under the stack (so no key of
the caller's can pose as a member). These are checked on the layout's few
entries, before any name or tensor is made. A layout without lazy stacks has
no ``"z"`` and encodes to exactly the bytes it did before ``"z"`` existed;
:data:`PROTOCOL_VERSION` was not bumped for it: a peer without ``"z"`` refuses
such a layout cleanly (a :class:`~zmqpool.errors.ProtocolError` answered as a
malformed message), and could not have encoded a heterogeneous lazy stack
anyway, while every other message reads as before.

Tensorclasses. A tensorclass (``@tensorclass``: a dataclass around a
tensordict, like torchrl's ``EnvWithTensorClass`` observation) travels as the
tensordict it wraps plus its class's *name*, never as code: ``"c"`` lists
``[key path, "module:qualname"]`` per tensorclass (key path ``[]``: the part
itself is one), each of which is also listed in ``"s"`` (its batch size), and
its fields are the keys under it as anywhere else (``str`` fields are
non-tensors; a field set to ``None`` is not sent and comes back ``None``). The
decoder looks a name up, never imports it: the module must already be in
``sys.modules`` (importing a module a peer names would run its code), the
qualname is followed through the ``__dict__`` of its module and classes only
(no ``getattr``, so no module ``__getattr__`` runs), and what it finds must be a
tensorclass type (:func:`tensordict.is_tensorclass`, not a non-tensor one)
whose fields include every key sent under it; it is then rebuilt with
``cls._from_tensordict``, bottom up, so tensorclasses inside tensorclasses,
inside lazy stacks (or wrapping one) and stacked into a batch by
:func:`stack_parts` come back as instances. A name that is malformed (not
``module:qualname`` of identifiers, over :data:`MAX_CLASS_NAME` characters) or
names something else (``os:system``, ``builtins:dict``) is refused with a
:class:`~zmqpool.errors.ProtocolError` when the layout is announced, before
anything is built; a class that is merely not loaded here (its module not
imported, no such attribute, defined inside a function) is not an error: its
values arrive as plain TensorDicts, with one
:class:`TensorclassNotLoadedWarning` per class naming the module to import. A
``"c"`` entry is refused unless its key is the part or one of the layout's
branches, and appears once. A layout without tensorclasses has no ``"c"`` and
encodes to the bytes it did before; as for ``"z"``, :data:`PROTOCOL_VERSION`
was not bumped: no older peer can misread a layout with ``"c"``, it refuses it
cleanly (a ``ProtocolError``, answered as a malformed message). Only tensorclass
values change: from a newer peer to an older one they used to arrive as plain
nested tensordicts, and are now refused (upgrade both sides).

Limits. A layout is refused when it breaks the tree a tensordict can be
(a key twice, a key both a leaf and a branch, a leaf whose shape does not start
with its tensordict's batch size), when a leaf exceeds :data:`MAX_LEAF_BYTES`
or a frame the decoder's ``max_frame_bytes``: so a layout claiming a 10 GB leaf
is refused when it is announced, before any frame is looked at, and allocates
nothing. What the decoder cannot stop is ZeroMQ receiving a huge frame: that is
the socket's ``MAXMSGSIZE`` (a per-frame limit, read when a socket binds or
connects), which :func:`max_message_bytes` derives from the layouts a peer
will use.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
import sys
import threading
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

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

from zmqpool.errors import ProtocolError, VersionMismatchError

#: Bumped whenever a peer of the previous version could misread a message.
#: 2: a spec's bounds may travel broadcast (:mod:`zmqpool.specs`' ``E``
#: tensors), which a version-1 pool would refuse as malformed specs.
PROTOCOL_VERSION = 2

#: Leaves of at least this many bytes travel as their own zero-copy frame.
#: Measured with ``scripts/bench.py --probe-threshold`` (CPU per message, sender
#: and receiver, a leaf packed against in its own frame; docs/PERFORMANCE.md):
#: below 64 KiB its own frame costs 1-12% more, from 64 KiB it saves 10%, at
#: 1 MiB 78%. 64 KiB is also pyzmq's ``COPY_THRESHOLD``: below it, pyzmq copies
#: a "zero-copy" frame anyway, so a frame of its own only adds a frame.
ZERO_COPY_THRESHOLD = 64 * 1024

#: Upper bounds that keep a hostile header from making us allocate or loop.
MAX_HEADER_BYTES = 1 << 20
#: The largest control message (a REGISTER, specs and all) a worker may send:
#: the pool's ROUTER refuses frames over :data:`MAX_HEADER_BYTES` (its
#: ``MAXMSGSIZE``), and under CURVE libzmq counts each frame's 33 bytes of
#: encryption against that limit too (measured). Over the limit, libzmq drops
#: the connection without a word to either side, so workers check first.
MAX_CONTROL_BYTES = MAX_HEADER_BYTES - 64
MAX_LEAVES = 4096
MAX_KEY_DEPTH = 16
MAX_DIMS = 16
#: A leaf, and any frame, larger than this is refused: a layout claiming more is
#: refused when announced. Zero-size dims do not make a shape free: the product
#: of its dims, zeros counted as one, is held to the same bound, since torch
#: computes strides from them.
MAX_LEAF_BYTES = 1 << 32
MAX_FRAME_BYTES = 1 << 32
MAX_PARTS = 4
MAX_LAYOUT_ID = 1 << 31
#: The longest name a tensorclass may travel as (``"module:qualname"``).
MAX_CLASS_NAME = 512

_ALIGN = 16


class Command(enum.IntEnum):
    """What a message asks for or answers."""

    # pool -> worker, on the broker's ROUTER
    STEP = 1  # env.step(td), reply: the "next" subtree
    RESET = 2  # env.reset(td), reply: the reset tensordict
    STEP_AND_MAYBE_RESET = 3  # reply: "next" subtree, then the next root
    STEP_RAW = 4  # env._step(td) (torchrl's private path), reply: its output
    RESET_RAW = 5  # env._reset(td), reply: its output
    SEED = 6  # env.set_seed(body["seed"]), reply: empty result
    CLOSE = 7  # shut down
    WELCOME = 8  # registration accepted: body["reg"] has token and env indices
    REFUSE = 9  # registration refused: body["err"]
    PING = 10  # the pool's heartbeat
    # worker -> pool, on the broker's ROUTER
    REGISTER = 20  # body["reg"]: env indices, specs, pid
    FAILED = 21  # building an env failed: body["err"], body["tb"]
    HEARTBEAT = 22
    # worker -> pool, on the results PULL
    RESULT = 30
    ERROR = 31  # the env raised: body["err"], body["tb"]


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
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16: numpy has no such type
        return None


#: The numpy twin of each wire dtype (None where numpy has none): numpy slices
#: and copies small arrays several times faster than torch dispatches ops.
_NUMPY_DTYPES = {dtype: _numpy_dtype(dtype) for dtype in _DTYPES.values()}


def dtype_from_name(name: Any) -> torch.dtype:
    """The torch dtype called ``name``; only the whitelisted ones exist."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot cross the wire") from None


# ---------------------------------------------------------------- tensorclass names


class TensorclassNotLoadedWarning(UserWarning):
    """A peer sent a tensorclass whose class this process has not loaded.

    Its values arrive as plain TensorDicts (its specs with ``data_cls=None``);
    importing the module the warning names, before the pool receives them,
    makes them instances again. Warned once per class.
    """


@functools.lru_cache(maxsize=1024)
def tensorclass_name(cls: type) -> str:
    """The name tensorclass ``cls`` travels as: ``"module:qualname"``.

    Raises:
        ProtocolError: ``cls`` is not a tensorclass, or its name is not one a
            peer would accept (:func:`parse_class_name`).
    """
    if not isinstance(cls, type) or not is_tensorclass(cls) or _is_non_tensor_class(cls):
        raise ProtocolError(f"{cls!r} is not a tensorclass; it cannot cross the wire")
    name = f"{cls.__module__}:{cls.__qualname__}"
    parse_class_name(name)
    return name


def parse_class_name(name: Any) -> tuple[str, tuple[str, ...]]:
    """A tensorclass's wire name split into its module and qualname parts.

    Raises:
        ProtocolError: ``name`` is not ``"module:qualname"`` (at most
            :data:`MAX_CLASS_NAME` characters, a dotted module of identifiers, a
            dotted qualname of identifiers and ``<locals>``), so cannot name a class.
    """
    if not isinstance(name, str) or not 0 < len(name) <= MAX_CLASS_NAME:
        raise ProtocolError(
            f"a tensorclass name is a 'module:qualname' string of at most {MAX_CLASS_NAME} "
            f"characters, not {_clipped(name)}"
        )
    module, _, qualname = name.partition(":")
    parts = tuple(qualname.split("."))
    if not (
        all(part.isidentifier() for part in module.split("."))
        and parts[0].isidentifier()
        and parts[-1].isidentifier()
        and all(part.isidentifier() or part == "<locals>" for part in parts)
    ):
        raise ProtocolError(f"{_clipped(name)} is not a 'module:qualname' tensorclass name")
    return module, parts


def resolve_tensorclass(name: Any) -> type | None:
    """The tensorclass called ``name``, looked up among the modules already loaded.

    Nothing is imported (a module named by a peer would run its code) and no
    attribute is read with ``getattr``: the qualname is followed through the
    ``__dict__`` of the module in :data:`sys.modules` and of the classes on
    its path, so no module ``__getattr__``, property or lazy loader runs.

    Returns:
        The class; or None, with a :class:`TensorclassNotLoadedWarning` (once per
        name), when it is not loaded here: its module is not imported, has no
        such attribute, or defines it inside a function.

    Raises:
        ProtocolError: ``name`` is malformed (:func:`parse_class_name`), or names
            something that is not a tensorclass type (``os:system``,
            ``builtins:dict``, ``tensordict:NonTensorData``).
    """
    module_name, parts = parse_class_name(name)
    module = sys.modules.get(module_name)
    if module is None or not issubclass(type(module), types.ModuleType):
        _not_loaded(
            name,
            f"module {module_name} is not imported",
            f"import {module_name} in this process before the pool receives them",
        )
        return None
    found: Any = module
    namespace: Mapping[str, Any] | None = _MODULE_DICT.__get__(module)
    for depth, part in enumerate(parts):
        if part == "<locals>":
            _not_loaded(
                name,
                "it is defined inside a function, where no name reaches it",
                f"define it at the top level of {module_name}, and import that here",
            )
            return None
        if namespace is None:
            raise ProtocolError(
                f"tensorclass name {name} is refused: {'.'.join(parts[:depth])} is a "
                f"{type(found).__name__}, not a class"
            )
        found = namespace.get(part, _MISSING)
        if found is _MISSING:
            where = ".".join(parts[: depth + 1])
            _not_loaded(
                name,
                f"module {module_name} is imported but has no {where}",
                f"import the {module_name} that defines it (the peer's version of it)",
            )
            return None
        namespace = _TYPE_DICT.__get__(found, type(found)) if _is_type(found) else None
    if not _declares_tensorclass(found) or not is_tensorclass(found):
        raise ProtocolError(
            f"tensorclass name {name} is refused: it names a {type(found).__name__}, "
            "not a tensorclass"
        )
    return found


# The descriptors themselves: reading through them runs no class's or metaclass's code.
_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
_TYPE_DICT: Any = vars(type)["__dict__"]
_TYPE_MRO: Any = vars(type)["__mro__"]
_FLAGS = ("_is_tensorclass", "_is_non_tensor")
_MISSING = object()
#: Names warned about already (bounded: past it, a peer's new names are not warned about).
_WARNED: set[str] = set()
_MAX_WARNED = 256
_WARNED_LOCK = threading.Lock()


def _is_non_tensor_class(cls: type) -> bool:
    # NonTensorData is a tensorclass, but the wire carries non-tensors as plain data.
    return bool(getattr(cls, "_is_non_tensor", False))


def _declares_tensorclass(found: Any) -> bool:
    """Whether ``found`` is a tensorclass type (not a non-tensor one), read from class dicts.

    The flags ``@tensorclass`` sets are looked for in the ``__dict__`` of each
    class of the MRO, so no metaclass ``__getattr__`` or descriptor runs; only
    then does :func:`tensordict.is_tensorclass` confirm (finding it there).
    """
    if not _is_type(found):
        return False
    flags: dict[str, Any] = {}
    for klass in reversed(_TYPE_MRO.__get__(found, type(found))):
        namespace = _TYPE_DICT.__get__(klass, type(klass))
        flags.update({key: namespace[key] for key in _FLAGS if key in namespace})
    return flags.get("_is_tensorclass") is True and not flags.get("_is_non_tensor", False)


def _is_type(found: Any) -> bool:
    # Not isinstance(found, type): for an object that is not, it reads found.__class__,
    # which that object's class may compute.
    return issubclass(type(found), type)


def tensorclass_fields(cls: type) -> frozenset[str]:
    """The field names of tensorclass ``cls``: what may lie directly under an instance."""
    return frozenset(cast(Any, cls).__expected_keys__)


def _not_loaded(name: str, why: str, fix: str) -> None:
    """Warn, once per name (and for at most ``_MAX_WARNED`` names), that ``name`` arrives plain."""
    with _WARNED_LOCK:
        if name in _WARNED or len(_WARNED) >= _MAX_WARNED:
            return
        _WARNED.add(name)
    warnings.warn(
        f"tensorclass {name} is not loaded in this process ({why}): its values arrive as "
        f"plain TensorDicts, and its specs with data_cls=None. To get instances of it, {fix}.",
        TensorclassNotLoadedWarning,
        stacklevel=3,
    )


def _clipped(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- headers


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    """Frame 0 of every message."""

    command: Command
    env: int = -1
    seq: int = 0
    token: bytes = b""
    layouts: tuple[int, ...] = ()
    body: dict[str, Any] | None = None
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                self.version,
                int(self.command),
                self.env,
                self.seq,
                self.token,
                list(self.layouts),
                self.body,
            ],
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Header:
        """Parse and validate frame 0; raise :class:`ProtocolError` if it is not one."""
        if len(data) > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            fields = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=False,
            )
        except Exception as err:  # msgpack raises many types; all mean "not a header"
            raise ProtocolError(f"header is not msgpack: {err}") from None
        return cls._from_fields(fields)

    @classmethod
    def _from_fields(cls, fields: Any) -> Header:
        if not isinstance(fields, list) or len(fields) != 7:
            raise ProtocolError("header must be a msgpack array of 7 fields")
        version, command, env, seq, token, layouts, body = fields
        if not _is_int(version) or version != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"protocol version {version!r} received, this side speaks {PROTOCOL_VERSION}"
            )
        known = _COMMANDS.get(command) if _is_int(command) else None
        if known is None:
            raise ProtocolError(f"unknown command {command!r}")
        if not _is_int(env) or not _is_int(seq) or seq < 0:
            raise ProtocolError("header env and seq must be integers (seq >= 0)")
        if not isinstance(token, bytes) or len(token) > 64:
            raise ProtocolError("header token must be at most 64 bytes")
        if not isinstance(layouts, list) or len(layouts) > MAX_PARTS:
            raise ProtocolError(f"header layouts must be a list of at most {MAX_PARTS} ids")
        if not all(_is_int(i) and 0 <= i < MAX_LAYOUT_ID for i in layouts):
            raise ProtocolError("layout ids must be non-negative integers")
        if body is not None and not isinstance(body, dict):
            raise ProtocolError("header body must be a map or nil")
        return cls(known, env, seq, token, tuple(layouts), body)


#: Command by value: a dict lookup is a fraction of ``Command(value)``'s cost.
_COMMANDS: dict[int, Command] = {command.value: command for command in Command}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------- layouts

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


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """How one tensordict is laid out in frames; see the module docstring.

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

    @property
    def num_frames(self) -> int:
        return len(self.frame_sizes)

    def signature(self) -> tuple:
        return (
            self.batch_size,
            tuple((leaf.key, leaf.dtype, leaf.shape) for leaf in self.leaves),
            self.nontensor_keys,
            self.stacked,
            self.branches,
            self.lazy,
            self.classes,
        )

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
    if not all(_is_int(v) and 0 <= v < (1 << 40) for v in value):
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
    if not all(isinstance(part, str) and 0 < len(part) <= 256 for part in value):
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
    if not isinstance(value, list) or not all(_is_int(i) and 0 <= i < count for i in value):
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
        if not _is_int(dim) or not 0 <= dim < MAX_DIMS:
            raise ProtocolError(f"a lazy stack's stack_dim must be in [0, {MAX_DIMS})")
        if not _is_int(count) or not 0 < count <= MAX_LEAVES:
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
    members = (_fields_under((*key, _member_name(i)), children, stacks) for i in range(count))
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
        if leaf.dtype not in _DTYPE_NAMES:
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
        packed_nbytes = -(-packed_nbytes // _ALIGN) * _ALIGN
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
            member = (*key, _member_name(i))
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


def _member_name(index: int) -> str:
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


def layout_of(td: TensorDictBase) -> Layout:
    """The layout of ``td`` with every leaf packed: what :func:`max_message_bytes` sizes.

    Example:
        >>> from tensordict import TensorDict
        >>> layout_of(TensorDict({"obs": torch.zeros(84, 84, 3)}, [])).packed_nbytes
        84672
    """
    flat = _flatten(td)
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


def max_message_bytes(layouts: Iterable[Layout], headroom: float = 2.0) -> int:
    """A ZMQ ``MAXMSGSIZE`` (a per-frame limit) for a peer that sends these layouts.

    The largest frame such a peer can send is its header (at most
    :data:`MAX_HEADER_BYTES`) or a tensor frame, and no tensor frame is larger
    than all of a layout's leaves packed, whatever the zero-copy threshold.
    ``headroom`` multiplies the latter: a frame over the limit disconnects the
    peer and loses its reply, so the limit must not be tight (an env may return
    leaves its spec does not declare). Layouts of specs: ``layout_of(spec.zero())``.

    Example:
        >>> from tensordict import TensorDict
        >>> image = layout_of(TensorDict({"pixels": torch.zeros(3, 1024, 1024)}, []))
        >>> max_message_bytes([image]) == 2 * 3 * 1024 * 1024 * 4
        True
        >>> max_message_bytes([]) == MAX_HEADER_BYTES
        True
    """
    largest = max((_all_packed_nbytes(layout) for layout in layouts), default=0)
    return max(MAX_HEADER_BYTES, math.ceil(largest * headroom))


def _all_packed_nbytes(layout: Layout) -> int:
    return sum(-(-leaf.nbytes // _ALIGN) * _ALIGN for leaf in layout.leaves)


# ---------------------------------------------------------------- encoding


@dataclasses.dataclass(slots=True)
class EncodedPart:
    """A tensordict ready to send: its layout id, frames and non-tensor values."""

    layout_id: int
    new_layout: dict[str, Any] | None
    frames: list[Any]
    nontensor: list[Any] | None


class Encoder:
    """Turns tensordicts into frames; remembers the layouts it announced.

    One encoder per connection: a layout is announced in full the first time
    it is used and referred to by id afterwards. ``forget()`` after the peer
    was replaced (a re-registration), so layouts are announced again.
    """

    def __init__(self, zero_copy_threshold: int = ZERO_COPY_THRESHOLD) -> None:
        self.zero_copy_threshold = zero_copy_threshold
        # signature (a tensordict's) or Layout (a packed part's) -> (layout id, layout)
        self._ids: dict[tuple | Layout, tuple[int, Layout]] = {}
        self._announced: set[int] = set()
        # id(layout) -> (layout id, layout): the layout is held, so the id stays its own.
        self._by_layout: dict[int, tuple[int, Layout]] = {}

    def forget(self) -> None:
        self._announced.clear()

    def encode(self, td: TensorDictBase | DecodedPart) -> EncodedPart:
        """``td``'s frames; a :class:`DecodedPart` (a packed row) is already frames."""
        if isinstance(td, DecodedPart):
            return self._encode_part(td)
        flat = _flatten(td)
        signature: tuple = (
            tuple(td.batch_size),
            tuple((key, t.dtype, tuple(t.shape)) for key, t in flat.tensors),
            tuple(flat.nontensor_keys),
            tuple(flat.stacked),
            tuple(flat.branches),
        )
        if flat.lazy:  # a longer signature: never equal to one without lazy stacks
            signature += (tuple(flat.lazy),)
        if flat.classes:  # tagged: never equal to a lazy stack's
            signature += (("c", tuple(flat.classes)),)
        layout_id, layout = self._layout_for(signature, flat, td.batch_size)
        frames = _pack(layout, [t for _, t in flat.tensors])
        values = [_plain(v, k) for k, v in zip(flat.nontensor_keys, flat.nontensor, strict=True)]
        return EncodedPart(layout_id, self._announce(layout_id, layout), frames, values or None)

    def _encode_part(self, part: DecodedPart) -> EncodedPart:
        layout = part.layout
        known = self._by_layout.get(id(layout))
        if known is None or known[1] is not layout:
            # Keyed by the layout itself: its frames are laid out already, maybe
            # by another threshold than ours, so a tensordict's id will not do.
            known = self._ids.setdefault(layout, (len(self._ids), layout))
            self._by_layout[id(layout)] = (known[0], layout)
        layout_id = known[0]
        nontensor = list(part.nontensor) or None
        return EncodedPart(layout_id, self._announce(layout_id, layout), part.buffers, nontensor)

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


@dataclasses.dataclass(slots=True)
class _Flat:
    """A tensordict's leaves in key order, and what its tree needs beyond their keys."""

    tensors: list[tuple[Key, torch.Tensor]] = dataclasses.field(default_factory=list)
    nontensor_keys: list[Key] = dataclasses.field(default_factory=list)
    nontensor: list[Any] = dataclasses.field(default_factory=list)
    stacked: list[bool] = dataclasses.field(default_factory=list)
    branches: list[Branch] = dataclasses.field(default_factory=list)
    lazy: list[LazyNode] = dataclasses.field(default_factory=list)
    classes: list[tuple[Key, type]] = dataclasses.field(default_factory=list)


def _flatten(td: TensorDictBase) -> _Flat:
    flat = _Flat()
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
    if not is_tensorclass(cls) or _is_non_tensor_class(cls):
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
        member_key = (*key, _member_name(i))
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
    flat = _flatten(td)
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
    flat = _flatten(td)
    for key, tensor in flat.tensors:
        if tensor.dtype not in _DTYPE_NAMES:
            raise ProtocolError(
                f"entry {'/'.join(key)} has dtype {tensor.dtype}, which cannot cross the wire"
            )
    for key, value in zip(flat.nontensor_keys, flat.nontensor, strict=True):
        _plain(value, key)
    for key, cls in flat.classes:
        _class_name_at(key, cls)


def _plain(value: Any, path: Key) -> Any:
    data = value.tolist() if isinstance(value, NonTensorStack) else getattr(value, "data", value)
    try:
        msgpack.packb(data, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        raise ProtocolError(
            f"non-tensor value at {'/'.join(path)} of type {type(data).__name__} "
            "is not plain data (msgpack-able); it cannot cross the wire"
        ) from None
    return data


def _pack(layout: Layout, tensors: list[torch.Tensor]) -> list[Any]:
    # Through numpy: a tensor's array is one call, where torch dispatches a
    # handful of ops per leaf (~50 us for five small leaves, ~10 us this way).
    arrays = [_as_array(t) for t in tensors]
    frames: list[Any] = []
    if layout.frame_sizes and not _all_own(layout):
        frames.append(_join_packed(layout, arrays))
    for leaf, array in zip(layout.leaves, arrays, strict=True):
        if leaf.own_frame:
            frames.append(np.ascontiguousarray(array))  # sent without a copy
    return frames


def _join_packed(layout: Layout, arrays: list[np.ndarray]) -> bytes:
    """The packed frame: the small leaves' bytes, each at its aligned offset, zeros between."""
    pieces, end = [], 0
    for leaf, array in zip(layout.leaves, arrays, strict=True):
        if leaf.own_frame:
            continue
        if leaf.offset > end:
            pieces.append(_PADDING[: leaf.offset - end])
        pieces.append(array.tobytes())  # C order, whatever the strides
        end = leaf.offset + leaf.nbytes
    return b"".join(pieces)


_PADDING = bytes(_ALIGN)


def _as_array(tensor: torch.Tensor) -> np.ndarray:
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


def encode_message(header: Header, parts: Sequence[EncodedPart]) -> list[Any]:
    """Header frame + every part's frames, with layouts announced and non-tensors attached."""
    body = header.body
    new_layouts = {p.layout_id: p.new_layout for p in parts if p.new_layout is not None}
    nontensor = any(p.nontensor for p in parts)
    if new_layouts or nontensor:
        body = dict(body or {})
        if new_layouts:
            body["L"] = new_layouts
        if nontensor:
            body["nt"] = [p.nontensor or [] for p in parts]
    fields = [
        header.version,
        int(header.command),
        header.env,
        header.seq,
        header.token,
        [p.layout_id for p in parts],
        body or None,
    ]
    # Header.encode's fields, without building a second Header per message.
    frames: list[Any] = [msgpack.packb(fields, use_bin_type=True)]
    for part in parts:
        frames.extend(part.frames)
    return frames


class RowPacker:
    """Packs every row of a batch (its first dim) into a part of its own, in one pass.

    What :meth:`Encoder.encode` would make of each row, as a
    :class:`DecodedPart` whose buffers are the frames: small leaves are copied
    column by column into one ``(rows, packed_nbytes)`` array, large ones stay
    views of the batch. Batches with non-tensor values or nested batch sizes
    are left to per-row tensordicts (``pack`` returns None).

    Example:
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"action": torch.arange(6.0).reshape(3, 2)}, [3])
        >>> rows = RowPacker().pack(batch)
        >>> rows[2].to_tensordict()["action"].tolist()
        [4.0, 5.0]
    """

    def __init__(self, zero_copy_threshold: int = ZERO_COPY_THRESHOLD) -> None:
        self.zero_copy_threshold = zero_copy_threshold
        self._layouts: dict[tuple, Layout] = {}

    def pack(self, batch: TensorDictBase, exclude: Sequence[str] = ()) -> list[DecodedPart] | None:
        """One part per row of ``batch`` without its top-level keys ``exclude``; or None."""
        flat = _flatten(batch)
        if flat.branches or flat.classes:
            return None
        if any(key[0] not in exclude for key in flat.nontensor_keys):
            return None
        leaves = [(key, t) for key, t in flat.tensors if key[0] not in exclude]
        rows = batch.batch_size[0] if batch.batch_dims else 0
        if not rows:
            return None
        layout = self._layout(tuple(batch.batch_size[1:]), leaves)
        columns = [
            np.ascontiguousarray(_as_array(t)).reshape(-1).view(np.uint8).reshape(rows, leaf.nbytes)
            for (_, t), leaf in zip(leaves, layout.leaves, strict=True)
        ]
        return _split_rows(layout, columns, rows)

    def _layout(self, batch: tuple[int, ...], leaves: list[tuple[Key, torch.Tensor]]) -> Layout:
        signature = (batch, tuple((key, t.dtype, tuple(t.shape[1:])) for key, t in leaves))
        layout = self._layouts.get(signature)
        if layout is None:
            specs = [
                (key, t.dtype, tuple(t.shape[1:]), _row_nbytes(t) >= self.zero_copy_threshold)
                for key, t in leaves
            ]
            layout = build_layout(batch, specs, (), [], [])
            self._layouts[signature] = layout
        return layout


def _row_nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _split_rows(layout: Layout, columns: list[np.ndarray], rows: int) -> list[DecodedPart]:
    packed = np.zeros((rows, layout.packed_nbytes), dtype=np.uint8)
    own = []
    for leaf, column in zip(layout.leaves, columns, strict=True):
        if leaf.own_frame:
            own.append(column)
        else:
            packed[:, leaf.offset : leaf.offset + leaf.nbytes] = column
    flat, size = packed.reshape(-1).data, layout.packed_nbytes
    has_packed = len(own) < len(layout.leaves)
    parts = []
    for row in range(rows):
        buffers = [flat[row * size : (row + 1) * size]] if has_packed else []
        buffers += [np.ascontiguousarray(column[row]).data for column in own]
        parts.append(DecodedPart(layout, buffers, []))
    return parts


# ---------------------------------------------------------------- decoding


@dataclasses.dataclass(slots=True)
class DecodedPart:
    """A tensordict still in frames: its layout, its frames (sizes checked), its non-tensors.

    Cheap to stack with others of its layout (:func:`stack_parts` reads the
    frames directly); ``tensors``, views on the frames, are made on first use.
    """

    layout: Layout
    buffers: list[memoryview]
    nontensor: list[Any]
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
    announced (give it the socket's ``MAXMSGSIZE``: nothing larger can arrive).
    """

    def __init__(self, max_layouts: int = 256, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_layouts = max_layouts
        self.max_frame_bytes = max_frame_bytes
        self._layouts: dict[int, Layout] = {}

    def forget(self) -> None:
        self._layouts.clear()

    def learn(self, body: Mapping[str, Any] | None) -> None:
        """Take in the layouts a message announces (before decoding its parts)."""
        announced = (body or {}).get("L")
        if announced is None:
            return
        if not isinstance(announced, dict):
            raise ProtocolError("announced layouts must be a map id -> layout")
        for layout_id, data in announced.items():
            if not _is_int(layout_id) or not 0 <= layout_id < MAX_LAYOUT_ID:
                raise ProtocolError(f"bad layout id {layout_id!r}")
            if layout_id not in self._layouts and len(self._layouts) >= self.max_layouts:
                raise ProtocolError(f"peer announced more than {self.max_layouts} layouts")
            self._layouts[layout_id] = _intern(self._checked(Layout.from_data(data)))

    def _checked(self, layout: Layout) -> Layout:
        largest = max(layout.frame_sizes, default=0)
        if largest > self.max_frame_bytes:
            raise ProtocolError(
                f"layout has a frame of {largest} bytes; this connection takes at most "
                f"{self.max_frame_bytes}"
            )
        return layout

    def decode(self, header: Header, frames: Sequence[Any]) -> list[DecodedPart]:
        """Split ``frames`` (all frames after the header) into the header's parts."""
        self.learn(header.body)
        layouts = [self._layout(i) for i in header.layouts]
        expected = sum(layout.num_frames for layout in layouts)
        if len(frames) != expected:
            raise ProtocolError(f"message has {len(frames)} tensor frames, layouts say {expected}")
        nontensor = _nontensor_lists(header.body, layouts)
        parts, start = [], 0
        for layout, values in zip(layouts, nontensor, strict=True):
            chunk = frames[start : start + layout.num_frames]
            parts.append(DecodedPart(layout, _checked_buffers(layout, chunk), values))
            start += layout.num_frames
        return parts

    def _layout(self, layout_id: int) -> Layout:
        layout = self._layouts.get(layout_id)
        if layout is None:
            raise ProtocolError(f"unknown layout id {layout_id}")
        return layout


#: Equal layouts learned on different connections, as one object: parts from
#: any worker then share a layout by identity (:func:`stack_parts`' condition).
#: Only an optimisation, so bounded crudely: a peer announcing layout after
#: layout costs the sharing, not memory.
_INTERNED: dict[Layout, Layout] = {}
_MAX_INTERNED = 1024


def _intern(layout: Layout) -> Layout:
    if len(_INTERNED) >= _MAX_INTERNED:
        _INTERNED.clear()
    return _INTERNED.setdefault(layout, layout)


def _nontensor_lists(body: Mapping[str, Any] | None, layouts: list[Layout]) -> list[list[Any]]:
    lists = (body or {}).get("nt")
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


def _buffer(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", frame)
    try:
        return buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    except TypeError:
        raise ProtocolError(f"a frame must be bytes, not {type(frame).__name__}") from None


def _checked_buffers(layout: Layout, frames: Sequence[Any]) -> list[memoryview]:
    buffers = [_buffer(f) for f in frames]
    for buffer, size in zip(buffers, layout.frame_sizes, strict=True):
        if buffer.nbytes != size:
            raise ProtocolError(f"frame of {buffer.nbytes} bytes where the layout says {size}")
    return buffers


def _unpack(layout: Layout, buffers: Sequence[memoryview]) -> list[torch.Tensor]:
    """Views on (size-checked) buffers, one per leaf.

    A read-only packed frame (zmq's) is copied once, so that its small leaves
    are cheap numpy views; a large leaf's own frame is viewed as it is, no copy.
    """
    if buffers and buffers[0].readonly and not _all_own(layout):
        buffers = [memoryview(bytearray(buffers[0])), *buffers[1:]]
    if not any(buffer.readonly for buffer in buffers):
        return [_numpy_view(buffers[leaf.frame], leaf) for leaf in layout.leaves]
    flat = [_as_uint8(buffer) for buffer in buffers]
    return [_torch_view(flat[leaf.frame], leaf) for leaf in layout.leaves]


def _torch_view(flat: torch.Tensor, leaf: Leaf) -> torch.Tensor:
    return flat[leaf.offset : leaf.offset + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)


def _numpy_view(buffer: memoryview, leaf: Leaf) -> torch.Tensor:
    """A leaf of a writable buffer: one numpy view and ``from_numpy``, a third of torch's ops."""
    dtype = _NUMPY_DTYPES[leaf.dtype]
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
    for key, batch in layout.branches:  # deepest first: children exist before parents
        _insert(nested, key, TensorDict(_pop_branch(nested, key), batch_size=lead + batch))
    # The layout is a checked tree whose leaves start with their batch sizes:
    # TensorDict's per-leaf checks would find nothing, and cost ~1 us a leaf.
    td = TensorDict._new_unsafe(nested, batch_size=torch.Size(lead + layout.batch_size))
    for i, (key, value) in enumerate(zip(layout.nontensor_keys, nontensor, strict=True)):
        if lead:
            td.set(key, value)
        elif layout.stacked[i]:
            td.set(key, _nontensor_stack(value, len(layout.nontensor_batches[i])))
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
            f"what was sent: {type(err).__name__}: {_clipped(str(err), 300)}"
        ) from err


def _nontensor_value(layout: Layout, index: int, value: Any) -> TensorDictBase:
    batch = layout.nontensor_batches[index]
    if layout.stacked[index]:
        return _nontensor_stack(value, len(batch))
    return NonTensorData(data=value, batch_size=batch)


def _subtree(
    children: dict[str, Any], node: tuple[int, int] | None, batch: tuple[int, ...], shift: int
) -> TensorDictBase:
    if node is None:
        return TensorDict(children, batch_size=batch)
    dim, count = node  # the layout was checked: exactly members #0..#count-1, of one batch size
    members = [children[_member_name(i)] for i in range(count)]
    return LazyStackedTensorDict(*members, stack_dim=shift + dim)


def _insert(nested: dict[str, Any], key: Key, value: Any) -> None:
    # The layout was checked to be a tree (_check_tree): no key collides.
    for part in key[:-1]:
        nested = nested.setdefault(part, {})
    nested[key[-1]] = value


def _pop_branch(nested: dict[str, Any], key: Key) -> dict[str, Any]:
    for part in key[:-1]:
        nested = nested.setdefault(part, {})
    return nested.pop(key[-1], {})


def _nontensor_stack(value: Any, depth: int) -> NonTensorStack:
    """Nested lists, ``depth`` levels deep, as a NonTensorStack (items may be lists too)."""
    if depth == 1:
        return NonTensorStack(*value)
    return NonTensorStack(*(_nontensor_stack(item, depth - 1) for item in value))


def stack_parts(parts: Sequence[DecodedPart]) -> TensorDict:
    """Stack parts of one layout into a batch, straight from their frames.

    Each frame position is joined over the parts into one ``(parts, bytes)``
    array (one copy), then each leaf is one column slice of it, copied out
    contiguous: a few array ops per leaf, none per part.
    """
    layout = parts[0].layout
    stacked = _stack_leaves(layout, [p.buffers for p in parts])
    values = [
        _stack_values(layout, i, [p.nontensor[i] for p in parts])
        for i in range(len(layout.nontensor_keys))
    ]
    return tensordict_from_leaves(layout, stacked, values, lead=(len(parts),))


def _stack_leaves(layout: Layout, buffers: list[list[memoryview]]) -> list[torch.Tensor]:
    count = len(buffers)
    frames = [
        _joined([b[i] for b in buffers], count, size) for i, size in enumerate(layout.frame_sizes)
    ]
    return [_leaf_of_rows(frames[leaf.frame], leaf, count) for leaf in layout.leaves]


def _joined(buffers: list[memoryview], count: int, size: int) -> np.ndarray:
    if not size:
        return np.empty((count, 0), dtype=np.uint8)
    return np.frombuffer(bytearray().join(buffers), dtype=np.uint8).reshape(count, size)


def _leaf_of_rows(frame: np.ndarray, leaf: Leaf, count: int) -> torch.Tensor:
    """``leaf``'s column of the joined ``(count, frame bytes)`` array, as a new tensor."""
    if not leaf.nbytes:  # numpy and torch refuse to reinterpret zero bytes
        return torch.empty((count, *leaf.shape), dtype=leaf.dtype)
    if leaf.nbytes == frame.shape[1]:
        contiguous = frame  # the whole frame (a large leaf): already a fresh copy
    else:
        # C order and fresh strides (a one-row view keeps odd ones torch refuses)
        contiguous = frame[:, leaf.offset : leaf.offset + leaf.nbytes].copy()
    dtype = _NUMPY_DTYPES[leaf.dtype]
    if dtype is None:
        return torch.from_numpy(contiguous).view(leaf.dtype).reshape(count, *leaf.shape)
    return torch.from_numpy(contiguous.view(dtype).reshape(count, *leaf.shape))


def _stack_values(layout: Layout, index: int, values: list[Any]) -> NonTensorStack:
    batch = layout.nontensor_batches[index]
    if layout.stacked[index]:
        return NonTensorStack(*(_nontensor_stack(v, len(batch)) for v in values))
    if batch:
        return NonTensorStack(*(NonTensorData(v, batch_size=batch) for v in values))
    return NonTensorStack(*values)
