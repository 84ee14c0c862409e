"""Tensorclasses on the wire: by name (layout field ``"c"``, spec ``data_cls``), never by code.

A tensorclass value crosses as the tensordict it wraps plus ``"module:qualname"``;
the receiver looks the name up among the modules it has loaded (it never imports
one), takes it only if it is a tensorclass type, and rebuilds an instance: plain,
batched, nested, stacked by the pool, inside lazy stacks, with non-tensor fields.
A malformed name, or one naming anything else, is a ``ProtocolError``; a class
that is not loaded gives a plain TensorDict (a spec with ``data_cls=None``) and
one ``TensorclassNotLoadedWarning``. Last, torchrl's ``EnvWithTensorClass`` in a
real pool, compared with ``SerialEnv``.
"""

from __future__ import annotations

import os
import sys
import time
import tracemalloc
import types
import uuid
import warnings
from collections.abc import Iterator
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
    is_tensorclass,
    lazy_stack,
    tensorclass,
)
from torchrl.data import Composite, NonTensor, Unbounded
from torchrl.envs import SerialEnv
from torchrl.testing.mocking_classes import TC, CountingEnv, EnvWithTensorClass

from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.batching import RowPacker, stack_parts
from zmqpool.classnames import (
    TensorclassNotLoadedWarning,
    parse_class_name,
    resolve_tensorclass,
    tensorclass_name,
)
from zmqpool.codec import Decoder, Encoder, check_crossable, layout_of
from zmqpool.errors import ProtocolError
from zmqpool.layout import Layout, max_message_bytes
from zmqpool.limits import MAX_CLASS_NAME, MAX_LEAVES
from zmqpool.specs import spec_from_data, spec_to_data
from zmqpool.wire import PROTOCOL_VERSION, Command, Header, encode_message

TC_NAME = "torchrl.testing.mocking_classes:TC"


@tensorclass
class Pair:
    """A tensorclass of this module: a tensor, a str and any plain value."""

    obs: torch.Tensor
    label: str
    info: Any = None


@tensorclass
class Outer:
    """Tensorclasses inside a tensorclass."""

    inner: TC
    pair: Any = None
    weight: torch.Tensor | None = None


@tensorclass
class Vec:
    """Tensors only: a batch of these would pack like plain leaves, were it not for its class."""

    x: torch.Tensor


# ---------------------------------------------------------------- helpers


def as_received(frames: list[Any]) -> list[memoryview]:
    """What a peer gets: read-only buffers, like zmq frames."""
    return [memoryview(bytes(memoryview(f).cast("B"))) for f in frames]


def send(td: Any, encoder: Encoder | None = None, decoder: Decoder | None = None):
    encoder, decoder = encoder or Encoder(), decoder or Decoder()
    frames = as_received(encode_message(Header(Command.RESULT, 0, 1), [encoder.encode(td)]))
    return decoder.decode(Header.decode(frames[0]), frames[1:])[0]


def round_trip(td: Any, **encoder_kwargs: Any) -> Any:
    return send(td, Encoder(**encoder_kwargs)).to_tensordict()


def picture(value: Any) -> Any:
    """Types (tensorclasses by class), batch sizes, keys, dtypes, shapes, bytes, non-tensors."""
    if isinstance(value, torch.Tensor):
        raw = value.contiguous().reshape(-1).view(torch.uint8).tolist()
        return ("tensor", value.dtype, tuple(value.shape), raw)
    if isinstance(value, NonTensorStack):
        return ("stack", tuple(value.batch_size), value.tolist())
    if isinstance(value, NonTensorData):
        return ("data", tuple(value.batch_size), value.data)
    if is_tensorclass(value):
        return ("class", type(value), picture(value._tensordict))
    if isinstance(value, LazyStackedTensorDict):
        members = [picture(member) for member in value.tensordicts]
        return ("lazy", value.stack_dim, tuple(value.batch_size), members)
    entries = {name: picture(item) for name, item in value.items()}
    return ("td", tuple(value.batch_size), entries)


def assert_same(got: Any, want: Any) -> None:
    assert picture(got) == picture(want)


