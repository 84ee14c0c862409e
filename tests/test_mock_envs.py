"""torchrl's mock envs: what torchrl's ``SerialEnv`` runs, ``ZMQAsyncEnvPool`` runs, alike.

Every ``EnvBase`` subclass defined in ``torchrl.testing.mocking_classes`` is
a case here, is excluded with a reason (``EXCLUDED``), or is one SerialEnv
itself cannot run (``SERIAL_FAILS``); ``test_every_mock_env_is_a_case``
keeps that list complete when torchrl adds mocks.

Each case runs the same calls (``drive``) on ``SerialEnv(2, maker)`` (the
reference, computed once per case and cached), on torchrl's
``AsyncEnvPool(backend="threading")`` and on ``ZMQAsyncEnvPool([maker] * 2)``
(one worker process hosting both envs): ``set_seed``, ``reset``, ``step``
with one fixed action (``torch.manual_seed(0)``; SerialEnv's
``full_action_spec.rand()``, which the pool's, seeded alike, must equal),
two async steps (``async_step_send`` with the indices in the tensordict,
then with ``env_index=[0, 1]``; ``async_step_recv(min_get=2, timeout=...)``;
SerialEnv's reference is its ``step``), two chained ``step_and_maybe_reset``,
``rollout(3)`` with a policy writing that fixed action, and ``rollout(3)``
with random actions. Results must have SerialEnv's keys, layouts (dense or
lazy, at every level), batch sizes (``(N, *B)`` for N envs of batch size B),
shapes and dtypes, and, where the env is deterministic (not in ``RANDOM``),
its values; specs must have its keys, shapes and dtypes. The random
rollout's actions differ, so only its structure is compared (and its length
may differ where done depends on the actions). Stacks are ``"dense"``: so
are SerialEnv's results for every case (HeterogeneousCountingEnv's
per-agent entries are lazy inside a dense stack of envs).

torchrl's own envs (``torchrl.envs.custom``) that build without other
packages are cases as well (``CUSTOM``); the rest are listed with why not.

``SERIAL_QUIRKS`` lists the few keys where SerialEnv differs from what its
own env returns (the pools follow the env); ``TORCHRL_POOL_FAILS`` records
where torchrl's own pool fails.

Seeding: ``ZMQAsyncEnvPool.set_seed(s)`` seeds as ``SerialEnv.set_seed(s)``
does: env 0 with ``s`` and env ``i + 1`` with the seed env ``i`` returned
(torchrl's ``seed_generator`` chain); torchrl's ``AsyncEnvPool.set_seed``
raises ``NotImplementedError``, so its envs are seeded along the same chain
directly (``seed_envs``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import random
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torchrl.envs.custom as custom
import torchrl.testing.mocking_classes as mocks
from tensordict import (
    NonTensorData,
    NonTensorStack,
    TensorDictBase,
    is_tensor_collection,
    is_tensorclass,
)
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import AsyncEnvPool, EnvBase, SerialEnv, StepCounter, TransformedEnv
from torchrl.modules import WorldModelWrapper

from zmqpool import PoolConfig, ZMQAsyncEnvPool

NUM_ENVS = 2
SEED = 1  # MockSerialEnv and MockBatched*Env assert seed >= 1
#: A step or reset hung for 30 s is restarted (the test then fails on
#: ``last_restarted_envs``) rather than waiting for pytest-timeout (120 s).
CONFIG = PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0, step_timeout_s=30.0)
RECV_TIMEOUT_S = 60.0
ALL = list(range(NUM_ENVS))


# ---------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
    cls: str  # the mock env class
    make: Callable[[], EnvBase]  # picklable: a class, a partial of one, or a closure
    seed: int | None = SEED  # None: the env cannot be seeded


def _world_model_env_maker() -> Callable[[], EnvBase]:
    """DummyModelBasedEnvBase needs a world model (torchrl's test of it uses this one)."""

    def make() -> EnvBase:  # a closure: cloudpickled by value, no import of this module
        world_model = WorldModelWrapper(
            TensorDictModule(
                mocks.ActionObsMergeLinear(5, 4),
                in_keys=["hidden_observation", "action"],
                out_keys=["hidden_observation"],
            ),
            TensorDictModule(nn.Linear(4, 1), in_keys=["hidden_observation"], out_keys=["reward"]),
        )
        return mocks.DummyModelBasedEnvBase(world_model)

    return make


def mock_env_classes() -> list[str]:
    """The EnvBase subclasses mocking_classes defines (EnvBase, ModelBasedEnvBase: imported)."""
    return sorted(
        name
        for name, obj in vars(mocks).items()
        if inspect.isclass(obj) and issubclass(obj, EnvBase) and obj.__module__ == mocks.__name__
    )


#: Mock env classes that cannot be built at all, with why.
EXCLUDED: dict[str, str] = {
    "_MockEnv": (
        "an abstract base: its __new__ reads cls._output_spec, which only its subclasses "
        "(DiscreteActionVecMockEnv, ContinuousActionVecMockEnv, ...) define; "
        "_MockEnv() raises AttributeError"
    ),
}

#: Cases whose maker needs arguments (or that add a batched variant).
_SPECIAL: dict[str, Case] = {
    "DummyModelBasedEnvBase": Case("DummyModelBasedEnvBase", _world_model_env_maker()),
    "MultiAgentCountingEnv": Case(
        "MultiAgentCountingEnv", functools.partial(mocks.MultiAgentCountingEnv, n_agents=2)
    ),
    # MockNestedResetEnv._set_seed(self) takes no seed: set_seed raises TypeError.
    "MockNestedResetEnv": Case(
        "MockNestedResetEnv",
        functools.partial(mocks.MockNestedResetEnv, num_steps=3, done_at_root=False),
        seed=None,
    ),
    "MockNestedResetEnv(done_at_root=True)": Case(
        "MockNestedResetEnv",
        functools.partial(mocks.MockNestedResetEnv, num_steps=3, done_at_root=True),
        seed=None,
    ),
    "CountingEnv(batch_size=2)": Case(
        "CountingEnv", functools.partial(mocks.CountingEnv, batch_size=[2])
    ),
    "CountingBatchedEnv(batch_size=2)": Case(
        "CountingBatchedEnv",
        functools.partial(mocks.CountingBatchedEnv, batch_size=[2], max_steps=torch.tensor([3, 5])),
    ),
}


#: torchrl's own envs (``torchrl.envs.custom``) that build without other packages,
#: as cases too: PendulumEnv's ``params`` spec (``data_cls=TensorDict``) once kept it
#: off the wire (seeding audit).
CUSTOM: dict[str, Case] = {
    f"custom.{name}": Case(name, getattr(custom, name))
    for name in ("FinancialRegimeEnv", "PendulumEnv", "TicTacToeEnv", "ToyVLAEnv")
}

#: The other ``torchrl.envs.custom`` envs, and why they are not cases.
CUSTOM_NOT_CASES: dict[str, str] = {
    "AntEnv": "needs the mujoco-torch package",
    "HopperEnv": "needs the mujoco-torch package",
    "HumanoidEnv": "needs the mujoco-torch package",
    "SatelliteEnv": "needs the mujoco-torch package",
    "Walker2dEnv": "needs the mujoco-torch package",
    "MujocoEnv": "an abstract base",
    "CubeBowlEnv": "needs a MuJoCo Menagerie checkout",
    "MicroDuckEnv": "needs a microduck_rl checkout",
    "MicroDuckTask": "a task description, not an env",
    "MicroDuckTaskSampler": "a task sampler, not an env",
    "ChessEnv": "needs the chess package",
    "LLMHashingEnv": "its reset needs a tensordict of text (SerialEnv's reset() fails on it)",
}


def _cases() -> dict[str, Case]:
    cases = {
        name: _SPECIAL.get(name, Case(name, getattr(mocks, name)))
        for name in mock_env_classes()
        if name not in EXCLUDED
    }
    for name, case in _SPECIAL.items():
        cases.setdefault(name, case)
    return {**cases, **CUSTOM}


CASES = _cases()

#: Cases torchrl's SerialEnv cannot run: (the call of ``drive`` that raises, its error).
#: (MockSerialEnv runs only seeded: its reset reads self.counter, which only
#: _set_seed sets; every case is seeded where the env allows it.)
SERIAL_FAILS: dict[str, tuple[str, type[Exception], str]] = {
    # Its done spec is a float Unbounded: rollout's `done | ...` raises.
    "EnvThatErrorsAfter10Iters": (
        "rollout(policy)",
        NotImplementedError,
        "\"bitwise_or_cpu\" not implemented for 'Float'",
    ),
    # Its step returns the action with shape [1] where the spec says [1, 1].
    "EnvThatErrorsBecauseOfStack": (
        "step",
        RuntimeError,
        "output with shape [1] doesn't match the broadcast shape [1, 1]",
    ),
}

#: Cases whose values depend on a random generator (global torch / random
#: state, shared by the envs of one process, or drawn in __init__): their
#: results are compared by structure only. ``test_random_is_right`` checks
#: the list: every other case gives the same values whatever the global seeds.
RANDOM: dict[str, str] = {
    "ContinuousActionConvMockEnv": "reset draws observation_spec.rand()",
    "ContinuousActionConvMockEnvNumpy": "reset draws observation_spec.rand()",
    "ContinuousActionVecMockEnv": "reset draws observation_spec.rand()",
    "CountingEnvWithString": "random strings (python random)",
    "DummyModelBasedEnvBase": "reset draws state_spec.rand()",
    "EnvWithScalarAction": "torch.randn observations",
    "FastImageEnv": "torch.rand observation drawn in __init__",
    "MultiAgentCountingEnv": "torch.rand observations",
    "StateLessCountingEnv": "torch.randint max_count at reset",
    "Str2StrEnv": "random strings, bernoulli done and reward",
}


@dataclasses.dataclass(frozen=True)
class Quirk:
    keys: frozenset  # key paths (batch indices left out) not compared with SerialEnv
    why: str


#: Where SerialEnv's results differ from what its env itself returns (its
#: own ``reset``/``step``): SerialEnv copies only the keys it preallocated,
#: from ``env._step``, skipping what ``EnvBase.step``/``reset`` add. A pool
#: should return what the env returns, so these keys are not compared with
#: SerialEnv; ``test_serial_env_quirks_are_real`` shows each difference.
_NESTED_RESET_QUIRK = Quirk(
    frozenset(
        (*prefix, *group, "terminated")
        for prefix in ((), ("next",))
        for group in ((), ("agent_1",), ("agent_2",))
    ),
    "the env returns done keys only; env.step() fills each terminated key from its done, "
    "SerialEnv leaves them False (its buffer's zeros)",
)
SERIAL_QUIRKS: dict[str, Quirk] = {
    "StateLessCountingEnv": Quirk(
        frozenset({("reward",)}),
        "the env's _reset returns a root 'reward' (env.reset() keeps it); SerialEnv drops it",
    ),
    "MockNestedResetEnv": _NESTED_RESET_QUIRK,
    "MockNestedResetEnv(done_at_root=True)": _NESTED_RESET_QUIRK,
}

#: Where torchrl's own AsyncEnvPool(backend="threading") fails, found by
#: ``test_torchrl_threading_pool`` (torchrl 0.14.1, tensordict 0.14.3):
#: (the call of ``drive`` that raises, its error). ZMQAsyncEnvPool must match
#: SerialEnv on these too. Elsewhere torchrl's pool matches SerialEnv (up to
#: SERIAL_QUIRKS, where it returns what the env returns).
TORCHRL_POOL_FAILS: dict[str, tuple[str, type[Exception], str]] = {
    # torchrl/envs/utils.py _update_during_reset: a partial reset of nested dones.
    "AutoResetHeteroCountingEnv": ("reset", AttributeError, "'NoneType' object has no attribute"),
    "HeterogeneousCountingEnv": ("reset", AttributeError, "'NoneType' object has no attribute"),
    "MockNestedResetEnv": ("reset", AttributeError, "'NoneType' object has no attribute"),
    "NestedCountingEnv": ("reset", AttributeError, "'NoneType' object has no attribute"),
    # step sets env_index as a (N,) tensor in a (N, B) tensordict.
    "CountingEnv(batch_size=2)": ("step", RuntimeError, "batch dimension mismatch"),
    "CountingBatchedEnv(batch_size=2)": ("step", RuntimeError, "batch dimension mismatch"),
}

RUNNABLE = [name for name in CASES if name not in SERIAL_FAILS]


# ---------------------------------------------------------------- driving an env


def seed_envs(env: EnvBase, seed: int) -> None:
    """``SerialEnv.set_seed``'s chain: env 0 gets ``seed``, env ``i + 1`` what env ``i`` gave."""
    if isinstance(env, (ZMQAsyncEnvPool, SerialEnv)):
        env.set_seed(seed)
        return
    next_seed: int | None = seed
    for sub in env.envs:  # torchrl's threading pool: its set_seed raises
        next_seed = sub.set_seed(next_seed)


def fixed_action_policy(action: TensorDictBase) -> Callable[[TensorDictBase], TensorDictBase]:
    def policy(td: TensorDictBase) -> TensorDictBase:
        return td.update(action.clone())

    return policy


def async_step(env: EnvBase, td: TensorDictBase, env_index: list[int] | None) -> TensorDictBase:
    """A pool's async step of every env (``env_index``, or the indices in ``td``).

    SerialEnv has no async API: its ``step`` is the reference.
    """
    if not isinstance(env, AsyncEnvPool):
        return env.step(td)
    env.async_step_send(td, env_index=env_index)
    return env.async_step_recv(min_get=NUM_ENVS, timeout=RECV_TIMEOUT_S)


def drive(
    env: EnvBase, case: Case, action: TensorDictBase, after_seed: Callable[[], None] | None = None
) -> dict[str, Any]:
    """The same calls on any batched env: what each gave, and ``error``: (call, exception)."""
    out: dict[str, Any] = {}
    restarted: dict[str, list[int]] = {}  # ZMQAsyncEnvPool: results a restart synthesized
    out["restarted"] = restarted

    def note(call: str) -> None:
        envs = list(getattr(env, "last_restarted_envs", []))
        if envs:
            restarted[call] = envs

    stage = "set_seed"
    try:
        if case.seed is not None:
            seed_envs(env, case.seed)
        if after_seed is not None:
            after_seed()
        stage = "reset"
        td = env.reset()
        out["reset"] = td.clone()
        note(stage)
        stage = "step"
        out["step"] = env.step(td.update(action.clone())).clone()
        note(stage)
        for stage, env_index in (("async step", None), ("async step(env_index)", ALL)):
            out[stage] = async_step(env, env.reset().update(action.clone()), env_index).clone()
            note(stage)
        stage = "step_and_maybe_reset"
        td, root = env.step_and_maybe_reset(env.reset().update(action.clone()))
        out["step_and_maybe_reset"], out["step_and_maybe_reset root"] = td.clone(), root.clone()
        note(stage)
        td, root = env.step_and_maybe_reset(root.update(action.clone()))
        out["step_and_maybe_reset 2"], out["step_and_maybe_reset 2 root"] = td.clone(), root.clone()
        note("step_and_maybe_reset 2")
        stage = "rollout(policy)"
        out["rollout(policy)"] = env.rollout(3, fixed_action_policy(action))
        note(stage)
        stage = "rollout"
        out["rollout"] = env.rollout(3)  # random actions: compared by structure
        note(stage)
    except Exception as e:
        out["error"] = (stage, e)
    return out


# ---------------------------------------------------------------- comparing results

POOL_ONLY_KEYS = {"env_index"}  # torchrl's pool and ours tag results with it


def flatten(td: Any, path: tuple = ()) -> dict[tuple, tuple]:
    """Every container and leaf of ``td``, batch dims unbound all the way down.

    Containers map to ``("container", type, batch_size)``, tensors to
    ``("tensor", shape, dtype, tensor)``, non-tensors to ``("non-tensor", value)``.
    Unbinding makes dense and lazy stacks comparable leaf by leaf (ragged ones
    too), while the container entries keep which layout each level has.
    """
    out = {path: ("container", type(td).__name__, tuple(td.batch_size))}
    if is_tensorclass(td):
        td = td._tensordict
    if td.batch_dims:
        for i, sub in enumerate(td.unbind(0)):
            sub_flat = flatten(sub, (*path, i))
            sub_flat[(*path, i)] = ("container", "*", ())  # the unbound piece itself
            out.update(sub_flat)
        return out
    for key in td.keys():  # noqa: SIM118 (iterating a tensordict unbinds it)
        if key in POOL_ONLY_KEYS:
            continue
        value = td.get(key)
        if isinstance(value, NonTensorData):
            out[(*path, key)] = ("non-tensor", value.data)
        elif isinstance(value, NonTensorStack):
            out[(*path, key)] = ("non-tensor", value.tolist())
        elif is_tensor_collection(value):
            out.update(flatten(value, (*path, key)))
        else:
            out[(*path, key)] = ("tensor", tuple(value.shape), value.dtype, value)
    return out


def _keys_only(path: tuple) -> tuple:
    return tuple(p for p in path if not isinstance(p, int))


def differing(
    expected: Any,
    got: Any,
    *,
    values: bool,
    layout: bool = True,
    ignore: frozenset = frozenset(),
) -> list[tuple[tuple, str]]:
    """(path, what) where ``got`` differs from ``expected``: keys, layout, shape, dtype, value."""
    want = {k: v for k, v in flatten(expected).items() if _keys_only(k) not in ignore}
    have = {k: v for k, v in flatten(got).items() if _keys_only(k) not in ignore}
    found = [(k, "missing") for k in want if k not in have]
    found += [(k, f"unexpected: {have[k][:3]}") for k in have if k not in want]
    for k in want.keys() & have.keys():
        w, h = want[k], have[k]
        if w[0] != h[0]:
            found.append((k, f"a {w[0]} expected, got a {h[0]}"))
        elif w[0] == "container":
            if layout and w != h:
                found.append((k, f"{w[1]}{list(w[2])} expected, got {h[1]}{list(h[2])}"))
        elif w[0] == "tensor":
            if w[1:3] != h[1:3]:
                found.append((k, f"shape, dtype {w[1:3]} expected, got {h[1:3]}"))
            elif values and not torch.equal(w[3], h[3]):
                found.append((k, f"{_short(w[3].tolist())} expected, got {_short(h[3].tolist())}"))
        elif values and w[1] != h[1]:
            found.append((k, f"{_short(w[1])} expected, got {_short(h[1])}"))
        elif not values and type(w[1]) is not type(h[1]):
            found.append((k, f"a {type(w[1]).__name__} expected, got {type(h[1]).__name__}"))
    return sorted(found, key=repr)


def differences(expected: Any, got: Any, **kwargs: Any) -> list[str]:
    return [f"{path}: {what}" for path, what in differing(expected, got, **kwargs)]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def first_step(rollout: TensorDictBase) -> TensorDictBase:
    return rollout[..., 0]  # time is the last batch dim


def result_differences(name: str, ref: dict, got: dict) -> dict[str, list[str]]:
    """Per call of ``drive``: where ``got`` (a pool's) differs from ``ref`` (SerialEnv's)."""
    values = name not in RANDOM
    ignore = SERIAL_QUIRKS[name].keys if name in SERIAL_QUIRKS else frozenset()
    found: dict[str, list[str]] = {}
    for call, expected in ref.items():
        result = got[call]
        if call == "rollout":  # random actions: the structure of its first step, its length
            diffs = differences(
                first_step(expected), first_step(result), values=False, ignore=ignore
            )
            if result.batch_size[:-1] != expected.batch_size[:-1]:
                diffs.append(f"batch size {tuple(result.batch_size)}")
            if not 1 <= result.batch_size[-1] <= 3:
                diffs.append(f"{result.batch_size[-1]} steps")
        else:
            diffs = differences(expected, result, values=values, ignore=ignore)
        if diffs:
            found[call] = diffs
    return found


def describe(found: dict[str, list[str]], limit: int = 6) -> str:
    lines = []
    for call, diffs in found.items():
        lines.append(f"{call}: {len(diffs)} differences")
        lines += [f"    {d}" for d in diffs[:limit]]
    return "\n".join(lines)


def error_text(stage_error: tuple[str, Exception]) -> str:
    """The call that raised, the error, and where: zmqpool's frames and the innermost two."""
    stage, e = stage_error
    frames = traceback.extract_tb(e.__traceback__)
    shown = [
        f"    {f.filename}:{f.lineno} in {f.name}: {f.line}"
        for i, f in enumerate(frames)
        if "/zmqpool/" in f.filename or "/workers/" in f.filename or i >= len(frames) - 2
    ]
    return f"{stage}: {type(e).__name__}: {e}\n" + "\n".join(shown)


# ---------------------------------------------------------------- the references


@dataclasses.dataclass
class Reference:
    batch_size: torch.Size
    action: TensorDictBase  # torch.manual_seed(0); full_action_spec.rand()
    specs: dict[str, Any]  # spec name -> spec.zero() (structure only)
    results: dict[str, Any]


SPECS = ("full_action_spec", "full_observation_spec", "full_reward_spec", "full_done_spec")


def spec_zeros(env: EnvBase) -> dict[str, Any]:
    return {name: getattr(env, name).zero() for name in SPECS}


def _reseed_globals(seed: int) -> Callable[[], None]:
    def reseed() -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)

    return reseed


