"""The envs a worker hosts, and what each command does to them. No sockets here.

A worker hosts one or more envs, each known by its pool index. A command is
answered by one small handler from :data:`HANDLERS`; each takes the env,
the decoded input tensordict (or None) and the command header's body (a
reset's keywords, a seed), and returns the tensordict parts of the reply.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import random
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase
from torchrl.data import Composite
from torchrl.envs import EnvBase

from workers.defaults import WORKER_THREADS_VAR
from zmqpool.codec import leaf_state
from zmqpool.errors import EnvMakerError, ProtocolError
from zmqpool.wire import NEXT_SEED, RESEED, Command

Parts = list[TensorDictBase]
Handler = Callable[[EnvBase, TensorDictBase | None, Mapping[str, Any]], Parts]


def _step(env: EnvBase, td: TensorDictBase | None, body: Mapping[str, Any]) -> Parts:
    # The pool keeps the input it sent; only the new "next" subtree comes back,
    # unless the env wrote into its input (the root then comes back too).
    td = _need(td)
    before = input_state(td)
    return _with_edited_root([step_next(env, td)], td, before)


def _with_edited_root(parts: Parts, td: TensorDictBase, before: tuple) -> Parts:
    """``parts``, plus the input's root when the env changed it in place.

    Some envs write into the tensordict they step (torchrl's
    ``AutoResetHeteroCountingEnv`` adds to its input observations); in-process,
    as under ``SerialEnv``, the caller sees that, so here the root travels back
    as a last part, which the pool then uses for the result's root.
    """
    if input_state(td) == before:
        return parts
    return [*parts, td.exclude("next")]


def input_state(td: TensorDictBase) -> tuple:
    """What changes when an env edits its input in place: :func:`~zmqpool.codec.leaf_state`.

    Quicker for the usual input, a TensorDict of tensors (and its "next",
    which is left out): each top-level key, tensor identity and version,
    without flattening the tree (~1 us where ``leaf_state`` takes 3-6). Any
    other input gets ``leaf_state``. The two forms never compare equal, so an
    env that turns one into the other is seen to have edited its input.
    """
    if type(td) is not TensorDict:
        return ("tree", leaf_state(td))
    state = []
    for key, value in td.items():
        if key == "next":
            continue
        if not isinstance(value, torch.Tensor):
            return ("tree", leaf_state(td))
        state.append((key, id(value), value._version))
    return ("flat", tuple(state))


def step_next(env: EnvBase, td: TensorDictBase) -> TensorDictBase:
    """``env.step(td)["next"]``, without the bookkeeping the pool does not need.

    For an input without ``"_step"`` (partial steps) or ``"next"`` (a preset
    to merge), ``EnvBase.step`` is its shape check, ``_step`` and
    ``_step_proc_data`` (reward shapes, missing done keys, type checks), then
    setting ``"next"`` on the input; the pool only wants that ``"next"``, and
    skipping the rest saves ~10 us of a cheap env's ~80 us step, and
    :func:`step_proc_data` ~10 more. An env that overrides ``step`` gets its
    own ``step``.
    """
    if type(env).step is not EnvBase.step or _has_step_extras(td):
        return env.step(td).get("next")
    env._assert_tensordict_shape(td)
    out = step_proc_data(env, env._step(td))
    if out.batch_size != td.batch_size:
        return td.set("next", out).get("next")  # the checks (and errors) of EnvBase.step
    return out


def _has_step_extras(td: TensorDictBase) -> bool:
    keys = td.keys()
    return "_step" in keys or "next" in keys


def step_proc_data(env: EnvBase, out: TensorDictBase) -> TensorDictBase:
    """``env._step_proc_data(out)``, skipped where it would change nothing.

    ``EnvBase._step_proc_data`` reshapes each reward and done flag to the
    shape its spec gives and fills in the done flags an env left out: ~13 us
    of a cheap env's step, spent mostly walking specs, for an output that is
    almost always complete already. An output holding every reward and every
    done flag at exactly that shape is returned as it is, which is what
    ``_step_proc_data`` returns for it. Anything else (a flag missing or of
    another shape, nested done specs, type checks on, unlocked specs, an env
    with its own ``_step_proc_data``) goes through torchrl's.
    """
    if type(env)._step_proc_data is not EnvBase._step_proc_data or env.run_type_checks:
        return env._step_proc_data(out)
    if not isinstance(out, TensorDictBase):  # a tensorclass, say: torchrl's to judge
        return env._step_proc_data(out)
    checks = _output_checks(env)
    if checks is None or not checks.complete(out, env.batch_size):
        return env._step_proc_data(out)
    return out


#: The key of an env's :class:`_OutputChecks` in torchrl's per-env cache.
_CHECKS_KEY = "zmqpool.output_checks"


def _output_checks(env: EnvBase) -> _OutputChecks | None:
    """The env's output checks, kept where torchrl keeps its ``reward_keys`` and ``done_keys``.

    That cache (``env._cache``) is used, as torchrl uses it, only while the
    specs are locked, and torchrl empties it whenever they are unlocked (the
    only way to add, remove or replace a spec): checks built from the specs'
    keys stay true until then. Shapes are read from the specs at every step.
    None (torchrl's own path) when there is no such cache.
    """
    cache = env.__dict__.get("_cache")
    if not isinstance(cache, dict) or not env.is_spec_locked:
        return None
    if not env.__dict__.get("cache_specs", True):
        return None
    checks = cache.get(_CHECKS_KEY)
    if checks is None:
        checks = cache[_CHECKS_KEY] = _OutputChecks.of(env)
    return checks


@dataclasses.dataclass(frozen=True)
class _OutputChecks:
    """What ``EnvBase._step_proc_data`` looks at in a step's output: its rewards and done flags.

    Each as (key, spec); ``done_spec`` is the env's ``full_done_spec``.
    ``usable`` is False for a done spec with nested done specs, which torchrl
    walks recursively: those envs keep torchrl's path.
    """

    rewards: tuple[tuple[Any, Any], ...]
    dones: tuple[tuple[Any, Any], ...]
    done_spec: Any
    usable: bool

    @classmethod
    def of(cls, env: EnvBase) -> _OutputChecks:
        reward_spec = env.output_spec["full_reward_spec"]
        done_spec = env.full_done_spec
        dones = tuple(done_spec.items())
        return cls(
            rewards=tuple((key, reward_spec[key]) for key in env.reward_keys),
            dones=dones,
            done_spec=done_spec,
            usable=not any(isinstance(spec, Composite) for _, spec in dones),
        )

    def complete(self, out: TensorDictBase, batch_size: torch.Size) -> bool:
        """Whether ``_step_proc_data`` would leave ``out`` as it is (the same shape rules)."""
        if not self.usable:
            return False
        shape = out.shape
        dims = len(batch_size)
        lead = out.batch_size[:-dims] if dims else shape
        for key, spec in self.rewards:
            expected = (*lead, *spec.shape)
            # torchrl leaves a reward of a variable-size spec as it is.
            if all(s > 0 for s in expected) and not _has_shape(out, key, expected):
                return False
        ndim = self.done_spec.ndim
        lead = shape[:-ndim] if ndim else shape
        return all(_has_shape(out, key, (*lead, *spec.shape)) for key, spec in self.dones)


def _has_shape(out: TensorDictBase, key: Any, shape: tuple[int, ...]) -> bool:
    # _get_str: what torchrl's own hot paths read a top-level key with (``get``: ~9x the cost).
    value = out._get_str(key, None) if isinstance(key, str) else out.get(key, None)
    return value is not None and value.shape == shape


def _step_raw(env: EnvBase, td: TensorDictBase | None, body: Mapping[str, Any]) -> Parts:
    return [env._step(_need(td))]


def _reset(env: EnvBase, td: TensorDictBase | None, body: Mapping[str, Any]) -> Parts:
    _reseed(env, body)
    return [env.reset(_none_if_empty(td), **_reset_kwargs(body))]


def _reset_raw(env: EnvBase, td: TensorDictBase | None, body: Mapping[str, Any]) -> Parts:
    _reseed(env, body)
    return [env._reset(_none_if_empty(td), **_reset_kwargs(body))]


def _reseed(env: EnvBase, body: Mapping[str, Any]) -> None:
    """A rebuilt env's seed, set before its first reset (the pool derives it from the seed
    ``set_seed`` gave the env before: :func:`zmqpool.roster.restart_seed`)."""
    seed = body.get(RESEED)
    if seed is None:
        return
    if type(seed) is not int:
        raise ProtocolError(f"reseed must be an integer, got {type(seed).__name__}")
    env.set_seed(seed)


def _reset_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The caller's reset keywords (``pool.reset(seed=...)``), handed on as SerialEnv does."""
    kwargs = body.get("kw")
    if kwargs is None:
        return _NO_KWARGS
    if type(kwargs) is not dict or not all(type(name) is str for name in kwargs):
        raise ProtocolError("a reset's keywords must be a map of names")
    return kwargs


