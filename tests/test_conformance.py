"""Differential conformance: the same calls on torchrl's ``AsyncEnvPool`` and ``ZMQAsyncEnvPool``.

The oracle is torchrl's own pool with ``backend="threading"`` (in-process,
fast), built from the same env makers, ``create_env_kwargs`` and ``stack``.
Each scenario runs the same calls on both and compares, with
:func:`tests.conformance.assert_same_td`: batch size, keys
(``keys(True, True)``), shapes, dtypes, values (the envs are deterministic;
random actions are drawn after the same ``torch.manual_seed``), the
``env_index`` entry (``NonTensorData`` vs ``NonTensorStack``, and its values)
and the order of the results. Errors must be of torchrl's class (or a
subclass). The tensordict class may differ for ``stack="dense"``; for
``stack="lazy"`` it must be a ``LazyStackedTensorDict`` like torchrl's.

Other oracles, each marked where used:

- ``SerialEnv`` where torchrl's pool itself fails on an env that
  ``SerialEnv`` runs (``# torchrl differs: ...``): nested keys, batched
  children, ``HeterogeneousCountingEnv``, the ``Collector``;
- torchrl's ``AsyncEnvPool(backend="multiprocessing", exchange="shm")`` for
  ``stats()`` (its threading pool returns ``{}``);
- ``SerialEnv`` for ``set_seed`` (torchrl's pool raises ``NotImplementedError``).

Pools are expensive (each zmqpool worker process imports torchrl): each one
is built once, by a class-scoped fixture, shared by the tests of its class,
and reset (after receiving anything a failed test left in flight) before each
test. Classes run one after another, so at most one group of pools is alive.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, TensorDictBase
from torchrl.collectors import Collector
from torchrl.data import NonTensor
from torchrl.envs import AsyncEnvPool, Compose, RewardSum, SerialEnv, StepCounter, TransformedEnv
from torchrl.envs.utils import check_env_specs, step_mdp
from torchrl.testing.mocking_classes import (
    CountingEnv,
    HeterogeneousCountingEnv,
    NestedCountingEnv,
)

from tests.conformance import (
    ENV_INDEX,
    DefaultDtypeEnv,
    ExtraKeyEnv,
    MaskedActionEnv,
    OffSpecDtypesEnv,
    RaisingEnv,
    ResetKeywordsEnv,
    WideActionEnv,
    assert_same_error,
    assert_same_spec,
    assert_same_td,
    counting_makers,
    drain,
    elapsed,
    env_index_kind,
    env_index_values,
    expected_env_index,
    raised_by,
    raising_maker,
)
from tests.conftest import awaited
from zmqpool import (
    BatchSizeMismatchError,
    EnvBusyError,
    EnvError,
    EnvMakerError,
    MissingKeyError,
    NothingInFlightError,
    PoolClosedError,
    PoolConfig,
    ZMQAsyncEnvPool,
)
from zmqpool.testing import CountingEnv as ZMQCountingEnv

FAST = PoolConfig(register_timeout_s=90.0, close_timeout_s=3.0)

#: Bounds every recv that could wait (a hang fails the test instead of the run).
RECV_TIMEOUT = 20.0

#: Envs of the main pools.
N = 3

SPEC_PROPERTIES = [
    "full_action_spec",
    "full_observation_spec",
    "full_done_spec",
    "full_reward_spec",
    "full_state_spec",
]

ACTION_DTYPES = [torch.bool, torch.float32, torch.int64, torch.float64, torch.int8]


@dataclasses.dataclass
class Pair:
    """The oracle and the zmqpool pool, driven by the same calls."""

    oracle: Any
    zmq: ZMQAsyncEnvPool

    @property
    def pools(self) -> tuple[Any, ZMQAsyncEnvPool]:
        return self.oracle, self.zmq

    def both(self, call: Callable[[Any], Any]) -> tuple[Any, Any]:
        """``call(pool)`` on the oracle, then on zmqpool."""
        return call(self.oracle), call(self.zmq)

    def settle(self) -> Pair:
        """Receive what a previous (maybe failed) test left in flight, then reset both."""
        for pool in self.pools:
            if isinstance(pool, ZMQAsyncEnvPool):
                drain(pool, RECV_TIMEOUT)
                assert not awaited(pool), f"zmqpool: {awaited(pool)} left busy"
            elif isinstance(pool, AsyncEnvPool):
                drain(pool, RECV_TIMEOUT)
                # torchrl's pool has no public view of what is in flight: its own _busy.
                assert not pool._busy, f"{type(pool).__name__}: envs {pool._busy} left busy"
            pool.reset()
        return self


def serve(oracle: Any, make_zmq: Callable[[], ZMQAsyncEnvPool]):
    """Yield a :class:`Pair`, closing both at the end (and the oracle if zmqpool fails to build)."""
    try:
        zmq = make_zmq()
    except BaseException:
        oracle.close(raise_if_closed=False)
        raise
    try:
        yield Pair(oracle, zmq)
    finally:
        zmq.close(raise_if_closed=False)
        oracle.close(raise_if_closed=False)


def serve_threading_pair(makers: Callable[[], list[Callable]]):
    """:func:`serve` of torchrl's threading pool and zmqpool (``FAST``), each of ``makers()``."""
    yield from serve(
        AsyncEnvPool(makers(), backend="threading"),
        lambda: ZMQAsyncEnvPool(makers(), config=FAST),
    )


def _raises(error: type[Exception], call: Callable, *args, **kwargs) -> None:
    """``call(*args, **kwargs)`` must raise ``error``."""
    with pytest.raises(error):
        call(*args, **kwargs)


def with_ones(pool: Any, td: TensorDictBase) -> TensorDictBase:
    """``td`` with every action set to the spec's ``one()`` (CountingEnvs count by it)."""
    return td.update(pool.full_action_spec.one())


def recv_everything(recv: Callable, count: int, min_get: int | None) -> list[Any]:
    """Call ``recv`` until ``count`` results came back; every call's result, in order.

    How many results a call returns depends on timing; what must hold is
    that each call returns at least ``min_get`` (capped by what is left).
    """
    batches, left = [], count
    while left:
        want = None if min_get is None else min(min_get, left)
        out = recv(min_get=want, timeout=RECV_TIMEOUT)
        got = (out[0] if isinstance(out, tuple) else out).batch_size[0]
        assert got >= (want or 1), f"recv(min_get={want}) returned {got} results"
        batches.append(out)
        left -= got
    return batches


def by_env(batches: list[TensorDictBase]) -> dict[int, TensorDictBase]:
    """Each env's row of the results, by its ``env_index``; checks each call's order."""
    rows: dict[int, TensorDictBase] = {}
    for batch in batches:
        idx = env_index_values(batch)
        assert idx == sorted(idx), f"results not sorted by env index: {idx}"
        for env, row in zip(idx, batch.unbind(0), strict=True):
            assert env not in rows, f"env {env} delivered twice"
            rows[env] = row
    return rows


def assert_same_batches(expected: list[Any], actual: list[Any], what: str) -> None:
    """Per env, the same rows; every env exactly once (batches may split differently)."""
    if isinstance(expected[0], tuple):
        for part in range(len(expected[0])):
            assert_same_batches([b[part] for b in expected], [b[part] for b in actual], what)
        return
    rows_e, rows_a = by_env(expected), by_env(actual)
    assert sorted(rows_a) == sorted(rows_e), f"{what}: envs {sorted(rows_a)} != {sorted(rows_e)}"
    for env, row in rows_e.items():
        assert_same_td(row, rows_a[env], f"{what}, env {env}")


# ====================================================================== main pool


@pytest.fixture(scope="class")
def counting():
    """3 torchrl CountingEnvs (int8 Binary action; env i starts at i, done past 4)."""
    yield from serve_threading_pair(lambda: counting_makers(N))


@pytest.fixture
def pair(counting) -> Pair:
    return counting.settle()


@pytest.fixture(scope="class")
def shm_oracle():
    """torchrl's multiprocessing pool with the shared-memory exchange: the oracle of ``stats()``.

    2 envs, importable makers (spawned workers import ``tests.conformance``).
    """
    pool = AsyncEnvPool(counting_makers(2), backend="multiprocessing", exchange="shm")
    yield pool
    pool.close(raise_if_closed=False)


def test_an_empty_list_of_makers_is_refused_as_torchrl_does():
    assert_same_error(
        lambda: AsyncEnvPool([], backend="threading"), lambda: ZMQAsyncEnvPool([], config=FAST)
    )


def test_torchrls_backend_argument_runs_unchanged():
    # Code written for torchrl's pool passes its backend; the envs run in processes anyway.
    pool = ZMQAsyncEnvPool(counting_makers(1), backend="threading", config=FAST)
    try:
        assert pool.reset()["observation"].tolist() == [[0]]
    finally:
        pool.close()
    for backend in ("asyncio", "processes"):  # torchrl's pool runs neither
        with pytest.raises(NotImplementedError):
            AsyncEnvPool(counting_makers(1), backend=backend)
        with pytest.raises(NotImplementedError, match="backend must be") as info:
            ZMQAsyncEnvPool(counting_makers(1), backend=backend, config=FAST)
        assert isinstance(info.value, ValueError)  # as zmqpool's refusal was before


@pytest.mark.parametrize(
    "error",
    [
        "ValueError",
        "KeyError",
        "AttributeError",
        "IndexError",
        "ConnectionResetError",
        "TimeoutError",
        "StopIteration",
    ],
)
def test_an_env_s_error_is_of_the_builtin_class_it_raised(error):
    # torchrl's pool re-raises the env's own exception: `except ValueError` around a
    # step catches it. Ours is an EnvError (naming the env, with the worker's
    # traceback) that is also an instance of the builtin the env raised.
    makers = [functools.partial(RaisingEnv, env_id=i, error=error) for i in range(2)]
    oracle = AsyncEnvPool(makers, backend="threading")
    zmq = ZMQAsyncEnvPool(makers, envs_per_worker=2, config=FAST)
    try:
        td_o, td_z = oracle.reset(), zmq.reset()
        err = assert_same_error(
            lambda: oracle.step(with_ones(oracle, td_o)), lambda: zmq.step(with_ones(zmq, td_z))
        )
        assert isinstance(err, EnvError) and err.env_index in (0, 1)  # both raise: either
        assert str(err).startswith(f"env {err.env_index}: env raised: {error}(")
        zmq.async_step_send(with_ones(zmq, td_z)[[1]], env_index=[1])  # and async, the same
        with pytest.raises(getattr(builtins, error)) as info:
            zmq.async_step_recv(min_get=1, timeout=RECV_TIMEOUT)
        assert isinstance(info.value, EnvError) and info.value.env_index == 1  # the one that ran
        assert str(info.value).startswith(f"env 1: env raised: {error}(")
    finally:
        oracle.close()
        zmq.close()


@pytest.mark.parametrize("error", ["ValueError", "TypeError", "ModuleNotFoundError"])
def test_an_env_makers_error_is_of_the_builtin_class_it_raised(error):
    # torchrl's pool (and SerialEnv) raise the maker's own exception: `except ImportError`
    # around a pool of an optional dependency catches it. Ours is an EnvMakerError (naming
    # the env, with the worker's traceback) that is also an instance of that builtin.
    makers = [counting_makers(1)[0], functools.partial(raising_maker, error)]
    err = assert_same_error(
        lambda: AsyncEnvPool(makers, backend="threading"),
        lambda: ZMQAsyncEnvPool(makers, envs_per_worker=2, config=FAST),
    )
    assert isinstance(err, EnvMakerError) and err.env_index == 1, repr(err)
    assert str(err).startswith(f"env 1: env maker raised {error}("), str(err)


class StopBuilding(BaseException):
    """A BaseException of an env maker's own."""


def exiting_maker(how: str) -> ZMQCountingEnv:
    if how == "exit":
        sys.exit("the env maker gives up")
    raise StopBuilding("the env maker gives up")