def layout_with(c: Any, **fields: Any) -> dict[str, Any]:
    """EnvWithTensorClass's reset layout, with tensorclasses ``c`` (and other fields changed)."""
    layout = {
        "b": [],
        "t": [[["obs"], "float32", [1], False], [["tc", "field1"], "float32", [], False]],
        "n": [["tc", "field0"]],
        "s": [[["tc"], []]],
        "c": c,
    }
    layout.update(fields)
    return {key: value for key, value in layout.items() if value is not None}


def decode(layout: dict[str, Any], nontensor: list[Any] | None = None) -> Any:
    """Decode one part of ``layout`` (zeroed frames of the sizes it says) and build it."""
    frames = [bytes(size) for size in Layout.from_data(layout).frame_sizes]
    body: dict[str, Any] = {"L": {0: layout}}
    if layout["n"]:
        body["nt"] = [nontensor or ["0"] * len(layout["n"])]
    parts = Decoder().decode(Header(Command.RESULT, layouts=(0,), body=body), frames)
    return parts[0].to_tensordict()


def fake_module(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, type]:
    """A module that exists only in ``sys.modules``, holding a tensorclass ``Dyn``."""
    name = f"zmqpool_fake_{uuid.uuid4().hex}"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    namespace = {
        "__module__": name,
        "__qualname__": "Dyn",
        "__annotations__": {"x": torch.Tensor, "label": str},
    }
    cls = tensorclass(type("Dyn", (), namespace))
    module.Dyn = cls  # type: ignore[attr-defined]
    return module, cls


def not_loaded_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, TensorclassNotLoadedWarning)]


# ---------------------------------------------------------------- round trips


def test_the_env_with_tensor_class_round_trips_as_instances():
    env = EnvWithTensorClass()
    reset = env.reset()
    part = send(reset)
    data = part.layout.to_data()
    assert data["c"] == [[["tc"], TC_NAME]] and [["tc"], []] in data["s"]
    out = part.to_tensordict()
    assert type(out.get("tc")) is TC
    assert out.get("tc").field0 == "0" and torch.equal(out.get("tc").field1, torch.zeros(()))
    assert_same(out, reset)
    step = env.rand_step(reset)
    out = round_trip(step)
    assert type(out.get(("next", "tc"))) is TC and out.get(("next", "tc")).field0 == "1"
    assert_same(out, step)


def test_batched_tensorclasses_with_non_tensor_fields_round_trip():
    one = Pair(obs=torch.randn(3, 2), label="same", info={"k": [1, 2]}, batch_size=[3])
    stacked = torch.stack([Pair(obs=torch.randn(2), label=s) for s in "ab"])
    assert isinstance(stacked._tensordict.get("label"), NonTensorStack)
    td = TensorDict({"one": one, "x": torch.ones(3)}, [3])
    out = round_trip(td)
    assert type(out.get("one")) is Pair
    assert out.get("one").label == "same" and out.get("one").info == {"k": [1, 2]}
    assert_same(out, td)
    out = round_trip(TensorDict({"stacked": stacked}, [2]))
    assert type(out.get("stacked")) is Pair and out.get("stacked").label == ["a", "b"]
    assert_same(out.get("stacked"), stacked)


def test_nested_tensorclasses_with_batch_sizes_of_their_own():
    inner = TC("1", torch.arange(6.0).reshape(2, 3), batch_size=[2, 3])
    pair = Pair(obs=torch.zeros(2, 4), label="p", info=[1, "two"], batch_size=[2])
    outer = Outer(inner=inner, pair=pair, weight=torch.ones(2), batch_size=[2])
    td = TensorDict({"outer": outer, "plain": TensorDict({"pair": pair}, [2])}, [2])
    for threshold in (1, 64 * 1024):  # every leaf in a frame of its own, or packed
        out = round_trip(td, zero_copy_threshold=threshold)
        got = out.get("outer")
        assert type(got) is Outer and type(got.inner) is TC and type(got.pair) is Pair
        assert got.inner.batch_size == (2, 3) and got.pair.info == [1, "two"]
        assert type(out.get(("plain", "pair"))) is Pair
        assert_same(out, td)


