"""Trainer input: what can never work is refused before anything is sent; the rest reaches the env.

Two halves:

- :func:`zmqpool.validation.check_step_input` called directly, with the
  stacked specs of ``CountingEnv`` (and of small hand-made specs), by default
  and with ``strict=True`` (dtype and shape against the spec, an opt-in);
- a real pool: an input that can never work (a missing action, rows that do
  not match ``env_index``, a bad index, a value that cannot cross the wire)
  raises at the send, names what is wrong, leaves no env busy, and the next
  good step is the env's next step (nothing reached it); an action of another
  dtype or shape than the spec reaches the env as the caller made it, as in
  torchrl, unless the pool was built with ``PoolConfig(strict_inputs=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict, lazy_stack
from torchrl.data import Bounded, Categorical, Composite, NonTensor, Unbounded

from tests.conftest import FAST, awaited
from zmqpool import (
    BatchSizeMismatchError,
    EnvError,
    InputError,
    MissingKeyError,
    ZMQAsyncEnvPool,
    validation,
)
from zmqpool.partial import masked_envs
from zmqpool.testing import CountingEnv
from zmqpool.validation import (
    StepInputSpec,
    check_env_indices,
    check_step_input,
    env_index_arg,
    step_input_spec,
)

NUM = 2


def pool_input_spec(num_envs: int = NUM):
    """What ``pool.input_spec`` is: the envs' input specs stacked, plus ``env_index``."""
    spec = torch.stack([CountingEnv(env_id=i).specs for i in range(num_envs)])["input_spec"]
    spec["full_state_spec"].set("env_index", NonTensor(example_data=0, shape=spec.shape))
    return spec


def actions(n: int, dtype=torch.float32, shape=(1,)) -> TensorDict:
    return TensorDict({"action": torch.zeros(n, *shape, dtype=dtype)}, [n])


# ---------------------------------------------------------------- the function


def test_good_inputs_pass_and_return_the_indices_as_ints():
    spec = pool_input_spec()
    assert check_step_input(actions(2), [1, 0], spec, NUM) == [1, 0]
    assert check_step_input(actions(1), torch.tensor([1]), spec, NUM) == [1]
    single = TensorDict({"action": torch.zeros(1)}, [])  # an env's own tensordict
    assert check_step_input(single, 1, spec, NUM) == [1]
    rows = lazy_stack([TensorDict({"action": torch.zeros(1)}, []) for _ in range(2)])
    assert check_step_input(rows, [0, 1], spec, NUM) == [0, 1]
    extra = actions(2).set("observation", torch.zeros(2, 4)).set("anything", torch.ones(2, 9))
    assert check_step_input(extra, [0, 1], spec, NUM) == [0, 1]


@pytest.mark.parametrize(
    ("td", "error", "match"),
    [
        (TensorDict({"observation": torch.zeros(2, 4)}, [2]), ValueError, "no action 'action'"),
        (actions(3), ValueError, r"batch size \(3,\) does not match the 2 env indices \[0, 1\]"),
        (TensorDict({"action": torch.zeros(2, 1)}, []), ValueError, r"batch size \(\)"),
    ],
    ids=["missing", "batch", "no-batch"],
)
@pytest.mark.parametrize("strict", [False, True])
def test_inputs_that_can_never_work_name_what_is_wrong(td, error, match, strict):
    with pytest.raises(error, match=match):
        check_step_input(td, [0, 1], pool_input_spec(), NUM, strict)


#: Refused only by the opt-in strict check; by default they reach the env as they are.
SPEC_MISMATCHES = [
    (actions(2, torch.float64), r"expected dtype torch.float32, got torch.float64"),
    (actions(2, torch.bool), r"expected dtype torch.float32, got torch.bool"),
    (actions(2, shape=()), r"'action': expected shape \(2, 1\), got \(2,\)"),
    (actions(2, shape=(3,)), r"expected shape \(2, 1\), got \(2, 3\)"),
    (TensorDict({"action": "left"}, [2]), "expected a torch.float32 tensor"),
]