def run_serial(name: str, global_seed: int | None = None) -> tuple[SerialEnv, dict]:
    """SerialEnv's results; ``global_seed``: the torch/random/numpy seeds its envs see."""
    case = CASES[name]
    reseed = None if global_seed is None else _reseed_globals(global_seed)
    if reseed is not None:
        reseed()
    serial = SerialEnv(NUM_ENVS, case.make)
    try:
        serial.start()  # its envs are built now, under global_seed
        torch.manual_seed(0)
        action = serial.full_action_spec.rand()
        results = drive(serial, case, action, after_seed=reseed)
        del results["restarted"]
        results["action"] = action
        results["specs"] = spec_zeros(serial)
        return serial, results
    finally:
        if not serial.is_closed:
            serial.close()


@functools.cache
def serial_reference(name: str) -> Reference:
    serial, results = run_serial(name, global_seed=10)
    if "error" in results:
        raise AssertionError(f"SerialEnv fails on {name}: {error_text(results['error'])}")
    action, specs = results.pop("action"), results.pop("specs")
    return Reference(serial.batch_size, action, specs, results)


# ---------------------------------------------------------------- the lists are right


def test_every_mock_env_is_a_case():
    classes = set(mock_env_classes())
    covered = {case.cls for name, case in CASES.items() if name not in CUSTOM}
    assert classes == covered | set(EXCLUDED), "a mock env is neither a case nor excluded"
    assert not covered & set(EXCLUDED)
    assert set(RANDOM) | set(SERIAL_QUIRKS) | set(TORCHRL_POOL_FAILS) <= set(RUNNABLE)
    assert len(CASES) >= 30