def test_a_part_that_is_a_tensorclass_comes_back_one():
    pair = Pair(obs=torch.randn(4, 3), label="root", batch_size=[4])
    out = round_trip(pair)
    assert type(out) is Pair and out.label == "root"
    assert_same(out, pair)
    assert Encoder().encode(pair).new_layout["c"] == [[[], tensorclass_name(Pair)]]


def test_tensorclasses_inside_lazy_stacks_and_lazy_stacks_inside_tensorclasses():
    members = [
        TensorDict({"tc": TC(str(i), torch.full((i + 1,), float(i)), batch_size=[]), "k": i}, [])
        for i in range(3)
    ]
    members[1].set("extra", torch.ones(2))
    of_tds = lazy_stack(members)  # members with a tensorclass entry each
    of_instances = LazyStackedTensorDict(TC("a", torch.zeros(2)), TC("b", torch.ones(2)))
    wrapping = LazyStackedTensorDict.lazy_stack([TC("0", torch.zeros(2)), TC("1", torch.ones(3))])
    assert isinstance(wrapping._tensordict, LazyStackedTensorDict)
    td = TensorDict({"of_tds": of_tds, "of_instances": of_instances, "wrapping": wrapping}, [])
    out = round_trip(td)
    got = out.get("of_tds")
    assert isinstance(got, LazyStackedTensorDict)
    assert [type(m.get("tc")) for m in got.tensordicts] == [TC] * 3
    assert [m.get("tc").field0 for m in got.tensordicts] == ["0", "1", "2"]
    assert [type(m) for m in out.get("of_instances").tensordicts] == [TC, TC]
    got = out.get("wrapping")
    assert type(got) is TC and isinstance(got._tensordict, LazyStackedTensorDict)
    assert got.field0 == ["0", "1"]
    assert_same(out, td)


def test_none_fields_and_fields_held_outside_the_tensordict():
    pair = Pair(obs=torch.ones(1), label=None)  # None: kept outside the tensordict
    out = round_trip(TensorDict({"p": pair}, []))
    assert out.get("p").label is None and out.get("p").info is None
    odd = Pair(obs=torch.ones(1), label="x")
    odd._non_tensordict["info"] = "held outside"  # tensordict keeps only None there itself
    out = round_trip(TensorDict({"p": odd}, []))
    assert out.get("p").info == "held outside" and out.get("p").label == "x"


def test_stacking_parts_gives_a_batch_of_instances():
    env = EnvWithTensorClass()
    step = env.rand_step(env.reset())
    encoder, decoder = Encoder(), Decoder()
    parts = [send(step, encoder, decoder) for _ in range(3)]
    assert parts[0].layout is parts[2].layout  # announced once, referred to by id
    stacked = stack_parts(parts)
    tc = stacked.get(("next", "tc"))
    assert type(tc) is TC and tc.batch_size == (3,) and tc.field0 == ["1"] * 3
    assert_same(stacked, torch.stack([part.to_tensordict() for part in parts]))
    rows = [send(Pair(obs=torch.ones(2), label=f"r{i}"), encoder, decoder) for i in range(2)]
    batch = stack_parts(rows)
    assert type(batch) is Pair and batch.label == ["r0", "r1"]


def test_the_row_packer_leaves_tensorclasses_to_the_encoder():
    batch = TensorDict({"v": Vec(x=torch.randn(4, 2), batch_size=[4]), "a": torch.ones(4)}, [4])
    assert RowPacker().pack(batch) is None  # packed as plain leaves, the class would be lost
    for row in batch.unbind(0):
        check_crossable(row)
        out = round_trip(row)
        assert type(out.get("v")) is Vec
        assert_same(out, row)


def test_layouts_without_tensorclasses_are_unchanged():
    reset = EnvWithTensorClass().reset()
    plain = reset.clone()
    plain.set("tc", reset.get("tc")._tensordict)  # the same entries, as a plain TensorDict
    data = layout_of(plain).to_data()
    assert "c" not in data and "s" not in data  # no branch: same batch size, keys of its own
    out = round_trip(plain)
    assert type(out.get("tc")) is TensorDict
    # "c" needed no bump (the wire docstring); 3 to 12 (batches, rows joined, held replies,
    # WELCOME's max_frame, SEED's next_seed, the beacon's asks, pieces, reset keywords,
    # set_state and reseed) came later.
    assert PROTOCOL_VERSION == 12


