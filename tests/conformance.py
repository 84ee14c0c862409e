"""Helpers for tests/test_conformance.py: envs the workers can import, and a readable td diff.

The differential suite runs the same calls on torchrl's own ``AsyncEnvPool``
(the oracle) and on ``ZMQAsyncEnvPool``; what it compares lives here:

- :func:`td_diff` / :func:`assert_same_td`: batch size, keys
  (``keys(True, True)``), per-leaf shape, dtype and values, the ``env_index``
  entry (its type, ``NonTensorData`` vs ``NonTensorStack``, and its values),
  and, for lazy stacks, every env's own row (exclusive keys included). The
  failure message lists every difference, one per line, oracle first.
- :func:`assert_same_error`: the zmqpool call raises the oracle's exception
  class (or a subclass of it).

The env classes are defined at module level so that zmqpool's worker
processes (which get the parent's ``sys.path``) and torchrl's spawned
multiprocessing workers can import them by name: ``tests.conformance``.
"""

from __future__ import annotations

import builtins
import functools
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
)
from torchrl.data import Bounded, Categorical, Composite, NonTensor, Unbounded
from torchrl.envs import EnvBase
from torchrl.testing.mocking_classes import CountingEnv as TorchRLCountingEnv

from zmqpool.testing import CountingEnv as ZMQCountingEnv

ENV_INDEX = "env_index"

# ---------------------------------------------------------------- envs


class SlowCountingEnv(TorchRLCountingEnv):
    """torchrl's mocking ``CountingEnv`` (int8 ``Binary`` action), with a fixed step delay.

    Like torchrl's own ``_DelayedCountingEnv`` in ``test/envs/test_special.py``,
    but the delay is deterministic and only on ``_step`` (resets between tests
    stay instant). With ``step_delay=0`` it *is* torchrl's ``CountingEnv``,
    defined here so that pools built from it prove that workers can import
    ``tests.conformance``.
    """

    def __init__(self, *args, step_delay: float = 0.0, **kwargs) -> None:
        self.step_delay = step_delay
        super().__init__(*args, **kwargs)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.step_delay:
            threading.Event().wait(self.step_delay)
        return super()._step(tensordict)


class InfoLeafEnv(TorchRLCountingEnv):
    """torchrl's CountingEnv; with ``info=True`` each step's "next" has an undeclared leaf more.

    Allowed (an env may return more than it declares), but not stackable with
    the steps of envs without it.
    """

    def __init__(self, *args, info: bool = False, **kwargs) -> None:
        self.info = info
        super().__init__(*args, **kwargs)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        out = super()._step(tensordict)
        if self.info:
            out.set("info", torch.zeros(1))
        return out


class ExtraKeyEnv(ZMQCountingEnv):
    """Not ``zmqpool.testing.CountingEnv``: another observation shape, and a key more.

    In one pool with a plain ``CountingEnv`` it makes a heterogeneous lazy
    stack: ``observation`` differs in shape and ``extra`` exists for this env
    only (an exclusive key).
    """

    def __init__(self, env_id: int = 0, text: bool = False, **kwargs) -> None:
        kwargs.setdefault("obs_shape", (6,))
        super().__init__(env_id=env_id, **kwargs)
        self.observation_spec["extra"] = Unbounded(shape=(2,), dtype=torch.float32)
        self.text = text  # a non-tensor observation too
        if text:
            self.observation_spec["text"] = NonTensor(shape=(), example_data="e0c0")

    def _reset(self, tensordict=None, **kwargs) -> TensorDictBase:
        out = super()._reset(tensordict, **kwargs)
        out["extra"] = torch.full((2,), 10.0 * self.env_id)
        return self._with_text(out)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        out = super()._step(tensordict)
        out["extra"] = torch.full((2,), 10.0 * self.env_id + self.count)
        return self._with_text(out)

    def _with_text(self, out: TensorDictBase) -> TensorDictBase:
        if self.text:
            out["text"] = NonTensorData(f"e{self.env_id}c{self.count}")
        return out


class WideActionEnv(ZMQCountingEnv):
    """zmqpool's CountingEnv whose action bounds are ``±(env_id + 1)``: envs that differ in
    spec values only (their stack is dense, its action spec a lazy stack of specs)."""

    def __init__(self, env_id: int = 0, **kwargs) -> None:
        super().__init__(env_id=env_id, **kwargs)
        bound = float(env_id + 1)
        self.action_spec = Bounded(-bound, bound, shape=(1,), dtype=torch.float32)