def test_every_torchrl_custom_env_is_a_case_or_said_why_not():
    cases = {case.cls for case in CUSTOM.values()}
    assert set(custom.__all__) == cases | set(CUSTOM_NOT_CASES)
    assert not cases & set(CUSTOM_NOT_CASES)


@pytest.mark.parametrize("name", sorted(EXCLUDED))
def test_excluded_cannot_be_built(name):
    with pytest.raises(AttributeError, match="_output_spec"):
        getattr(mocks, name)()


@pytest.mark.parametrize("name", sorted(SERIAL_FAILS))
def test_serial_env_fails(name):
    _, results = run_serial(name)
    stage, error_type, message = SERIAL_FAILS[name]
    assert "error" in results, f"SerialEnv now runs {name}: make it a runnable case"
    assert results["error"][0] == stage
    assert isinstance(results["error"][1], error_type)
    assert message in str(results["error"][1])


@pytest.mark.parametrize("name", RUNNABLE)
def test_random_is_right(name):
    """Deterministic cases give the same values whatever the global seeds; RANDOM ones do not."""
    ref = serial_reference(name)
    _, again = run_serial(name, global_seed=20)
    assert "error" not in again
    changed = {
        call: differences(expected, again[call], values=True)
        for call, expected in ref.results.items()
        if call != "rollout"
    }
    changed = {call: diffs for call, diffs in changed.items() if diffs}
    if name in RANDOM:
        assert changed, f"{name} is deterministic: take it off RANDOM"
    else:
        assert not changed, f"{name} is random: put it in RANDOM\n{describe(changed)}"


