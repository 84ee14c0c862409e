"""Properties of the wire codec, found by hypothesis.

- Round trip: ``decode(encode(td))`` is ``td``, bit for bit: every dtype the
  wire allows, scalar and empty shapes, nesting (with nested batch sizes and
  empty sub-tensordicts), non-contiguous and expanded views, plain non-tensor
  data (``NonTensorData`` and ``NonTensorStack``), lazy stacks of
  heterogeneous members (nested, inside each other, or the part itself: they
  come back lazy, with their stack_dim), tensorclasses (anywhere, wrapping any
  of these: they come back instances of their class); stacking decoded parts is
  stacking the tensordicts.
- Hostile input: any bytes given to ``Header.decode`` and any header and
  frames given to ``Decoder.decode`` raise :class:`ProtocolError` or nothing
  (tensorclass names included: loaded, not loaded, malformed, naming
  functions); what decodes can always be made into a tensordict and stacked.
- A layout that claims a 10 GB leaf is refused before a frame is looked at,
  and allocates nothing.

Example counts are modest so the file runs in seconds (``ZMQPOOL_FUZZ_SCALE=50``
multiplies them for a long run); hypothesis's database is off.
"""

from __future__ import annotations

import copy
import os
import tracemalloc
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_tensorclass,
    lazy_stack,
    tensorclass,
)
from torchrl.testing.mocking_classes import TC

from zmqpool.batching import stack_parts
from zmqpool.codec import Decoder, Encoder, layout_of
from zmqpool.errors import ProtocolError
from zmqpool.layout import _DTYPES, Layout, max_message_bytes
from zmqpool.limits import MAX_HEADER_BYTES, MAX_LEAF_BYTES
from zmqpool.testing import CountingEnv
from zmqpool.wire import PROTOCOL_VERSION, Command, Header, encode_message