def counting_makers(n: int, max_steps: int = 4, **kwargs) -> list[Callable]:
    """``n`` torchrl CountingEnvs; env ``i`` starts at ``i``, so it is done ``i`` steps earlier."""
    return [
        functools.partial(SlowCountingEnv, max_steps=max_steps, start_val=i, **kwargs)
        for i in range(n)
    ]


# ---------------------------------------------------------------- comparing


def env_index_kind(td: TensorDictBase) -> str | None:
    """The type of ``td``'s ``env_index`` entry, by name (None: absent)."""
    if ENV_INDEX not in td.keys():  # noqa: SIM118 (a lazy stack's `in` differs)
        return None
    return type(td.get(ENV_INDEX)).__name__


def env_index_values(td: TensorDictBase) -> Any:
    """``env_index`` as plain Python (an int, or nested lists matching the batch dims)."""
    return _plain(td.get(ENV_INDEX))


def expected_env_index(batch_size: torch.Size) -> Any:
    """The ``env_index`` a user expects in a result of ``batch_size``: ``i`` at ``[i, ...]``."""
    n, rest = batch_size[0], batch_size[1:]
    return torch.arange(n).reshape(n, *[1] * len(rest)).expand(batch_size).tolist()


def _leaf_diff(path: str, expected: Any, actual: Any, values: bool) -> list[str]:
    if isinstance(expected, torch.Tensor) != isinstance(actual, torch.Tensor):
        return [f"{path}: type {type(expected).__name__} != {type(actual).__name__}"]
    if not isinstance(expected, torch.Tensor):
        if type(expected) is not type(actual):
            return [f"{path}: type {type(expected).__name__} != {type(actual).__name__}"]
        if values and _plain(expected) != _plain(actual):
            return [f"{path}: value {_plain(expected)!r} != {_plain(actual)!r}"]
        return []
    out = []
    if expected.shape != actual.shape:
        out.append(f"{path}: shape {tuple(expected.shape)} != {tuple(actual.shape)}")
    if expected.dtype != actual.dtype:
        out.append(f"{path}: dtype {expected.dtype} != {actual.dtype}")
    if values and not out and not torch.equal(expected, actual):
        wrong = (expected != actual).nonzero()
        first = tuple(wrong[0].tolist()) if len(wrong) else ()
        out.append(
            f"{path}: values differ at {len(wrong)} positions, first {first}: "
            f"{expected[first].tolist()} != {actual[first].tolist()}\n"
            f"      expected {_short(expected)}\n      actual   {_short(actual)}"
        )
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, NonTensorData):
        return value.tolist() if value.batch_dims else value.data
    if isinstance(value, NonTensorStack):
        return value.tolist()
    return value


def _short(tensor: torch.Tensor) -> str:
    flat = tensor.reshape(-1).tolist()
    return str(flat[:12]) + (" ..." if len(flat) > 12 else "")


def _key_name(key: Any) -> str:
    return key if isinstance(key, str) else ".".join(key)