def test_the_broker_sizes_a_tensorclass_env_from_its_specs():
    env = EnvWithTensorClass()
    specs = spec_from_data(msgpack.unpackb(msgpack.packb(spec_to_data(env.specs)), raw=False))
    zero = specs.zero()
    assert type(zero.get(("output_spec", "full_observation_spec", "tc"))) is TC
    assert max_message_bytes([layout_of(zero)]) >= 1 << 20
    check_crossable(env.reset())


# ---------------------------------------------------------------- specs


def test_env_with_tensor_class_specs_round_trip():
    env = EnvWithTensorClass()
    data = spec_to_data(env.specs)
    tc = data["entries"]["output_spec"]["entries"]["full_observation_spec"]["entries"]["tc"]
    assert tc["data_cls"] == TC_NAME
    back = spec_from_data(msgpack.unpackb(msgpack.packb(data, use_bin_type=True), raw=False))
    assert back == env.specs
    assert back["output_spec", "full_observation_spec", "tc"].data_cls is TC
    batched = torch.stack([env.specs, env.specs])
    assert spec_from_data(spec_to_data(batched)) == batched


def test_specs_without_data_cls_have_no_such_key():
    assert "data_cls" not in msgpack.packb(spec_to_data(CountingEnv().specs)).decode("latin-1")


def spec_with(name: Any, **entries: Any) -> dict[str, Any]:
    spec = Composite(field0=NonTensor(example_data="x", shape=()), field1=Unbounded(shape=()))
    data = spec_to_data(spec)
    data["entries"].update(entries)
    data["data_cls"] = name
    return data


@pytest.mark.parametrize(
    "name",
    ["os:system", "builtins:dict", "tensordict:NonTensorData", "no colon", 7, None, "a:b:c"],
)
def test_a_spec_data_cls_that_is_no_tensorclass_is_refused(name):
    with pytest.raises(ProtocolError, match="data_cls"):
        spec_from_data(spec_with(name))


def test_a_spec_data_cls_must_have_a_field_per_entry():
    assert spec_from_data(spec_with(TC_NAME)).data_cls is TC
    extra = spec_to_data(Unbounded(shape=()))
    with pytest.raises(ProtocolError, match="has no field 'evil'"):
        spec_from_data(spec_with(TC_NAME, evil=extra))


def test_encoding_refuses_a_data_cls_no_peer_could_name():
    @tensorclass
    class Odd:
        x: torch.Tensor

    Odd.__qualname__ = "not a name"
    with pytest.raises(ProtocolError, match="data_cls"):
        spec_to_data(Composite(x=Unbounded(shape=()), data_cls=Odd))
    with pytest.raises(ProtocolError, match="entry odd"):
        check_crossable(TensorDict({"odd": Odd(x=torch.ones(()))}, []))


# ---------------------------------------------------------------- names refused


MALFORMED = [
    "",
    "module",
    ":TC",
    "torchrl:",
    "a:b:c",
    "1torch:TC",
    "torchrl..testing:TC",
    "torchrl.testing.mocking_classes:TC.",
    "torchrl.testing.mocking_classes:.TC",
    "torchrl.testing.mocking_classes:<locals>",
    "torchrl.testing.mocking_classes:TC.<locals>",
    "os:system()",
    "os:system; rm -rf /",
    "os:__import__('os').system",
    "a:" + "b" * MAX_CLASS_NAME,
    7,
    None,
    b"os:system",
    ["os", "system"],
]