#: ZMQPOOL_FUZZ_SCALE=50 runs fifty times the examples (a long, offline fuzz run).
SCALE = int(os.environ.get("ZMQPOOL_FUZZ_SCALE", "1"))
SETTINGS = settings(
    max_examples=150 * SCALE,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DTYPES = list(_DTYPES.values())
NAMES = st.text(alphabet="abxyz_.é", min_size=1, max_size=3)
RARELY = st.sampled_from([False] * 7 + [True])  # hypothesis favours the first items


@tensorclass
class Fuzz:
    """A tensorclass whose fields may hold anything a tensordict may."""

    x: Any = None
    y: Any = None
    z: Any = None


FIELDS = st.sampled_from(["x", "y", "z"])
#: Tensorclass names a hostile layout may give: loaded, not loaded, malformed, not classes.
CLASS_NAMES = st.sampled_from(
    [
        f"{Fuzz.__module__}:{Fuzz.__qualname__}",
        f"{TC.__module__}:TC",
        "zmqpool_not_a_module:Fuzz",
        f"{Fuzz.__module__}:Missing",
        "os:system",
        "builtins:dict",
        "tensordict:NonTensorData",
        "a:",
        "a:b:c",
        "a" * 600,
        7,
    ]
)


# ---------------------------------------------------------------- strategies: valid tensordicts


@st.composite
def tensors(draw, batch: tuple[int, ...]) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = batch + tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    numel = torch.Size(shape).numel()
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
    if dtype == torch.bool:
        flat = flat % 2  # a bool byte is 0 or 1
    tensor = flat.to(torch.uint8).view(dtype).reshape(shape)
    return draw(st.sampled_from(_views(tensor, batch)))


def _views(tensor: torch.Tensor, batch: tuple[int, ...]) -> list[torch.Tensor]:
    """The tensor, and non-contiguous tensors of the same shape holding its values."""
    views = [tensor]
    extra = tensor.dim() - len(batch)
    if extra >= 2:  # transpose of a transposed copy: same values, non-contiguous strides
        views.append(tensor.transpose(-1, -2).contiguous().transpose(-1, -2))
    if tensor.dim():  # every other element of a twice-as-long tensor
        doubled = torch.stack([tensor, torch.zeros_like(tensor)], dim=-1)
        views.append(doubled[..., 0])
    if extra >= 1 and tensor.shape[-1] == 1:
        base = tensor.select(-1, 0).unsqueeze(-1)
        views.append(base.expand(tensor.shape))  # stride 0
    return views


PLAIN = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=4)
    | st.binary(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


def _nested_values(draw, batch: tuple[int, ...]) -> Any:
    if not batch:
        return draw(PLAIN)
    return [_nested_values(draw, batch[1:]) for _ in range(batch[0])]


def _nontensor_stack(values: Any, depth: int) -> NonTensorStack:
    if depth == 1:
        return NonTensorStack(*values)
    return NonTensorStack(*(_nontensor_stack(v, depth - 1) for v in values))


@st.composite
def tensordicts(
    draw, batch: tuple[int, ...] | None = None, depth: int = 0, names=NAMES
) -> TensorDict:
    if batch is None:
        batch = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    td = TensorDict({}, batch_size=batch)
    for name in draw(st.lists(names, max_size=4, unique=True)):
        kinds = ["tensor", "data"] + (["td", "lazy", "class"] if depth < 2 else [])
        if batch and 0 not in batch:
            kinds.append("stack")
        kind = draw(st.sampled_from(kinds))
        if kind == "tensor":
            td.set(name, draw(tensors(batch)))
        elif kind == "data":
            td.set_non_tensor(name, draw(PLAIN))
        elif kind == "stack":
            td.set(name, _nontensor_stack(_nested_values(draw, batch), len(batch)))
        elif kind == "lazy":
            td.set(name, draw(lazy_stacks(batch, depth + 1)))
        elif kind == "class":
            td.set(name, draw(tensorclasses(batch, depth + 1)))
        else:  # a nested tensordict, with the parent's batch size or a longer one
            extra = tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
            td.set(name, draw(tensordicts(batch + extra, depth + 1)))
    return td


@st.composite
def lazy_stacks(draw, batch: tuple[int, ...], depth: int, exact: bool = False) -> TensorDictBase:
    """A lazy stack of members with different keys, whose batch size starts with ``batch``.

    Its batch size is ``batch`` itself if ``exact`` (a member of another lazy
    stack), else maybe longer; it stacks at any dim whose size is not zero, so a
    member may itself be a lazy stack, hold none, or have no keys.
    """
    full = batch if exact else batch + tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    dims = [dim for dim, size in enumerate(full) if size]
    if not dims:
        if exact:  # no dim to stack members along: a member that is a plain tensordict
            return draw(tensordicts(batch, depth))
        full, dims = (*full, draw(st.integers(1, 3))), [len(full)]
    dim = draw(st.sampled_from(dims))
    member_batch = full[:dim] + full[dim + 1 :]
    members = [
        draw(lazy_stacks(member_batch, depth + 1, exact=True))
        if depth < 2 and draw(RARELY)  # a lazy stack in a lazy stack
        else draw(tensordicts(member_batch, depth))
        for _ in range(full[dim])
    ]
    return lazy_stack(members, dim=dim)


@st.composite
def tensorclasses(draw, batch: tuple[int, ...], depth: int) -> Any:
    """A ``Fuzz`` of batch ``batch`` (or longer), wrapping a tensordict, rarely a lazy stack."""
    full = batch + tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
    if draw(RARELY) and full and full[0]:
        member = tensordicts(full[1:], depth + 1, names=FIELDS)
        inner = lazy_stack([draw(member) for _ in range(full[0])], dim=0)
    else:
        inner = draw(tensordicts(full, depth, names=FIELDS))
    return Fuzz._from_tensordict(inner)


def parts() -> st.SearchStrategy[TensorDictBase]:
    """What one message part can be: a tensordict, rarely a lazy stack or tensorclass itself."""
    batches = st.lists(st.integers(0, 3), max_size=2).map(tuple)
    root_lazy = batches.flatmap(lambda batch: lazy_stacks(batch, 1))
    root_class = batches.flatmap(lambda batch: tensorclasses(batch, 1))
    return st.sampled_from(["td"] * 14 + ["lazy", "class"]).flatmap(
        lambda kind: {"lazy": root_lazy, "class": root_class}.get(kind, tensordicts())
    )


# ---------------------------------------------------------------- equality, bit for bit


def canonical(td: TensorDictBase) -> dict[str, Any]:
    """A plain, comparable picture of a tensordict: batch sizes, leaf types, dtypes, bytes."""
    if is_tensorclass(td):
        return {"class": type(td), "of": canonical(td._tensordict)}
    if _is_lazy(td):
        members = [canonical(member) for member in td.tensordicts]
        return {"batch": tuple(td.batch_size), "lazy": td.stack_dim, "members": members}
    entries: dict[str, Any] = {}
    for name, value in td.items():
        if isinstance(value, torch.Tensor):
            raw = _raw_bytes(value)
            entries[name] = ("tensor", value.dtype, tuple(value.shape), raw)
        elif isinstance(value, NonTensorStack):
            entries[name] = ("stack", tuple(value.batch_size), value.tolist())
        elif isinstance(value, NonTensorData):
            entries[name] = ("data", tuple(value.batch_size), value.data)
        else:
            entries[name] = ("td", canonical(value))
    return {"batch": tuple(td.batch_size), "entries": entries}


def _is_lazy(td: Any) -> bool:
    return isinstance(td, LazyStackedTensorDict) and not isinstance(td, NonTensorStack)


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.reshape(-1))
    return bytes(flat.view(torch.uint8).numpy())