@pytest.mark.parametrize("name", sorted(SERIAL_QUIRKS))
def test_serial_env_quirks_are_real(name):
    """SerialEnv(1) differs from its env run alone, and only at the quirk's keys."""
    case = CASES[name]
    results = {}
    for label in ("alone", "serial"):
        env = case.make() if label == "alone" else SerialEnv(1, case.make)
        try:
            torch.manual_seed(0)
            action = env.full_action_spec.rand()
            if case.seed is not None:
                env.set_seed(case.seed)
            policy = fixed_action_policy(action)
            reset = env.reset()
            rollout = env.rollout(3, policy, break_when_any_done=False)
            if label == "serial":
                reset, rollout = reset[0], rollout[0]
            results[label] = (reset, rollout)
        finally:
            env.close()
    kwargs = {"values": name not in RANDOM, "layout": False}
    found = set()
    for expected, got in zip(results["alone"], results["serial"], strict=True):
        found |= {_keys_only(path) for path, _ in differing(expected, got, **kwargs)}
    assert found, f"SerialEnv no longer differs from {name}: take it off SERIAL_QUIRKS"
    assert found <= SERIAL_QUIRKS[name].keys


# ---------------------------------------------------------------- the pools


def check_pool(name: str, pool: AsyncEnvPool) -> None:
    """Drive ``pool`` like SerialEnv and compare everything."""
    ref = serial_reference(name)
    n_by_b = torch.Size([NUM_ENVS, *CASES[name].make().batch_size])
    assert pool.batch_size == ref.batch_size == n_by_b, "N envs of batch size B: (N, *B)"
    spec_diffs = {
        spec: differences(ref.specs[spec], zero, values=False, layout=False)
        for spec, zero in spec_zeros(pool).items()
    }
    spec_diffs = {spec: diffs for spec, diffs in spec_diffs.items() if diffs}
    assert not spec_diffs, describe(spec_diffs)
    torch.manual_seed(0)
    pool_action = pool.full_action_spec.rand()
    assert not differences(ref.action, pool_action, values=True, layout=False), (
        "seeded alike, the pool's full_action_spec.rand() should be SerialEnv's"
    )
    got = drive(pool, CASES[name], ref.action)
    if "error" in got:
        pytest.fail(error_text(got["error"]))
    assert not got.pop("restarted"), "a restart synthesized results (a hung or dead env)"
    found = result_differences(name, ref.results, got)
    assert not found, f"{name}: results differ from SerialEnv's\n{describe(found)}"
    for call in ("reset", "async step", "async step(env_index)", "step_and_maybe_reset root"):
        assert env_ids(got[call]) == ALL, f"{call}: env_index {env_ids(got[call])}"