@pytest.mark.parametrize("name", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_names_are_refused(name):
    with pytest.raises(ProtocolError):
        parse_class_name(name)
    with pytest.raises(ProtocolError):
        decode(layout_with([[["tc"], name]]))


NOT_TENSORCLASSES = [
    "os:system",
    "builtins:dict",
    "builtins:dict.fromkeys",
    "builtins:object",
    "os:path",  # a module
    "os.path:join",
    "sys:modules",  # a dict instance
    "torch:Tensor",
    "tensordict:TensorDict",
    "tensordict:NonTensorData",  # a tensorclass, but the wire's non-tensors are plain data
    "tensordict:NonTensorStack",
    "torchrl.testing.mocking_classes:EnvWithTensorClass",
    "torchrl.testing.mocking_classes:TC.__init__",
]


@pytest.mark.parametrize("name", NOT_TENSORCLASSES)
def test_names_of_anything_but_a_tensorclass_are_refused(name):
    with pytest.raises(ProtocolError, match="refused"):
        resolve_tensorclass(name)
    with pytest.raises(ProtocolError, match="refused"):
        decode(layout_with([[["tc"], name]]))


def test_what_a_refused_name_names_is_never_called(monkeypatch):
    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *args: calls.append(("os.system", args)))

    class Meta(type):
        def __call__(cls, *args, **kwargs):
            calls.append(("call", cls))

        def __getattr__(cls, name):
            calls.append(("getattr", name))
            raise AttributeError(name)

    trap = types.ModuleType(f"zmqpool_trap_{uuid.uuid4().hex}")
    trap.Evil = Meta("Evil", (), {})  # type: ignore[attr-defined]
    trap.__getattr__ = lambda name: calls.append(("module getattr", name))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, trap.__name__, trap)
    for name in ("os:system", f"{trap.__name__}:Evil"):
        with pytest.raises(ProtocolError, match="refused"):
            decode(layout_with([[["tc"], name]]))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        decode(layout_with([[["tc"], f"{trap.__name__}:Lazy"]]))  # a module __getattr__ name
    assert calls == []


def test_a_module_that_is_not_imported_is_never_imported(tmp_path, monkeypatch):
    name = f"zmqpool_evil_{uuid.uuid4().hex}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(TensorclassNotLoadedWarning, match=f"import {name}"):
        out = decode(layout_with([[["tc"], f"{name}:TC"]]))
    assert type(out.get("tc")) is TensorDict
    assert name not in sys.modules and not marker.exists()


@pytest.mark.parametrize(
    "c",
    [
        "nope",
        [],
        [[["tc"]]],
        [[["tc"], TC_NAME, 1]],
        [["tc", TC_NAME]],  # the key is not a path
        [[[""], TC_NAME]],
        [[["nope"], TC_NAME]],  # not a branch
        [[["tc"], TC_NAME], [["tc"], TC_NAME]],  # twice
        [[["tc", "field1"], TC_NAME]],  # a leaf
        [[["obs"], TC_NAME]],
    ],
)
def test_malformed_tensorclass_entries_are_refused(c):
    with pytest.raises(ProtocolError):
        decode(layout_with(c))


def test_a_tensorclass_must_be_a_listed_branch():
    # Without "s", "tc" would be an implicit nested tensordict: not one a class may claim.
    with pytest.raises(ProtocolError, match="not a nested tensordict"):
        decode(layout_with([[["tc"], TC_NAME]], s=None))
    assert type(decode(layout_with([[["tc"], TC_NAME]])).get("tc")) is TC


def test_a_loaded_class_without_a_field_sent_is_refused_before_anything_is_built():
    evil = [["tc", "evil"], "float32", [], False]
    layout = layout_with([[["tc"], TC_NAME]], t=[*layout_with([])["t"], evil])
    with pytest.raises(ProtocolError, match="has no field evil"):
        decode(layout)
    lazy = {  # through a lazy stack's members too
        "b": [],
        "t": [[["tc", "#0", "evil"], "float32", [], False]],
        "n": [],
        "s": [[["tc"], [1]], [["tc", "#0"], []]],
        "z": [[["tc"], 0, 1]],
        "c": [[["tc"], TC_NAME]],
    }
    with pytest.raises(ProtocolError, match="has no field evil"):
        decode(lazy)


def test_a_class_whose_post_init_refuses_is_a_protocol_error(monkeypatch):
    module, cls = fake_module(monkeypatch)

    def refuse(self):
        raise ValueError("no")

    cls.__post_init__ = refuse  # type: ignore[attr-defined]
    layout = layout_with([[["tc"], f"{module.__name__}:Dyn"]], t=[], n=[])
    with pytest.raises(ProtocolError, match="refused what was sent"):
        decode(layout)