@pytest.mark.parametrize(
    ("td", "match"),
    SPEC_MISMATCHES,
    ids=["float64", "bool", "shape-dropped-dim", "shape-wrong", "not-tensor"],
)
def test_spec_mismatches_pass_by_default_and_are_refused_when_strict(td, match):
    assert check_step_input(td, [0, 1], pool_input_spec(), NUM) == [0, 1]
    with pytest.raises(ValueError, match=match):
        check_step_input(td, [0, 1], pool_input_spec(), NUM, strict=True)


@pytest.mark.parametrize(
    "mask, envs",
    [
        ([True, False, True], [0, 2]),
        ([[False], [True], [False]], [1]),
        ([[True, True], [False, False], [True, True]], [0, 2]),
        ([False, False, False], []),
    ],
)
def test_a_step_mask_selects_whole_envs(mask, envs):
    assert masked_envs(torch.tensor(mask), 3) == envs


@pytest.mark.parametrize(
    "mask, error, match",
    [
        (torch.tensor([1, 0, 1]), TypeError, "boolean tensor, got torch.int64"),
        (torch.tensor([True, False]), ValueError, r"shape \(2,\) does not split into 3 envs"),
        (torch.tensor([[True, False], [True, True], [True, True]]), ValueError, "whole envs"),
    ],
)
def test_a_step_mask_that_can_never_work_is_refused(mask, error, match):
    with pytest.raises(error, match=match):
        masked_envs(mask, 3)


def test_a_single_env_input_is_checked_without_the_env_dim():
    spec = pool_input_spec()
    with pytest.raises(InputError, match=r"expected shape \(1,\), got \(1, 1\)"):
        check_step_input(actions(1), 0, spec, NUM, strict=True)  # a batch where one env's td goes
    with pytest.raises(ValueError, match="no action 'action'"):
        check_step_input(TensorDict({}, []), 0, spec, NUM)


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        (
            [0, 2],
            IndexError,
            r"env index 2 is out of range for a pool of 2 envs \(0 to 1, or -2 to -1\)",
        ),
        ([-3, 0], IndexError, "env index -3 is out of range"),
        ([1, 1], ValueError, r"repeat env \[1\]"),
        ([1, -1], ValueError, r"env indices \[1, -1\] repeat env \[1\]"),
        ([0, 1.0], TypeError, "must be integers"),
        ([True, 0], TypeError, r"must be integers, got True \(a bool\)"),
        (True, TypeError, r"must be integers, got True \(a bool\)"),
        (np.bool_(False), TypeError, r"must be integers, got np.False_ \(a bool\)"),
        ("01", TypeError, "an int or a list of ints"),
    ],
)
def test_bad_env_indices(indices, error, match):
    with pytest.raises(error, match=match):
        check_step_input(actions(2), indices, pool_input_spec(), NUM)
    with pytest.raises(error, match=match):
        check_env_indices(indices, NUM)


@pytest.mark.parametrize(
    ("indices", "expected"),
    [
        ([-1, 0], [1, 0]),
        ([-2, -1], [0, 1]),
        (-1, 1),
        (np.array([-1]), [1]),
        (torch.tensor([-2, 1]), [0, 1]),
        (np.int64(-2), 0),
        (torch.tensor(-1), 1),
    ],
    ids=["list", "all-negative", "int", "array", "tensor", "np.int64", "0-d tensor"],
)
def test_negative_env_indices_count_from_the_end_as_a_list_s_do(indices, expected):
    # torchrl's pool indexes its list of envs with them; each is that env's index here.
    assert env_index_arg(indices, NUM) == expected
    assert check_env_indices(indices, NUM) == (
        expected if isinstance(expected, list) else [expected]
    )


def test_the_common_env_indices_are_returned_as_given():
    # The hot path: a list of in-range Python ints is copied, not rebuilt index by index.
    given = [1, 0]
    assert env_index_arg(given, NUM) == given and env_index_arg(given, NUM) is not given