@pytest.mark.parametrize("how", ["exit", "BaseException"])
def test_an_env_maker_that_calls_sys_exit_is_an_env_maker_error_naming_its_env(how):
    # The worker died of the SystemExit (or BaseException), and the trainer heard only
    # "the worker of envs [0, 1] exited with status 1 before registering". SerialEnv would
    # exit the trainer itself; an error that names the env and the call is what a user
    # can act on.
    makers = [counting_makers(1)[0], functools.partial(exiting_maker, how)]
    with pytest.raises(EnvMakerError) as info:
        ZMQAsyncEnvPool(makers, envs_per_worker=2, config=FAST)
    assert info.value.env_index == 1 and not isinstance(info.value, SystemExit)
    raised = "SystemExit" if how == "exit" else "StopBuilding"
    assert str(info.value).startswith(f"env 1: env maker raised {raised}('the env maker"), str(
        info.value
    )


def test_envs_are_built_with_the_trainers_default_dtype_as_in_process():
    # torch.set_default_dtype(torch.float64) in the trainer: SerialEnv's envs, built
    # in-process, make float64 specs and observations. Our workers, forked from a fork
    # server, did not inherit it: float32, silently. Each local worker is told the dtype.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pools = []
    try:
        makers = [functools.partial(DefaultDtypeEnv, env_id=i) for i in range(2)]
        pools = [SerialEnv(2, makers), ZMQAsyncEnvPool(makers, config=FAST)]
        results = []
        for p in pools:
            reset = p.reset()
            results.append((reset, p.step(with_ones(p, reset)), p.observation_spec))
    finally:
        torch.set_default_dtype(previous)
        for p in pools:
            p.close()
    (reset_s, step_s, spec_s), (reset_z, step_z, spec_z) = results
    assert spec_s["observation"].dtype == spec_z["observation"].dtype == torch.float64
    assert_same_td(reset_s, reset_z, "reset", exclude=[ENV_INDEX])
    assert_same_td(step_s, step_z, "step", exclude=[ENV_INDEX])


def test_results_carry_the_device_of_the_envs():
    # Envs built with device="cpu" return tensordicts on it, and so do SerialEnv's
    # results. torchrl's pool is not consistent (its resets and the roots of its steps
    # have no device, its step_and_maybe_reset has it everywhere): here every result
    # has the envs' device, as SerialEnv's.
    makers = counting_makers(2, device="cpu")
    oracle = AsyncEnvPool(makers, backend="threading")
    ours = ZMQAsyncEnvPool(makers, config=FAST)

    def devices(pool) -> list:
        td = pool.reset().exclude(ENV_INDEX)
        td["action"] = torch.ones(2, 1, dtype=torch.int8)
        pool.async_step_send(td, env_index=[0, 1])
        stepped = pool.async_step_recv(min_get=2, timeout=RECV_TIMEOUT)
        pool.async_reset_send(env_index=1)
        own = pool.async_reset_recv(env_index=1, timeout=RECV_TIMEOUT)
        rollout = pool.rollout(3, break_when_any_done=False)
        return [stepped.device, stepped["next"].device, own.device, rollout.device]

    try:
        assert devices(oracle)[1] == torch.device("cpu")  # the envs' own tensordicts have it
        assert devices(ours) == [torch.device("cpu")] * 4
    finally:
        ours.close()
        oracle.close()