def as_received(frames: list[Any]) -> list[memoryview]:
    """What a peer gets: read-only buffers, like zmq frames."""
    return [memoryview(bytes(f)) for f in frames]


def send(td: TensorDictBase, encoder: Encoder, decoder: Decoder):
    frames = as_received(encode_message(Header(Command.RESULT, 0, 1), [encoder.encode(td)]))
    return decoder.decode(Header.decode(frames[0]), frames[1:])[0]


# ---------------------------------------------------------------- round trips


@SETTINGS
@given(parts())
def test_decode_of_encode_is_the_identity(td):
    part = send(td, Encoder(), Decoder())
    assert canonical(part.to_tensordict()) == canonical(td)


@SETTINGS
@given(parts(), st.booleans())
def test_small_threshold_zero_copy_frames_round_trip_too(td, copy_own_frames):
    # Every non-empty leaf in its own frame: the zero-copy path, whatever the sizes
    # (and the pool's, which copies those frames at the send).
    part = send(td, Encoder(zero_copy_threshold=1, copy_own_frames=copy_own_frames), Decoder())
    assert canonical(part.to_tensordict()) == canonical(td)


@SETTINGS
@given(parts(), st.integers(1, 3))
def test_stacking_decoded_parts_is_stacking_the_tensordicts(td, count):
    encoder, decoder = Encoder(), Decoder()
    parts = [send(td, encoder, decoder) for _ in range(count)]  # the layout is announced once
    stacked = stack_parts(parts)
    assert stacked.batch_size == (count, *td.batch_size)
    for i in range(count):
        assert canonical(_plain_nontensors(stacked[i])) == canonical(_plain_nontensors(td))


def _plain_nontensors(td: TensorDictBase) -> TensorDictBase:
    """Non-tensors as per-element lists: a stack of equal values is the same data."""
    if is_tensorclass(td):
        return type(td)._from_tensordict(_plain_nontensors(td._tensordict))
    if _is_lazy(td):
        members = [_plain_nontensors(member) for member in td.tensordicts]
        return LazyStackedTensorDict(*members, stack_dim=td.stack_dim)
    out = TensorDict({}, batch_size=td.batch_size)
    for name, value in td.items():
        if isinstance(value, (NonTensorData, NonTensorStack)):
            out.set_non_tensor(name, value.tolist())
        elif isinstance(value, torch.Tensor):
            out.set(name, value)
        else:
            out.set(name, _plain_nontensors(value))
    return out


# ---------------------------------------------------------------- hostile input: headers


def _header_fields():
    junk = st.none() | st.booleans() | st.floats() | st.text(max_size=3) | st.binary(max_size=70)
    ints = st.integers(-(2**63), 2**64 - 1) | st.integers(-2, 40)
    field = ints | junk | st.lists(ints, max_size=6) | st.dictionaries(st.text(max_size=2), ints)
    return st.lists(field, min_size=0, max_size=9) | st.tuples(
        st.just(PROTOCOL_VERSION) | ints,
        st.sampled_from([int(c) for c in Command]) | ints | junk,
        ints | junk,
        ints | junk,
        st.binary(max_size=70) | junk,
        st.lists(st.integers(-1, 2**31), max_size=5) | junk,
        st.none() | st.dictionaries(st.text(max_size=3), ints | junk, max_size=3) | junk,
    ).map(list)


def _mutations(data: bytes):
    cut = st.integers(0, max(len(data) - 1, 0)).map(lambda n: data[:n])
    flip = st.tuples(st.integers(0, max(len(data) - 1, 0)), st.integers(0, 255)).map(
        lambda p: data[: p[0]] + bytes([p[1]]) + data[p[0] + 1 :]
    )
    return cut | flip