def test_inputs_that_can_never_work_raise_torchrl_s_classes_too():
    # A missing action: the env's KeyError on torchrl's pool; rows that do not match the
    # indices: tensordict's RuntimeError. Both stay the ValueError they were.
    spec = pool_input_spec()
    with pytest.raises(MissingKeyError) as missing:
        check_step_input(TensorDict({"observation": torch.zeros(2, 4)}, [2]), [0, 1], spec, NUM)
    assert isinstance(missing.value, KeyError) and isinstance(missing.value, ValueError)
    assert str(missing.value) == (  # not KeyError's quoted repr
        "the step input has no action 'action': expected a torch.float32 tensor of shape (2, 1)"
    )
    with pytest.raises(BatchSizeMismatchError) as rows:
        check_step_input(actions(3), [0, 1], spec, NUM)
    assert isinstance(rows.value, RuntimeError) and isinstance(rows.value, ValueError)


@pytest.mark.parametrize(
    ("indices", "expected"),
    [
        (np.array([1, 0]), [1, 0]),
        ([np.int64(1), np.int32(0)], [1, 0]),
        (torch.tensor([1, 0], dtype=torch.uint8), [1, 0]),
        ((1, 0), [1, 0]),
        (range(2), [0, 1]),
        (np.int64(1), 1),
        (torch.tensor(1), 1),
        (np.array(0), 0),
    ],
    ids=["array", "numpy-ints", "uint8-tensor", "tuple", "range", "np.int64", "0-d tensor", "0-d"],
)
def test_integers_of_any_kind_are_env_indices_as_python_ints(indices, expected):
    assert env_index_arg(indices, NUM) == expected
    assert {type(i) for i in check_env_indices(indices, NUM)} == {int}
    assert type(env_index_arg(indices, NUM)) is type(expected)  # one env's stays one int


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        (torch.tensor([0.0, 1.0]), "a tensor of torch.float32"),
        (torch.tensor([True, False]), "a tensor of torch.bool"),
        (np.array([True, False]), "a numpy array of bool"),
        (np.array([0.0, 1.0]), "a numpy array of float64"),
        (torch.tensor(1.0), "a tensor of torch.float32"),
        ([np.bool_(True)], "must be integers"),
        ([np.float64(1.0)], "must be integers"),
        ([torch.tensor(0.5)], "a tensor of torch.float32"),
        (torch.tensor([[0], [1]]), r"one-dimensional, got shape \(2, 1\)"),
        (None, "an int or a list of ints"),
    ],
    ids=[
        "float",
        "bool-mask",
        "np-bool-mask",
        "np-float",
        "0-d-float",
        "np.bool_",
        "np.float64",
        "float-item",
        "2-d",
        "none",
    ],
)
def test_what_is_not_integers_is_refused_naming_it(indices, match):
    with pytest.raises(TypeError, match=match):
        check_env_indices(indices, NUM)
    if indices is not None:
        with pytest.raises(TypeError, match=match):
            env_index_arg(indices, NUM)


def test_the_callers_list_is_copied():
    indices = [1, 0]
    checked = env_index_arg(indices, NUM)
    indices.append(5)
    assert checked == [1, 0]


def test_nested_integer_actions_and_optional_state_entries():
    env_spec = Composite(
        full_action_spec=Composite(
            agents=Composite(action=Categorical(5, shape=(3,)), shape=()), shape=()
        ),
        full_state_spec=Composite(hidden=Unbounded(shape=(8,)), shape=()),
        shape=(),
    )
    spec = torch.stack([env_spec.clone() for _ in range(NUM)])
    good = TensorDict({"agents": {"action": torch.zeros(2, 3, dtype=torch.int64)}}, [2])
    assert check_step_input(good, [0, 1], spec, NUM, strict=True) == [0, 1]  # "hidden" optional
    with pytest.raises(ValueError, match=r"action \('agents', 'action'\): expected dtype"):
        check_step_input(good.apply(lambda t: t.int()), [0, 1], spec, NUM, strict=True)
    with pytest.raises(ValueError, match=r"state 'hidden': expected shape \(2, 8\), got \(2, 7\)"):
        check_step_input(good.clone().set("hidden", torch.zeros(2, 7)), [0, 1], spec, NUM, True)
    with pytest.raises(ValueError, match=r"no action \('agents', 'action'\)"):
        check_step_input(TensorDict({"agents": {}}, [2]), [0, 1], spec, NUM)