class TestCountingPool:
    """Every public method and private hook of torchrl's pool, on torchrl's CountingEnv."""

    # ------------------------------------------------------------ specs

    def test_workers_import_envs_from_tests_conformance(self, pair):
        # The envs of this pool are defined in tests/conformance.py: zmqpool's
        # workers (and torchrl's spawned ones, for stats) import them by name.
        assert counting_makers(1)[0].func.__module__ == "tests.conformance"
        o, z = pair.both(lambda p: p.reset())
        assert_same_td(o, z, "reset() of envs from tests.conformance")

    def test_batch_size_and_env_batch_sizes(self, pair):
        o, z = pair.both(lambda p: (p.batch_size, list(p.env_batch_sizes)))
        assert z == o

    @pytest.mark.parametrize("name", SPEC_PROPERTIES)
    def test_spec_property(self, pair, name):
        o, z = pair.both(lambda p: getattr(p, name))
        assert_same_spec(o, z, name)

    def test_action_spec_is_int8_binary(self, pair):
        # What the dtype scenarios below rely on: torchrl's CountingEnv has an int8 action.
        o, z = pair.both(lambda p: p.full_action_spec["action"])
        assert o.dtype == z.dtype == torch.int8
        assert type(o).__name__ == type(z).__name__ == "Binary"

    # ------------------------------------------------------------ reset

    def test_reset(self, pair):
        o, z = pair.both(lambda p: p.reset())
        assert_same_td(o, z, "reset()")
        assert env_index_kind(z) == "NonTensorStack"

    def test_reset_with_an_empty_tensordict(self, pair):
        o, z = pair.both(lambda p: p.reset(TensorDict(batch_size=[N])))
        assert_same_td(o, z, "reset(TensorDict(batch_size=[N]))")

    @pytest.mark.parametrize("call", ["reset", "step", "step_and_maybe_reset"])
    @pytest.mark.parametrize("shape", [[N - 1], [N, 1], []], ids=["fewer", "deeper", "none"])
    def test_a_tensordict_of_another_batch_size_is_refused_as_serial_env_does(
        self, pair, call, shape
    ):
        # torchrl's pool sends it, then waits for more envs than it addressed and stays
        # busy (Cannot await...); SerialEnv refuses it, and so does zmqpool, first.
        td = TensorDict({"action": torch.ones(*shape, 1)}, shape)
        serial = SerialEnv(N, counting_makers(N))
        try:
            expected = raised_by(lambda: getattr(serial, call)(td.clone()))
        finally:
            serial.close(raise_if_closed=False)
        assert isinstance(expected, RuntimeError), expected
        # A BatchSizeMismatchError, as an async send's: the RuntimeError SerialEnv raises.
        with pytest.raises(BatchSizeMismatchError, match=r"shape==env\.batch_size"):
            getattr(pair.zmq, call)(td.clone())
        assert pair.zmq.step(with_ones(pair.zmq, pair.zmq.reset())).shape == (N,)  # not busy

    def test_reset_with_the_previous_root(self, pair):
        # A user resetting from where a step left: reset(step_mdp(step(td))).
        def run(p):
            td = p.step(with_ones(p, p.reset()))
            return p.reset(step_mdp(td))

        o, z = pair.both(run)
        assert_same_td(o, z, "reset(previous root)")

    def test_private_reset(self, pair):
        o, z = pair.both(lambda p: p._reset(None))
        assert_same_td(o, z, "_reset(None)")

    # ------------------------------------------------------------ step

    def test_step(self, pair):
        o, z = pair.both(lambda p: p.step(with_ones(p, p.reset())))
        assert_same_td(o, z, "step()")

    @pytest.mark.parametrize("call", ["step", "step_and_maybe_reset"])
    def test_a_sync_step_returns_the_callers_tensordict_as_serial_env_does(self, pair, call):
        # torchrl differs: its pool returns a new tensordict and leaves the caller's
        # without "next" (README). EnvBase.step, and so SerialEnv, write into it.
        serial = SerialEnv(N, counting_makers(N))
        try:
            returned = {}
            for name, env in (("SerialEnv", serial), ("zmqpool", pair.zmq)):
                td = with_ones(env, env.reset())
                out = getattr(env, call)(td)
                root = out[0] if call == "step_and_maybe_reset" else out
                assert root is td and "next" in td, f"{name}: {call} made a new tensordict"
                returned[name] = td
            assert_same_td(
                returned["SerialEnv"], returned["zmqpool"], f"{call}(td)", exclude=[ENV_INDEX]
            )
        finally:
            serial.close(raise_if_closed=False)

    @pytest.mark.parametrize("dtype", ACTION_DTYPES, ids=str)
    def test_step_takes_actions_of_another_dtype(self, pair, dtype):
        # torchrl hands the caller's tensor to the env as it is (CountingEnv
        # casts it); the result's "action" keeps the caller's dtype.
        def run(p):
            td = p.reset()
            td["action"] = torch.ones(N, 1, dtype=dtype)
            return p.step(td)

        o, z = pair.both(run)
        assert_same_td(o, z, f"step() with a {dtype} action for an int8 spec")

    @pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
    def test_a_float8_entry_in_a_step_comes_back_as_torchrls_does(self, pair, dtype):
        # Session 62's audit: refused as "cannot cross the wire", where torchrl's pool passes it.
        def run(p):
            td = p.reset().set("action", torch.ones(N, 1, dtype=torch.int8))
            td["extra"] = torch.tensor([[0.5], [1.0], [-2.0]]).to(dtype)
            return p.step(td)

        o, z = pair.both(run)
        assert z["extra"].dtype == o["extra"].dtype == dtype
        assert torch.equal(z["extra"].view(torch.uint8), o["extra"].view(torch.uint8))
        assert_same_td(o.exclude("extra"), z.exclude("extra"), f"step() with a {dtype} entry")

    @pytest.mark.parametrize("shape", [(N, 1), (N,)], ids=["exact", "broadcast"])
    def test_step_takes_float_ones_of_a_broadcastable_shape(self, pair, shape):
        # torchrl's own TestAsyncEnvPool steps with torch.ones((*r.shape, 1)), a float32.
        def run(p):
            td = p.reset()
            td["action"] = torch.ones(shape)
            return p.step(td)

        o, z = pair.both(run)
        assert_same_td(o, z, f"step() with float ones of shape {shape}")

    @pytest.mark.parametrize("call", ["step", "step_and_maybe_reset"])
    def test_sync_calls_index_a_tensordict_without_env_index(self, pair, call):
        # The input carries no env_index (a policy's output, say): both pools index
        # every row themselves, step every env and return its env_index in order.
        def run(p):
            return getattr(p, call)(with_ones(p, p.reset().exclude(ENV_INDEX)))

        o, z = pair.both(run)
        if call == "step":
            assert_same_td(o, z, "step() of a tensordict without env_index")
        else:
            assert_same_td(o[0], z[0], "step_and_maybe_reset() without env_index: result")
            assert_same_td(o[1], z[1], "step_and_maybe_reset() without env_index: next root")

    def test_private_step(self, pair):
        o, z = pair.both(lambda p: p._step(with_ones(p, p.reset())))
        assert_same_td(o, z, "_step()")

    def test_rand_step(self, pair):
        def run(p):
            td = p.reset()
            torch.manual_seed(0)
            return p.rand_step(td)

        o, z = pair.both(run)
        assert_same_td(o, z, "rand_step()")

    def test_step_and_maybe_reset_through_episode_ends(self, pair):
        # Env i starts at i and is done past 4: over 6 steps every env ends
        # (at different steps) and is reset by step_and_maybe_reset.
        def run(p):
            out, td = [], p.reset()
            for _ in range(6):
                result, td = p.step_and_maybe_reset(with_ones(p, td))
                out.append((result.clone(), td.clone()))
            return out

        o, z = pair.both(run)
        for step, ((res_o, root_o), (res_a, root_a)) in enumerate(zip(o, z, strict=True)):
            assert_same_td(res_o, res_a, f"step_and_maybe_reset #{step}: result")
            assert_same_td(root_o, root_a, f"step_and_maybe_reset #{step}: next root")

    @pytest.mark.parametrize("break_when_any_done", [True, False])
    def test_rollout(self, pair, break_when_any_done):
        def run(p):
            torch.manual_seed(1)
            return p.rollout(10, break_when_any_done=break_when_any_done)

        o, z = pair.both(run)
        assert_same_td(o, z, f"rollout(10, break_when_any_done={break_when_any_done})")

    @pytest.mark.parametrize(
        "call",
        ["reset", "step", "step_and_maybe_reset", "rollout", "transformed reset", "_reset"],
    )
    def test_a_sync_call_while_an_async_step_is_in_flight_is_refused(self, pair, call):
        # torchrl's RuntimeError; here the EnvBusyError of every busy refusal (README).
        calls = {
            "reset": lambda p, td: p.reset(),
            "step": lambda p, td: p.step(td),
            "step_and_maybe_reset": lambda p, td: p.step_and_maybe_reset(td),
            "rollout": lambda p, td: p.rollout(2),
            "transformed reset": lambda p, td: TransformedEnv(p, StepCounter()).reset(),
            "_reset": lambda p, td: p._reset(),  # the hook TransformedEnv calls
        }
        inputs = {}
        for p in pair.pools:
            inputs[id(p)] = with_ones(p, p.reset())
            p.async_step_send(with_ones(p, p.reset()))
        try:
            error = assert_same_error(
                *(functools.partial(calls[call], p, inputs[id(p)]) for p in pair.pools)
            )
            assert isinstance(error, EnvBusyError), type(error).__mro__
            assert str(error).startswith("Some envs are still processing a step"), error
        finally:
            for p in pair.pools:
                drain(p, RECV_TIMEOUT)

    # ------------------------------------------------------------ async, batched channel

    @pytest.mark.parametrize("min_get", [None, 1, 2, N])
    def test_async_reset(self, pair, min_get):
        # As torchrl's test_async_reset_and_step: env_index carried by the tensordict.
        def run(p):
            p.async_reset_send(TensorDict({ENV_INDEX: NonTensorStack(*range(N))}, [N]))
            return recv_everything(p.async_reset_recv, N, min_get)

        o, z = pair.both(run)
        assert_same_batches(o, z, f"async_reset_recv(min_get={min_get})")

    @pytest.mark.parametrize("min_get", [None, 1, 2, N])
    def test_async_step(self, pair, min_get):
        def run(p):
            r = p.reset()
            r.set("action", torch.ones((*r.shape, 1)))
            p.async_step_send(r)
            return recv_everything(p.async_step_recv, N, min_get)

        o, z = pair.both(run)
        assert_same_batches(o, z, f"async_step_recv(min_get={min_get})")

    @pytest.mark.parametrize("min_get", [None, N])
    def test_async_step_and_maybe_reset(self, pair, min_get):
        def run(p):
            r = p.reset()
            r.set("action", torch.ones((*r.shape, 1)))
            p.async_step_and_maybe_reset_send(r)
            return recv_everything(p.async_step_and_maybe_reset_recv, N, min_get)

        o, z = pair.both(run)
        assert_same_batches(o, z, f"async_step_and_maybe_reset_recv(min_get={min_get})")

    def test_async_step_to_a_subset_in_any_order(self, pair):
        # Rows for envs [2, 0], in that order; env 2 gets action 1, env 0 gets 0.
        def run(p):
            r = p.reset()[[2, 0]]
            r["action"] = torch.tensor([[1], [0]], dtype=torch.int8)
            p.async_step_send(r, env_index=[2, 0])
            return p.async_step_recv(min_get=2, timeout=RECV_TIMEOUT)

        o, z = pair.both(run)
        assert_same_td(o, z, "async_step_send(env_index=[2, 0]) then recv(min_get=2)")
        assert env_index_values(z) == [0, 2]

    @pytest.mark.parametrize(
        "as_indices", [np.array, lambda v: [np.int64(i) for i in v]], ids=["array", "numpy-ints"]
    )
    def test_async_step_takes_numpy_env_indices(self, pair, as_indices):
        def run(p):
            r = p.reset()[[2, 0]]
            r["action"] = torch.tensor([[1], [0]], dtype=torch.int8)
            p.async_step_send(r, env_index=as_indices([2, 0]))
            return p.async_step_recv(min_get=2, timeout=RECV_TIMEOUT)

        o, z = pair.both(run)
        # torchrl's env_index keeps the numpy integers; they equal zmqpool's ints.
        assert_same_td(o, z, "async_step_send(env_index=numpy [2, 0]) then recv(min_get=2)")
        assert [type(i) for i in env_index_values(z)] == [int, int]

    def test_async_step_takes_a_set_of_env_indices_in_its_order(self, pair):
        indices = {2, 0}

        def run(p):
            r = p.reset()[list(indices)]  # the rows in the set's order, as torchrl pairs them
            r["action"] = torch.tensor([[1], [0]], dtype=torch.int8)
            p.async_step_send(r, env_index=indices)
            return p.async_step_recv(min_get=2, timeout=RECV_TIMEOUT)

        o, z = pair.both(run)
        assert_same_td(o, z, "async_step_send(env_index={2, 0}) then recv(min_get=2)")

    def test_async_reset_of_a_subset_without_a_tensordict(self, pair):
        def run(p):
            p.async_reset_send(env_index=[1, 2])
            return p.async_reset_recv(min_get=2, timeout=RECV_TIMEOUT)

        o, z = pair.both(run)
        assert_same_td(o, z, "async_reset_send(env_index=[1, 2])")

    def test_max_get_leaves_the_rest_for_the_next_call(self, pair):
        def run(p):
            p.async_reset_send(env_index=list(range(N)))
            first = p.async_reset_recv(min_get=1, max_get=1, timeout=RECV_TIMEOUT)
            rest = p.async_reset_recv(min_get=N - 1, max_get=N - 1, timeout=RECV_TIMEOUT)
            return [first, rest]

        o, z = pair.both(run)
        assert [b.batch_size[0] for b in z] == [b.batch_size[0] for b in o] == [1, N - 1]
        assert_same_batches(o, z, "recv(max_get=1) then recv(max_get=N-1)")

    def test_private_async_hooks(self, pair):
        # What TransformedEnv and EnvBase.reset/step go through.
        def run(p):
            p._async_private_reset_send(TensorDict(batch_size=[N]), env_index=list(range(N)))
            reset = p._async_private_reset_recv(min_get=N)
            td = with_ones(p, reset.clone())
            p._async_private_step_send(td)  # env_index carried by the reset's result
            return reset, p._async_private_step_recv(min_get=N)

        (reset_o, step_o), (reset_z, step_z) = pair.both(run)
        assert_same_td(reset_o, reset_z, "_async_private_reset_send/recv")
        assert_same_td(step_o, step_z, "_async_private_step_send/recv")

    # ------------------------------------------------------------ async, per-env channel

    @staticmethod
    def _per_env_reset(p: Any, env: int) -> TensorDictBase:
        p.async_reset_send(env_index=env)
        return p.async_reset_recv(env_index=env, timeout=RECV_TIMEOUT)

    @pytest.mark.parametrize("env", [0, 2])
    def test_per_env_reset(self, pair, env):
        # torchrl: the env's own batch size (() here), env_index a NonTensorData.
        o, z = pair.both(lambda p: self._per_env_reset(p, env))
        assert o.batch_size == torch.Size([]) and env_index_kind(o) == "NonTensorData"
        assert_same_td(o, z, f"per-env reset of env {env}")

    @pytest.mark.parametrize("env", [0, 2])
    def test_per_env_step(self, pair, env):
        def run(p):
            r = self._per_env_reset(p, env)
            r.set("action", torch.ones((*r.shape, 1)))  # as torchrl's own tests do
            p.async_step_send(r, env_index=env)
            return p.async_step_recv(env_index=env, timeout=RECV_TIMEOUT)

        o, z = pair.both(run)
        assert_same_td(o, z, f"per-env step of env {env}")

    @pytest.mark.parametrize("kind", ["step", "reset", "step_and_maybe_reset"])
    def test_a_recv_on_an_env_s_channel_that_nothing_was_sent_on_raises(self, pair, kind):
        # torchrl's pool raises KeyError (no future for the env); ours a KeyError
        # that is also the RuntimeError it used to be, naming the env, at once.
        recv = f"async_{kind}_recv"
        error, took = elapsed(
            lambda: assert_same_error(
                lambda: getattr(pair.oracle, recv)(env_index=1),
                lambda: getattr(pair.zmq, recv)(env_index=1, timeout=RECV_TIMEOUT),
            )
        )
        assert isinstance(error, NothingInFlightError) and isinstance(error, RuntimeError)
        assert str(error).startswith(f"env 1 has no {kind} in flight on its own channel")
        assert took < RECV_TIMEOUT / 2

    def test_two_sends_on_an_env_s_channel_get_a_recv_each_in_order(self, pair):
        # torchrl's pool keeps one future per env: its first recv returns the second
        # step and its next raises KeyError (README: where torchrl's pool falls short).
        r = self._per_env_reset(pair.zmq, 1)
        r.set("action", torch.ones((*r.shape, 1)))
        pair.zmq.async_step_send(r, env_index=1)
        pair.zmq.async_step_send(r, env_index=1)
        first = pair.zmq.async_step_recv(env_index=1, timeout=RECV_TIMEOUT)
        second = pair.zmq.async_step_recv(env_index=1, timeout=RECV_TIMEOUT)
        assert first["next", "observation"].item() + 1 == second["next", "observation"].item()
        assert int(first["env_index"]) == int(second["env_index"]) == 1

    @pytest.mark.parametrize("env", [0, 2])
    def test_per_env_step_and_maybe_reset(self, pair, env):
        def run(p):
            r = self._per_env_reset(p, env)
            out = []
            for _ in range(4):  # env 2 ends at its 3rd step and is reset
                r.set("action", torch.ones((*r.shape, 1)))
                p.async_step_and_maybe_reset_send(r, env_index=env)
                result, r = p.async_step_and_maybe_reset_recv(env_index=env, timeout=RECV_TIMEOUT)
                # Clones: torchrl's threading pool writes "next" into the r it is sent.
                out.append((result.clone(), r.clone()))
            return out

        o, z = pair.both(run)
        for step, ((res_o, root_o), (res_a, root_a)) in enumerate(zip(o, z, strict=True)):
            assert_same_td(res_o, res_a, f"per-env step_and_maybe_reset #{step} of env {env}")
            assert_same_td(root_o, root_a, f"per-env next root #{step} of env {env}")

    # ------------------------------------------------------------ min_get / max_get errors

    def test_busy_env_is_refused(self, pair):
        for p in pair.pools:
            p.async_step_send(with_ones(p, p.reset())[[0]], env_index=[0])
        try:
            # Busy is shared by the channels: a reset of a stepping env is refused too.
            assert_same_error(
                lambda: pair.oracle.async_reset_send(env_index=[0]),
                lambda: pair.zmq.async_reset_send(env_index=[0]),
            )
        finally:
            for p in pair.pools:
                drain(p, RECV_TIMEOUT)

    def test_min_get_above_what_is_in_flight_is_refused(self, pair):
        for p in pair.pools:
            p.async_reset_send(env_index=[0])
        try:
            assert_same_error(
                lambda: pair.oracle.async_reset_recv(min_get=2, timeout=RECV_TIMEOUT),
                lambda: pair.zmq.async_reset_recv(min_get=2, timeout=RECV_TIMEOUT),
            )
        finally:
            for p in pair.pools:
                drain(p, RECV_TIMEOUT)

    @pytest.mark.parametrize(
        "kwargs",
        [{"min_get": 2, "max_get": 1}, {"min_get": 0}, {"min_get": 1, "timeout": -1.0}],
        ids=["max_get<min_get", "min_get=0", "negative-timeout"],
    )
    def test_bad_recv_arguments_are_refused(self, pair, kwargs):
        for p in pair.pools:
            p.async_reset_send(env_index=list(range(N)))
        try:
            error = assert_same_error(
                lambda: pair.oracle.async_reset_recv(**kwargs),
                lambda: pair.zmq.async_reset_recv(**kwargs),
            )
            assert isinstance(error, ValueError)
        finally:
            for p in pair.pools:
                drain(p, RECV_TIMEOUT)

    @pytest.mark.parametrize("bad", [N, -N - 1], ids=["N", "-N-1"])
    def test_env_index_out_of_range_is_refused(self, pair, bad):
        try:
            error = assert_same_error(
                lambda: pair.oracle.async_reset_send(env_index=[bad]),
                lambda: pair.zmq.async_reset_send(env_index=[bad]),
            )
            assert str(error) == (
                f"env index {bad} is out of range for a pool of {N} envs "
                f"(0 to {N - 1}, or -{N} to -1)"
            )
        finally:
            # torchrl differs: it marks env N busy before failing on it; a phantom that
            # only its private _busy holds and no public call clears (a recv would wait).
            pair.oracle._busy.discard(bad)

    @pytest.mark.parametrize("bad", [N, -N - 1], ids=["N", "-N-1"])
    def test_a_recv_on_an_env_index_out_of_range_is_a_keyerror_as_torchrl(self, pair, bad):
        # torchrl's pool looks the env's future up: KeyError. Ours was an IndexError alone.
        error = assert_same_error(
            lambda: pair.oracle.async_reset_recv(env_index=bad),
            lambda: pair.zmq.async_reset_recv(env_index=bad),
        )
        assert isinstance(error, IndexError), type(error).__mro__
        assert str(error).startswith(f"env index {bad} is out of range for a pool of {N} envs")

    @pytest.mark.parametrize("bad", ["a", 2.5])
    def test_a_recv_on_an_env_index_not_an_integer_is_a_keyerror_as_torchrl(self, pair, bad):
        # torchrl's pool looks the env's future up: KeyError. Ours was a TypeError alone.
        error = assert_same_error(
            lambda: pair.oracle.async_reset_recv(env_index=bad),
            lambda: pair.zmq.async_reset_recv(env_index=bad),
        )
        assert isinstance(error, TypeError), type(error).__mro__
        assert str(error).startswith("env ind"), str(error)

    # ------------------------------------------------------------ inputs that can never work

    def test_a_tensordict_without_env_index_raises_keyerror_as_torchrl(self, pair):
        error = assert_same_error(
            lambda: pair.oracle.async_step_send(with_ones(pair.oracle, TensorDict({}, [N]))),
            lambda: pair.zmq.async_step_send(with_ones(pair.zmq, TensorDict({}, [N]))),
        )
        assert isinstance(error, MissingKeyError)
        assert str(error).startswith("the tensordict has no 'env_index' entry: pass env_index=")

    @pytest.mark.parametrize("kind", ["step", "reset"])
    def test_rows_that_do_not_match_env_index_raise_runtimeerror_as_torchrl(self, pair, kind):
        # torchrl's pool: tensordict's RuntimeError ("Received a new batch size"), before
        # anything is sent; ours a BatchSizeMismatchError, a RuntimeError and a ValueError.
        def send(p):
            td = TensorDict({}, [N]) if kind == "reset" else with_ones(p, p.reset())
            getattr(p, f"async_{kind}_send")(td, env_index=[0, 1])

        error = assert_same_error(lambda: send(pair.oracle), lambda: send(pair.zmq))
        assert isinstance(error, BatchSizeMismatchError) and isinstance(error, ValueError)
        assert (
            str(error)
            == f"the tensordict's batch size ({N},) does not match the 2 env indices [0, 1]"
        )
        assert not pair.oracle._busy and not awaited(pair.zmq)

    # ------------------------------------------------------------ negative env indices

    def test_a_negative_env_index_steps_the_env_counted_from_the_end(self, pair):
        # torchrl's pool indexes its list of envs with it: env N-1 steps. Its result says
        # -1; ours says N-1, the env's own index (README: "Drop-in").
        def run(p):
            r = p.reset()[[N - 1, 0]]
            r["action"] = torch.tensor([[1], [0]], dtype=torch.int8)
            p.async_step_send(r, env_index=[-1, 0])
            return p.async_step_recv(min_get=2, timeout=RECV_TIMEOUT)

        o, z = pair.both(run)
        assert env_index_values(o) == [-1, 0]  # sorted by its labels
        assert env_index_values(z) == [0, N - 1]
        assert_same_td(o[[1, 0]].exclude(ENV_INDEX), z.exclude(ENV_INDEX), "env_index=[-1, 0]")

        # The result goes straight back (its env_index names the same envs on both).
        def resend(p, result):
            again = step_mdp(result).set("action", torch.ones(2, 1, dtype=torch.int8))
            p.async_step_send(again)
            return p.async_step_recv(min_get=2, timeout=RECV_TIMEOUT)

        o2, z2 = resend(pair.oracle, o), resend(pair.zmq, z)
        assert_same_td(o2[[1, 0]].exclude(ENV_INDEX), z2.exclude(ENV_INDEX), "its step_mdp resent")

    @pytest.mark.parametrize("kind", ["step", "reset"])
    def test_a_negative_env_index_names_an_env_s_own_channel(self, pair, kind):
        def run(p):
            r = self._per_env_reset(p, -1)
            if kind == "reset":
                return r
            r.set("action", torch.ones((*r.shape, 1)))
            p.async_step_send(r, env_index=-1)
            return p.async_step_recv(env_index=-1, timeout=RECV_TIMEOUT)

        o, z = pair.both(run)
        assert int(o[ENV_INDEX]) == -1 and int(z[ENV_INDEX]) == N - 1
        assert_same_td(o.exclude(ENV_INDEX), z.exclude(ENV_INDEX), f"per-env {kind} of env -1")
        # Ours knows the env by one number: sent as -1, its channel is env N-1's.
        pair.zmq.async_reset_send(env_index=-1)
        own = pair.zmq.async_reset_recv(env_index=N - 1, timeout=RECV_TIMEOUT)
        assert int(own[ENV_INDEX]) == N - 1

    def test_a_negative_env_index_is_busy_with_its_env(self, pair):
        # torchrl's pool would step env N-1 twice at once (it tracks -1 and N-1 apart).
        pair.zmq.async_reset_send(env_index=[-1])
        try:
            with pytest.raises(RuntimeError, match="Some envs are still processing"):
                pair.zmq.async_reset_send(env_index=[N - 1])
            with pytest.raises(ValueError, match=rf"repeat env \[{N - 1}\]"):
                pair.zmq.async_reset_send(env_index=[N - 1, -1])
        finally:
            drain(pair.zmq, RECV_TIMEOUT)

    def test_a_negative_timeout_on_an_env_s_own_channel_is_refused(self, pair):
        # As on the batch channel (torchrl's pool ignores timeout on an env's own channel).
        pair.zmq.async_reset_send(env_index=1)
        with pytest.raises(ValueError, match="timeout must be non-negative, got -1"):
            pair.zmq.async_reset_recv(env_index=1, timeout=-1)
        out = pair.zmq.async_reset_recv(env_index=1, timeout=RECV_TIMEOUT)  # still there
        assert int(out[ENV_INDEX]) == 1

    @pytest.mark.parametrize(
        ("kind", "rows"),
        [
            ("step", "the whole batch"),
            ("step", "a one-row slice"),
            ("step_and_maybe_reset", "the whole batch"),
            ("reset", "the whole batch"),
        ],
    )
    def test_a_batch_sent_on_an_env_s_own_channel_is_refused_at_the_send(self, pair, kind, rows):
        # Session 62's audit: sent to the worker, the env raised, and the error came at the
        # recv (with on_env_error="restart": a restart, then a bare RuntimeError).
        def send(p):
            td = p.reset().set("action", torch.ones(N, 1, dtype=torch.int8))
            getattr(p, f"async_{kind}_send")(td if rows == "the whole batch" else td[1:2], 1)

        error = assert_same_error(lambda: send(pair.oracle), lambda: send(pair.zmq))
        assert isinstance(error, BatchSizeMismatchError)
        assert str(error).startswith("env 1's own channel takes that env's tensordict")
        assert not awaited(pair.zmq)  # nothing went out

    def test_an_unbatched_tensordict_sent_with_a_list_of_indices_is_torchrls_index_error(
        self, pair
    ):
        def send(p):
            td = p.reset().set("action", torch.ones(N, 1, dtype=torch.int8))
            p.async_step_send(td[1], env_index=[1])

        # A pool of its own: torchrl's is left with env 1 busy for good after it raises.
        oracle = AsyncEnvPool(counting_makers(N), backend="threading")
        try:
            error = assert_same_error(lambda: send(oracle), lambda: send(pair.zmq))
        finally:
            oracle.close(raise_if_closed=False)
        assert isinstance(error, BatchSizeMismatchError) and isinstance(error, RuntimeError)
        assert not awaited(pair.zmq)  # nothing went out, and nothing is left busy

    def test_an_empty_list_of_indices_sends_nothing(self, pair):
        # torchrl's pool raises IndexError ("list index out of range"): README.
        assert isinstance(raised_by(lambda: pair.oracle.async_reset_send(env_index=[])), IndexError)
        pair.zmq.async_reset_send(env_index=[])
        empty = pair.zmq.reset().set("action", torch.ones(N, 1, dtype=torch.int8))[:0]
        pair.zmq.async_step_send(empty, env_index=[])
        assert not awaited(pair.zmq)

    def test_a_masked_reset_of_rows_in_another_order_labels_its_rows_by_position(self, pair):
        # Rows are envs by position in a sync call; EnvBase kept the rows not reset with the
        # input's own labels, so env 0 was named twice ([0, 1, 0]).
        def run(p):
            td = p.reset()[[2, 1, 0]]
            td.set("_reset", torch.tensor([[True], [False], [False]]))
            return p.reset(td)

        o, z = pair.both(run)
        assert env_index_values(z) == env_index_values(o) == [0, 1, 2]

    # ------------------------------------------------------------ torchrl's tooling

    def test_check_env_specs(self, pair):
        for p in pair.pools:
            check_env_specs(p, break_when_any_done="both")

    @pytest.mark.parametrize(
        "make_transform",
        [StepCounter, lambda: Compose(StepCounter(max_steps=3), RewardSum())],
        ids=["StepCounter", "StepCounter(3)+RewardSum"],
    )
    def test_transformed_env(self, pair, make_transform):
        # TransformedEnv steps and resets the pool through _step/_reset.
        def run(p):
            env = TransformedEnv(p, make_transform())
            check_env_specs(env)
            torch.manual_seed(2)
            return env.rollout(8, break_when_any_done=False)

        o, z = pair.both(run)
        assert_same_td(o, z, "TransformedEnv(pool, ...).rollout(8)")

    def test_collector(self, pair):
        # torchrl differs: Collector(AsyncEnvPool(...)) raises AttributeError
        # ('Tensor' object has no attribute 'batch_size'): the pool writes
        # env_index into the collector's tensordict as a tensor. A user
        # expects what SerialEnv gives, plus env_index.
        # total_frames=-1 and two batches taken: a collector that reaches its
        # total_frames closes its env, and this pool is shared.
        serial = SerialEnv(N, counting_makers(N))

        def collect(env):
            torch.manual_seed(3)
            collector = Collector(env, None, frames_per_batch=2 * N, total_frames=-1)
            try:
                return [batch.clone() for batch in itertools.islice(collector, 2)]
            finally:
                collector.shutdown(close_env=False)

        try:
            expected = collect(serial)
        finally:
            serial.close(raise_if_closed=False)
        actual = collect(pair.zmq)
        assert len(actual) == len(expected) == 2
        for i, (batch_e, batch_a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_td(batch_e, batch_a, f"collector batch {i}", exclude=[ENV_INDEX])
            assert env_index_values(batch_a) == expected_env_index(batch_a.batch_size)

    # ------------------------------------------------------------ stats()

    @staticmethod
    def _stats_calls(p: Any) -> tuple[dict, dict]:
        """A partial batch, a full one and a step, on envs 0 and 1 only.

        The oracle has 2 envs and zmqpool's pool 3: with the same calls on the
        same envs the counts are the same. Every recv with a timeout has a
        max_get: torchrl's multiprocessing pool, once min_get is met, waits
        for more until the deadline even when nothing else is in flight.
        """
        p.stats(reset=True)
        p.async_reset_send(env_index=[0])
        p.async_reset_recv(min_get=1, max_get=2, timeout=0.3)  # 1 of max_get=2: partial
        p.async_reset_send(env_index=[0, 1])
        r = p.async_reset_recv(min_get=2, max_get=2, timeout=RECV_TIMEOUT)
        r.set("action", torch.ones((*r.shape, 1)))
        p.async_step_send(r)
        p.async_step_recv(min_get=2, max_get=2, timeout=RECV_TIMEOUT)
        return p.stats(reset=True), p.stats()

    COUNTS = ["batches", "items", "avg_batch_size", "batch_fill_ratio", "partial_batch_fraction"]
    TIMES = ["avg_observation_to_batch_ms", "avg_batch_to_action_ms", "consumer_busy_fraction"]

    def test_stats_keys_and_counts(self, pair, shm_oracle):
        (expected, _), (actual, _) = self._stats_calls(shm_oracle), self._stats_calls(pair.zmq)
        assert set(actual) == set(expected) == set(self.COUNTS + self.TIMES)
        # 3 batches of 1, 2, 2 items for capacities 2, 2, 2.
        assert expected["batches"] == 3 and expected["items"] == 5
        for key in self.COUNTS:
            assert actual[key] == pytest.approx(expected[key]), (key, expected, actual)

    def test_stats_count_sync_calls_as_torchrl_does(self, pair, shm_oracle):
        """torchrl's sync calls go through its async send and recv: each is a batch of every
        env, and the action a step's result awaits is timed (a Collector's loop)."""

        def run(p):
            p.stats(reset=True)
            td = p.reset().set("action", torch.ones((p.num_envs, 1)))
            td = p.step(td)
            td = step_mdp(td).set("action", torch.ones((p.num_envs, 1)))
            _, root = p.step_and_maybe_reset(td)
            p.step(root.set("action", torch.ones((p.num_envs, 1))))
            return p.stats(reset=True), p.num_envs

        (expected, n_e), (actual, n_a) = run(shm_oracle), run(pair.zmq)
        assert expected["batches"] == 4 and expected["items"] == 4 * n_e, expected
        per_env = {"items": n_e, "avg_batch_size": n_e}
        for key in self.COUNTS:
            scale = n_a / n_e if key in per_env else 1
            assert actual[key] == pytest.approx(expected[key] * scale), (key, expected, actual)
        assert expected["avg_batch_to_action_ms"] > 0 and actual["avg_batch_to_action_ms"] > 0

    def test_stats_reset_clears(self, pair, shm_oracle):
        (_, expected), (_, actual) = self._stats_calls(shm_oracle), self._stats_calls(pair.zmq)
        assert expected["batches"] == expected["items"] == 0
        for key in self.COUNTS:
            assert actual.get(key) == pytest.approx(expected[key]), (key, expected, actual)

    def test_stats_count_the_per_env_channel(self, pair, shm_oracle):
        # torchrl's shm exchange counts a per-env recv as a batch of 1 of max_get=1.
        def run(p):
            p.stats(reset=True)
            self._per_env_reset(p, 1)
            return p.stats(reset=True)

        expected, actual = run(shm_oracle), run(pair.zmq)
        assert expected["batches"] == expected["items"] == 1
        for key in self.COUNTS:
            assert actual.get(key) == pytest.approx(expected[key]), (key, expected, actual)

    def test_stats_times_are_plausible(self, pair, shm_oracle):
        # As torchrl's test_shared_memory_exchange: a recv then a send of the
        # next action makes avg_batch_to_action_ms and consumer_busy_fraction > 0.
        def run(p):
            p.stats(reset=True)
            p.async_reset_send(env_index=[0, 1])
            r = p.async_reset_recv(min_get=2, max_get=2, timeout=RECV_TIMEOUT)
            for _ in range(2):
                r.set("action", torch.ones((*r.shape, 1)))
                p.async_step_send(r)
                r = step_mdp(p.async_step_recv(min_get=2, max_get=2, timeout=RECV_TIMEOUT))
            return p.stats(reset=True)

        for name, stats in (("torchrl", run(shm_oracle)), ("zmqpool", run(pair.zmq))):
            for key in self.TIMES:
                assert 0 <= stats[key] < 60_000, (name, key, stats)
            assert stats["consumer_busy_fraction"] <= 1.0, (name, stats)
            assert stats["avg_batch_to_action_ms"] > 0, (name, stats)
            assert stats["consumer_busy_fraction"] > 0, (name, stats)

    def test_env_stats_and_stats_table(self, pair):
        # zmqpool's own per-env statistics moved from stats() to env_stats().
        per_env = pair.zmq.env_stats()
        assert sorted(per_env) == list(range(N))
        assert {"steps", "restarts"} <= set(per_env[0])
        table = pair.zmq.stats_table()
        assert isinstance(table, str) and len(table.splitlines()) == N + 1


# ====================================================================== min_get / max_get / timeout


def plain_makers() -> list[Callable]:
    """zmqpool's CountingEnv (float32 action), whose step reads ``tensordict["action"]``."""
    return [functools.partial(ZMQCountingEnv, env_id=i) for i in range(N)]


@pytest.fixture(scope="class")
def plain():
    yield from serve_threading_pair(plain_makers)


class TestMissingAction:
    """A step input without its action: the env's KeyError on torchrl's pool; ours, at the send."""

    @pytest.fixture
    def pair(self, plain) -> Pair:
        return plain.settle()

    @staticmethod
    def _without_action_then_recv(p: Any, call: str) -> Any:
        """``call`` with a reset's result (no action), and its recv where it has one."""
        if call in ("step", "step_and_maybe_reset"):
            return getattr(p, call)(p.reset())
        if call == "own-channel":
            r = TestCountingPool._per_env_reset(p, 1)
            p.async_step_send(r, env_index=1)
            return p.async_step_recv(env_index=1, timeout=RECV_TIMEOUT)
        getattr(p, f"{call}_send")(p.reset())
        return getattr(p, f"{call}_recv")(min_get=N, timeout=RECV_TIMEOUT)

    @pytest.mark.parametrize(
        "call",
        ["step", "step_and_maybe_reset", "async_step", "async_step_and_maybe_reset", "own-channel"],
    )
    def test_a_step_without_its_action_raises_keyerror_as_torchrl(self, pair, call):
        # torchrl's pool hands the input to the env, whose tensordict["action"] raises
        # KeyError (SerialEnv's too); ours refuses it at the send with a MissingKeyError,
        # also a ValueError. (torchrl's mocking CountingEnv gets it with a default of None
        # and raises AttributeError: which class an env raises is the env's.)
        oracle = AsyncEnvPool(plain_makers(), backend="threading")  # an error wedges it
        try:
            error = assert_same_error(
                lambda: self._without_action_then_recv(oracle, call),
                lambda: self._without_action_then_recv(pair.zmq, call),
            )
        finally:
            oracle.close(raise_if_closed=False)
        assert isinstance(error, MissingKeyError) and isinstance(error, ValueError)
        shape = "(1,)" if call == "own-channel" else f"({N}, 1)"
        assert str(error) == (
            "the step input has no action 'action': expected a torch.float32 tensor of shape "
            + shape
        )
        assert not awaited(pair.zmq)  # refused before anything was sent
        assert pair.zmq.rand_step(pair.zmq.reset()).batch_size == (N,)


#: Per-env step delays (s): env 1 answers first, then env 0, env 2 long after.
DELAYS = (0.3, 0.0, 1.5)
#: A deadline between env 0's answer and env 2's.
DEADLINE = 0.9


def delayed_makers() -> list[Callable]:
    """zmqpool's CountingEnv (float32 action; its observation shows its seed), fixed step delays."""
    return [
        functools.partial(ZMQCountingEnv, env_id=i, step_sleep_s=(d, d))
        for i, d in enumerate(DELAYS)
    ]


@pytest.fixture(scope="class")
def delayed():
    yield from serve_threading_pair(delayed_makers)


class TestDeadlines:
    """``min_get``, ``max_get`` and ``timeout`` against envs that answer late, in a known order."""

    @pytest.fixture
    def pair(self, delayed) -> Pair:
        return delayed.settle()

    @staticmethod
    def _send_steps(p: Any, envs: list[int]) -> None:
        # Only the action: no reset needed (a reset is refused while steps are in flight).
        td = TensorDict({"action": torch.full((len(envs), 1), 0.5)}, [len(envs)])
        p.async_step_send(td, env_index=envs)

    def test_deadline_batching_includes_envs_that_answer_before_the_deadline(self, pair):
        # torchrl: once min_get is met, with a timeout the call keeps collecting
        # until the deadline (or max_get), then returns what is ready: env 1
        # (at once) and env 0 (0.3 s), not env 2 (1.5 s).
        def run(p):
            self._send_steps(p, list(range(N)))
            batch, took = elapsed(lambda: p.async_step_recv(min_get=1, timeout=DEADLINE))
            rest = p.async_step_recv(min_get=1, timeout=RECV_TIMEOUT)
            return batch, took, rest

        (batch_o, took_o, rest_o), (batch_z, took_z, rest_z) = pair.both(run)
        assert env_index_values(batch_o) == [0, 1] and env_index_values(rest_o) == [2]
        assert_same_td(batch_o, batch_z, f"recv(min_get=1, timeout={DEADLINE})")
        assert_same_td(rest_o, rest_z, "the late env, at the next recv")
        assert took_z >= 0.8 * DEADLINE, f"returned after {took_z:.2f}s (torchrl {took_o:.2f}s)"

    def test_a_nan_timeout_is_a_deadline_already_past(self, pair):
        # NaN compares false with everything: ours waited as if it had no timeout (for env 2's
        # 1.5 s here; for ever with an env that hangs). torchrl's raises TimeoutError at once.
        def run(p):
            self._send_steps(p, list(range(N)))
            _, took = elapsed(
                lambda: _raises(TimeoutError, p.async_step_recv, min_get=N, timeout=float("nan"))
            )
            return took, p.async_step_recv(min_get=N, timeout=RECV_TIMEOUT)

        (took_o, all_o), (took_z, all_z) = pair.both(run)
        assert took_z < 0.25, f"TimeoutError after {took_z:.2f}s (torchrl {took_o:.2f}s)"
        assert_same_td(all_o, all_z, "every result after a NaN timeout")

    def test_deadline_batching_returns_at_max_get(self, pair):
        # With max_get reached (envs 1 and 0) the call returns without waiting for the deadline.
        def run(p):
            self._send_steps(p, list(range(N)))
            batch, took = elapsed(lambda: p.async_step_recv(min_get=1, max_get=2, timeout=10.0))
            p.async_step_recv(min_get=1, timeout=RECV_TIMEOUT)
            return batch, took

        (batch_o, took_o), (batch_z, took_z) = pair.both(run)
        assert_same_td(batch_o, batch_z, "recv(min_get=1, max_get=2, timeout=10)")
        assert took_o < 1.2 and took_z < 1.2, (took_o, took_z)

    def test_too_few_results_by_the_deadline_raise_and_are_kept(self, pair):
        # torchrl's test_recv_timeout_bounds_whole_call: the deadline bounds the
        # wait for min_get; what had arrived stays for the next call.
        def run(p):
            self._send_steps(p, list(range(N)))
            _, took = elapsed(
                lambda: _raises(TimeoutError, p.async_step_recv, min_get=N, timeout=0.2)
            )
            return took, p.async_step_recv(min_get=N, timeout=RECV_TIMEOUT)

        (took_o, all_o), (took_z, all_z) = pair.both(run)
        assert took_z < 1.0, f"TimeoutError after {took_z:.2f}s (torchrl {took_o:.2f}s)"
        assert env_index_values(all_z) == list(range(N))
        assert_same_td(all_o, all_z, "every result after a TimeoutError")

    def test_timeout_zero_polls(self, pair):
        # timeout=0 never blocks: with nothing ready it raises TimeoutError at once,
        # and polling returns a result as soon as one is ready.
        def run(p):
            self._send_steps(p, [2])  # 1.5 s
            _, took = elapsed(
                lambda: _raises(TimeoutError, p.async_step_recv, min_get=1, timeout=0)
            )
            self._send_steps(p, [1])  # at once
            deadline = time.monotonic() + RECV_TIMEOUT
            while True:
                try:
                    ready = p.async_step_recv(min_get=1, timeout=0)
                    break
                except TimeoutError:
                    assert time.monotonic() < deadline, "no result after polling for 20 s"
                    time.sleep(0.005)
            late = p.async_step_recv(min_get=1, timeout=RECV_TIMEOUT)
            return took, ready, late

        (took_o, ready_o, late_o), (took_z, ready_z, late_z) = pair.both(run)
        assert took_z < 0.5, f"timeout=0 blocked for {took_z:.2f}s (torchrl {took_o:.2f}s)"
        assert env_index_values(ready_z) == [1] and env_index_values(late_z) == [2]
        assert_same_td(ready_o, ready_z, "the polled result")
        assert_same_td(late_o, late_z, "the slow env's result")

    def test_step_sorts_results_that_finish_out_of_order(self, pair):
        def run(p):
            td = p.reset()
            td["action"] = torch.tensor([[0.1], [0.2], [0.3]])
            return p.step(td)

        o, z = pair.both(run)
        assert_same_td(o, z, "step() with envs finishing in the order 1, 0, 2")

    @pytest.mark.parametrize("static_seed", [False, True])
    def test_set_seed_seeds_as_serial_env_does(self, pair, static_seed):
        # torchrl differs: AsyncEnvPool.set_seed raises NotImplementedError.
        # SerialEnv is the reference: env 0 gets s, env i + 1 the seed env i's
        # set_seed returned (every env s with static_seed). zmqpool's
        # CountingEnv shows its seed in observation[3].
        with pytest.raises(NotImplementedError):
            pair.oracle.set_seed(7)
        serial = SerialEnv(len(DELAYS), delayed_makers())
        try:
            returned = serial.set_seed(7, static_seed=static_seed)
            expected = serial.reset()
        finally:
            serial.close()
        try:
            assert pair.zmq.set_seed(7, static_seed=static_seed) == returned
            actual = pair.zmq.reset()
        finally:
            pair.zmq.set_seed(None)  # the shared pool's envs go back to unseeded
        assert_same_td(expected, actual, "set_seed(7) then reset()", exclude=[ENV_INDEX])
        seeds = actual["observation"][:, 3].tolist()
        assert (seeds == [7.0] * len(DELAYS)) == static_seed, seeds

    # ------------------------------------------------------------ close (last: ends the pools)

    def test_zz_close_then_use(self, delayed):
        """torchrl's pool raises once closed; this one starts again on a reset, as
        ``SerialEnv`` does (README), and a recv raises: nothing can be in flight."""
        # Last of its class (its tests all use the same fixtures, so pytest
        # keeps their order): it closes the class's pools.
        for p in delayed.pools:
            p.close()
        with pytest.raises(RuntimeError, match="after shutdown"):
            delayed.oracle.reset()
        with pytest.raises(PoolClosedError, match="starts its envs again"):
            delayed.zmq.async_step_recv(min_get=1, timeout=1.0)
        assert delayed.zmq.reset().batch_size == (len(DELAYS),)
        delayed.zmq.close()


# ====================================================================== env structures


class SameCallsOnBoth:
    """reset, step, step_and_maybe_reset, rollout, rand_step and specs on one env structure.

    Subclasses give ``makers()`` (the env makers) and a class-scoped
    ``pool_pair`` fixture. With ``SerialEnv`` as the oracle
    (``serial_oracle``): it has no ``env_index``, which is checked against
    what a user expects instead (env ``i`` at ``[i, ...]``), nor the
    ``env_index`` entry of ``full_state_spec``.
    """

    serial_oracle = False
    check_type = False

    @staticmethod
    def makers() -> list[Callable]:
        raise NotImplementedError

    @pytest.fixture
    def pair(self, pool_pair) -> Pair:
        return pool_pair.settle()

    def same(self, expected, actual, what: str, exclude: tuple = ()) -> None:
        if self.serial_oracle:
            exclude = (*exclude, ENV_INDEX)
        assert_same_td(expected, actual, what, exclude=exclude, check_type=self.check_type)
        if self.serial_oracle:
            assert env_index_kind(actual) == "NonTensorStack", what
            assert env_index_values(actual) == expected_env_index(actual.batch_size), what

    def test_batch_size_and_env_batch_sizes(self, pair):
        assert pair.zmq.batch_size == pair.oracle.batch_size
        own = [env.batch_size for env in (make() for make in self.makers())]
        assert list(pair.zmq.env_batch_sizes) == own

    @pytest.mark.parametrize("name", SPEC_PROPERTIES)
    def test_spec_property(self, pair, name):
        if self.serial_oracle and name == "full_state_spec":
            # SerialEnv's has no env_index: the pool's is SerialEnv's plus env_index.
            spec = pair.zmq.full_state_spec.clone()
            assert isinstance(spec[ENV_INDEX], NonTensor)
            del spec[ENV_INDEX]
            assert_same_spec(pair.oracle.full_state_spec, spec, name)
            return
        o, z = pair.both(lambda p: getattr(p, name))
        assert_same_spec(o, z, name)

    def test_reset(self, pair):
        o, z = pair.both(lambda p: p.reset())
        self.same(o, z, "reset()")

    def test_step(self, pair):
        o, z = pair.both(lambda p: p.step(with_ones(p, p.reset())))
        self.same(o, z, "step() with ones")

    def test_step_keeps_what_a_preset_next_holds(self, pair):
        # EnvBase.step keeps the entries of a "next" the input already has that the
        # env does not set; the env must see that "next" to do so.
        def run(p):
            td = with_ones(p, p.reset())
            td["next", "preset"] = torch.zeros(td.shape)
            return p.step(td)

        o, z = pair.both(run)
        assert ("next", "preset") in z.keys(True)
        self.same(o, z, "step() of a tensordict with a preset next entry")

    def test_reset_of_a_stepped_tensordict(self, pair):
        o, z = pair.both(lambda p: p.reset(p.step(with_ones(p, p.reset()))))
        self.same(o, z, "reset() of step()'s result, its next and all")

    def test_rand_step(self, pair):
        def run(p):
            td = p.reset()
            torch.manual_seed(0)
            return p.rand_step(td)

        o, z = pair.both(run)
        self.same(o, z, "rand_step()")

    def test_step_and_maybe_reset(self, pair):
        def run(p):
            out, td = [], p.reset()
            for _ in range(7):  # envs end (count past 5) and are reset
                result, td = p.step_and_maybe_reset(with_ones(p, td))
                out.append((result.clone(), td.clone()))
            return out

        # SerialEnv zeroes the action left in the next root of an env it just
        # reset (it resets into its buffers); each env's own
        # step_and_maybe_reset, which torchrl's pool runs, keeps the caller's.
        # That echo of the input is not compared against SerialEnv.
        echoed = tuple(pair.zmq.action_keys) if self.serial_oracle else ()
        o, z = pair.both(run)
        for step, ((res_o, root_o), (res_a, root_a)) in enumerate(zip(o, z, strict=True)):
            self.same(res_o, res_a, f"step_and_maybe_reset #{step}: result")
            self.same(root_o, root_a, f"step_and_maybe_reset #{step}: next root", echoed)

    @pytest.mark.parametrize("break_when_any_done", [True, False])
    def test_rollout(self, pair, break_when_any_done):
        def run(p):
            torch.manual_seed(4)
            return p.rollout(8, break_when_any_done=break_when_any_done)

        o, z = pair.both(run)
        self.same(o, z, f"rollout(8, break_when_any_done={break_when_any_done})")

    # Partial resets: torchrl's pool sends the whole batch, mask and all, to every env,
    # and an env that ignores the mask (most unbatched envs; not torchrl's mock envs)
    # is reset mid-episode with no done flag; gymnasium's raises. SerialEnv, the
    # reference here, resets the envs the "_reset" mask selects.

    @pytest.mark.parametrize("selected", ["first", "none"])
    def test_a_reset_mask_resets_only_the_envs_it_selects(self, pair, selected):
        def run(p):
            td = p.reset()
            for _ in range(2):
                td = step_mdp(p.step(with_ones(p, td)))
            n = td.shape[0]
            rows = torch.tensor([selected == "first"] + [False] * (n - 1))
            td["_reset"] = rows.reshape(n, *[1] * td.ndim).expand(*td.shape, 1).clone()
            td = p.reset(td)
            # "next" only: SerialEnv gives an env it does not reset its buffers' values
            # of the keys the input lacks, and with unbuffered envs zeros, as this pool.
            return p.step(with_ones(p, td))["next"]

        self.same_as_serial_env(pair.zmq, run, f"reset() with a {selected} '_reset' mask")

    @pytest.mark.parametrize("layout", ["dense", "lazy"])
    def test_a_reset_mask_treats_a_key_the_envs_lack_as_serial_env(self, pair, layout):
        # EnvBase.reset (SerialEnv's, and this pool's with a mask) merges the reset rows
        # with where(..., pad=0): a key of the input that the reset does not produce is
        # zero in those rows of a dense input, and keeps its values in a lazy stack's
        # (tensordict's where). torchrl's pool keeps them in both (README).
        def run(p):
            td = step_mdp(p.step(with_ones(p, p.reset())))
            td = td.contiguous() if layout == "dense" else LazyStackedTensorDict(*td.unbind(0))
            n = td.shape[0]
            td["extra"] = torch.arange(1.0, n + 1).reshape(n, *[1] * (td.ndim - 1)).expand(td.shape)
            rows = torch.tensor([False] * (n - 1) + [True])
            td["_reset"] = rows.reshape(n, *[1] * td.ndim).expand(*td.shape, 1).clone()
            return p.reset(td)

        reset = self.same_as_serial_env(pair.zmq, run, f"reset() of a {layout} input with a mask")
        if reset is not None and layout == "dense":  # the reset row's are zeros, the others kept
            extra = reset["extra"].reshape(reset.shape[0], -1)
            assert not extra[-1].any() and extra[:-1].all(), extra

    def test_a_transformed_env_resets_only_the_envs_that_are_done(self, pair):
        # TransformedEnv's maybe_reset resets through the pool's _reset with a mask.
        def run(p):
            env = TransformedEnv(p, StepCounter())
            rollout = env.rollout(8, functools.partial(with_ones, p), break_when_any_done=False)
            # "next" only: over a lazy stack, TransformedEnv's rollout roots hold
            # zeros, torchrl's pool's as this pool's (not SerialEnv's).
            return rollout["next"]

        self.same_as_serial_env(pair.zmq, run, "TransformedEnv(pool, StepCounter()).rollout(8)")

    # Partial steps: torchrl's pool sends every row to its env and fails to stack
    # "next" ("The sets of keys ... are exclusive"); SerialEnv, the reference here,
    # steps the envs the "_step" mask selects.

    def same_as_serial_env(self, pool: ZMQAsyncEnvPool, run: Callable, what: str) -> Any:
        """``run`` on ``SerialEnv`` of the same makers and on ``pool``: one result, or error."""
        serial = SerialEnv(len(self.makers()), self.makers())
        try:
            expected, error = run(serial), None
        except Exception as err:  # SerialEnv cannot run this structure: neither may we
            expected, error = None, err
        finally:
            serial.close()
        if error is not None:
            with pytest.raises(type(error)):
                run(pool)
            return None
        actual = run(pool)
        assert_same_td(expected, actual, what, exclude=(ENV_INDEX,), check_type=self.check_type)
        return expected

    @pytest.mark.parametrize("selected", ["first", "none", "all"])
    def test_a_step_mask_steps_only_the_envs_it_selects(self, pair, selected):
        n = pair.zmq.num_envs
        rows = {"first": [True] + [False] * (n - 1), "none": [False] * n, "all": [True] * n}

        def run(p):
            td = with_ones(p, p.reset())
            mask = torch.tensor(rows[selected]).reshape(n, *[1] * (td.ndim - 1))
            td["_step"] = mask.expand(td.shape).clone()
            return p.step(td)

        expected = self.same_as_serial_env(pair.zmq, run, f"step() with a {selected} '_step' mask")
        if expected is not None and selected == "first":  # env 0 counted; the others held
            held = expected["next", pair.zmq.done_keys[0]].reshape(n, -1)[1:]
            assert not held.any()

    def test_rollout_until_every_env_is_done_steps_only_those_still_running(self, pair):
        def run(p):
            ones = functools.partial(with_ones, p)
            return p.rollout(8, ones, break_when_any_done=False, break_when_all_done=True)

        rollout = self.same_as_serial_env(pair.zmq, run, "rollout(8, break_when_all_done=True)")
        if rollout is not None:  # envs start at different counts: some wait for the others
            done = rollout["next", pair.zmq.done_keys[0]].squeeze(-1)
            by_step = done.movedim(rollout.ndim - 1, 0).reshape(rollout.shape[-1], -1)
            assert (by_step.any(1) & ~by_step.all(1)).any()

    def test_step_and_maybe_reset_with_a_step_mask(self, pair):
        # EnvBase's: the partial step, then the done envs reset. SerialEnv zeroes the
        # echoed action and mask in the root of an env it reset (its buffers): not compared.
        def run(p):
            results, roots, td = [], [], p.reset()
            for i in range(6):
                td = with_ones(p, td)
                td["_step"] = torch.tensor([i % 2 == 0] + [True] * (td.shape[0] - 1))
                td["_step"] = td["_step"].reshape(-1, *[1] * (td.ndim - 1)).expand(td.shape)
                result, td = p.step_and_maybe_reset(td)
                results.append(result.clone())
                roots.append(td.exclude(*p.action_keys, "_step"))
            both = {"results": torch.stack(results), "roots": torch.stack(roots)}
            return TensorDict(both, batch_size=[6])

        self.same_as_serial_env(pair.zmq, run, "step_and_maybe_reset() with a '_step' mask")

    def test_per_env_channel(self, pair):
        # torchrl's per-env channel: a result of the env's own batch size with
        # env_index a NonTensorData; an action built from it goes back with
        # env_index=1. Expected: env 1 built alone, reset, stepped with ones.
        env = self.makers()[1]()
        reset = env.reset()
        step = env.step(reset.clone().update(env.full_action_spec.one()))
        env.close()
        pair.zmq.async_reset_send(env_index=1)
        r = pair.zmq.async_reset_recv(env_index=1, timeout=RECV_TIMEOUT)
        assert env_index_kind(r) == "NonTensorData", "per-env reset"
        assert env_index_values(r) == (torch.full(r.shape, 1).tolist() if r.shape else 1)
        assert_same_td(reset, r, "per-env reset of env 1", exclude=[ENV_INDEX])
        r.update(env.full_action_spec.one())
        pair.zmq.async_step_send(r, env_index=1)
        s = pair.zmq.async_step_recv(env_index=1, timeout=RECV_TIMEOUT)
        assert env_index_kind(s) == "NonTensorData", "per-env step"
        assert_same_td(step, s, "per-env step of env 1", exclude=[ENV_INDEX])


class TestBatchedWire(SameCallsOnBoth):
    """4 CountingEnvs, 2 per worker, stepped in the workers' main threads
    (``env_threads=False``): commands and replies travel as batches and rows
    joined (the wire's ``BATCH``, ``COMMANDS`` and ``RESULTS``), and every call
    answers as torchrl's pool does."""

    @staticmethod
    def makers() -> list[Callable]:
        return counting_makers(4)

    @pytest.fixture(scope="class")
    @classmethod
    def pool_pair(cls):
        inline = dataclasses.replace(FAST, env_threads=False)
        yield from serve(
            AsyncEnvPool(cls.makers(), backend="threading"),
            lambda: ZMQAsyncEnvPool(cls.makers(), envs_per_worker=2, config=inline),
        )

    def test_rounds_whose_replies_are_held_answer_as_torchrl(self, pair):
        # After a recv that waited for every env, the next call's joined commands ask
        # their workers to hold the replies together (wire: "h"): the same results.
        def run(p):
            rounds, r = [], p.reset()
            for value in (1, 0, 1):
                r.set("action", torch.full((*r.shape, 1), float(value)))
                p.async_step_send(r)
                n = r.shape[0]
                [batch] = recv_everything(p.async_step_recv, n, n)  # every env, one call
                rounds.append([batch])
                r = step_mdp(batch)
            return rounds

        o, z = pair.both(run)
        assert pair.zmq.runtime.hold_replies
        for i, (expected, actual) in enumerate(zip(o, z, strict=True)):
            assert_same_batches(expected, actual, f"held round {i}")


class TestNestedKeys(SameCallsOnBoth):
    """NestedCountingEnv (("data", "states"), ("data", "action"), ...), stack="maybe_dense"."""

    serial_oracle = True

    @staticmethod
    def makers() -> list[Callable]:
        return [functools.partial(NestedCountingEnv, start_val=i) for i in range(2)]

    @pytest.fixture(scope="class")
    @classmethod
    def pool_pair(cls):
        # torchrl differs: its AsyncEnvPool cannot reset NestedCountingEnv
        # (AttributeError: 'NoneType' object has no attribute 'update', in
        # _update_during_reset), not even on its per-env channel; SerialEnv
        # runs it: it is the oracle.
        yield from serve(
            SerialEnv(2, cls.makers()),
            lambda: ZMQAsyncEnvPool(cls.makers(), stack="maybe_dense", config=FAST),
        )

    def test_check_env_specs(self, pair):
        for p in pair.pools:
            check_env_specs(p)


class TestBatchedChildren(SameCallsOnBoth):
    """CountingEnv(batch_size=[2]) x 2: the pool's batch size is (N, *B) = (2, 2)."""

    serial_oracle = True

    @staticmethod
    def makers() -> list[Callable]:
        return [functools.partial(CountingEnv, start_val=i, batch_size=[2]) for i in range(2)]

    @pytest.fixture(scope="class")
    @classmethod
    def pool_pair(cls):
        # torchrl differs: its AsyncEnvPool cannot step batched children
        # (step() sets env_index = arange(N), an (N,) tensor, into an (N, 2)
        # tensordict: RuntimeError batch dimension mismatch), its env_index
        # after a reset is [[0, 0], [0, 0]], and its per-env channel raises
        # (RuntimeError: new batch size (1, 2) in a lazy TD). SerialEnv is the oracle.
        yield from serve(
            SerialEnv(2, cls.makers()), lambda: ZMQAsyncEnvPool(cls.makers(), config=FAST)
        )

    def test_batch_size_is_n_by_b(self, pair):
        assert pair.zmq.batch_size == torch.Size([2, 2])

    def test_check_env_specs(self, pair):
        for p in pair.pools:
            check_env_specs(p)

    @pytest.mark.parametrize("transform", [StepCounter, RewardSum], ids=lambda t: t.__name__)
    def test_transformed_env_rolls_out_as_over_serial_env(self, pair, transform):
        # TransformedEnv calls the pool's _step, whose env_index was an (N,) tensor
        # in torchrl's: "batch dimension mismatch" for children of batch size [2].
        def run(p):
            env = TransformedEnv(p, transform())  # not closed: that would close p
            return env.rollout(4, functools.partial(with_ones, p), break_when_any_done=False)

        self.same_as_serial_env(pair.zmq, run, f"TransformedEnv(pool, {transform.__name__}())")

    def test_a_step_mask_that_splits_an_env_is_refused(self, pair):
        # Half of env 0's batch: SerialEnv raises ValueError, and so do we, before
        # anything is sent.
        def run(p):
            td = with_ones(p, p.reset())
            td["_step"] = torch.tensor([[True, False], [True, True]])
            return p.step(td)

        with pytest.raises(ValueError, match="_step"):
            run(pair.zmq)
        self.same_as_serial_env(pair.zmq, run, "step() with a mask that splits env 0")
        self.test_a_step_mask_steps_only_the_envs_it_selects(pair, "first")  # still usable


class TestHeterogeneousCountingEnv(SameCallsOnBoth):
    """torchrl's HeterogeneousCountingEnv (a lazy stack of 3 agents per env), stack="lazy"."""

    serial_oracle = True
    check_type = True

    @staticmethod
    def makers() -> list[Callable]:
        return [functools.partial(HeterogeneousCountingEnv, start_val=i) for i in range(2)]

    @pytest.fixture(scope="class")
    @classmethod
    def pool_pair(cls):
        # torchrl differs: its AsyncEnvPool cannot reset HeterogeneousCountingEnv
        # (AttributeError in _update_during_reset, whatever the stack); SerialEnv
        # is the oracle. (check_env_specs fails on SerialEnv too: not compared.)
        yield from serve(
            SerialEnv(2, cls.makers()),
            lambda: ZMQAsyncEnvPool(cls.makers(), stack="lazy", config=FAST),
        )


class TestOffSpecDtypes(SameCallsOnBoth):
    """OffSpecDtypesEnv: float64 observations, int64 rewards and done flags; specs say otherwise."""

    serial_oracle = True

    @staticmethod
    def makers() -> list[Callable]:
        return [functools.partial(OffSpecDtypesEnv, env_id=i) for i in range(2)]

    @pytest.fixture(scope="class")
    @classmethod
    def pool_pair(cls):
        # torchrl differs: its pool returns the env's float64 and int64 where its own
        # specs say float32 and bool. SerialEnv copies each output into buffers made
        # from the specs, so it returns what the specs say; so does zmqpool (its
        # workers cast, where each reply was an EnvError before). SerialEnv is the oracle.
        yield from serve(
            SerialEnv(2, cls.makers()),
            lambda: ZMQAsyncEnvPool(cls.makers(), config=FAST),
        )

    def test_check_env_specs(self, pair):
        for p in pair.pools:
            check_env_specs(p)

    def test_per_env_channel(self, pair):
        # Expected: env 1 built alone, reset, stepped with ones, its output cast to its specs.
        env = self.makers()[1]()
        reset = _as_specs(env, env.reset())
        step = _as_specs(env, env.step(reset.clone().update(env.full_action_spec.one())))
        env.close()
        pair.zmq.async_reset_send(env_index=1)
        r = pair.zmq.async_reset_recv(env_index=1, timeout=RECV_TIMEOUT)
        assert_same_td(reset, r, "per-env reset of env 1", exclude=[ENV_INDEX])
        pair.zmq.async_step_send(r.update(env.full_action_spec.one()), env_index=1)
        s = pair.zmq.async_step_recv(env_index=1, timeout=RECV_TIMEOUT)
        assert_same_td(step, s, "per-env step of env 1", exclude=[ENV_INDEX])

    def test_the_dtypes_are_the_specs(self, pair):
        for p in pair.pools:
            out = p.rollout(5, break_when_any_done=False)
            assert out["next", "observation"].dtype == torch.float32
            assert out["next", "reward"].dtype == torch.float32
            assert out["next", "done"].dtype == torch.bool and out["next", "done"].any()


def _as_specs(env, td: TensorDictBase) -> TensorDictBase:
    """``td`` with each leaf ``env``'s output specs declare cast to its dtype, "next" too."""
    specs = env.full_observation_spec.clone().update(env.full_reward_spec)
    specs.update(env.full_done_spec)
    for key in specs.keys(True, True):
        for where in (key, ("next", key)):
            if where in td.keys(True, True):
                td[where] = td[where].to(specs[key].dtype)
    return td


def mixed_makers() -> list[Callable]:
    return [
        functools.partial(ZMQCountingEnv, env_id=0, max_steps=3),
        functools.partial(ExtraKeyEnv, env_id=1, max_steps=5),
    ]


class TestTwoDifferentEnvsLazy(SameCallsOnBoth):
    """Two different envs in one pool, stack="lazy": observations of two shapes, a key in one only.

    torchrl's threading pool runs this: it is the oracle, and the results
    must be LazyStackedTensorDicts like its own. (check_env_specs fails on
    torchrl's pool and on SerialEnv for such a lazy stack: not compared.)
    """

    check_type = True

    @staticmethod
    def makers() -> list[Callable]:
        return mixed_makers()

    @pytest.fixture(scope="class")
    @classmethod
    def pool_pair(cls):
        yield from serve(
            AsyncEnvPool(cls.makers(), backend="threading", stack="lazy"),
            lambda: ZMQAsyncEnvPool(cls.makers(), stack="lazy", config=FAST),
        )

    @pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool], ids=str)
    @pytest.mark.parametrize("shape", [(2, 1), (2,)], ids=["exact", "broadcast"])
    def test_step_takes_actions_of_another_dtype_for_a_float32_spec(self, pair, dtype, shape):
        def run(p):
            td = p.reset()
            td["action"] = torch.ones(shape, dtype=dtype)
            return p.step(td)

        o, z = pair.both(run)
        self.same(o, z, f"step() with a {dtype} action of shape {shape} for a float32 spec")

    @pytest.mark.parametrize("env", [0, 1])
    def test_per_env_round_trip(self, pair, env):
        def run(p):
            p.async_reset_send(env_index=env)
            r = p.async_reset_recv(env_index=env, timeout=RECV_TIMEOUT)
            out = [r.clone()]  # torchrl's threading pool writes "next" into r when it is sent
            r.set("action", torch.ones((*r.shape, 1)))
            p.async_step_and_maybe_reset_send(r, env_index=env)
            result, root = p.async_step_and_maybe_reset_recv(env_index=env, timeout=RECV_TIMEOUT)
            return [*out, result, root]

        o, z = pair.both(run)
        for name, got_o, got_z in zip(["reset", "result", "next root"], o, z, strict=True):
            assert_same_td(got_o, got_z, f"per-env {name} of env {env}")


