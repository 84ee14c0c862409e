"""Lazy stacks on the wire (layout field ``"z"``): exact round trips, hostile layouts refused.

A ``LazyStackedTensorDict`` (a heterogeneous env's per-agent entries) crosses
as its members, never densified, and comes back a lazy stack with the same
``stack_dim``, members, keys, shapes, dtypes, values and non-tensors. A layout
without lazy stacks is the bytes it was before ``"z"`` existed.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import msgpack
import pytest
import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    lazy_stack,
)
from torchrl.envs import SerialEnv
from torchrl.testing.mocking_classes import HeterogeneousCountingEnv

from zmqpool.batching import stack_parts
from zmqpool.codec import Decoder, Encoder, check_crossable, layout_of
from zmqpool.errors import ProtocolError
from zmqpool.layout import Layout, max_message_bytes
from zmqpool.limits import MAX_LEAVES
from zmqpool.specs import spec_from_data, spec_to_data
from zmqpool.wire import PROTOCOL_VERSION, Command, Header, encode_message


def as_received(frames: list[Any]) -> list[memoryview]:
    """What a peer gets: read-only buffers, like zmq frames."""
    return [memoryview(bytes(memoryview(f).cast("B"))) for f in frames]


def send(td: TensorDictBase, encoder: Encoder | None = None, decoder: Decoder | None = None):
    encoder, decoder = encoder or Encoder(), decoder or Decoder()
    frames = as_received(encode_message(Header(Command.RESULT, 0, 1), [encoder.encode(td)]))
    return decoder.decode(Header.decode(frames[0]), frames[1:])[0]


def round_trip(td: TensorDictBase, **encoder_kwargs: Any) -> TensorDictBase:
    return send(td, Encoder(**encoder_kwargs)).to_tensordict()


def picture(td: Any) -> Any:
    """Everything the wire promises to keep, lazy stacks as (stack_dim, members), comparable."""
    if isinstance(td, torch.Tensor):
        return ("tensor", td.dtype, tuple(td.shape), td.contiguous().view(-1).view(torch.uint8))
    if isinstance(td, NonTensorStack):
        return ("stack", tuple(td.batch_size), td.tolist())
    if isinstance(td, NonTensorData):
        return ("data", tuple(td.batch_size), td.data)
    if isinstance(td, LazyStackedTensorDict):
        members = [picture(member) for member in td.tensordicts]
        return ("lazy", td.stack_dim, tuple(td.batch_size), members)
    entries = {name: picture(value) for name, value in td.items()}
    return ("td", tuple(td.batch_size), entries)


def assert_same(got: Any, want: Any) -> None:
    a, b = picture(got), picture(want)
    _assert_equal(a, b, ())


def _assert_equal(a: Any, b: Any, path: tuple) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_equal(a[key], b[key], (*path, key))
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, (*path, i))
    else:
        assert a == b, (path, a, b)


def hetero(batch: tuple[int, ...] = (), dim: int = 0) -> LazyStackedTensorDict:
    """Three members with different keys and shapes, like an env's agents."""
    a = TensorDict({"vector": torch.arange(3.0).expand(*batch, 3).clone()}, batch)
    b = TensorDict({"vector": torch.ones(*batch, 2), "lidar": torch.rand(*batch, 8)}, batch)
    c = TensorDict({"camera": torch.randint(0, 255, (*batch, 2, 2), dtype=torch.uint8)}, batch)
    return lazy_stack([a, b, c], dim=dim)


# ---------------------------------------------------------------- round trips


def test_the_heterogeneous_env_round_trips_exactly():
    env = HeterogeneousCountingEnv()
    for td in (env.reset(), env.rand_step(env.reset()), env.full_action_spec.rand()):
        part = send(td)
        assert "z" in part.layout.to_data()
        out = part.to_tensordict()
        assert isinstance(out.get("lazy"), LazyStackedTensorDict)
        assert_same(out, td)