def test_envs_whose_action_shapes_differ_accept_any_size_in_that_dim():
    specs = [
        Composite(full_action_spec=Composite(action=Bounded(-1, 1, shape=(n,)))) for n in (1, 2)
    ]
    spec = torch.stack(specs)  # a heterogeneous stack: action shape (2, -1)
    rows = lazy_stack([TensorDict({"action": torch.zeros(n)}, []) for n in (1, 2)])
    assert check_step_input(rows, [0, 1], spec, NUM, strict=True) == [0, 1]
    with pytest.raises(ValueError, match=r"expected shape \(-1,\), got \(1, 2\)"):
        check_step_input(
            lazy_stack([TensorDict({"action": torch.zeros(1, 2)}, [])] * 2), [0, 1], spec, NUM, True
        )


def test_expectations_are_worked_out_once_per_spec(monkeypatch):
    built = []

    class Counted(StepInputSpec):
        def __init__(self, *args, **kwargs) -> None:
            built.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(validation, "StepInputSpec", Counted)  # the class the module builds
    spec = pool_input_spec()
    check_step_input(actions(2), [0, 1], spec, NUM)
    check_step_input(actions(1), [1], spec, NUM)
    assert len(built) == 1
    assert step_input_spec(spec, NUM) is step_input_spec(spec, NUM)
    assert step_input_spec(spec, NUM, strict=True) is not step_input_spec(spec, NUM)
    assert [e.key for e in StepInputSpec(spec, NUM).expected] == ["action"]  # not env_index
    assert [e.key for e in StepInputSpec(spec, NUM, strict=True).expected] == ["action"]


# ---------------------------------------------------------------- a real pool


@pytest.fixture(scope="module")
def pool():
    p = ZMQAsyncEnvPool(
        CountingEnv, create_env_kwargs=[{"env_id": i} for i in range(NUM)], config=FAST
    )
    yield p
    p.close()


@pytest.fixture(scope="module")
def strict_pool():
    """A pool that opted in to spec checks at the send."""
    config = dataclasses.replace(FAST, strict_inputs=True)
    p = ZMQAsyncEnvPool(
        CountingEnv, create_env_kwargs=[{"env_id": i} for i in range(NUM)], config=config
    )
    yield p
    p.close()


@pytest.fixture
def fresh(pool):
    """The pool, reset, with nothing in flight."""
    assert not awaited(pool)
    return pool.reset()


def step_counts(pool, env_index=None) -> list[int]:
    """One good step of ``env_index`` (default: all envs); the step counts they report."""
    env_index = list(range(NUM)) if env_index is None else env_index
    pool.async_step_send(actions(len(env_index)), env_index=env_index)
    out = pool.async_step_recv(min_get=len(env_index), timeout=30)
    return [int(c) for c in out["next", "observation"][:, 1]]


def refused_before_sending(pool, send, error, match, env_index=None, channel=None):
    """``send()`` raises ``error``, leaves nothing in flight, and no env took a step.

    ``env_index``: the envs to watch (default: all); ``channel``: the env whose own
    channel ``send`` uses, if it does.
    """
    before = step_counts(pool, env_index)
    sent = False
    try:
        with pytest.raises(error, match=match):
            send()
            sent = True
    finally:
        if sent:  # it went out after all: collect its reply, so the pool stays usable
            _drain(pool, channel)
    assert not awaited(pool)
    assert step_counts(pool, env_index) == [c + 1 for c in before]  # the bad one never ran


def _drain(pool, channel):
    """Collect every reply in flight (each env error raised removes one).

    Only env errors are discarded: a reply that never comes (TimeoutError) or
    any other failure is the test's failure, not swallowed.
    """
    if channel is not None:
        with contextlib.suppress(EnvError):
            pool.async_step_recv(env_index=channel, timeout=30)
    for _ in range(2 * NUM):
        if not awaited(pool):
            return
        with contextlib.suppress(EnvError):
            pool.async_step_recv(min_get=1, timeout=30)