VALID_HEADER = Header(Command.STEP, 3, 7, b"t" * 16, (0,), {"L": {0: {"b": [], "t": [], "n": []}}})
HEADER_BYTES = (
    st.binary(max_size=300)
    | _header_fields().map(lambda f: msgpack.packb(f, use_bin_type=True))
    | _mutations(VALID_HEADER.encode())
)


@SETTINGS
@given(HEADER_BYTES)
def test_any_bytes_as_a_header_raise_only_protocol_error(data):
    for frame in (data, memoryview(data)):
        try:
            header = Header.decode(frame)
        except ProtocolError:
            continue
        assert isinstance(header, Header)


def test_oversized_and_deeply_nested_headers_are_refused():
    with pytest.raises(ProtocolError):
        Header.decode(b"\x91" * 100_000)  # 100k nested one-element arrays
    with pytest.raises(ProtocolError):
        Header.decode(b"\xdd\xff\xff\xff\xff")  # an array claiming 4 billion items
    with pytest.raises(ProtocolError, match="exceeds"):
        Header.decode(b"\x00" * (MAX_HEADER_BYTES + 1))


# ---------------------------------------------------------------- hostile input: layouts and frames

SIZE = st.integers(0, 3) | st.sampled_from([-1, 1 << 39, 1 << 40, True, 2.0])
JUNK_SHAPE = st.lists(SIZE, max_size=4) | st.lists(st.integers(0, 2), min_size=17, max_size=18)
JUNK_KEY = st.lists(st.sampled_from(["a", "b", "", 3, None]), max_size=17)
NAME = st.sampled_from(["a", "b", "next", "é"])
DTYPE_NAME = st.sampled_from([*_DTYPES, "float128", "object", 7])


@st.composite
def layout_data(draw) -> Any:
    """Layout maps: mostly plausible (so they get past the first checks), often subtly wrong."""
    if draw(RARELY):
        return draw(PLAIN)
    shape = JUNK_SHAPE if draw(RARELY) else st.lists(st.integers(0, 2), max_size=2)
    key = JUNK_KEY if draw(RARELY) else st.lists(NAME, min_size=1, max_size=2)
    batch = draw(shape)
    extend = st.lists(st.integers(0, 3), max_size=2).map(lambda extra: batch + extra)
    leaf = st.tuples(key, DTYPE_NAME, extend | shape, st.booleans()).map(list)
    data = {
        "b": batch,
        "t": draw(st.lists(_rarely_junk(leaf), max_size=3)),
        "n": draw(st.lists(key, max_size=2)),
    }
    if draw(st.booleans()):
        data["s"] = draw(st.lists(st.tuples(key, extend | shape).map(list), max_size=2))
    if draw(st.booleans()):
        data["k"] = draw(_rarely_junk(st.lists(st.integers(-1, 3), max_size=2)))
    if draw(RARELY):  # lazy stacks: [key path ([]: the part), stack_dim, member count]
        lazy = st.tuples(st.just([]) | key, st.integers(-1, 3), st.integers(-1, 3)).map(list)
        data["z"] = draw(_rarely_junk(st.lists(lazy, max_size=2)))
    if draw(RARELY):  # tensorclasses: [key path ([]: the part), "module:qualname"]
        named = st.tuples(st.just([]) | key, CLASS_NAMES).map(list)
        data["c"] = draw(_rarely_junk(st.lists(named, max_size=2)))
    if draw(RARELY):
        data[draw(st.sampled_from(["zz", "b", 0]))] = draw(PLAIN)
    return data


def _rarely_junk(strategy):
    return RARELY.flatmap(lambda junk: PLAIN if junk else strategy)