def td_diff(
    expected: TensorDictBase,
    actual: TensorDictBase,
    *,
    values: bool = True,
    exclude: Iterable[Any] = (),
    check_type: bool = False,
    path: str = "",
) -> list[str]:
    """Every difference between two tensordicts, one readable line each (empty: the same).

    Args:
        values: compare values exactly (the envs are deterministic), not
            only keys, shapes and dtypes.
        exclude: keys left out (e.g. ``"env_index"`` when the oracle is
            ``SerialEnv``, which has none).
        check_type: the tensordict classes must match too (``TensorDict`` vs
            ``LazyStackedTensorDict``: required for ``stack="lazy"``).
    """
    exclude = set(exclude)
    out: list[str] = []
    where = path or "<root>"
    if check_type and type(expected) is not type(actual):
        out.append(f"{where}: type {type(expected).__name__} != {type(actual).__name__}")
    if expected.batch_size != actual.batch_size:
        out.append(
            f"{where}: batch_size {tuple(expected.batch_size)} != {tuple(actual.batch_size)}"
        )
        return out  # nothing below lines up
    if ENV_INDEX not in exclude:
        kind_e, kind_a = env_index_kind(expected), env_index_kind(actual)
        if kind_e != kind_a:
            out.append(f"{where}: env_index type {kind_e} != {kind_a}")
        elif kind_e is not None and env_index_values(expected) != env_index_values(actual):
            out.append(
                f"{where}: env_index {env_index_values(expected)} != {env_index_values(actual)}"
            )
    keys_e = _keys(expected, exclude)
    keys_a = _keys(actual, exclude)
    if keys_e - keys_a:
        out.append(f"{where}: keys missing: {sorted(map(_key_name, keys_e - keys_a))}")
    if keys_a - keys_e:
        out.append(f"{where}: unexpected keys: {sorted(map(_key_name, keys_a - keys_e))}")
    for key in sorted(keys_e & keys_a, key=_key_name):
        if _is_env_index_key(key):
            continue  # top level: compared above; nested: its presence is compared
        got_e, err_e = _get(expected, key)
        got_a, err_a = _get(actual, key)
        name = f"{path}{_key_name(key)}"
        if err_e is not None or err_a is not None:
            if (err_e is None) != (err_a is None):
                out.append(f"{name}: get() raised {err_e!r} vs {err_a!r}")
            continue  # a heterogeneous leaf: compared row by row below
        out.extend(_leaf_diff(name, got_e, got_a, values))
    lazy = isinstance(expected, LazyStackedTensorDict) or isinstance(actual, LazyStackedTensorDict)
    if lazy and expected.batch_dims:
        # A lazy stack's rows may hold keys the stack does not (exclusive keys)
        # and leaves whose shapes differ across envs: compare every env's row.
        rows = zip(expected.unbind(0), actual.unbind(0), strict=True)
        for i, (row_e, row_a) in enumerate(rows):
            sub = td_diff(row_e, row_a, values=values, exclude=exclude, path=f"{path}[{i}].")
            out.extend(sub)
    return _unique(out)


def _keys(td: TensorDictBase, exclude: set) -> set:
    """``keys(True, True)`` without excluded keys (and their subtrees) and the root env_index."""
    return {
        k
        for k in td.keys(True, True)
        if k != ENV_INDEX and k not in exclude and _top(k) not in exclude
    }


def _is_env_index_key(key: Any) -> bool:
    return key == ENV_INDEX or (isinstance(key, tuple) and key[-1] == ENV_INDEX)


def _top(key: Any) -> Any:
    return key if isinstance(key, str) else key[0]


def _get(td: TensorDictBase, key: Any) -> tuple[Any, Exception | None]:
    try:
        return td.get(key), None
    except Exception as err:  # a lazy stack of leaves that do not stack
        return None, err


def _unique(lines: list[str]) -> list[str]:
    seen: set[str] = set()
    return [line for line in lines if not (line in seen or seen.add(line))]


def assert_same_td(
    expected: TensorDictBase, actual: TensorDictBase, what: str = "result", **kwargs
) -> None:
    """Fail with every difference between the oracle's result and zmqpool's, one per line."""
    diff = td_diff(expected, actual, **kwargs)
    if diff:
        lines = "\n  ".join(diff)
        raise AssertionError(
            f"{what}: torchrl (expected) and zmqpool (actual) differ:\n  {lines}\n"
            f"expected: {type(expected).__name__}{tuple(expected.batch_size)}, "
            f"actual: {type(actual).__name__}{tuple(actual.batch_size)}"
        )


def assert_same_spec(expected: Any, actual: Any, what: str) -> None:
    """Specs: same shape, same leaf keys, each leaf equal (type, shape, dtype, bounds), per env too.

    A lazily stacked spec (envs that differ) lists only the keys its envs
    share: each env's own spec (``spec[i]``) is compared as well, exclusive
    keys included, where torchrl can index it. Fails listing every difference.
    """
    diff = _spec_diff(expected, actual, what)
    if expected.shape and expected.shape == actual.shape:
        for i in range(expected.shape[0]):
            try:
                item = expected[i]
            except IndexError:  # torchrl cannot index a spec stacked along an inner dim
                break
            diff += _spec_diff(item, actual[i], f"{what}[{i}]")
    if diff:
        lines = "\n  ".join(diff)
        raise AssertionError(f"torchrl (expected) and zmqpool (actual) specs differ:\n  {lines}")