def test_many_long_names_are_refused_without_work_or_warnings():
    keys = [[f"k{i}"] for i in range(MAX_LEAVES)]
    name = "m" * (MAX_CLASS_NAME - 2) + ":C"  # a module that is not loaded, named at length
    layout = {"b": [], "t": [], "n": [], "c": [[key, name] for key in keys]}  # no branches
    header = Header(Command.RESULT, layouts=(0,), body={"L": {0: layout}})
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ProtocolError, match="not a nested tensordict"):
                Decoder().decode(header, [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not not_loaded_warnings(caught)  # refused before any name was looked up
    assert time.perf_counter() - start < 5.0
    assert peak < 8 << 20, f"refusing the layout allocated {peak} bytes"
    layout["c"] = [[key, name] for key in [*keys, ["one more"]]]
    with pytest.raises(ProtocolError, match="1 to 4096"):
        Decoder().decode(header, [])
    with pytest.raises(ProtocolError, match="at most 512"):
        parse_class_name("m" * MAX_CLASS_NAME + ":C")


# ---------------------------------------------------------------- not loaded: plain, warned once


def test_a_class_that_is_not_loaded_arrives_as_a_plain_tensordict(monkeypatch):
    module, cls = fake_module(monkeypatch)
    value = cls(x=torch.arange(3.0), label="hello", batch_size=[3])
    td = TensorDict({"dyn": value, "y": torch.ones(3)}, [3])
    frames = as_received(encode_message(Header(Command.RESULT, 0, 1), [Encoder().encode(td)]))
    monkeypatch.delitem(sys.modules, module.__name__)  # this process "never imported" it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = []
        for _ in range(3):  # three connections, three announcements of the layout
            part = Decoder().decode(Header.decode(frames[0]), frames[1:])[0]
            outs.append(part.to_tensordict())
        batch = stack_parts([part, part])
    [message] = not_loaded_warnings(caught)  # one warning for the class
    assert f"{module.__name__}:Dyn" in message and f"import {module.__name__}" in message
    got = outs[0].get("dyn")
    assert type(got) is TensorDict and got.get_non_tensor("label") == "hello"
    assert torch.equal(got.get("x"), torch.arange(3.0)) and got.batch_size == (3,)
    assert type(batch.get("dyn")) is TensorDict and batch.get("dyn").batch_size == (2, 3)
    monkeypatch.setitem(sys.modules, module.__name__, module)  # imported now: instances again
    part = Decoder().decode(Header.decode(frames[0]), frames[1:])[0]
    assert type(part.to_tensordict().get("dyn")) is cls


def test_a_spec_whose_data_cls_is_not_loaded_has_none(monkeypatch):
    module, cls = fake_module(monkeypatch)
    spec = Composite(
        tc=Composite(
            x=Unbounded(shape=(2,)),
            label=NonTensor(example_data="a", shape=(2,)),
            shape=(2,),
            data_cls=cls,
        )
    )
    data = msgpack.packb(spec_to_data(spec), use_bin_type=True)
    assert spec_from_data(msgpack.unpackb(data, raw=False))["tc"].data_cls is cls
    monkeypatch.delitem(sys.modules, module.__name__)
    with pytest.warns(TensorclassNotLoadedWarning, match=f"import {module.__name__}"):
        back = spec_from_data(msgpack.unpackb(data, raw=False))
    assert back["tc"].data_cls is None
    assert type(back.zero().get("tc")) is TensorDict


def test_a_class_defined_inside_a_function_arrives_plain_with_a_warning():
    @tensorclass
    class Local:
        x: torch.Tensor

    td = TensorDict({"local": Local(x=torch.ones(2), batch_size=[2])}, [2])
    assert "<locals>" in tensorclass_name(Local)
    with pytest.warns(TensorclassNotLoadedWarning, match="inside a function"):
        out = round_trip(td)
    assert type(out.get("local")) is TensorDict
    assert torch.equal(out.get(("local", "x")), torch.ones(2))


# ---------------------------------------------------------------- end to end: a real pool

NUM_ENVS = 2


@pytest.fixture(scope="module")
def pool() -> Iterator[ZMQAsyncEnvPool]:
    pool = ZMQAsyncEnvPool(
        [EnvWithTensorClass] * NUM_ENVS,
        config=PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0),
    )
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def serial() -> Iterator[SerialEnv]:
    env = SerialEnv(NUM_ENVS, EnvWithTensorClass)
    yield env
    env.close()


def entries(td: Any, values: bool = True) -> dict[tuple, Any]:
    """Every entry of ``td`` by key path: its type, batch size or shape and dtype, its value.

    ``env_index`` (the pool's tag) is left out; with ``values`` False, tensors are
    compared by shape and dtype only (random actions make their values differ),
    non-tensors still by value.
    """
    out: dict[tuple, Any] = {}

    def walk(value: Any, path: tuple) -> None:
        if is_tensorclass(value) and not isinstance(value, NonTensorData):
            out[path] = (type(value), tuple(value.batch_size))
            walk(value._tensordict, path)
        elif isinstance(value, torch.Tensor):
            out[path] = ("tensor", value.dtype, tuple(value.shape), value.tolist() if values else 0)
        elif isinstance(value, (NonTensorData, NonTensorStack)):
            out[path] = ("non-tensor", tuple(value.batch_size), value.tolist())
        else:
            out[path] = (type(value), tuple(value.batch_size))
            for name, item in value.items():
                if path or name != "env_index":
                    walk(item, (*path, name))

    walk(td, ())
    return out


def assert_like(got: TensorDictBase, want: TensorDictBase, values: bool = True) -> None:
    a, b = entries(got, values), entries(want, values)
    assert a.keys() == b.keys()
    for key in b:
        assert a[key] == b[key], key


def with_action(td: TensorDictBase, action: torch.Tensor) -> TensorDictBase:
    return td.set("action", action.clone())


ACTION = torch.ones(NUM_ENVS, 1, dtype=torch.int8)


def test_the_pool_builds_tensorclass_specs(pool, serial):
    spec, want = pool.observation_spec["tc"], serial.observation_spec["tc"]
    assert spec.data_cls is want.data_cls is TC
    assert spec.shape == want.shape and set(spec.keys()) == set(want.keys())  # devices differ
    assert type(pool.observation_spec.zero().get("tc")) is TC


def test_reset_and_step_are_serial_envs(pool, serial):
    got, want = pool.reset(), serial.reset()
    assert type(got.get("tc")) is TC and type(want.get("tc")) is TC
    assert got.get("tc").field0 == ["0", "0"]
    assert_like(got, want)
    got, want = pool.step(with_action(got, ACTION)), serial.step(with_action(want, ACTION))
    assert type(got.get(("next", "tc"))) is TC and got.get(("next", "tc")).field0 == ["1", "1"]
    assert_like(got, want)


def test_step_and_maybe_reset_is_serial_envs(pool, serial):
    got_root, want_root = pool.reset(), serial.reset()
    for _ in range(2):
        got, got_root = pool.step_and_maybe_reset(with_action(got_root, ACTION))
        want, want_root = serial.step_and_maybe_reset(with_action(want_root, ACTION))
        assert type(got_root.get("tc")) is TC and type(got.get(("next", "tc"))) is TC
        assert_like(got, want)
        assert_like(got_root, want_root)
    assert got_root.get("tc").field0 == ["2", "2"]  # the env read it from its input


def test_rollouts_are_serial_envs(pool, serial):
    def policy(td: TensorDictBase) -> TensorDictBase:
        return with_action(td, ACTION)

    got, want = pool.rollout(3, policy), serial.rollout(3, policy)
    assert got.batch_size == want.batch_size == (NUM_ENVS, 3)
    assert type(got.get("tc")) is TC and type(got.get(("next", "tc"))) is TC
    assert got.get(("next", "tc")).field0 == [["1", "2", "3"]] * NUM_ENVS
    assert_like(got, want)
    got, want = pool.rollout(3), serial.rollout(3)  # random actions: "tc" does not read them
    assert_like(got, want, values=False)
    assert got.get(("next", "tc")).field0 == want.get(("next", "tc")).field0