def test_pool_refuses_a_missing_action_at_the_send(pool, fresh):
    td = TensorDict({"observation": torch.zeros(2, 4)}, [2])
    match = "no action 'action'"
    refused_before_sending(
        pool, lambda: pool.async_step_send(td, env_index=[0, 1]), ValueError, match
    )
    refused_before_sending(
        pool,
        lambda: pool.async_step_and_maybe_reset_send(td.clone(), env_index=[0, 1]),
        ValueError,
        match,
    )


class _Opaque:
    """Neither a tensor nor plain data: it cannot cross the wire."""


@pytest.mark.parametrize(
    "entry",
    [
        lambda: NonTensorStack(_Opaque(), _Opaque()),
        # Not on the wire's list (README; float8 is, since session 62): raw bits, no values.
        lambda: torch.zeros(2, 1, dtype=torch.bits16),
        lambda: torch.stack([torch.eye(2).to_sparse()] * 2),  # its bytes are not its values
    ],
    ids=["object", "bits16", "sparse"],
)
def test_pool_refuses_a_value_that_cannot_cross_the_wire(pool, fresh, entry):
    td = actions(2).set("extra", entry())
    send = lambda: pool.async_step_send(td, env_index=[0, 1])  # noqa: E731
    refused_before_sending(pool, send, ValueError, "extra.*cannot cross the wire")


@pytest.mark.parametrize(
    "action",
    [
        torch.full((NUM, 1), 0.5, dtype=torch.float64),
        torch.ones(NUM, 1, dtype=torch.bool),
        torch.ones(NUM, 1, dtype=torch.int64),
        torch.full((NUM, 3), 0.25),  # another shape: the env reads what it reads
    ],
    ids=["float64", "bool", "int64", "shape"],
)
def test_an_action_of_another_dtype_or_shape_reaches_the_env_as_given(pool, fresh, action):
    """torchrl hands the caller's tensor to the env as it is; the env copes (or raises)."""
    td = TensorDict({"action": action}, [NUM])
    pool.async_step_send(td, env_index=list(range(NUM)))
    out = pool.async_step_recv(min_get=NUM, timeout=30)
    assert out["action"].dtype == action.dtype and out["action"].shape == action.shape
    for i in range(NUM):
        env = CountingEnv(env_id=i)  # the same env, stepped in-process
        env.reset()
        expected = env.step(TensorDict({"action": action[i]}, []))["next"]
        assert (out["next", "observation"][i] == expected["observation"]).all()


@pytest.mark.parametrize(
    ("td", "match"),
    [
        (actions(2, torch.float64), "expected dtype torch.float32, got torch.float64"),
        (actions(2, shape=(3,)), r"expected shape \(2, 1\), got \(2, 3\)"),
    ],
    ids=["dtype", "shape"],
)
def test_a_strict_pool_refuses_spec_mismatches_at_the_send(strict_pool, td, match):
    strict_pool.reset()
    refused_before_sending(
        strict_pool, lambda: strict_pool.async_step_send(td, env_index=[0, 1]), InputError, match
    )
    refused_before_sending(
        strict_pool,
        lambda: strict_pool.async_step_and_maybe_reset_send(td.clone(), env_index=[0, 1]),
        InputError,
        match,
    )


def test_a_strict_pool_step_refuses_bad_actions(strict_pool):
    td = strict_pool.reset()
    td["action"] = torch.zeros(NUM, 1, dtype=torch.float64)
    refused_before_sending(
        strict_pool, lambda: strict_pool.step(td), InputError, "expected dtype torch.float32"
    )


def test_a_strict_pool_refuses_a_bad_action_on_an_env_channel(strict_pool):
    strict_pool.reset()
    bad = TensorDict({"action": torch.zeros(2)}, [])
    refused_before_sending(
        strict_pool,
        lambda: strict_pool.async_step_send(bad, env_index=1),
        InputError,
        r"expected shape \(1,\), got \(2,\)",
        env_index=[1],
        channel=1,
    )