def _spec_diff(expected: Any, actual: Any, what: str) -> list[str]:
    if expected.shape != actual.shape:
        return [f"{what}: shape {tuple(expected.shape)} != {tuple(actual.shape)}"]
    out = []
    keys_e = set(expected.keys(True, True))
    keys_a = set(actual.keys(True, True))
    if keys_e != keys_a:
        out.append(
            f"{what}: keys missing: {sorted(map(_key_name, keys_e - keys_a))}, "
            f"unexpected: {sorted(map(_key_name, keys_a - keys_e))}"
        )
    for key in sorted(keys_e & keys_a, key=_key_name):
        leaf_e, leaf_a = expected[key], actual[key]
        name = f"{what}[{_key_name(key)}]"
        if type(leaf_e) is not type(leaf_a):
            out.append(f"{name}: {type(leaf_e).__name__} != {type(leaf_a).__name__}")
        elif leaf_e.shape != leaf_a.shape:
            out.append(f"{name}: shape {tuple(leaf_e.shape)} != {tuple(leaf_a.shape)}")
        elif leaf_e.dtype != leaf_a.dtype:
            out.append(f"{name}: dtype {leaf_e.dtype} != {leaf_a.dtype}")
        elif leaf_e != leaf_a:
            out.append(f"{name}: {leaf_e} != {leaf_a}")
    return out


