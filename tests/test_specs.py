"""zmqpool.specs: torchrl specs <-> plain msgpack data, and refusal of bad data."""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.data import (
    Binary,
    Bounded,
    Categorical,
    Choice,
    Composite,
    MultiCategorical,
    MultiOneHot,
    NonTensor,
    OneHot,
    TensorSpec,
    Unbounded,
)
from torchrl.envs import GymEnv

from zmqpool import specs as specs_module
from zmqpool.errors import ProtocolError
from zmqpool.limits import MAX_DEPTH
from zmqpool.specs import spec_from_data, spec_to_data
from zmqpool.testing import CountingEnv

PLAIN_TYPES = (dict, list, str, int, float, bool, bytes, type(None))


def wire(data: Any) -> Any:
    return msgpack.unpackb(msgpack.packb(data, use_bin_type=True), raw=False)


def assert_plain(value: Any) -> None:
    assert isinstance(value, PLAIN_TYPES), type(value)
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str
            assert_plain(item)
    elif isinstance(value, list):
        for item in value:
            assert_plain(item)


def round_trip(spec: TensorSpec) -> TensorSpec:
    data = spec_to_data(spec)
    assert_plain(data)
    out = spec_from_data(wire(data))
    assert type(out) is type(spec)
    assert out == spec
    return out


def nested(depth: int) -> Composite:
    spec = Composite(leaf=Unbounded(shape=(1,)))
    for _ in range(depth - 1):
        spec = Composite(child=spec)
    return spec


# ---------------------------------------------------------------- round trips

LEAF_SPECS = {
    "unbounded-f32": Unbounded(shape=(3,)),
    "unbounded-f64-scalar": Unbounded(shape=(), dtype=torch.float64),
    "unbounded-bf16": Unbounded(shape=(2, 2), dtype=torch.bfloat16),
    "unbounded-i64": Unbounded(shape=(1,), dtype=torch.int64),
    "unbounded-u8": Unbounded(shape=(3, 4), dtype=torch.uint8),
    "unbounded-bool": Unbounded(shape=(2,), dtype=torch.bool),
    "unbounded-int-as-continuous": Unbounded(shape=(2,), dtype=torch.int32, domain="continuous"),
    "unbounded-empty": Unbounded(shape=(0, 5)),
    "bounded-scalar-bounds": Bounded(-1.0, 1.0, shape=(1,)),
    "bounded-per-element-f64": Bounded(
        torch.tensor([0.1, -1 / 3, -torch.inf], dtype=torch.float64),
        torch.tensor([0.2, 1 / 3, torch.inf], dtype=torch.float64),
        shape=(3,),
        dtype=torch.float64,
    ),
    "bounded-bf16": Bounded(
        torch.full((2, 3), -0.3), torch.full((2, 3), 0.7), shape=(2, 3), dtype=torch.bfloat16
    ),
    "bounded-i64": Bounded(0, 10, shape=(4,), dtype=torch.int64),
    "bounded-u8-image": Bounded(0, 255, shape=(3, 8, 8), dtype=torch.uint8),
    "bounded-bool": Bounded(False, True, shape=(2,), dtype=torch.bool),
    "categorical": Categorical(3),
    "categorical-bool": Categorical(2, shape=(1,), dtype=torch.bool),
    "categorical-i8": Categorical(5, shape=(4, 2), dtype=torch.int8),
    "categorical-mask": Categorical(3, shape=(2,), mask=torch.tensor([True, False, True])),
    "categorical-undefined-n": Categorical(-1),
    "one-hot": OneHot(4),
    "one-hot-i64": OneHot(4, shape=(2, 4), dtype=torch.int64),
    "one-hot-mask": OneHot(3, mask=torch.tensor([False, True, True])),
    "one-hot-register": OneHot(2, use_register=True),
    "binary": Binary(4),
    "binary-bool": Binary(shape=(2, 3), dtype=torch.bool),
    "multi-categorical": MultiCategorical([3, 2, 4]),
    "multi-categorical-batched": MultiCategorical([3, 2, 4], shape=(2, 3), dtype=torch.int32),
    "multi-categorical-keep-singleton": MultiCategorical([5], remove_singleton=False),
    "multi-categorical-mask": MultiCategorical(
        [2, 3], mask=torch.tensor([True, False, True, True, False])
    ),
    "multi-one-hot": MultiOneHot([3, 2, 3]),
    "multi-one-hot-batched": MultiOneHot([3, 2], shape=(4, 5), dtype=torch.uint8),
    "multi-one-hot-mask": MultiOneHot([2, 2], mask=torch.tensor([True, False, True, True])),
    "non-tensor": NonTensor(),
    "non-tensor-str": NonTensor(shape=(3,), example_data="a string"),
    "non-tensor-nested": NonTensor(example_data={"a": [1, 2.5, None], "b": b"\x00", "c": True}),
    "non-tensor-batched": NonTensor(shape=(2,), batched=True, example_data=7),
    "non-tensor-feature-dims": NonTensor(shape=(2, 3), feature_dims=1),
    "non-tensor-dtype": NonTensor(shape=(1,), dtype=torch.float32, device="cpu"),
}