@st.composite
def hostile_messages(draw) -> tuple[Header, list[Any]]:
    junk_id = st.sampled_from([-1, 1 << 31, "0", None, 2.5, b"\x00"])
    ids = RARELY.flatmap(lambda junk: junk_id if junk else st.integers(0, 3))
    layouts = draw(st.dictionaries(ids, layout_data(), min_size=1, max_size=2))
    announced = [i for i in layouts if isinstance(i, int)] or [0]
    used = draw(st.lists(_rarely_junk(st.sampled_from(announced)), max_size=3))
    body: dict[str, Any] = {"L": draw(_rarely_junk(st.just(layouts)))}
    valid = [_fitting(layouts.get(i)) if isinstance(i, int) else None for i in used]
    if not draw(RARELY):
        body["nt"] = [_values(draw, layout) if layout else [] for layout in valid]
    elif draw(st.booleans()):
        body["nt"] = draw(PLAIN)
    header = Header(Command.RESULT, 0, 1, b"", tuple(i for i in used if isinstance(i, int)), body)
    # Frames sized as the layouts say (to reach the views), or any frames at all.
    sized = [bytes(size) for layout in valid if layout for size in layout.frame_sizes]
    frames = draw(_rarely_junk(st.just(sized)))
    if not isinstance(frames, list) or draw(RARELY):
        frames = draw(st.lists(st.binary(max_size=40), max_size=4))
    return header, [memoryview(f) if isinstance(f, bytes) else f for f in frames]


def _fitting(data: Any) -> Layout | None:
    try:
        return Layout.from_data(data)
    except ProtocolError:
        return None


def _values(draw, layout: Layout) -> list[Any]:
    return [
        _nested_values(draw, batch) if stacked and not draw(RARELY) else draw(PLAIN)
        for batch, stacked in zip(layout.nontensor_batches, layout.stacked, strict=True)
    ]


@settings(SETTINGS, max_examples=200 * SCALE)
@given(hostile_messages())
@pytest.mark.filterwarnings("ignore::zmqpool.classnames.TensorclassNotLoadedWarning")
def test_any_layout_and_frames_raise_only_protocol_error(message):
    header, frames = message
    try:
        parts = Decoder().decode(header, frames)
    except ProtocolError:
        return
    # What decodes is usable: the pool makes tensordicts of it and stacks it.
    for part in parts:
        part.to_tensordict()
        stack_parts([part, part])


@st.composite
def mutated_layouts(draw, data: dict[str, Any]) -> dict[str, Any]:
    """A real layout with one to three fields changed: deep, plausible, wrong."""
    data = copy.deepcopy(data)
    keys = [leaf[0] for leaf in data["t"]] + data["n"] + [[]]
    keys += [branch[0] for branch in data.get("s", [])] + [z[0] for z in data.get("z", [])]
    keys += [c[0] for c in data.get("c", [])]
    related = st.sampled_from(keys).flatmap(
        lambda k: st.sampled_from([k, k[:-1] or k, [*k, "a"], ["a"]])
    )
    small_shape = st.lists(st.integers(0, 3), max_size=3)
    for _ in range(draw(st.integers(1, 3))):
        field = draw(
            st.sampled_from(["b", "shape", "dtype", "key", "own", "n", "s", "k", "z", "c"])
        )
        leaf = draw(st.sampled_from(data["t"])) if data["t"] else None
        if field == "b":
            data["b"] = draw(small_shape)
        elif field == "shape" and leaf:
            leaf[2] = draw(small_shape)
        elif field == "dtype" and leaf:
            leaf[1] = draw(st.sampled_from(list(_DTYPES)))
        elif field == "key" and leaf:
            leaf[0] = draw(related)
        elif field == "own" and leaf:
            leaf[3] = not leaf[3]
        elif field == "n":
            data["n"].append(draw(related))
        elif field == "s":
            data.setdefault("s", []).append([draw(related), draw(small_shape)])
        elif field == "k":
            data["k"] = draw(st.lists(st.integers(0, max(len(data["n"]) - 1, 0)), max_size=2))
        elif field == "z":
            _mutate_lazy(draw, data, related)
        elif field == "c":
            _mutate_classes(draw, data, related)
    return data


def _mutate_classes(draw, data: dict[str, Any], related) -> None:
    """Another name or key for a tensorclass; or one more, or one less."""
    classes = data.setdefault("c", [])
    change = draw(st.sampled_from(["name", "key", "add", "drop"]))
    if not classes or change == "add":
        classes.append([draw(related | st.just([])), draw(CLASS_NAMES)])
    elif change == "name":
        draw(st.sampled_from(classes))[1] = draw(CLASS_NAMES)
    elif change == "key":
        draw(st.sampled_from(classes))[0] = draw(related | st.just([]))
    else:
        classes.remove(draw(st.sampled_from(classes)))
    if not classes:
        del data["c"]