def test_a_serial_envs_rollout_round_trips_with_its_stack_dims():
    rollout = SerialEnv(2, HeterogeneousCountingEnv).rollout(3)
    out = round_trip(rollout)
    assert out.get("lazy").stack_dim == 2 and out.get(("next", "lazy")).stack_dim == 2
    assert_same(out, rollout)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_every_stack_dim_round_trips(dim):
    agents = hetero((2, 3), dim)  # members of batch [2, 3]
    # At dim 0 its batch is [3, 2, 3], which no tensordict of batch [2] holds: it is the part.
    td = agents if dim == 0 else TensorDict({"agents": agents, "obs": torch.randn(2)}, [2])
    out = round_trip(td)
    assert (out if dim == 0 else out.get("agents")).stack_dim == dim
    assert_same(out, td)


def test_lazy_inside_lazy_empty_members_and_homogeneous_members():
    td = TensorDict(
        {
            "nest": lazy_stack(
                [TensorDict({"deep": hetero((2,), 1)}, [2]), TensorDict({}, [2])], 1
            ),
            "of_lazies": lazy_stack([hetero((2,), 1), hetero((2,), 1)], 0),
            "empty": lazy_stack([TensorDict({}, [2, 4]), TensorDict({}, [2, 4])], 2),
            "same": lazy_stack(
                [TensorDict({"x": torch.full((2,), float(i))}, [2]) for i in range(3)], 1
            ),
        },
        [2],
    )
    out = round_trip(td)
    assert isinstance(out.get("same"), LazyStackedTensorDict)  # not densified
    assert isinstance(out.get("of_lazies").tensordicts[0], LazyStackedTensorDict)
    assert out.get("empty").batch_size == (2, 4, 2)
    assert_same(out, td)


def test_a_part_that_is_a_lazy_stack_comes_back_one():
    root = hetero((2,), 1)
    out = round_trip(root)
    assert isinstance(out, LazyStackedTensorDict) and out.stack_dim == 1
    assert_same(out, root)


def test_a_lazy_stack_under_a_nested_tensordict_of_the_same_batch():
    td = TensorDict({"group": TensorDict({"agents": hetero((2,), 1)}, [2])}, [2])
    out = round_trip(td)
    assert isinstance(out.get(("group", "agents")), LazyStackedTensorDict)
    assert_same(out, td)


def test_members_non_tensors_and_large_leaves_round_trip():
    a = TensorDict({"x": torch.randn(2, 3)}, [2])
    a.set_non_tensor("name", "alice")
    b = TensorDict({"big": torch.randn(2, 40_000)}, [2])  # its own zero-copy frame
    b.set("names", NonTensorStack("b0", "b1"))
    td = TensorDict({"agents": lazy_stack([a, b], 1)}, [2])
    for threshold in (1, 64 * 1024, 1 << 40):
        out = round_trip(td, zero_copy_threshold=threshold)
        assert out.get("agents").tensordicts[0].get_non_tensor("name") == "alice"
        assert_same(out, td)


def test_a_lazy_stack_can_have_members_named_like_the_synthetic_keys():
    # "#0" is only synthetic directly under a lazy stack: elsewhere it is the caller's key.
    member = TensorDict({"#0": torch.ones(1), "#9": {"#1": torch.zeros(2)}}, [])
    td = TensorDict({"#0": torch.ones(2), "agents": lazy_stack([member, member.clone()])}, [])
    assert_same(round_trip(td), td)


def test_stacking_lazy_parts_is_stacking_their_tensordicts():
    env = HeterogeneousCountingEnv()
    td = env.rand_step(env.reset())
    encoder, decoder = Encoder(), Decoder()
    parts = [send(td, encoder, decoder) for _ in range(3)]
    assert parts[0].layout is parts[2].layout  # announced once, referred to by id
    assert_same(stack_parts(parts), torch.stack([p.to_tensordict() for p in parts]))
    root = hetero((2,), 1)
    rows = [send(root, encoder, decoder) for _ in range(2)]
    assert_same(stack_parts(rows), torch.stack([root, root]))