def raised_by(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except Exception as err:
        return err
    return None


def assert_same_error(oracle_call: Callable[[], Any], zmq_call: Callable[[], Any]) -> Exception:
    """The oracle's call raises; zmqpool's raises the same class (or a subclass). Returns it."""
    expected = raised_by(oracle_call)
    assert expected is not None, "the oracle (torchrl) did not raise: the scenario is wrong"
    with pytest.raises(type(expected)) as info:
        zmq_call()
    return info.value


# ---------------------------------------------------------------- settling shared pools


def drain(pool: Any, timeout: float = 15.0) -> None:
    """Receive whatever a previous (maybe failed) test left in flight on the batched channels."""
    pairs = (
        ("_current_step", pool.async_step_recv),
        ("_current_reset", pool.async_reset_recv),
        ("_current_step_reset", pool.async_step_and_maybe_reset_recv),
    )
    for counter, recv in pairs:
        pending = getattr(pool, counter, 0)
        if pending > 0:
            recv(min_get=pending, timeout=timeout)


def elapsed(call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()``'s result and how long it took, in seconds."""
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


class OffTheWireEnv(ZMQCountingEnv):
    """A CountingEnv whose step output cannot cross the wire as the pool takes it.

    ``text_bytes``: a string of that many bytes in ``"text"`` (non-tensor data
    travels in a message's header, of at most 1 MiB), declared in the
    observation spec with ``declared`` (then the next root of a
    ``step_and_maybe_reset`` carries it too, and a reset an empty one);
    ``tuple_key``: a dict keyed by a tuple in ``"info"`` (msgpack packs it,
    but it comes back keyed by a list); ``numpy_info``: numpy scalars in
    ``"info"`` (they cross as the Python numbers they hold); ``obs_elems``: an
    observation of that many floats, for a spec of 4 (over the frame size the
    pool takes from this worker).
    """

    def __init__(
        self,
        env_id: int = 0,
        text_bytes: int = 0,
        declared: bool = False,
        tuple_key: bool = False,
        numpy_info: bool = False,
        obs_elems: int = 0,
    ) -> None:
        super().__init__(env_id=env_id)
        self.text_bytes, self.tuple_key, self.obs_elems = text_bytes, tuple_key, obs_elems
        self.numpy_info = numpy_info
        self.declared = declared
        if declared:
            self.observation_spec["text"] = NonTensor(shape=(), example_data="")

    def _reset(self, tensordict=None, **kwargs) -> TensorDictBase:
        out = super()._reset(tensordict, **kwargs)
        if self.declared:
            out["text"] = NonTensorData("")
        return out

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        out = super()._step(tensordict)
        if self.text_bytes:
            out["text"] = NonTensorData("x" * self.text_bytes)
        if self.tuple_key:
            out["info"] = NonTensorData({(1, 2): self.count})
        if self.numpy_info:
            info = {"count": np.int64(self.count), "ok": np.bool_(True), "w": [np.float32(0.5)]}
            out["info"] = NonTensorData(info)
        if self.obs_elems:
            out["observation"] = torch.zeros(self.obs_elems)
        return out


def raising_maker(error: str = "ValueError") -> ZMQCountingEnv:
    """An env maker that raises the builtin exception named ``error`` (``ImportError``:
    an import of a module that is not there, as a maker of an optional dependency)."""
    if error == "ModuleNotFoundError":
        import zmqpool_has_no_such_module  # type: ignore[import-not-found]  # noqa: F401
    raise getattr(builtins, error)("the env maker cannot build its env")


class RaisingEnv(ZMQCountingEnv):
    """A CountingEnv whose steps raise the builtin exception named ``error`` (as an env's own)."""

    def __init__(self, env_id: int = 0, error: str = "ValueError") -> None:
        super().__init__(env_id=env_id)
        self.error = error

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        raise getattr(builtins, self.error)(f"env {self.env_id} cannot step")


class OffSpecDtypesEnv(ZMQCountingEnv):
    """A CountingEnv replying off its specs' dtypes, as an env built on numpy may.

    A float64 observation and an int64 reward and done flags, where its specs
    say float32 and bool (``max_steps=3 + env_id``: the flags are not all 0,
    and envs end at different steps).
    """

    def __init__(self, env_id: int = 0) -> None:
        super().__init__(env_id=env_id, max_steps=3 + env_id)

    def _reset(self, tensordict=None, **kwargs) -> TensorDictBase:
        return _off_dtypes(super()._reset(tensordict, **kwargs))

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        return _off_dtypes(super()._step(tensordict))


class ResetKeywordsEnv(ZMQCountingEnv):
    """A CountingEnv whose reset takes gymnasium's keywords: ``seed`` (reported as its seed)
    and ``options={"start": n}`` (its step count starts at ``n``).

    ``options={"exit_once": path}``: the process exits in the reset, unless
    ``path`` exists (made then): a worker that dies once, mid-reset.
    """

    def _reset(self, tensordict=None, seed=None, options=None) -> TensorDictBase:
        if options and "exit_once" in options:
            marker = pathlib.Path(options["exit_once"])
            if not marker.exists():
                marker.touch()
                os._exit(1)
        if seed is not None:
            self.seed = int(seed)
        out = super()._reset(tensordict)
        if options and "start" in options:
            self.count = int(options["start"])
            out["observation"] = self._observation(0.0)
        return out


class DefaultDtypeEnv(ZMQCountingEnv):
    """A CountingEnv whose observation is of torch's default dtype where it is built."""

    def __init__(self, env_id: int = 0) -> None:
        super().__init__(env_id=env_id, obs_dtype=torch.get_default_dtype())


def _off_dtypes(out: TensorDictBase) -> TensorDictBase:
    for key, value in list(out.items()):
        out[key] = value.double() if key == "observation" else value.long()
    return out


class GlobalRandomEnv(ZMQCountingEnv):
    """A CountingEnv whose reset draws from torch's and numpy's global generators.

    ``observation[4:6]``: ``torch.rand(())`` and ``np.random.rand()``, drawn at
    each reset (an unseeded env that samples its start state).
    """

    def __init__(self, env_id: int = 0) -> None:
        super().__init__(env_id=env_id, obs_shape=(6,), obs_dtype=torch.float64)

    def _reset(self, tensordict=None, **kwargs) -> TensorDictBase:
        out = super()._reset(tensordict, **kwargs)
        out["observation"][4] = torch.rand((), dtype=torch.float64)
        out["observation"][5] = float(np.random.rand())
        return out


class MaskedActionEnv(EnvBase):
    """Four discrete actions of which two are allowed at each step (``action_mask``), in turn;
    a masked action raises. Done after six steps."""

    def __init__(self) -> None:
        super().__init__(batch_size=[])
        self.action_spec = Categorical(4)
        self.observation_spec = Composite(
            observation=Unbounded(shape=(1,)),
            action_mask=Categorical(2, shape=(4,), dtype=torch.bool),
        )
        self.reward_spec = Unbounded(shape=(1,))
        self.count = 0

    def _mask(self) -> torch.Tensor:
        mask = torch.zeros(4, dtype=torch.bool)
        mask[[self.count % 4, (self.count + 1) % 4]] = True
        return mask

    def _out(self, observation: float) -> TensorDict:
        done = torch.tensor([self.count >= 6])
        fields = {"observation": torch.full((1,), observation), "action_mask": self._mask()}
        return TensorDict({**fields, "done": done, "terminated": done.clone()}, [])

    def _reset(self, tensordict=None, **kwargs) -> TensorDictBase:
        self.count = 0
        return self._out(0.0)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        action = int(tensordict["action"])
        if not self._mask()[action]:
            raise ValueError(f"action {action} is masked at step {self.count}")
        self.count += 1
        return self._out(float(action)).set("reward", torch.ones(1))

    def _set_seed(self, seed: int | None) -> int | None:
        return seed