def test_unlike_envs_on_cpu_step_and_reset_and_roll_out_as_torchrls_pool():
    """Two unlike envs built with ``device="cpu"``, one with a text observation (stack="lazy").

    Found by an audit: a result stacked from the caller's inputs (no device)
    and the roots an env sent back (on cpu) failed ("devices differ") in
    step_and_maybe_reset, its async form and rollout. (Partial steps are not
    compared: with the text key only in env 1, SerialEnv and torchrl's pool
    fail on them too.)
    """
    makers = [
        functools.partial(ZMQCountingEnv, env_id=0, max_steps=3, device="cpu"),
        functools.partial(ExtraKeyEnv, env_id=1, max_steps=5, device="cpu", text=True),
    ]

    def run(p):
        # Clones: torchrl's threading pool writes "next" into what it was sent.
        td = p.reset()
        td["action"] = torch.ones(2, 1)
        result, root = p.step_and_maybe_reset(td)
        out = [result.clone(), root.clone()]
        root["action"] = torch.ones(2, 1)
        p.async_step_and_maybe_reset_send(root, env_index=[0, 1])
        later, later_root = p.async_step_and_maybe_reset_recv(min_get=2, timeout=RECV_TIMEOUT)
        torch.manual_seed(0)  # the same random actions from the same specs
        return [*out, later, later_root, p.rollout(4)]

    oracle = AsyncEnvPool(makers, backend="threading", stack="lazy")
    pool = ZMQAsyncEnvPool(makers, stack="lazy", config=FAST)
    try:
        expected, got = run(oracle), run(pool)
    finally:
        oracle.close()
        pool.close()
    names = ["step_and_maybe_reset", "its next root", "async", "its next root", "rollout"]
    for name, want, have in zip(names, expected, got, strict=True):
        assert_same_td(want, have, name)
    # A step's results carry the envs' device, as torchrl's pool's do (its rollout's
    # has none: ours keeps the envs', as SerialEnv's does).
    assert [td.device for td in got[:4]] == [td.device for td in expected[:4]]