def test_layouts_without_lazy_stacks_encode_to_the_same_bytes_as_before():
    td = TensorDict(
        {
            "obs": torch.arange(3, dtype=torch.float32),
            "nested": TensorDict({"x": torch.arange(4, dtype=torch.int16).reshape(2, 2)}, [2]),
            "empty": TensorDict({}, []),
        },
        [],
    )
    td.set_non_tensor("info", "hi")
    frames = encode_message(Header(Command.RESULT, 0, 1), [Encoder().encode(td)])
    # Made by the encoder before "z" existed, byte for byte but for the version
    # (the header's second byte: 12 since REGISTER says set_state, which came later).
    assert PROTOCOL_VERSION == 12
    assert [bytes(memoryview(f).cast("B")).hex() for f in frames] == [
        "970c1e0001c400910082a14c810084a16290a174929491a36f6273a7666c6f617433329103c29492a6"
        "6e6573746564a178a5696e743136920202c2a16e9191a4696e666fa173929291a66e65737465649102"
        "9291a5656d70747990a26e749191a26869",
        "000000000000803f00000040000000000000010002000300",
    ]
    assert "z" not in layout_of(td).to_data()


def test_the_broker_can_size_and_check_the_heterogeneous_env():
    env = HeterogeneousCountingEnv()
    # What the broker's welcome computes from the specs a worker registers.
    specs = spec_from_data(msgpack.unpackb(msgpack.packb(spec_to_data(env.specs)), raw=False))
    assert specs == env.specs  # the spec codec carries its stacked (per-agent) specs already
    assert max_message_bytes([layout_of(specs.zero())]) >= 2 * 64 * 64 * 3 * 4
    action = SerialEnv(2, HeterogeneousCountingEnv).full_action_spec.rand()
    for row in action.unbind(0):  # the pool's payloads
        check_crossable(row)
        assert_same(round_trip(row), row)


def test_what_the_encoder_refuses_inside_members_is_named():
    bad = TensorDict({"x": torch.zeros(1, dtype=torch.bits16)}, [])
    with pytest.raises(ProtocolError, match="agents/#1/x"):
        check_crossable(TensorDict({"agents": lazy_stack([TensorDict({}, []), bad])}, []))
    odd = TensorDict({}, [])
    odd.set_non_tensor("obj", object())
    with pytest.raises(ProtocolError, match="agents/#0/obj"):
        Encoder().encode(TensorDict({"agents": lazy_stack([odd, TensorDict({}, [])])}, []))
    with pytest.raises(ProtocolError, match="no members"):
        Encoder().encode(LazyStackedTensorDict(stack_dim=0))


# ---------------------------------------------------------------- hostile layouts


def valid_layout() -> dict[str, Any]:
    """A lazy stack "a" of 2 members (batch [2]) at dim 1, in a part of batch [2]."""
    return {
        "b": [2],
        "t": [[["a", "#0", "x"], "float32", [2, 3], False], [["a", "#1", "y"], "int8", [2], False]],
        "n": [],
        "s": [[["a"], [2, 2]], [["a", "#0"], [2]], [["a", "#1"], [2]]],
        "z": [[["a"], 1, 2]],
    }


def decode(layout: dict[str, Any]) -> TensorDictBase:
    """Decode a part of ``layout`` (frames of the sizes it says), stack it, make it a tensordict."""
    try:
        frames = [bytes(size) for size in Layout.from_data(layout).frame_sizes]
    except ProtocolError:
        frames = [bytes(34)]  # the valid layout's one packed frame
    header = Header(Command.RESULT, layouts=(0,), body={"L": {0: layout}})
    parts = Decoder().decode(header, frames)
    stack_parts([parts[0], parts[0]])
    return parts[0].to_tensordict()


def test_the_valid_layout_decodes():
    td = decode(valid_layout())
    assert isinstance(td.get("a"), LazyStackedTensorDict) and td.get("a").stack_dim == 1


def _with(**changes: Any) -> dict[str, Any]:
    layout = valid_layout()
    for key, value in changes.items():
        if value is None:
            layout.pop(key)
        else:
            layout[key] = value
    return layout


S = valid_layout()["s"]
T = valid_layout()["t"]