def env_ids(td: TensorDictBase) -> list[int | set]:
    """The ``env_index`` of each env's entry (one value for all its batch elements)."""
    ids: list[int | set] = []
    for sub in td.unbind(0):
        value = sub.get("env_index")
        if isinstance(value, NonTensorData):
            value = value.data
        elif isinstance(value, (NonTensorStack, torch.Tensor)):
            value = value.tolist()
        flat = set(np.asarray(value).ravel().tolist())
        ids.append(flat.pop() if len(flat) == 1 else flat)
    return ids


@pytest.mark.parametrize("name", RUNNABLE)
def test_torchrl_threading_pool(name):
    """torchrl's own pool, for the record: it fails where TORCHRL_POOL_FAILS says, else matches."""
    serial_reference(name)  # computed first: it reseeds the global generators
    pool = AsyncEnvPool([CASES[name].make] * NUM_ENVS, backend="threading", stack="dense")
    try:
        if name not in TORCHRL_POOL_FAILS:
            check_pool(name, pool)
            return
        got = drive(pool, CASES[name], serial_reference(name).action)
        stage, error_type, message = TORCHRL_POOL_FAILS[name]
        assert "error" in got, f"torchrl's pool now runs {name}: take it off TORCHRL_POOL_FAILS"
        assert got["error"][0] == stage, error_text(got["error"])
        assert isinstance(got["error"][1], error_type), error_text(got["error"])
        assert message in str(got["error"][1])
    finally:
        pool.close()