def test_an_env_whose_transform_excludes_terminated_keeps_its_specs_as_in_serial_env():
    """``TransformedEnv(env, ExcludeTransform("terminated"))``: torchrl's pool completes its
    done specs again and declares a "terminated" the envs never write, so its
    ``fake_tensordict`` holds it and ``check_env_specs`` fails; SerialEnv's does not."""
    from torchrl.envs import ExcludeTransform

    def make():
        return TransformedEnv(ZMQCountingEnv(max_steps=3), ExcludeTransform("terminated"))

    def fake_keys(env) -> set:
        return set(env.fake_tensordict().keys(True, True))

    serial = SerialEnv(2, [make, make])
    oracle = AsyncEnvPool([make, make], backend="threading")
    pool = ZMQAsyncEnvPool([make, make], config=FAST)
    try:
        expected = fake_keys(serial)
        assert "terminated" not in expected and "done" in expected
        assert fake_keys(oracle) == expected | {"terminated", ("next", "terminated")}
        assert fake_keys(pool) == expected
        assert pool.done_keys == serial.done_keys == ["done", "truncated"]
        check_env_specs(pool)
        check_env_specs(serial)
    finally:
        serial.close(raise_if_closed=False)
        oracle.close()
        pool.close()


def test_an_action_mask_around_the_pool_rolls_out_as_around_torchrls_pool_and_serial_env():
    """``TransformedEnv(pool, ActionMask())``: random actions drawn from the masked spec (a
    masked one raises in the env), the same seeded rollout on all three."""
    from torchrl.envs import ActionMask

    makers = [MaskedActionEnv, MaskedActionEnv]
    envs = [
        SerialEnv(2, makers),
        AsyncEnvPool(makers, backend="threading"),
        ZMQAsyncEnvPool(makers, config=FAST),
    ]
    try:
        rollouts = []
        for env in envs:
            torch.manual_seed(1)
            rollouts.append(TransformedEnv(env, ActionMask()).rollout(8, break_when_any_done=False))
    finally:
        for env in envs:
            env.close(raise_if_closed=False)
    serial, oracle, ours = rollouts
    assert ours["next", "done"].any()  # past an episode's end: the reset's mask is used too
    assert_same_td(oracle, ours, "ActionMask rollout", exclude={ENV_INDEX})
    assert_same_td(serial, ours, "ActionMask rollout (SerialEnv)", exclude={ENV_INDEX})