@pytest.mark.parametrize(
    "layout",
    [
        _with(z="nope"),
        _with(z=[["a", 1, 2]]),  # key not a path
        _with(z=[[["a"], 1]]),  # no count
        _with(z=[[["a"], 1, 2, 0]]),
        _with(z=[[["a"], -1, 2]]),
        _with(z=[[["a"], True, 2]]),
        _with(z=[[["a"], 2, 2]]),  # stack_dim past the stack's dims
        _with(z=[[["a"], 16, 2]]),
        _with(z=[[["a"], 1, 0]]),  # no members
        _with(z=[[["a"], 1, -2]]),
        _with(z=[[["a"], 1, 1 << 40]]),
        _with(z=[[["a"], 1, 3]]),  # count is not the stack's size at stack_dim
        _with(z=[[["a"], 0, 2]], s=[[["a"], [2, 3]], S[1], S[2]]),  # members' batch is [3]
        _with(  # the stack's batch does not start with the part's [2]
            s=[[["a"], [3, 2]], [["a", "#0"], [3]], [["a", "#1"], [3]]],
            t=[[["a", "#0", "x"], "float32", [3], False], [["a", "#1", "y"], "int8", [3], False]],
        ),
        _with(z=[[["a"], 1, 2], [["a"], 1, 2]]),  # twice
        _with(z=[[["b"], 1, 2]]),  # not a branch
        _with(z=[[[], 0, 2]]),  # the part is not a stack of these
        _with(s=[S[0], S[1]]),  # member #1 not declared
        _with(s=[S[0], S[1], [["a", "#1"], [3]]], t=T[:1]),  # member #1 of another batch
        _with(s=[S[1], S[2]]),  # the stack itself not declared
        _with(t=[*T, [["a", "x"], "float32", [2, 2], False]]),  # a key beside the members
        _with(t=[*T, [["a", "#2", "x"], "float32", [2], False]]),  # a member past count
        _with(s=[*S, [["a", "#5"], [2]]]),
        _with(t=[*T, [["a", "#00"], "float32", [2], False]]),
        _with(n=[["a", "info"]]),  # a non-tensor beside the members
    ],
)
def test_malformed_lazy_stacks_are_refused(layout):
    with pytest.raises(ProtocolError):
        decode(layout)


def test_a_root_lazy_stack_must_hold_only_members():
    layout = {
        "b": [2],
        "t": [[["#0", "x"], "float32", [3], False], [["#1", "x"], "float32", [2], False]],
        "n": [],
        "s": [[["#0"], []], [["#1"], []]],
        "z": [[[], 0, 2]],
    }
    assert isinstance(decode(layout), LazyStackedTensorDict)
    layout["t"].append([["other"], "float32", [2], False])
    with pytest.raises(ProtocolError, match="none of its members"):
        decode(layout)


def test_counts_claiming_more_members_than_branches_are_refused_without_work():
    # 4096 stacks of 4096 members each would be 16M member names to make and look up.
    keys = [[f"k{i}"] for i in range(MAX_LEAVES)]
    layout = {
        "b": [],
        "t": [],
        "n": [],
        "s": [[key, [MAX_LEAVES]] for key in keys],
        "z": [[key, 0, MAX_LEAVES] for key in keys],
    }
    header = Header(Command.RESULT, layouts=(0,), body={"L": {0: layout}})

    class Untouchable:
        def __len__(self):
            raise AssertionError("the decoder read the frames of a refused layout")

    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ProtocolError, match="more members than"):
            Decoder().decode(header, Untouchable())  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 5.0
    assert peak < 8 << 20, f"refusing the layout allocated {peak} bytes"


def test_unknown_layout_keys_are_refused_as_an_old_peer_refuses_z():
    # A decoder that does not know "z" refuses the layout (a ProtocolError, answered as a
    # malformed message), which is why "z" did not need a PROTOCOL_VERSION bump.
    with pytest.raises(ProtocolError, match="keys b, t, n"):
        decode(_with(zz=[[["a"], 1, 2]]))