@pytest.mark.parametrize("name", RUNNABLE)
def test_zmq_pool_matches_serial_env(name):
    """ZMQAsyncEnvPool runs every mock env SerialEnv runs, with SerialEnv's results."""
    serial_reference(name)
    pool = ZMQAsyncEnvPool(
        [CASES[name].make] * NUM_ENVS, stack="dense", envs_per_worker=2, config=CONFIG
    )
    try:
        check_pool(name, pool)
    finally:
        pool.close()


# ---------------------------------------------------------------- deterministic resets


def _set_state_calls(env: EnvBase) -> dict[str, Any]:
    """A reset to a given state, through TransformedEnv's rollout and a masked reset."""
    td = env.reset()
    td["th"], td["thdot"] = torch.tensor([0.5, 0.25]), torch.tensor([-1.0, -2.0])
    out: dict[str, Any] = {"supports": env._supports_set_state}
    transformed = TransformedEnv(env, StepCounter())
    action = env.full_action_spec.zero().apply(lambda leaf: leaf + 1)
    policy = fixed_action_policy(action)
    out["rollout"] = transformed.rollout(2, policy, tensordict=td.clone(), set_state=True)
    masked = td.clone().set("_reset", torch.tensor([[False], [True]]))
    out["masked reset"] = env.reset(masked, set_state=True)
    return out


@pytest.mark.parametrize("name", ["custom.PendulumEnv", "CountingEnv"])
def test_resets_to_a_given_state_as_serial_env_does(name):
    """torchrl's PendulumEnv honours a reset's state (``_supports_set_state``); the pool
    said False whatever its envs, so TransformedEnv(pool).rollout(set_state=True) and a
    masked reset(set_state=True) raised NotImplementedError (seeding audit)."""
    case = CASES[name]
    serial = SerialEnv(NUM_ENVS, case.make)
    pool = ZMQAsyncEnvPool([case.make] * NUM_ENVS, stack="dense", config=CONFIG)
    try:
        results = []
        for env in (serial, pool):
            try:
                results.append(_set_state_calls(env))
            except NotImplementedError as err:  # an env without deterministic resets
                results.append({"error": type(err)})
    finally:
        serial.close()
        pool.close()
    expected, got = results
    assert got.keys() == expected.keys()
    if name == "CountingEnv":
        assert expected == got == {"error": NotImplementedError}
        return
    assert expected["supports"] is got["supports"] is True
    for call in ("rollout", "masked reset"):
        assert not differences(expected[call], got[call], values=True), call