_NO_KWARGS: dict[str, Any] = {}


def _none_if_empty(td: TensorDictBase | None) -> TensorDictBase | None:
    # As SerialEnv does: an env whose reset keys are nested (NestedCountingEnv)
    # fails on an empty tensordict where it takes None.
    return None if td is None or td.is_empty() else td


def _step_and_maybe_reset(
    env: EnvBase, td: TensorDictBase | None, body: Mapping[str, Any]
) -> Parts:
    td = _need(td)
    before = input_state(td)
    result, next_root = step_and_maybe_reset(env, td)
    return _with_edited_root([result.get("next"), next_root], result, before)


def step_and_maybe_reset(env: EnvBase, td: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
    """``env.step_and_maybe_reset(td)``, its step as lean as :func:`step_next`'s.

    torchrl's is ``EnvBase.step`` (with ``_step_proc_data``), ``_step_mdp``, the
    post-step-mdp hooks and ``maybe_reset``; here the step is :func:`step_next`'s
    (~10 us less) and the rest is the env's own methods, in the same order. Envs
    that change any of it (their own ``step`` or ``step_and_maybe_reset``, a
    compiled one, native auto-reset), an input with ``"_step"`` or ``"next"``
    and one on another device take torchrl's path.
    """
    if not _lean_step_and_maybe_reset(env, td):
        return env.step_and_maybe_reset(td)
    env._assert_tensordict_shape(td)
    td.set("next", step_proc_data(env, env._step(td)))  # EnvBase.step's set, with its checks
    next_root = env._step_mdp(td)
    hooks = getattr(env, "_post_step_mdp_hooks", None)  # not in every torchrl 0.14.x
    if hooks is not None:
        td, next_root = hooks(td, next_root)
    return td, env.maybe_reset(next_root)


def _lean_step_and_maybe_reset(env: EnvBase, td: TensorDictBase) -> bool:
    """Whether EnvBase's ``step_and_maybe_reset`` would do for ``td`` just what ours does."""
    cls = type(env)
    return (
        cls.step_and_maybe_reset is EnvBase.step_and_maybe_reset
        and cls._step_and_maybe_reset is EnvBase._step_and_maybe_reset
        and cls.step is EnvBase.step
        and env.__dict__.get("_compiled_step_and_maybe_reset") is None
        and not env.__dict__.get("_torchrl_native_autoreset", False)
        and td.device == env.device
        and not _has_step_extras(td)
    )


def _seed(env: EnvBase, td: TensorDictBase | None, body: Mapping[str, Any]) -> Parts:
    """``env.set_seed(seed, static_seed)``; the reply carries the seed it returned (SerialEnv's
    chain: the pool seeds the next env with it)."""
    seed, static = body.get("seed"), body.get("static", False)
    if seed is not None and (type(seed) is not int):
        raise ProtocolError(f"seed must be an integer or nil, got {type(seed).__name__}")
    if type(static) is not bool:
        raise ProtocolError(f"static must be a bool, got {type(static).__name__}")
    following = env.set_seed(seed, static_seed=static)
    following = None if following is None else int(following)
    return [TensorDict({NEXT_SEED: NonTensorData(following)}, batch_size=())]


def _need(td: TensorDictBase | None) -> TensorDictBase:
    if td is None:
        raise ProtocolError("this command needs an input tensordict")
    return td


HANDLERS: dict[Command, Handler] = {
    Command.STEP: _step,
    Command.STEP_RAW: _step_raw,
    Command.RESET: _reset,
    Command.RESET_RAW: _reset_raw,
    Command.STEP_AND_MAYBE_RESET: _step_and_maybe_reset,
    Command.SEED: _seed,
}


@dataclasses.dataclass
class EnvRecipe:
    """How to build one env: a callable (or an env instance) and its kwargs."""

    maker: Any
    kwargs: dict[str, Any]

    def build(self) -> EnvBase:
        if isinstance(self.maker, EnvBase):
            return self.maker
        env = self.maker(**self.kwargs)
        if not isinstance(env, EnvBase):
            raise TypeError(f"the env maker returned {type(env).__name__}, not a torchrl EnvBase")
        return env


def fresh_random_state() -> None:
    """Seed torch's, numpy's and Python's global generators from the OS.

    A worker is forked (from the fork server, or a remote host's supervisor),
    and a fork copies its parent's generators: unseeded envs of every worker,
    and an env after each restart, drew the same numbers. Each process starts
    its own stream instead, as a fresh interpreter (or torchrl's pools) would;
    ``set_seed`` seeds the envs after this, as before.
    """
    torch.manual_seed(int.from_bytes(os.urandom(8), "little"))
    np.random.seed(np.frombuffer(os.urandom(16), dtype=np.uint32))
    random.seed(os.urandom(16))


def recipe_from_name(name: str, kwargs: Mapping[str, Any]) -> EnvRecipe:
    """An env recipe from a ``package.module:callable`` name (:func:`maker_from_name`)."""
    return EnvRecipe(maker_from_name(name), dict(kwargs))


def maker_from_name(name: str) -> Callable[..., Any]:
    """The callable an importable ``package.module:callable`` name names.

    The one check of an ``--env`` name, for ``python -m workers`` and ``zmqpool
    demo`` alike: whatever goes wrong (the name's form, the module's import,
    with whatever it raised, a ``sys.exit()`` too, a missing attribute, an
    attribute that is not callable) is a :class:`ValueError` whose message is
    one line, which the command lines print as an argparse error (exit status
    2). Only a KeyboardInterrupt passes: the user's Ctrl-C, not the module's.

    Example:
        >>> maker_from_name("zmqpool.testing:CountingEnv").__name__
        'CountingEnv'
        >>> maker_from_name("json:nope")
        Traceback (most recent call last):
        ...
        ValueError: AttributeError: module 'json' has no attribute 'nope'
    """
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"must look like package.module:callable, got {name!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except KeyboardInterrupt:  # the user's Ctrl-C, not the module's failure
        raise
    except BaseException as err:  # not only ImportError: a module may raise anything, exit too
        raise ValueError(f"cannot import {module_name!r}: {_one_line(err)}") from err
    try:
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError as err:
        raise ValueError(_one_line(err)) from err
    if not callable(target):
        raise ValueError(
            f"{attr!r} of {module_name!r} is a {type(target).__name__}, not a callable"
        )
    return target


def _one_line(err: BaseException) -> str:
    """``Type: message`` of ``err``, its whitespace (newlines too) folded to single spaces."""
    return " ".join(f"{type(err).__name__}: {err}".split())


class EnvHost:
    """The envs of one worker, by pool index."""

    def __init__(self, envs: Mapping[int, EnvBase]) -> None:
        self.envs = dict(envs)

    @classmethod
    def build(
        cls,
        indices: Sequence[int],
        recipes: Sequence[EnvRecipe],
        torch_threads: int | None = None,
        default_dtype: str | None = None,
    ) -> EnvHost:
        """Build every env; an env maker that raises becomes an :class:`EnvMakerError`,
        one that calls ``sys.exit()`` or raises another ``BaseException`` too (the
        worker died of it, and the trainer heard only "exited with status 1 before
        registering"); not a ``KeyboardInterrupt`` (a remote worker's Ctrl-C).

        ``torch_threads``: see :func:`limit_torch_threads`; ``default_dtype``: torch's
        (one of ``DEFAULT_DTYPES``; None: float32). Both are set before any env is built.
        """
        limit_torch_threads(torch_threads)
        if default_dtype is not None:
            torch.set_default_dtype(getattr(torch, default_dtype))
        fresh_random_state()
        envs = {}
        for index, recipe in zip(indices, recipes, strict=True):
            try:
                envs[index] = recipe.build()
            except KeyboardInterrupt:
                raise
            except BaseException as err:
                raise EnvMakerError(
                    index, f"env maker raised {err!r}", traceback.format_exc()
                ) from err
        return cls(envs)

    def run(self, command: Command, env_index: int, td: TensorDictBase | None, body) -> Parts:
        env = self.envs.get(env_index)
        if env is None:
            raise ProtocolError(f"this worker does not host env {env_index}")
        handler = HANDLERS.get(command)
        if handler is None:
            raise ProtocolError(f"command {command.name} is not an env command")
        return handler(env, td, body or {})

    def close(self) -> None:
        for env in self.envs.values():
            # Best effort: the process is about to exit. A close that calls sys.exit() too:
            # its traceback showed at the pool's close().
            try:
                env.close()
            except KeyboardInterrupt:
                raise
            except BaseException:
                pass


def limit_torch_threads(threads: int | None = None) -> None:
    """Give torch one intra-op thread in this worker, as ParallelEnv does (``num_sub_threads``).

    Every worker otherwise starts one spinning OpenMP thread per core: with a
    pool of workers on a few cores, an env making a 1 MiB tensor spent more
    CPU in those threads than in its step (measured in docs/PERFORMANCE.md).
    ``threads`` (a pool's ``PoolConfig.worker_torch_threads``, a worker's
    ``--torch-threads``) sets the count, else ``ZMQPOOL_WORKER_THREADS`` does,
    else 1; ``0`` leaves torch's default.
    """
    if threads is None:
        threads = int(os.environ.get(WORKER_THREADS_VAR, "1"))
    if threads > 0:
        torch.set_num_threads(threads)