def test_envs_whose_specs_differ_in_values_only_stack_densely_as_in_torchrls_pool():
    """Action bounds of ±1 and ±2, stack="dense" (the default): built, reset and stepped.

    zmqpool used to refuse env 1 ("spec mismatch ... high"): a dense stack
    needs the same keys, shapes and dtypes, not the same bounds.
    """
    makers = [functools.partial(WideActionEnv, env_id=i) for i in range(2)]

    def run(p):
        td = p.reset()
        td["action"] = torch.full((2, 1), 0.5)
        result = p.step(td.clone())
        td["action"] = torch.full((2, 1), 1.5)  # within env 1's bounds only: not checked
        later, root = p.step_and_maybe_reset(td)
        return [result, later, root]

    oracle = AsyncEnvPool(makers, backend="threading")
    pool = ZMQAsyncEnvPool(makers, config=FAST)
    try:
        expected, got = run(oracle), run(pool)
        assert_same_spec(oracle.full_action_spec, pool.full_action_spec, "full_action_spec")
    finally:
        oracle.close()
        pool.close()
    for name, want, have in zip(
        ["step", "step_and_maybe_reset", "its root"], expected, got, strict=True
    ):
        assert_same_td(want, have, name)


class TestResetKeywords:
    """``reset(seed=..., options=...)`` and ``list_of_kwargs`` reach each env's reset.

    SerialEnv is the oracle: it hands them to each env's reset (``list_of_kwargs``
    one dict per env, the other keywords added to each). torchrl's pool drops
    them, so ``reset(seed=3)`` did nothing there, nor here before.
    """

    @pytest.fixture(scope="class")
    @classmethod
    def pool_pair(cls):
        makers = [functools.partial(ResetKeywordsEnv, env_id=i) for i in range(2)]
        yield from serve(SerialEnv(2, makers), lambda: ZMQAsyncEnvPool(makers, config=FAST))

    @pytest.fixture
    def pair(self, pool_pair) -> Pair:
        return pool_pair.settle()

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"seed": 3},
            {"seed": torch.tensor(3)},  # a 0-d tensor crosses as its number
            {"seed": 4, "options": {"start": 5}},
            {"list_of_kwargs": [{"seed": 1}, {"seed": 2, "options": {"start": 7}}]},
            {"list_of_kwargs": [{"seed": 1}, {}], "options": {"start": 2}},
        ],
        ids=["seed", "tensor-seed", "seed-options", "list", "list-and-common"],
    )
    def test_reset_keywords_reach_each_env(self, pair, kwargs):
        o, z = pair.both(lambda p: p.reset(**kwargs))
        assert_same_td(o, z, f"reset(**{kwargs})", exclude=[ENV_INDEX])
        seeds = [int(s) for s in z["observation"][:, 3]]
        assert seeds != [-1, -1]  # the keywords did something (ResetKeywordsEnv's doc)

    def test_reset_keywords_reach_the_envs_through_a_transform(self, pair):
        # TransformedEnv's reset calls the pool's _reset (torchrl's RESET_RAW path).
        o, z = pair.both(lambda p: TransformedEnv(p, StepCounter()).reset(seed=6))
        assert_same_td(o, z, "TransformedEnv(pool).reset(seed=6)", exclude=[ENV_INDEX])
        assert z["observation"][:, 3].tolist() == [6.0, 6.0]

    def test_a_reset_sent_again_after_its_worker_died_keeps_its_keywords(self, pair, tmp_path):
        # The reset kills env 0's worker; the restarted one gets the same command.
        pool = pair.zmq
        restarts = pool.env_stats()[0]["restarts"]
        options = [{"options": {"exit_once": str(tmp_path / "died"), "start": 3}}, {}]
        out = pool.reset(seed=8, list_of_kwargs=options)
        assert out["observation"].tolist() == [[0.0, 3.0, 0.0, 8.0], [1.0, 0.0, 0.0, 8.0]]
        assert pool.env_stats()[0]["restarts"] == restarts + 1

    def test_reset_keywords_reach_the_envs_a_mask_selects(self, pair):
        def masked(p):
            td = p.reset(seed=1)  # env 0, left out, reports this seed on both
            td["_reset"] = torch.tensor([[False], [True]])
            return p.reset(td, seed=9, options={"start": 4})

        o, z = pair.both(masked)
        assert_same_td(o, z, "reset(mask, seed=9)", exclude=[ENV_INDEX])
        assert z["observation"][1, 1:4].tolist() == [4.0, 0.0, 9.0]

    @pytest.mark.parametrize(
        ("kwargs", "error", "match"),
        [
            ({"seed": object()}, ValueError, "reset keyword 'seed' of env 0 of type object"),
            ({"options": {"x": "a" * 20000}}, ValueError, "over the 16384"),
            ({"list_of_kwargs": [{}]}, ValueError, "1 dicts for a pool of 2 envs"),
            ({"list_of_kwargs": [{}, {1: 2}]}, TypeError, "env 1 must be a dict of names"),
        ],
        ids=["not-plain", "too-large", "count", "names"],
    )
    def test_reset_keywords_that_cannot_cross_are_refused_before_sending(
        self, pair, kwargs, error, match
    ):
        pool = pair.zmq
        before = pool.reset(seed=5)
        with pytest.raises(error, match=match):
            pool.reset(**kwargs)
        assert not awaited(pool)
        after = pool.step(before.set("action", torch.ones(2, 1)))
        assert after["next", "observation"][:, 1].tolist() == [1.0, 1.0]  # nothing reset them