def _mutate_lazy(draw, data: dict[str, Any], related) -> None:
    """Another stack_dim, count or key for a lazy stack; or one more, or one less."""
    stacks = data.setdefault("z", [])
    change = draw(st.sampled_from(["dim", "count", "key", "add", "drop"]))
    if not stacks or change == "add":
        stacks.append(
            [draw(related | st.just([])), draw(st.integers(0, 2)), draw(st.integers(1, 3))]
        )
        return
    stack = draw(st.sampled_from(stacks))
    if change == "dim":
        stack[1] = max(stack[1] + draw(st.sampled_from([-1, 1])), 0)
    elif change == "count":
        stack[2] = max(stack[2] + draw(st.sampled_from([-1, 1])), 1)
    elif change == "key":
        stack[0] = draw(related | st.just([]))
    else:
        stacks.remove(stack)


@settings(SETTINGS, max_examples=200 * SCALE)
@given(parts(), st.data())
@pytest.mark.filterwarnings("ignore::zmqpool.classnames.TensorclassNotLoadedWarning")
def test_mutated_layouts_raise_only_protocol_error(td, data):
    frames = as_received(encode_message(Header(Command.RESULT), [Encoder().encode(td)]))
    header = Header.decode(frames[0])
    assert header.body is not None and 0 in header.body["L"]
    layout_data_ = data.draw(mutated_layouts(header.body["L"][0]))
    layout = _fitting(layout_data_)
    body = {"L": {0: layout_data_}}
    if layout is not None:  # frames and values that fit the mutated layout
        body["nt"] = [_values(data.draw, layout)]
        frames = [frames[0], *(memoryview(bytes(size)) for size in layout.frame_sizes)]
    try:
        parts = Decoder().decode(Header(Command.RESULT, layouts=(0,), body=body), frames[1:])
    except ProtocolError:
        return
    parts[0].to_tensordict()
    stack_parts([parts[0], parts[0]])


@SETTINGS
@given(parts(), st.data())
def test_a_valid_message_with_any_frames_raises_only_protocol_error(td, data):
    frames = as_received(encode_message(Header(Command.RESULT), [Encoder(1).encode(td)]))
    header = Header.decode(frames[0])
    tampered = data.draw(st.lists(st.binary(max_size=64).map(memoryview), max_size=4))
    try:
        parts = Decoder().decode(header, tampered)
    except ProtocolError:
        return
    parts[0].to_tensordict()


# ---------------------------------------------------------------- limits


class Untouchable:
    """Frames that fail the test if the decoder looks at them."""

    def __len__(self):
        raise AssertionError("the decoder read the frames of a refused layout")

    def __getitem__(self, index):
        raise AssertionError("the decoder read the frames of a refused layout")


@pytest.mark.parametrize(
    "shape",
    [[10_000_000_000], [100_000, 100_000], [0, 10_000_000_000], [1 << 20, 1 << 20, 1 << 20]],
)
def test_a_layout_claiming_10_gb_is_refused_before_frames_are_read(shape):
    layout = {"b": [], "t": [[["obs"], "uint8", shape, True]], "n": []}
    header = Header(Command.RESULT, layouts=(0,), body={"L": {0: layout}})
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=r"too large|exceeds"):
            Decoder().decode(header, Untouchable())  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing the layout allocated {peak} bytes"


def test_a_decoder_refuses_layouts_with_frames_above_its_limit():
    layout = {"b": [], "t": [[["obs"], "float32", [1024], True]], "n": []}
    header = Header(Command.RESULT, layouts=(0,), body={"L": {0: layout}})
    with pytest.raises(ProtocolError, match="at most 4095"):
        Decoder(max_frame_bytes=4095).decode(header, Untouchable())  # type: ignore[arg-type]
    assert len(Decoder(max_frame_bytes=4096).decode(header, [bytes(4096)])) == 1


def test_max_message_bytes_bounds_every_frame_of_the_layouts():
    assert max_message_bytes([]) == MAX_HEADER_BYTES  # headers only: the control socket
    specs = CountingEnv(obs_shape=(3, 512, 512)).specs
    limit = max_message_bytes([layout_of(specs.zero())])
    frame = 3 * 512 * 512 * 4  # the observation, in its own zero-copy frame
    assert 2 * frame <= limit < 2 * frame + 4096
    td = CountingEnv(obs_shape=(3, 512, 512)).reset()
    for threshold in (1, 1 << 15, 1 << 40):  # all own frames ... all packed
        frames = encode_message(Header(Command.RESULT), [Encoder(threshold).encode(td)])
        assert max(len(memoryview(f).cast("B")) for f in frames) <= limit
    assert MAX_LEAF_BYTES < 10_000_000_000