@pytest.mark.parametrize(
    ("indices", "td", "error", "match"),
    [
        ([0, 2], actions(2), IndexError, "out of range"),
        ([1, 1], actions(2), ValueError, "repeat"),
        ([0, 1], actions(3), ValueError, "batch size"),
        # Once truncated to [0, 1], and a mask read as envs [1, 0]: each env stepped unasked.
        (torch.tensor([0.4, 1.6]), actions(2), TypeError, "a tensor of torch.float32"),
        (torch.tensor([True, True]), actions(2), TypeError, "a tensor of torch.bool"),
    ],
    ids=["range", "repeat", "batch", "float", "mask"],
)
def test_pool_refuses_bad_indices_at_the_send(pool, fresh, indices, td, error, match):
    send = lambda: pool.async_step_send(td, env_index=indices)  # noqa: E731
    refused_before_sending(pool, send, error, match)


def test_numpy_indices_step_the_envs_they_name(pool, fresh):
    before = step_counts(pool)
    pool.async_step_send(actions(1), env_index=np.array([1]))
    out = pool.async_step_recv(min_get=1, timeout=30)
    assert [(i, type(i)) for i in out.get("env_index").tolist()] == [(1, int)]
    pool.async_step_send(TensorDict({"action": torch.zeros(1)}, []), env_index=np.int64(0))
    own = pool.async_step_recv(env_index=torch.tensor(0), timeout=30)  # env 0's own channel
    assert own["env_index"] == 0 and own.batch_size == torch.Size([])
    assert step_counts(pool) == [before[0] + 2, before[1] + 2]


def test_a_recv_on_an_own_channel_takes_one_env(pool, fresh):
    with pytest.raises(TypeError, match="must name one env"):
        pool.async_step_recv(env_index=[0])
    with pytest.raises(IndexError, match="out of range"):
        pool.async_step_recv(env_index=np.int64(NUM))


#: An action of 4 MiB a row: over the 64 KiB from which a leaf travels in a frame of its own.
LARGE_ACTION = 1 << 20


class MeanActionEnv(CountingEnv):
    """CountingEnv with a large action, whose mean it reports as its last action."""

    def __init__(self, env_id: int = 0) -> None:
        super().__init__(env_id=env_id)
        self.action_spec = Unbounded(shape=(LARGE_ACTION,), dtype=torch.float32)

    def _step(self, tensordict):
        mean = tensordict["action"].mean().reshape(1)
        return super()._step(tensordict.clone(False).set("action", mean))


@pytest.fixture(scope="module")
def large_action_pool():
    p = ZMQAsyncEnvPool(
        MeanActionEnv, create_env_kwargs=[{"env_id": i} for i in range(NUM)], config=FAST
    )
    yield p
    p.close()


@pytest.mark.parametrize("channel", [None, 0], ids=["batch", "own-channel"])
def test_a_large_action_changed_after_its_send_reaches_the_env_as_sent(large_action_pool, channel):
    """A command is taken at its send, as torchrl's process pools take it: the caller may
    reuse the tensor at once. A leaf of 64 KiB or more used to go out as a view of the
    caller's tensor, read whenever ZeroMQ wrote it: the env got the edit, or part of it."""
    pool = large_action_pool
    pool.reset()
    rows = NUM if channel is None else 1
    for round_ in range(3):  # a race without the copy: most rounds lose it
        action = torch.full((rows, LARGE_ACTION), float(round_ + 1))
        if channel is None:
            pool.async_step_send(TensorDict({"action": action}, [rows]), env_index=[0, 1])
        else:
            pool.async_step_send(TensorDict({"action": action[0]}, []), env_index=channel)
        action.fill_(-7.0)  # the caller's next action, written into the same tensor
        if channel is None:
            out = pool.async_step_recv(min_get=rows, timeout=30)
        else:
            out = pool.async_step_recv(env_index=channel, timeout=30).unsqueeze(0)
        assert out["next", "observation"][:, 2].tolist() == [round_ + 1.0] * rows