@pytest.mark.parametrize("spec", LEAF_SPECS.values(), ids=LEAF_SPECS.keys())
def test_leaf_spec_round_trips(spec: TensorSpec) -> None:
    round_trip(spec)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
)
def test_bounds_are_bit_exact(dtype: torch.dtype) -> None:
    # ContinuousBox.__eq__ uses isclose, so compare the bits directly.
    low = (torch.arange(6, dtype=torch.float64) / 7 - 3).to(dtype).reshape(2, 3)
    high = low + 1
    out = round_trip(Bounded(low, high, shape=(2, 3), dtype=dtype))
    assert torch.equal(out.space.low, low) and out.space.low.dtype == dtype
    assert torch.equal(out.space.high, high)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.reshape(-1))
    return flat.view(torch.uint8)


def assert_bitwise_fresh(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bits as ``expected``, laid out as a fresh tensor, and writable."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.equal(bits(out), bits(expected))
    assert out.stride() == torch.empty(expected.shape, dtype=expected.dtype).stride()
    out.reshape(-1)[:1] = out.reshape(-1)[:1].clone()  # a real tensor, not an expanded view


def test_a_pixel_spec_with_scalar_bounds_travels_in_a_few_bytes() -> None:
    spec = Bounded(0, 255, shape=(3, 512, 512), dtype=torch.uint8)
    data = spec_to_data(spec)
    assert len(msgpack.packb(data, use_bin_type=True)) < 300  # was 1.57 MB, element by element
    one = {"dtype": "uint8", "shape": [1, 1, 1], "data": b"\0", "expand": [3, 512, 512]}
    assert data["low"] == one
    out = round_trip(spec)
    assert_bitwise_fresh(out.space.low, spec.space.low)
    assert_bitwise_fresh(out.space.high, spec.space.high)
    assert out.space.low.data_ptr() != out.space.high.data_ptr()


def test_per_channel_bounds_travel_one_element_per_channel() -> None:
    low = torch.tensor([0.0, -1.0, 2.5]).view(3, 1, 1).expand(3, 64, 64)
    spec = Bounded(low, low + 1, shape=(3, 64, 64))
    data = spec_to_data(spec)
    assert data["low"]["shape"] == [3, 1, 1] and data["low"]["expand"] == [3, 64, 64]
    out = round_trip(spec)
    assert_bitwise_fresh(out.space.low, low)


def test_bounds_that_vary_everywhere_travel_whole() -> None:
    low = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    data = spec_to_data(Bounded(low, low + 1, shape=(3, 4)))
    assert "expand" not in data["low"] and data["low"]["shape"] == [3, 4]
    one = spec_to_data(Bounded(-1.0, 1.0, shape=(1,)))  # nothing to shrink: sent whole
    assert "expand" not in one["low"]


def test_broadcast_bounds_compare_bits_not_values() -> None:
    # -0.0 == 0.0 and NaN != NaN: only bitwise-equal slices may be shrunk.
    signed = torch.tensor([[0.0, -0.0], [0.0, -0.0]])
    nans = torch.tensor([[0x7FC00000, 0x7FC00001]] * 2, dtype=torch.int32).view(torch.float32)
    for low in (signed, nans, torch.full((2, 2), float("nan"))):
        data = spec_to_data(Bounded(low, torch.ones(2, 2), shape=(2, 2)))
        out = spec_from_data(wire(data))  # NaN bounds: Bounded.__eq__ cannot tell, bits can
        assert_bitwise_fresh(out.space.low, low)
    assert spec_to_data(Bounded(signed, 1.0, shape=(2, 2)))["low"]["shape"] == [1, 2]
    assert spec_to_data(Bounded(nans, 1.0, shape=(2, 2)))["low"]["shape"] == [1, 2]


SHAPES = st.lists(st.integers(0, 4), max_size=4)
BOUND_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


@settings(max_examples=150, deadline=None)
@given(
    shape=SHAPES,
    dtype=st.sampled_from(BOUND_DTYPES),
    constant=st.lists(st.booleans(), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_any_bound_round_trips_bit_exact_with_fresh_strides(
    shape: list[int], dtype: torch.dtype, constant: list[bool], seed: int
) -> None:
    # Few distinct values, repeated along random dims: every shrink pattern occurs.
    generator = torch.Generator().manual_seed(seed)
    base_shape = [1 if constant[i] else n for i, n in enumerate(shape)]
    values = torch.tensor([0.0, -0.0, 1.0, float("nan"), -3.5])
    picks = torch.randint(0, 2 if dtype == torch.bool else 5, base_shape, generator=generator)
    low = values[picks].to(dtype).expand(shape)
    out = spec_from_data(wire(spec_to_data(Bounded(low, low, shape=shape, dtype=dtype))))
    assert_bitwise_fresh(out.space.low, low)
    assert_bitwise_fresh(out.space.high, low)


def test_masks_survive() -> None:
    mask = torch.tensor([True, False, True])
    out = round_trip(Categorical(3, shape=(2,), mask=mask))
    assert torch.equal(out.mask, mask.expand(2, 3))
    binary = Binary(3)
    binary.update_mask(torch.tensor([[True, False]] * 3))
    out = spec_from_data(wire(spec_to_data(binary)))
    assert torch.equal(out.mask, binary.mask)


def test_non_tensor_drops_non_plain_example_data() -> None:
    for example in (torch.zeros(2), (1, 2), {1: "int key"}, object()):
        data = spec_to_data(NonTensor(shape=(1,), example_data=example))
        assert data["example_data"] is None
        out = spec_from_data(wire(data))
        assert isinstance(out, NonTensor) and out.example_data is None


def test_composite_round_trips_shape_device_names_and_empty_entries() -> None:
    spec = Composite(
        obs=Composite(pixels=Bounded(0, 255, shape=(2, 3, 4, 4), dtype=torch.uint8), shape=(2, 3)),
        reward=Unbounded(shape=(2, 1)),
        missing=None,
        empty=Composite(shape=(2,)),
        shape=(2,),
        device="cpu",
        names=["env"],
        step_mdp_static=True,
    )
    spec["obs"].names = ["env", "time"]
    out = round_trip(spec)
    assert out.device == torch.device("cpu") and out.shape == (2,)
    assert out["missing"] is None
    assert out.names == ["env"] and out["obs"].names == ["env", "time"]
    assert out.step_mdp_static and not out["obs"].step_mdp_static


def test_composite_without_device_stays_without_device() -> None:
    out = round_trip(Composite(a=Unbounded(shape=(1,))))
    assert out.device is None


def test_deep_nesting_up_to_the_cap_round_trips() -> None:
    round_trip(nested(MAX_DEPTH))


def test_heterogeneous_stacks_round_trip() -> None:
    stacked = torch.stack(
        [Composite(obs=Unbounded(shape=(3,))), Composite(obs=Unbounded(shape=(4,)))]
    )
    assert type(stacked).__name__ == "StackedComposite"
    round_trip(stacked)
    leaves = torch.stack([Unbounded(shape=(3,)), Unbounded(shape=(4,))], dim=0)
    assert type(leaves).__name__ == "Stacked"
    round_trip(leaves)


# ---------------------------------------------------------------- env specs


@pytest.mark.parametrize(
    "kwargs", [{}, {"obs_shape": (3, 84, 84), "obs_dtype": torch.uint8}], ids=["vector", "image"]
)
def test_counting_env_specs_round_trip(kwargs: dict[str, Any]) -> None:
    specs = CountingEnv(**kwargs).specs
    out = round_trip(specs)
    assert set(out.keys()) == {"output_spec", "input_spec"}


@pytest.mark.parametrize("env_name", ["CartPole-v1", "Pendulum-v1"])
def test_gym_env_specs_round_trip(env_name: str) -> None:
    env = GymEnv(env_name)
    try:
        round_trip(env.specs)
    finally:
        env.close()


def test_batched_env_specs_round_trip() -> None:
    specs = CountingEnv().specs
    batched = torch.stack([specs, specs])
    assert type(batched) is Composite and batched.shape == (2,)
    out = round_trip(batched)
    action = out["input_spec", "full_action_spec", "action"]
    assert action.shape == (2, 1)


def test_batched_gym_specs_round_trip() -> None:
    env = GymEnv("Pendulum-v1")
    try:
        round_trip(torch.stack([env.specs] * 3))
    finally:
        env.close()


def test_a_tensordict_data_cls_round_trips() -> None:
    """torchrl's PendulumEnv declares its params so; specs compare data_cls (seeding audit)."""
    spec = Composite(params=Composite(g=Unbounded(shape=()), data_cls=TensorDict))
    back = round_trip(spec)
    assert back["params"].data_cls is TensorDict


# ---------------------------------------------------------------- refused on encode


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (Composite(c=Choice([Categorical(2), Categorical(3)])), "Choice"),
        (Unbounded(shape=(-2, 3)), "shape"),  # -1 is torchrl's variable-size dim, and crosses
        (Unbounded(shape=(2,), device="meta"), "device"),
        (NonTensor(dtype=torch.bits16), "dtype"),
        (nested(MAX_DEPTH + 1), "deeper"),
    ],
    ids=["choice", "negative-dim", "meta-device", "bits16", "too-deep"],
)
def test_encode_refuses_what_cannot_cross(spec: TensorSpec, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        spec_to_data(spec)


def test_encode_refuses_non_specs() -> None:
    for value in (None, 3, {"class": "Composite"}):
        with pytest.raises(ProtocolError):
            spec_to_data(value)  # type: ignore[arg-type]


# ---------------------------------------------------------------- refused on decode


def bounded_data() -> dict[str, Any]:
    return spec_to_data(Bounded(-1.0, 1.0, shape=(2,)))


def counting_data() -> dict[str, Any]:
    return wire(spec_to_data(CountingEnv().specs))


def with_(data: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    out.update(changes)
    return out


def pixel_data(**low: Any) -> dict[str, Any]:
    """A broadcast uint8 bound's data, with ``low`` changed."""
    data = spec_to_data(Bounded(0, 255, shape=(3, 4, 4), dtype=torch.uint8))
    data["low"].update(low)
    return data


def nested_data(depth: int) -> dict[str, Any]:
    data: dict[str, Any] = spec_to_data(Unbounded(shape=(1,)))
    for _ in range(depth):
        data = with_(spec_to_data(Composite()), entries={"child": data})
    return data


BAD_DATA = {
    "none": None,
    "int": 5,
    "str": "Composite",
    "list": [1, 2],
    "bytes": b"\x80\x04",
    "empty-dict": {},
    "class-int": {"class": 5},
    "class-list": {"class": ["Composite"]},
    "unknown-class": {"class": "Pickle", "shape": []},
    "base-class": with_(bounded_data(), **{"class": "TensorSpec"}),
    "unknown-dtype": with_(bounded_data(), dtype="float128"),
    "dotted-dtype": with_(bounded_data(), dtype="torch.float32"),
    "dtype-not-str": with_(bounded_data(), dtype=7),
    "missing-key": {k: v for k, v in bounded_data().items() if k != "high"},
    "extra-key": with_(bounded_data(), __reduce__="os.system"),
    "negative-dim": with_(bounded_data(), shape=[-2]),
    "huge-dim": with_(spec_to_data(Unbounded(shape=(1,))), shape=[2**40]),
    "huge-numel": with_(spec_to_data(Unbounded(shape=(1,))), shape=[2**16, 2**16]),
    "overflowing-numel": with_(spec_to_data(Unbounded(shape=(1,))), shape=[2**31] * 3),
    "too-many-dims": with_(spec_to_data(Unbounded(shape=(1,))), shape=[1] * 33),
    "bool-dim": with_(bounded_data(), shape=[True, True]),
    "float-dim": with_(bounded_data(), shape=[2.0]),
    "shape-str": with_(bounded_data(), shape="2"),
    "device-cuda": with_(bounded_data(), device="cuda"),
    "device-int": with_(bounded_data(), device=0),
    "low-short-bytes": with_(
        bounded_data(), low={"dtype": "float32", "shape": [2], "data": b"\0" * 7}
    ),
    "low-long-bytes": with_(
        bounded_data(), low={"dtype": "float32", "shape": [2], "data": b"\0" * 9}
    ),
    "low-str-data": with_(bounded_data(), low={"dtype": "float32", "shape": [2], "data": "x" * 8}),
    "low-wrong-dtype": with_(
        bounded_data(), low={"dtype": "int32", "shape": [2], "data": b"\0" * 8}
    ),
    "low-wrong-shape": with_(
        bounded_data(), low={"dtype": "float32", "shape": [1], "data": b"\0" * 4}
    ),
    "low-not-dict": with_(bounded_data(), low=[0.0, 0.0]),
    "low-extra-key": with_(
        bounded_data(), low={"dtype": "float32", "shape": [2], "data": b"\0" * 8, "x": 1}
    ),
    "expand-wrong-byte-length": pixel_data(data=b"\0\0"),
    "expand-no-bytes": pixel_data(data=b""),
    "expand-bytes-not-bytes": pixel_data(data=0),
    "expand-negative-dim": pixel_data(expand=[3, -4, 4]),
    "expand-huge-dim": pixel_data(expand=[3, 2**40, 4]),
    "expand-too-many-elements": pixel_data(expand=[2**16, 2**16, 1]),
    # Within the caps, but far beyond the leaf's (counted) shape: refused before
    # allocating the 8 GB the expansion would take.
    "expand-beyond-the-leaf": pixel_data(expand=[2**31, 1, 1]),
    "expand-not-the-leaf-shape": pixel_data(expand=[3, 4, 5]),
    "expand-fewer-dims": pixel_data(expand=[4, 4]),
    "expand-more-dims": pixel_data(expand=[1, 3, 4, 4]),
    "expand-not-broadcastable": pixel_data(shape=[2, 1, 1], data=b"\0\0", expand=[3, 4, 4]),
    "expand-not-list": pixel_data(expand="3,4,4"),
    "expand-float-dims": pixel_data(expand=[3.0, 4.0, 4.0]),
    "expand-none": pixel_data(expand=None),
    "expand-wrong-dtype": pixel_data(dtype="int8"),
    "expand-bad-bool-bytes": with_(
        spec_to_data(Bounded(False, True, shape=(4,), dtype=torch.bool)),
        low={"dtype": "bool", "shape": [1], "data": b"\x02", "expand": [4]},
    ),
    "expand-on-a-mask": with_(
        spec_to_data(Categorical(3, shape=(2,))),
        mask={"dtype": "bool", "shape": [1, 1], "data": b"\x01", "expand": [2, 3]},
    ),
    "expand-on-nvec": with_(
        spec_to_data(MultiCategorical([2, 2])),
        nvec={"dtype": "int64", "shape": [1], "data": (2).to_bytes(8, "little"), "expand": [2]},
    ),
    "categorical-n-float": with_(spec_to_data(Categorical(3)), n=3.0),
    "categorical-n-bool": with_(spec_to_data(Categorical(3)), n=True),
    "categorical-n-negative": with_(spec_to_data(Categorical(3)), n=-2),
    "mask-bad-bool-bytes": with_(
        spec_to_data(Categorical(3)), mask={"dtype": "bool", "shape": [3], "data": b"\x01\x02\x00"}
    ),
    "mask-not-bool": with_(
        spec_to_data(Categorical(3)), mask={"dtype": "uint8", "shape": [3], "data": b"\x01\x01\x00"}
    ),
    "mask-wrong-shape": with_(
        spec_to_data(Categorical(3)), mask={"dtype": "bool", "shape": [4], "data": b"\x01" * 4}
    ),
    "one-hot-n-mismatch": with_(spec_to_data(OneHot(4)), n=5),
    "one-hot-register-int": with_(spec_to_data(OneHot(4)), use_register=1),
    "multi-one-hot-bad-nvec": with_(spec_to_data(MultiOneHot([2, 2])), nvec=[2, "2"]),
    "multi-one-hot-sum-mismatch": with_(spec_to_data(MultiOneHot([2, 2])), nvec=[2, 3]),
    "multi-categorical-float-nvec": with_(
        spec_to_data(MultiCategorical([2, 2])),
        nvec={"dtype": "float32", "shape": [2], "data": b"\0" * 8},
    ),
    "multi-categorical-negative-nvec": with_(
        spec_to_data(MultiCategorical([2, 2])),
        nvec={"dtype": "int8", "shape": [2], "data": b"\x02\xff"},
    ),
    "non-tensor-ext-example": with_(
        spec_to_data(NonTensor()), example_data=msgpack.ExtType(1, b"")
    ),
    "non-tensor-tuple-example": with_(spec_to_data(NonTensor()), example_data=(1, 2)),
    "non-tensor-feature-dims-when-batched": with_(
        spec_to_data(NonTensor(batched=True)), feature_dims=1
    ),
    "composite-entries-list": with_(spec_to_data(Composite()), entries=[]),
    "composite-int-key": with_(spec_to_data(Composite()), entries={1: None}),
    "composite-entry-garbage": with_(spec_to_data(Composite()), entries={"a": 3}),
    "composite-reserved-key": with_(
        spec_to_data(Composite()), entries={"shape": spec_to_data(Unbounded(shape=(1,)))}
    ),
    "composite-child-shape-mismatch": with_(
        spec_to_data(Composite(shape=(2,))), entries={"a": spec_to_data(Unbounded(shape=(3,)))}
    ),
    "composite-names-wrong-length": with_(spec_to_data(Composite(shape=(2,))), names=["a", "b"]),
    "composite-names-not-str": with_(spec_to_data(Composite(shape=(2,))), names=[3]),
    "composite-static-none": with_(spec_to_data(Composite()), step_mdp_static=None),
    "too-deep": nested_data(MAX_DEPTH + 1),
    "far-too-deep": nested_data(500),
    "stack-empty": {"class": "StackedComposite", "dim": 0, "specs": []},
    "stack-not-list": {"class": "Stacked", "dim": 0, "specs": "ab"},
    "stack-leaf-in-composite-stack": {
        "class": "StackedComposite",
        "dim": 0,
        "specs": [spec_to_data(Unbounded(shape=(1,)))],
    },
    "stack-mixed-classes": {
        "class": "Stacked",
        "dim": 0,
        "specs": [spec_to_data(Unbounded(shape=(1,))), spec_to_data(Categorical(2, shape=(1,)))],
    },
    "stack-dim-out-of-range": {
        "class": "Stacked",
        "dim": 5,
        "specs": [spec_to_data(Unbounded(shape=(1,)))] * 2,
    },
}


@pytest.mark.parametrize("data", BAD_DATA.values(), ids=BAD_DATA.keys())
def test_malformed_data_raises_protocol_error(data: Any) -> None:
    with pytest.raises(ProtocolError):
        spec_from_data(data)


def test_tree_element_budget_counts_all_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every leaf fits the cap, but together they do not: torchrl would
    # materialise each Unbounded's low/high, so the tree shares one budget.
    spec = Composite(a=Unbounded(shape=(40,)), b=Unbounded(shape=(40,)), c=Unbounded(shape=(40,)))
    data = spec_to_data(spec)
    monkeypatch.setattr(specs_module, "MAX_NUMEL", 100)
    with pytest.raises(ProtocolError, match="more than 100 elements"):
        spec_from_data(data)
    with pytest.raises(ProtocolError, match="more than 100 elements"):
        spec_to_data(spec)
    spec_from_data(spec_to_data(Composite(a=Unbounded(shape=(50,)), b=Unbounded(shape=(50,)))))


def test_tree_element_budget_counts_broadcast_bounds_at_full_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A few bytes each, but materialised at the leaf's shape: they count as such.
    spec = Composite(a=Bounded(0, 1, shape=(60,)), b=Bounded(0, 1, shape=(60,)))
    data = spec_to_data(spec)
    assert data["entries"]["a"]["low"]["expand"] == [60]
    monkeypatch.setattr(specs_module, "MAX_NUMEL", 100)
    with pytest.raises(ProtocolError, match="more than 100 elements"):
        spec_from_data(data)


def test_error_names_the_path_and_field() -> None:
    data = counting_data()
    actions = data["entries"]["input_spec"]["entries"]["full_action_spec"]
    actions["entries"]["action"]["low"]["data"] = b"\0"
    with pytest.raises(ProtocolError, match=r"input_spec/full_action_spec/action: low\.data"):
        spec_from_data(data)


def test_protocol_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        spec_from_data({"class": "nope"})


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into ``value``'s dicts and lists."""
    out = [prefix] if prefix else []
    if isinstance(value, (dict, list)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            out += paths(item, (*prefix, key))
    return out


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=16),
    st.lists(st.integers(-3, 3), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
COUNTING_DATA = counting_data()
COUNTING_PATHS = paths(COUNTING_DATA)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(COUNTING_PATHS) - 1), junk=JUNK, delete=st.booleans())
def test_any_single_corruption_raises_only_protocol_error(
    index: int, junk: Any, delete: bool
) -> None:
    data = copy.deepcopy(COUNTING_DATA)
    *parents, last = COUNTING_PATHS[index]
    target = data
    for key in parents:
        target = target[key]
    if delete and isinstance(target, dict):
        del target[last]
    else:
        target[last] = junk
    try:
        spec = spec_from_data(data)
    except ProtocolError:
        return
    assert isinstance(spec, TensorSpec)


def test_a_few_bytes_cannot_describe_gigabytes_of_bounds() -> None:
    # An Unbounded float64 leaf of 2**30 elements: torchrl would materialise
    # 16 GiB of low/high from these few bytes of spec data.
    data = spec_to_data(Unbounded(shape=(4,), dtype=torch.float64))
    data["shape"] = [2**30]
    assert len(msgpack.packb(data)) < 200
    with pytest.raises(ProtocolError, match=f"more than {specs_module.MAX_SPEC_BYTES} bytes"):
        spec_from_data(data)


def test_tree_byte_budget_counts_all_leaves_by_their_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # A box leaf costs three tensors of its shape once built: its low, high and a zero.
    monkeypatch.setattr(specs_module, "MAX_SPEC_BYTES", 3000)
    fits = Composite(a=Unbounded(shape=(100,)), b=Unbounded(shape=(150,)))  # 3 x (400 + 600)
    assert spec_from_data(spec_to_data(fits)) == fits
    too_big = Composite(a=Unbounded(shape=(100,), dtype=torch.float64), b=Unbounded(shape=(100,)))
    with pytest.raises(ProtocolError, match="more than 3000 bytes"):
        spec_to_data(too_big)
    with pytest.raises(ProtocolError, match="more than 2999 bytes"):
        spec_from_data(spec_to_data(fits), max_bytes=2999)
