"""``ZMQAsyncEnvPool``: torchrl's ``AsyncEnvPool``, with ZeroMQ as its transport.

The torchrl adapter: its public methods are torchrl's, with torchrl's
semantics, and everything zmqpool adds is a keyword argument with a safe
default. It turns the caller's tensordicts into payloads (checked, see
:mod:`zmqpool.validation`; built by :class:`~zmqpool.assembly.Assembler`),
keeps torchrl's bookkeeping (busy envs, what each recv may await) and turns
replies into torchrl's results. Sockets, processes, registration and the
event loop are the :class:`~zmqpool.runtime.Runtime`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NoReturn, TypeVar

import torch
from tensordict import TensorDictBase
from torchrl.envs import AsyncEnvPool, EnvBase

from zmqpool import interrupts
from zmqpool.arguments import (
    check_network_args,
    check_remote_envs,
    is_single_maker,
    public_key_of,
    with_remote_slots,
)
from zmqpool.assembly import Assembler
from zmqpool.config import PoolConfig
from zmqpool.errors import (
    BackendError,
    BatchSizeMismatchError,
    ChannelIndexError,
    ChannelIndexTypeError,
    EnvBusyError,
    EnvError,
    EnvLostError,
    NothingInFlightError,
    PoolClosedError,
    TooFewInFlightError,
)
from zmqpool.gate import Gate
from zmqpool.indexing import ENV_INDEX, EnvIndexer
from zmqpool.launcher import WorkerProcess
from zmqpool.partial import (
    STEP_MASK,
    envs_to_reset,
    fill_unreset,
    fill_unstepped,
    masked_envs,
    unreset_rows,
)
from zmqpool.runtime import PoolPlan, Resources, Runtime
from zmqpool.state import KIND_OF, STEPS, Channel, Kind, Reply
from zmqpool.stats import BatchStats, env_stats, stats_table
from zmqpool.validation import reset_kwargs, seed_argument, step_input_spec
from zmqpool.wire import Command

log = logging.getLogger("zmqpool")

_Method = TypeVar("_Method", bound=Callable[..., Any])
_Pool = TypeVar("_Pool", bound="ZMQAsyncEnvPool")


def _exclusive(method: _Method) -> _Method:
    """The call holds the pool's gate: one thread at a time on its sockets (:mod:`zmqpool.gate`)."""
    return _holding_the_gate(method, starts=False)


def _starting(method: _Method) -> _Method:
    """As :func:`_exclusive`, and a pool closed by ``close()`` starts again first (a
    forked child's pool raises :class:`PoolClosedError` there: such calls need no
    ``_check_open`` of their own).

    SerialEnv's and ParallelEnv's way (their ``_check_start``): torchrl's
    Collector closes its env once it has collected ``total_frames``, and
    evaluating on the env after is what their users do. torchrl's pool stays
    closed (a ``RuntimeError``); recvs do here too, as nothing can be in flight.
    """
    return _holding_the_gate(method, starts=True)


class _SyncCalls(threading.local):
    """The sync calls a thread is in on one pool (nested: a masked step calls ``step``),
    the replies they took, and the runtime those came from."""

    depth = 0
    replies: list[Reply]
    runtime: Any = None


def _sync_call(method: _Method) -> _Method:
    """A sync call (outside its gate): if it ends in an exception, the replies it took go too.

    A Ctrl-C held back is raised as the gate is let go (:mod:`zmqpool.interrupts`),
    once the call's result is built; a SIGINT handler of the caller's may raise
    something else there, and anything raised after the replies came loses
    them as well. A restart's truncation among them is owed to the env's next
    step (:meth:`Runtime.drop_replies`), and ``last_restarted_envs`` is left
    empty: the call that answers with the truncation names the env. Only the
    outermost call of a thread does this, its nested ones' replies included.
    """

    @functools.wraps(method)
    def sync_call(self: ZMQAsyncEnvPool, *args: Any, **kwargs: Any) -> Any:
        calls = self._sync_calls
        outer = calls.depth == 0
        if outer:
            calls.replies = []
        try:
            calls.depth += 1  # in the try: a Ctrl-C before it cannot leave the count raised
            return method(self, *args, **kwargs)
        except BaseException:
            # Not if another thread closed the pool and started it again meanwhile:
            # these replies' envs are not the new runtime's to owe.
            if outer and calls.replies and calls.runtime is self._runtime:
                self._runtime.drop_replies(calls.replies)
                self.__dict__["last_restarted_envs"] = []
            raise
        finally:
            if outer:
                calls.depth, calls.replies, calls.runtime = 0, [], None
            else:
                calls.depth -= 1

    return sync_call  # type: ignore[return-value]


def _holding_the_gate(method: _Method, starts: bool) -> _Method:
    @functools.wraps(method)
    def holding_the_gate(self: ZMQAsyncEnvPool, *args: Any, **kwargs: Any) -> Any:
        if self._resources.inherited:
            # A forked child: its copy of the gate may be held, by a parent thread that
            # was in a call when it forked and does not exist here (it would wait for ever).
            raise PoolClosedError(self._closed_because())
        with self._gate:
            if starts and self._resources.closed:
                self._start_again()
            return method(self, *args, **kwargs)

    return holding_the_gate  # type: ignore[return-value]


class ZMQAsyncEnvPool(AsyncEnvPool):
    """A drop-in :class:`torchrl.envs.AsyncEnvPool` whose envs run in processes reached over ZeroMQ.

    Args:
        env_makers: a callable returning an env, a list of them, or env
            instances (sent cloudpickled to the worker). Lambdas and closures
            work.
        stack: ``"dense"``, ``"maybe_dense"`` or ``"lazy"`` (heterogeneous envs).
        create_env_kwargs: a dict, or one dict per env.
        envs_per_worker: envs hosted by each worker process.
        worker_affinity: one set of CPU indices per worker, or a callable
            ``worker -> set of CPU indices``.
        config: timings and limits (:class:`~zmqpool.PoolConfig`).
        on_env_error: ``"raise"`` (an env exception raises in recv, naming the
            env, with its traceback) or ``"restart"`` (handled like a crash:
            the worker is restarted and the request answered by a truncation).
        remote_envs: env slots filled by workers on other machines (after the
            local envs: indices ``len(env_makers)`` onwards). Construction
            waits for them (``config.register_timeout_s``).
        bind: ``"tcp://HOST:PORT"``: where remote workers connect (commands on
            PORT, results on PORT+1, the pool's heartbeats on PORT+2).
        curve_keys: a directory made by ``zmqpool keygen``: TCP traffic is
            encrypted and only workers whose public key is in its
            ``authorized/`` folder may connect.
        insecure: bind TCP without CURVE (anyone who reaches the port can
            step your envs); refused unless set, and logged as a warning.
        local_transport: ``"ipc"`` (default) or ``"tcp"`` (loopback, with CURVE: each
            local worker gets a key pair the pool makes) for local workers.
        remote_workers: remote workers the pool starts itself, e.g.
            :class:`~zmqpool.ray_workers.RayWorkers` (one, or a list; any
            :class:`~zmqpool.ray_workers.RemoteLauncher`): their
            env slots come right after the local envs, before ``remote_envs``
            more for workers started by hand. Needs ``bind``; without
            ``curve_keys`` the pool makes its CURVE pair in memory.
        remote_spec: the specs every remote worker must register (an env's
            ``specs``). Without it, remote slots are held to the local envs'
            specs (``stack="dense"``), or in a remote-only pool to the first
            remote worker's; with it, a worker bringing other specs is refused
            before they are built, and remote replies' frames are held to what
            it implies (the results port then takes pieces of 256 KiB, or 1/128
            of that: see the README's security notes).
        backend, exchange: torchrl's values are accepted, so that code written
            for torchrl's pool runs unchanged; envs always run in worker
            processes, reached over ZeroMQ.

    Example:
        >>> from zmqpool import ZMQAsyncEnvPool
        >>> from zmqpool.testing import CountingEnv
        >>> pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": i} for i in range(2)])
        >>> td = pool.reset()
        >>> pool.async_step_send(pool.rand_action(td), env_index=[0, 1])
        >>> out = pool.async_step_recv(min_get=1)
        >>> pool.close()
    """

    def __init__(
        self,
        env_makers: Callable[[], EnvBase] | EnvBase | Sequence[Any],
        *,
        stack: Literal["dense", "maybe_dense", "lazy"] = "dense",
        create_env_kwargs: dict | list[dict] | None = None,
        envs_per_worker: int = 1,
        worker_affinity: Any = None,
        config: PoolConfig | None = None,
        on_env_error: Literal["raise", "restart"] = "raise",
        remote_envs: int = 0,
        bind: str | None = None,
        curve_keys: str | os.PathLike | None = None,
        insecure: bool = False,
        local_transport: Literal["ipc", "tcp"] = "ipc",
        remote_spec: Any = None,
        remote_workers: Any = None,
        backend: str | None = None,
        exchange: str | None = None,
    ) -> None:
        if backend not in (None, "multiprocessing", "threading"):
            raise BackendError(
                f"backend must be 'threading' or 'multiprocessing' (torchrl's), got {backend!r}"
            )
        if backend == "threading":  # code written for torchrl's pool runs unchanged
            log.info("ZMQAsyncEnvPool runs envs in worker processes; backend='threading' is moot")
        if stack not in ("dense", "maybe_dense", "lazy"):  # torchrl's type, with a message
            raise NotImplementedError(
                f"stack must be 'dense', 'maybe_dense' or 'lazy', got {stack!r}"
            )
        if exchange not in (None, "queue", "shm", "auto"):
            raise ValueError(f"exchange must be 'queue', 'shm' or 'auto', got {exchange!r}")
        if is_single_maker(env_makers) and isinstance(create_env_kwargs, list):
            # One maker and one kwargs dict per env: torchrl refuses this; it means N envs.
            env_makers = [env_makers] * len(create_env_kwargs)
        if config is not None and not isinstance(config, PoolConfig):
            hint = ": PoolConfig(**config)" if isinstance(config, dict) else ""
            raise TypeError(f"config must be a PoolConfig{hint}, got {type(config).__name__}")
        if on_env_error not in ("raise", "restart"):
            raise ValueError(f"on_env_error must be 'raise' or 'restart', got {on_env_error!r}")
        launchers = _as_list(remote_workers)
        if not remote_envs and not launchers and _is_empty(env_makers):
            raise ValueError("ZMQAsyncEnvPool needs at least one env maker (or remote_envs)")
        # Launched workers get keys the pool makes: it can make its own pair in memory too.
        keys = curve_keys if curve_keys is not None else ("in memory" if launchers else None)
        check_remote_envs(remote_envs)  # before the sum: "2" + True would be a TypeError of its own
        check_network_args(remote_envs + bool(launchers), bind, keys, insecure, local_transport)
        remote_envs += sum(launcher.num_envs for launcher in launchers)
        self.remote_workers = launchers
        self.remote_envs, self.bind = remote_envs, bind
        self.curve_keys, self.local_transport = curve_keys, local_transport
        if remote_spec is not None and not remote_envs:
            raise ValueError("remote_spec is the spec of remote slots: it needs remote_envs > 0")
        self.remote_spec = remote_spec
        # The envs' default dtype, as in-process: a worker process does not inherit it.
        self._default_dtype = str(torch.get_default_dtype()).removeprefix("torch.")
        env_makers, create_env_kwargs = with_remote_slots(
            env_makers, create_env_kwargs, remote_envs
        )
        self.num_local_envs = len(env_makers) - remote_envs
        for index, maker in enumerate(env_makers[: self.num_local_envs]):
            if not callable(maker):  # before any process starts, not as the worker's EnvMakerError
                raise TypeError(
                    f"env maker {index} must be callable (a function or class making an env), "
                    f"got {type(maker).__name__}: {maker!r:.80}"
                )
        self.on_env_error = on_env_error
        self.config = config or PoolConfig()
        #: env indices whose results in the latest recv were synthesized by a restart
        #: (none after a recv that raised).
        self.last_restarted_envs: list[int] = []
        self._resources = Resources(self.config)
        self._finalizer = weakref.finalize(self, Resources.release, self._resources)
        #: One thread at a time on the pool's sockets, the same across a start again.
        self._gate = Gate()
        self._batch_stats = BatchStats()
        #: Requests a sync call left in flight when a Ctrl-C stopped its wait, by kind.
        self._interrupted_sync: dict[Kind, int] = {}
        #: Each thread's sync calls under way and the replies they took (:func:`_sync_call`).
        self._sync_calls = _SyncCalls()
        #: Keys revoke_worker_key refused: still refused after a close and a start again.
        self._revoked_keys: set[str] = set()
        #: A set_seed is under way (another thread may send meanwhile: not a reset on an
        #: env's own channel, where the seeds' replies come).
        self._seeding = False
        super().__init__(
            env_makers,
            backend="multiprocessing",
            stack=stack,
            exchange="queue",
            worker_affinity=worker_affinity,
            envs_per_worker=envs_per_worker,
            create_env_kwargs=create_env_kwargs,
        )
        self.exchange = "zmq"
        # The workers run from here on: said so, as SerialEnv says once started, so that
        # torchrl's `if not env.is_closed: env.close()` (Collector.shutdown) closes the pool.
        self.is_closed = False

    @property
    def is_closed(self) -> bool:
        """Whether its workers are stopped: by its ``close()``, or by a copy's.

        ``copy.copy(pool)`` shares the pool's workers; closing or dropping the
        copy stops them, and the original must say so, not only its ``repr``.
        """
        resources = self.__dict__.get("_resources")
        closed = resources is not None and resources.closed
        return self.__dict__.get("is_closed", True) or closed

    @is_closed.setter
    def is_closed(self, value: bool) -> None:
        self.__dict__["is_closed"] = value  # where EnvBase.__del__ looks for it

    def _create_done_specs(self) -> None:
        """torchrl's completion of the done specs, without the entries it adds.

        An env is built with its done specs completed (a "terminated" beside a
        lone "done"); the pool's are its envs', completed already. Completing
        them again declared a "terminated" an env whose transform excludes it
        never writes: ``fake_tensordict`` held it and ``check_env_specs``
        failed, where SerialEnv's does not complete them. A pool whose output
        spec holds no done entries (a lazy stack of unlike envs' keeps them
        in its envs' specs) is completed as torchrl's pool is: its rollouts
        find their done keys there.
        """
        before = set(self.output_spec["full_done_spec"].keys(True, True))
        super()._create_done_specs()
        spec = self.output_spec["full_done_spec"]
        added = set(spec.keys(True, True)) - before
        if not before or not added:
            return
        locked = self.is_spec_locked  # type: ignore[has-type]  # torchrl sets it untyped
        self.is_spec_locked = False
        for key in added:
            del spec[key]
        self.output_spec["full_done_spec"] = spec
        self.is_spec_locked = locked

    # ------------------------------------------------------------ set-up

    def _setup(self) -> tuple[Any, Any]:
        try:
            return self._start()
        except BaseException:
            self._resources.release(grace_s=0.0)  # a failed start owes its workers nothing
            raise

    def _start(self) -> tuple[Any, Any]:
        self._runtime = Runtime(self._plan(), self._resources, self._gate)
        self._child_specs = self._runtime.start()
        self._env_batch_sizes = [torch.Size(spec.shape) for spec in self._child_specs]
        self._assembler = Assembler(
            self.stack,
            self._stack_func,
            self._child_specs,
            self.config.zero_copy_threshold_bytes,
            _envs_device(self._child_specs),
        )
        self._indexer = EnvIndexer(
            self._env_batch_sizes, self.device, self.stack == "dense", self._assembler.set_env_index
        )
        specs: Any = torch.stack(list(self._child_specs))
        # Cloned, as torchrl's threading pool does: a lazy stack of specs (envs whose
        # non-tensor examples differ) shares the children, which torchrl then edits.
        return specs["output_spec"].clone(), specs["input_spec"].clone()

    def _plan(self) -> PoolPlan:
        return PoolPlan(
            config=self.config,
            env_makers=self.env_makers,
            create_env_kwargs=self.create_env_kwargs,
            num_local_envs=self.num_local_envs,
            envs_per_worker=self.envs_per_worker,
            worker_affinity=self._worker_affinity,
            same_specs=self.stack == "dense",
            restart_on_env_error=self.on_env_error == "restart",
            bind=self.bind,
            curve_keys=self.curve_keys,
            local_transport=self.local_transport,
            remote_spec=self.remote_spec,
            launchers=tuple(self.remote_workers),
            default_dtype=self._default_dtype,
            revoked_keys=frozenset(self._revoked_keys),
        )

    @property
    def runtime(self) -> Runtime:
        """The machinery below torchrl's API, for tools and tests (see :mod:`zmqpool.runtime`).

        Its roster says who hosts which env and in which phase each worker and
        env is; its ledger, what is in flight. Read it; changing it is the
        runtime's business.
        """
        return self._runtime

    @property
    def _supports_set_state(self) -> bool:  # type: ignore[override]
        """``SerialEnv``'s: every env honours a reset's state (``reset(td, set_state=True)``).

        Read by ``EnvBase.reset`` and ``TransformedEnv`` to resolve ``set_state``;
        each worker's REGISTER says it of its envs (torchrl's pool says False).
        """
        runtime = getattr(self, "_runtime", None)
        return runtime is not None and runtime.roster.all_set_state()

    @property
    def remote_endpoint(self) -> str | None:
        """Where remote workers connect (``--connect``), once bound."""
        return self._runtime.remote_endpoint

    # ------------------------------------------------------------ torchrl hooks

    def _get_child_specs(self) -> list:
        return self._child_specs

    @property
    def env_batch_sizes(self) -> list[torch.Size]:
        return self._env_batch_sizes

    @property
    def resolved_exchange(self) -> str:  # type: ignore[override]
        return "zmq"

    # torchrl's base methods read these counters to refuse overlapping calls: one
    # accounting, the ledger's, of the batch requests no recv has taken yet.
    @property
    def _current_step(self) -> int:
        return self._awaiting(Kind.STEP)

    @property
    def _current_reset(self) -> int:
        return self._awaiting(Kind.RESET)

    @property
    def _current_step_reset(self) -> int:
        return self._awaiting(Kind.STEP_RESET)

    def _awaiting(self, kind: Kind) -> int:
        return self._runtime.awaiting((kind, None))

    def _assert_tensordict_shape(self, tensordict: TensorDictBase) -> None:
        """EnvBase's check of a sync call's batch size; its ``RuntimeError`` (``SerialEnv``'s)
        is a :class:`BatchSizeMismatchError`, as an async send's mismatch is."""
        try:
            super()._assert_tensordict_shape(tensordict)
        except RuntimeError as err:
            raise BatchSizeMismatchError(str(err)) from None

    # ------------------------------------------------------------ sync API

    @_sync_call
    @_starting
    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Step every env; like ``EnvBase.step``, returns ``tensordict`` with ``"next"`` set."""
        self._check_idle(Kind.STEP)
        self._assert_tensordict_shape(tensordict)  # as SerialEnv: a wrong one would wedge
        if STEP_MASK in tensordict:
            return self._partial_step(tensordict)
        # The indices go with the send, which tags the caller's tensordict with them:
        # set first and read back, they cost a NonTensorStack's tolist (~4 us an env) a step.
        self._send(Command.STEP, tensordict, list(range(tensordict.shape[0])), False)
        replies = self._recv_every_env(Kind.STEP, self.num_envs)
        self._apply_edits(tensordict, replies)
        tensordict.set("next", self._assembler.stack_next(replies))
        return tensordict

    def _partial_step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """``step`` with a ``"_step"`` mask: only the envs it selects step (:mod:`zmqpool.partial`).

        As ``SerialEnv``: the mask stays in the tensordict (unless it selects
        no env), the envs see neither it nor a preset ``"next"`` (whose
        entries the result keeps, as ``EnvBase.step`` does), and what an env
        writes into its input does not reach the caller's tensordict.
        """
        envs = masked_envs(tensordict.get(STEP_MASK), self.num_envs)
        if len(envs) == self.num_envs:  # a full step, the mask kept
            mask = tensordict.pop(STEP_MASK)
            return self.step(tensordict).set(STEP_MASK, mask)
        if not envs:
            del tensordict[STEP_MASK]
            stepped = self._skip_tensordict(tensordict)
        else:
            idx = list(range(self.num_envs))
            self._send(Command.STEP, tensordict.exclude(STEP_MASK, "next")[envs], envs, False)
            replies = self._recv_every_env(Kind.STEP, len(envs))
            stepped = fill_unstepped(self._assembler.stack_next(replies), tensordict, envs)
            self._assembler.set_env_index(tensordict, idx)
        preset = tensordict.get("next", None)
        if preset is not None:
            stepped.update(preset.exclude(*stepped.keys(True, True)))
        tensordict.set("next", stepped)
        return tensordict

    @_sync_call
    @_starting
    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """torchrl's hook, which ``TransformedEnv`` and ``SerialEnv`` call: the envs' ``"next"``.

        torchrl's pool tags the input with ``env_index`` as an ``(N,)`` tensor,
        which fails for envs with a batch size of their own; the send tags it
        as every send does.
        """
        self._check_idle(Kind.STEP)
        self._send(Command.STEP_RAW, tensordict, list(range(tensordict.shape[0])), False)
        result = self._assembler.assemble(self._recv_every_env(Kind.STEP, self.num_envs))[0]
        result.pop(ENV_INDEX)
        return result

    @_starting
    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        """torchrl's hook (``TransformedEnv`` calls it), the pool left idle if an env raises.

        Keywords (``seed=``, ``options=``, ``list_of_kwargs=``) reach each env's
        reset as ``SerialEnv`` hands them out (:func:`~zmqpool.validation.reset_kwargs`);
        torchrl's pool drops them.
        """
        self._settle_interrupted()
        envs = None
        if tensordict is not None:
            envs = envs_to_reset(tensordict, self.reset_keys, self.num_envs)
        if envs is None:  # every env: refused as reset() refuses it (torchrl's is plain)
            self._check_idle(Kind.STEP)
        with interrupts.WHOLE, self._settled_on_error(Kind.RESET):
            keywords = reset_kwargs(kwargs, self.num_envs)  # refused before anything is sent
            if envs is None and keywords is None:
                return super()._reset(tensordict)
            if envs is None:  # torchrl's _reset, with each env's keywords
                assert keywords is not None
                return self._reset_every_env(Command.RESET_RAW, tensordict, keywords)
            return self._partial_reset(tensordict, envs, keywords)

    def _reset_every_env(
        self, command: Command, tensordict: TensorDictBase | None, keywords: list[dict]
    ) -> TensorDictBase:
        """torchrl's reset of every env (``reset``, or ``_reset`` for RESET_RAW), each env's
        keywords in its command."""
        self._send(command, tensordict, list(range(self.num_envs)), True, keywords)
        return self.async_reset_recv(min_get=self.num_envs)

    def _partial_reset(
        self, tensordict: TensorDictBase, envs: list[int], keywords: list[dict] | None
    ) -> TensorDictBase:
        """``_reset`` of the envs a ``"_reset"`` mask selects, only (:mod:`zmqpool.partial`)."""
        reset_rows = None
        if envs:
            kept = None if keywords is None else [keywords[env] for env in envs]
            self._send(Command.RESET_RAW, tensordict[envs], envs, True, kept)
            reset_rows = self._assembler.stack_next(self._recv_every_env(Kind.RESET, len(envs)))
        zeros = self.full_observation_spec.zero()  # SerialEnv's for an env it does not reset
        if self.stack == "dense":
            out = fill_unreset(reset_rows, zeros, envs)
        else:  # envs of unlike structures: row by row
            rows = unreset_rows(reset_rows, zeros.unbind(0), envs)
            out = self._assembler.stack_tds(rows)
        self._assembler.set_env_index(out, list(range(self.num_envs)))
        return out

    def _recv_every_env(self, kind: Kind, count: int) -> list[Reply]:
        """A sync call's recv of the ``count`` envs it sent to (see :meth:`_settled_on_error`).

        Held whole: a Ctrl-C is raised once every env answered (``interrupts.WHOLE``),
        as the call lets go of its gate; the replies are noted for :func:`_sync_call`.
        A batch in :meth:`stats`, as torchrl's sync calls are (its async recv).
        """
        with interrupts.WHOLE, self._settled_on_error(kind, sent=True):
            replies = self._recv(kind, count, None, None, None)
        calls = self._sync_calls
        if calls.depth:  # a reset's own (torchrl's reset calls _reset) needs no note
            calls.replies += replies
            calls.runtime = self._runtime
        ready_at = [(r.env, r.ready_at) for r in replies]
        self._batch_stats.record_batch(ready_at, None, kind != Kind.RESET)
        return replies

    @contextlib.contextmanager
    def _settled_on_error(self, kind: Kind, sent: bool = False) -> Iterator[None]:
        """A sync call: an env's error is raised once the other envs have answered too.

        Their results are dropped, so that the next call finds the pool idle,
        as ``SerialEnv``'s does: raised at once, the error left the others in
        flight, and every sync call after it refused ("Some envs are still
        processing"). Anything else raised (a Ctrl-C in a wait) leaves what the
        call sent for the next sync call to drop: all that is awaited if the
        call has ``sent`` already, or if the channel was idle when it began (a
        sync call sends only to an idle one); else the call was refused, and
        what is awaited is the caller's own async requests.
        """
        ours = sent or not self._awaiting(kind)
        try:
            yield
        except (EnvError, EnvLostError):
            # Held whole (the caller's ``with interrupts.WHOLE`` is outside this one), a
            # Ctrl-C waits for the settling too; a second one may cut it short.
            self._settle_or_leave_to_next(kind)
            raise
        except BaseException:  # a Ctrl-C in a wait (or what the caller's handler raised):
            if ours:
                self._interrupted_sync[kind] = self._awaiting(kind)
            raise

    def _settle_interrupted(self) -> None:
        """Drop what sync calls cut short left in flight, as ``SerialEnv`` has none.

        A sync call holds a Ctrl-C to its end (``interrupts.WHOLE``); a second
        one goes through at once and may leave its requests in flight. Dropped
        by the next sync call, whatever its kind, but only if nothing was sent
        or taken on that channel since: an async request the caller made
        meanwhile is theirs, and is refused as before.
        """
        for kind in list(self._interrupted_sync):
            left = self._interrupted_sync.pop(kind)
            if left and left == self._awaiting(kind):
                log.warning(
                    "dropping the results of the %s call interrupted before them", kind.value
                )
                with self._gate, interrupts.WHOLE:
                    self._settle_or_leave_to_next(kind)

    def _settle_or_leave_to_next(self, kind: Kind) -> None:
        """:meth:`_settle`; cut short (a second Ctrl-C), the rest is left for the next sync call."""
        try:
            self._settle(kind)
        except BaseException:
            self._interrupted_sync[kind] = self._awaiting(kind)
            raise

    def _settle(self, kind: Kind) -> None:
        """Take (and drop) what the batch channel of ``kind`` still awaits, errors included.

        A restart's truncation among them is owed (:meth:`Runtime.drop_replies`):
        the call that answers with it names its env in ``last_restarted_envs``.
        """
        channel: Channel = (kind, None)
        for _ in range(self.num_envs + 1):  # each round takes every reply, or one error
            left = self._runtime.awaiting(channel)
            if not left:
                break
            try:
                self._runtime.drop_replies(self._recv(kind, left, None, None, None))
            except (EnvError, EnvLostError) as err:
                log.warning("dropped with the failed call: %s", str(err).splitlines()[0])
        self.__dict__["last_restarted_envs"] = []

    def _apply_edits(self, tensordict: TensorDictBase, replies: list[Reply]) -> None:
        """What an env wrote into its input, written into the caller's, as in-process.

        In place, into the caller's tensors: a rollout's root shares them with
        the previous step's ``"next"``, which an in-process env edits too.
        """
        edited = self._assembler.edited_roots(replies)
        if edited is not None:
            tensordict.update(edited.exclude(ENV_INDEX), inplace=True)

    @_sync_call
    @_starting
    def step_and_maybe_reset(
        self, tensordict: TensorDictBase
    ) -> tuple[TensorDictBase, TensorDictBase]:
        """Like ``EnvBase.step_and_maybe_reset``: ``tensordict`` with ``"next"``, and the next root.

        torchrl's pool writes ``env_index`` into the caller's tensordict as a
        tensor, which breaks its own ``Collector``; here it stays a
        ``NonTensorStack``, as in every result.
        """
        self._check_idle(Kind.STEP_RESET)
        self._assert_tensordict_shape(tensordict)
        if STEP_MASK in tensordict:
            # EnvBase's: the partial step (ours, above), then the done envs reset
            return EnvBase.step_and_maybe_reset(self, tensordict)
        idx = list(range(tensordict.shape[0]))
        self._send(Command.STEP_AND_MAYBE_RESET, tensordict, idx, False)  # tags it, as step's
        replies = self._recv_every_env(Kind.STEP_RESET, self.num_envs)
        self._apply_edits(tensordict, replies)
        tensordict.set("next", self._assembler.stack_next(replies))
        next_root = self._assembler.stack_roots(replies)
        self._assembler.set_env_index(next_root, idx)
        return tensordict, next_root

    @_starting
    def reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        """torchrl's ``reset``; a tensordict of another batch size than the pool's is refused.

        As ``SerialEnv`` refuses it (``RuntimeError``), before anything is sent:
        torchrl's pool sends it and then waits for more envs than it reset, and
        the pool stays busy. With a ``"_reset"`` mask that leaves some envs out,
        only the envs it selects are reset, as by ``SerialEnv``. Keywords
        (``seed=``, ``options=``, ``list_of_kwargs=``) reach each env's reset as
        ``SerialEnv`` hands them out (:func:`~zmqpool.validation.reset_kwargs`);
        torchrl's pool drops them.
        """
        if tensordict is not None:
            self._assert_tensordict_shape(tensordict)
            if envs_to_reset(tensordict, self.reset_keys, self.num_envs) is not None:
                # A "_reset" mask: EnvBase's reset, as SerialEnv's, whose _reset resets the
                # envs it selects only. torchrl's pool resets every env (zmqpool.partial).
                out = EnvBase.reset(self, tensordict, **kwargs)
                # Rows are envs by position, as in every sync call: EnvBase keeps the rows
                # not reset from the input, whose "env_index" may name them in another order.
                self._assembler.set_env_index(out, list(range(self.num_envs)))
                return out
        keywords = reset_kwargs(kwargs, self.num_envs)  # refused before anything is sent
        # torchrl's reset checks this first, with a plain RuntimeError: ours is the
        # EnvBusyError (a RuntimeError) of every other sync call's refusal.
        self._check_idle(Kind.STEP)
        with interrupts.WHOLE, self._settled_on_error(Kind.RESET):
            if keywords is None:
                return super().reset(tensordict)
            return self._reset_every_env(Command.RESET, tensordict, keywords)

    def _check_idle(self, kind: Kind) -> None:
        self._settle_interrupted()
        if self._awaiting(kind) > 0:
            raise EnvBusyError("Some envs are still processing a step.")

    # ------------------------------------------------------------ sending

    @_starting
    def _send(
        self,
        command: Command,
        tensordict: TensorDictBase | None,
        env_index: int | list[int] | None,
        make_if_none: bool,
        kwargs: list[dict[str, Any]] | None = None,
    ) -> None:
        env_index = self._indexer.arg(env_index)
        tensordict, env_idx = self._indexer.batch(tensordict, env_index, make_if_none)
        if command in STEPS:
            strict = self.config.strict_inputs
            # The indices were checked above: only the entries are left to check.
            step_input_spec(self.input_spec, self.num_envs, strict).check_batch(tensordict, env_idx)
        per_env = type(env_index) is int
        kind = KIND_OF[command]
        if per_env and self._seeding and kind is Kind.RESET:
            raise EnvBusyError(
                f"cannot reset env {env_index} on its own channel while set_seed is under way "
                "(the seeds' replies come there)"
            )
        self._runtime.refuse_lost(env_idx)
        if not per_env:
            busy = self._busy.intersection(env_idx)
            if busy:
                raise EnvBusyError(
                    f"Some envs are still processing a step: envs that are busy: {sorted(busy)}, "
                    f"queried: {env_idx}."
                )
        # The payload is the input too: a result is rebuilt from what was sent.
        # Every payload is built (and refused if it cannot cross the wire) before any is sent.
        payloads = self._assembler.payloads(tensordict)
        bodies = None if kwargs is None else [{"kw": each} for each in kwargs]
        self._runtime.send_all(env_idx, command, payloads, per_env, bodies)
        if kind != Kind.RESET:
            self._batch_stats.record_actions(env_idx)
        if not per_env:
            self._busy.update(env_idx)

    def _maybe_make_tensordict(
        self, tensordict: TensorDictBase | None, env_index: Any, make_if_none: bool
    ) -> tuple[TensorDictBase, list[int]]:
        """torchrl's hook, read along the env dim (see :meth:`EnvIndexer.make`)."""
        return self._indexer.make(tensordict, env_index, make_if_none)

    def async_step_send(self, tensordict, env_index=None) -> None:
        self._send(Command.STEP, tensordict, env_index, False)

    def _async_private_step_send(self, tensordict, env_index=None) -> None:
        self._send(Command.STEP_RAW, tensordict, env_index, False)

    def async_step_and_maybe_reset_send(self, tensordict, env_index=None) -> None:
        self._send(Command.STEP_AND_MAYBE_RESET, tensordict, env_index, False)

    def async_reset_send(self, tensordict=None, env_index=None) -> None:
        self._send(Command.RESET, tensordict, env_index, True)

    def _async_private_reset_send(self, tensordict=None, env_index=None) -> None:
        self._send(Command.RESET_RAW, tensordict, env_index, True)

    # ------------------------------------------------------------ receiving

    def async_step_recv(self, min_get=None, env_index=None, *, max_get=None, timeout=None):
        """Step results: at least ``min_get`` (see torchrl's docs), or env ``env_index``'s own.

        ``timeout`` is a deadline for the whole call: fewer than ``min_get``
        results by then raises ``TimeoutError`` (they stay for the next call);
        once ``min_get`` are in, the call keeps collecting until the deadline,
        ``max_get`` results, or every request in flight answered, as torchrl
        documents (deadline batching).
        """
        return self._results(Kind.STEP, min_get, env_index, max_get, timeout)[0]

    _async_private_step_recv = async_step_recv

    def async_reset_recv(self, min_get=None, env_index=None, *, max_get=None, timeout=None):
        """Reset results; the arguments are those of :meth:`async_step_recv`."""
        return self._results(Kind.RESET, min_get, env_index, max_get, timeout)[0]

    _async_private_reset_recv = async_reset_recv

    def async_step_and_maybe_reset_recv(
        self, min_get=None, env_index=None, *, max_get=None, timeout=None
    ):
        """Step results and the next roots; the arguments are those of :meth:`async_step_recv`."""
        return self._results(Kind.STEP_RESET, min_get, env_index, max_get, timeout)

    def _results(
        self, kind: Kind, min_get, env_index, max_get, timeout
    ) -> tuple[TensorDictBase, TensorDictBase | None]:
        """A recv's results, holding the gate; a Ctrl-C in it gives back what it took.

        The interrupt is held back until the gate is let go (:mod:`zmqpool.interrupts`),
        which is after the results are built: then they are not returned, and the
        replies they were built from wait for the next recv, their envs in flight.
        """
        taking = _Taking()
        try:
            return self._take_results(kind, min_get, env_index, max_get, timeout, taking)
        except BaseException as err:
            if taking.replies and (taking.built or not isinstance(err, Exception)):
                self._give_back(taking)  # an env's error or a bad stack: not given back
            raise

    @_exclusive
    def _take_results(
        self, kind: Kind, min_get, env_index, max_get, timeout, taking: _Taking
    ) -> tuple[TensorDictBase, TensorDictBase | None]:
        taking.runtime = self._runtime
        taking.replies = replies = self._recv(kind, min_get, env_index, max_get, timeout)
        per_env = env_index is not None
        if per_env:  # torchrl's per-env channel: the env's own tensordict
            results = self._assembler.assemble_one(replies[0])
        else:
            results = self._assembler.assemble(replies)
        taking.built = True
        ready_at = [(r.env, r.ready_at) for r in replies]
        self._batch_stats.record_batch(ready_at, 1 if per_env else max_get, kind != Kind.RESET)
        return results

    @_exclusive
    def _give_back(self, taking: _Taking) -> None:
        """Undo a recv's take: its replies wait for the next recv, their envs awaited again."""
        if taking.runtime is not self._runtime or self._resources.closed:
            return  # closed by another thread since (and maybe started again): none waits
        replies = taking.replies
        channel = replies[0].pending.channel
        self._runtime.give_back(channel, replies)
        self.__dict__["last_restarted_envs"] = []  # they are the next recv's to name
        if channel[1] is None:
            self._busy.update(r.env for r in replies)

    def _recv(  # every caller (step, step_and_maybe_reset, _results) holds the gate
        self,
        kind: Kind,
        min_get: int | None,
        env_index: int | None,
        max_get: int | None,
        timeout: float | None,
    ) -> list[Reply]:
        self._check_open()
        # Until this recv returns: one that raises returns no result from a restart.
        self.__dict__["last_restarted_envs"] = []
        # On an env's own channel too, where torchrl's pool ignores it.
        timeout = _checked_timeout(timeout)
        if env_index is not None:
            env_index = self._channel_index(env_index)
            self._check_awaited((kind, env_index))
            channel: Channel = (kind, env_index)
            replies = self._runtime.collect(channel, 1, 1, timeout, self._raise_taken)
            return self._note_restarted(replies)
        min_get = self.min_get if min_get is None else min_get
        self._check_recv_args(kind, min_get, max_get)
        replies = self._runtime.collect((kind, None), min_get, max_get, timeout, self._raise_taken)
        replies = self._note_restarted(replies)
        self._busy.difference_update([r.env for r in replies])
        return replies

    def _channel_index(self, env_index: Any) -> int:
        """The env whose own channel a recv reads; out of range: ``ChannelIndexError``; not an
        integer: ``ChannelIndexTypeError`` (each also the ``KeyError`` of torchrl's pool)."""
        try:
            return self._indexer.one(env_index)
        except IndexError as err:
            raise ChannelIndexError(str(err)) from None
        except TypeError as err:
            raise ChannelIndexTypeError(str(err)) from None

    def _note_restarted(self, replies: list[Reply]) -> list[Reply]:
        # Into the instance dict: what EnvBase's and nn.Module's __setattr__ end up doing
        # for a list, without their checks (4 us a recv, for every recv).
        self.__dict__["last_restarted_envs"] = [r.env for r in replies if r.synthesized]
        return replies

    def _check_awaited(self, channel: Channel) -> None:
        """An env's own channel: refuse a recv that nothing was sent for (it would wait forever)."""
        if self._runtime.awaiting(channel):
            return
        raise NothingInFlightError(
            f"env {channel[1]} has no {channel[0].value} in flight on its own channel: "
            f"send one with env_index={channel[1]} first"
        )

    def _check_recv_args(self, kind: Kind, min_get: int, max_get: int | None) -> None:
        if min_get < 1:
            raise ValueError(f"min_get must be positive, got {min_get}.")
        if max_get is not None and max_get < min_get:
            raise ValueError(f"max_get ({max_get}) must be >= min_get ({min_get}).")
        if min_get > self._awaiting(kind):
            raise TooFewInFlightError(
                f"Cannot await {min_get} {kind.value} when only "
                f"{self._awaiting(kind)} are in flight."
            )

    def _raise_taken(self, reply: Reply) -> NoReturn:
        """Raise the error a reply carries; a batch reply no longer counts as in flight."""
        if reply.pending.channel[1] is None:
            self._busy.discard(reply.env)
        assert reply.error is not None
        raise reply.error

    # ------------------------------------------------------------ seeding, closing

    def set_seed(self, seed: int | None = None, static_seed: bool = False) -> int | None:
        """``SerialEnv.set_seed`` (torchrl's pool raises ``NotImplementedError``).

        Env 0 is seeded with ``seed``, env ``i + 1`` with the seed env ``i``'s
        ``set_seed`` returned (torchrl's ``seed_generator`` chain; with
        ``static_seed=True``, every env gets ``seed``). Returns the last env's.
        """
        return self._seed_envs(seed, static_seed)

    def _set_seed(self, seed: int | None) -> None:
        """torchrl's hook: :meth:`set_seed`'s seeding."""
        self._seed_envs(seed, False)

    @_starting
    def _seed_envs(self, seed: int | None, static_seed: bool) -> int | None:
        seed = seed_argument(seed)
        if self._busy:
            raise EnvBusyError(f"cannot seed while envs {sorted(self._busy)} are busy")
        # A seed's reply comes on its env's own reset channel: one awaited there (another
        # thread's async_reset_send(env_index=i)) would be taken for it, and it for that.
        resetting = [e for e in range(self.num_envs) if self._runtime.awaiting((Kind.RESET, e))]
        if resetting:
            raise EnvBusyError(f"cannot seed while envs {resetting} have resets in flight")
        self._seeding = True
        try:
            with interrupts.WHOLE:  # cut short, it would leave a seed's reply for the next one
                # Truthy as torchrl reads it; a bool, so that np.bool_ crosses too.
                return self._runtime.set_seed(seed, bool(static_seed), self._raise_taken)
        finally:
            self._seeding = False

    @_exclusive  # a recv records its batch under the gate: reset=True must not lose one
    def stats(self, *, reset: bool = False) -> dict[str, float | int]:
        """torchrl's batch figures (``batches``, ``items``, ``avg_batch_size``, ...).

        The keys and meanings of torchrl's ``AsyncEnvPool.stats()`` (which
        only its shared-memory exchange fills); see
        :class:`~zmqpool.stats.BatchStats`. ``reset=True`` clears them after
        the snapshot. Per-env figures are :meth:`env_stats`.

        Example:
            >>> pool.stats()["avg_batch_size"]  # doctest: +SKIP
            1.7
        """
        return self._batch_stats.snapshot(reset=reset)

    @_exclusive
    def env_stats(self, *, reset: bool = False) -> dict[int, dict[str, Any]]:
        """Per env: steps, restarts, the last restart's cause, request latency (ms, p50 and p99).

        ``reset=True`` clears the latencies after the snapshot.

        Example:
            >>> pool.env_stats()[0]["restarts"]  # doctest: +SKIP
            0
        """
        ledger, roster = self._runtime.ledger, self._runtime.roster
        result = {s.index: env_stats(s, roster.envs[s.index]) for s in ledger.slots}
        if reset:
            ledger.clear_latencies()
        return result

    def stats_table(self) -> str:
        """:meth:`env_stats` as a table for people."""
        return stats_table(self.env_stats())

    # ------------------------------------------------------------ processes

    @property
    def fork_server_pid(self) -> int | None:
        """The pid of the fork server that local workers are forked from (None: none running)."""
        return self._runtime.launcher.fork_server_pid

    def worker_processes(self) -> dict[int, WorkerProcess]:
        """Each local worker's process (``pid``, ``exit_status()``), by worker index.

        A worker being restarted is absent, and a closed pool has none. Remote
        workers are not ours to list.
        """
        if self._resources.closed:  # its processes are gone, or the parent's (forked)
            return {}
        return self._runtime.worker_processes()

    def worker_pid(self, env_index: int) -> int | None:
        """The pid of the local process hosting env ``env_index`` now.

        None for a remote env, while its worker is being restarted, or once the
        pool is closed.

        Example:
            >>> os.kill(pool.worker_pid(0), signal.SIGKILL)  # doctest: +SKIP
        """
        env_index = self._indexer.one(env_index)
        if env_index >= self.num_local_envs:
            return None
        process = self.worker_processes().get(env_index // self.envs_per_worker)
        return None if process is None else process.pid

    @_exclusive
    def revoke_worker_key(self, key: str | bytes | os.PathLike) -> list[int]:
        """Refuse a remote worker key from now on: a ``.key`` file or its z85 public key.

        New connections with it are refused by the ZAP handler; the workers
        that hold slots with it are set aside at once (their requests wait
        ``config.rejoin_timeout_s`` for another worker, as after a silence), and
        anything they still send is dropped. Returns the env slots vacated.
        The pool refuses it for its life, after a ``close()`` and a start again
        too, whatever ``authorized/`` then holds.

        Example:
            >>> pool.revoke_worker_key("keys/authorized/worker-3.key")  # doctest: +SKIP
            [6, 7]
        """
        self._check_open()
        public = public_key_of(key)
        self._revoked_keys.add(public)
        return self._runtime.revoke(public)

    def _check_open(self) -> None:
        if self._resources.closed:
            raise PoolClosedError(self._closed_because())

    def _closed_because(self) -> str:
        if self._resources.inherited:
            return (
                "the pool belongs to the process this one was forked from: a forked "
                "child cannot use it (make a pool in the child)"
            )
        return (  # a Collector's close() surprises: say so
            "the pool is closed (by close(): a torchrl Collector also calls it once it has "
            "collected total_frames), so nothing is in flight; a step, reset or send starts "
            "its envs again"
        )

    def _start_again(self) -> None:
        """Start the envs of a pool closed by ``close()`` again (see :func:`_starting`).

        New workers, sockets and envs (made and seeded as at construction); the
        pool's specs are kept. A start that fails leaves the pool closed.
        """
        if self._resources.inherited:
            raise PoolClosedError(self._closed_because())
        log.info("the pool was closed: starting its %d envs again", self.num_envs)
        self._finalizer.detach()  # its resources are released
        self._resources = Resources(self.config)
        self._finalizer = weakref.finalize(self, Resources.release, self._resources)
        self._busy.clear()
        self._interrupted_sync.clear()
        self.__dict__["last_restarted_envs"] = []
        self._setup()
        self.is_closed = False

    def shutdown(self) -> None:
        """Stop every worker (bounded by ``config.close_timeout_s``) and remove the sockets."""
        runtime = getattr(self, "_runtime", None)  # None: the pool failed to start
        if runtime is None or self._resources.inherited:  # a forked child's gate may be held
            self._resources.release()
        else:
            with self._gate:  # not under another thread's feet: it sees the pool closed
                self._resources.release()
        self.is_closed = True

    def __enter__(self: _Pool) -> _Pool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``with ZMQAsyncEnvPool(...) as pool:`` closes it at the block's end (as pyzmq's
        sockets do; torchrl's pools are not context managers)."""
        self.close(raise_if_closed=False)

    def __repr__(self) -> str:
        state = "closed" if self._resources.closed else "open"
        return f"{type(self).__name__}(num_envs={self.num_envs}, stack={self.stack!r}, {state})"


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_empty(env_makers: Any) -> bool:
    return isinstance(env_makers, (list, tuple)) and not env_makers


def _checked_timeout(timeout: float | None) -> float | None:
    """A recv's ``timeout``, checked as torchrl checks it; NaN is a deadline already past.

    NaN compares false with everything: taken as it is, every deadline check
    said "not yet", and the recv waited as if it had no timeout. torchrl's
    pool raises ``TimeoutError`` at once; here it polls (``timeout=0``), which
    raises ``RecvTimeoutError``, a ``TimeoutError``, unless results are ready.
    """
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout must be non-negative, got {timeout}.")
    if timeout is not None and math.isnan(timeout):
        return 0.0
    return timeout


def _envs_device(child_specs: Sequence[Any]) -> torch.device | None:
    """The device every env's tensordicts are on (None: none, or not all the same).

    The pool's own ``device`` is None even then (torchrl's pool's is too), but
    each env's result carries its env's, and so does their stack.
    """
    try:
        devices = {spec["output_spec"].device for spec in child_specs}
    except (KeyError, AttributeError):  # specs without an output_spec: nothing to follow
        return None
    return devices.pop() if len(devices) == 1 else None


@dataclasses.dataclass(slots=True)
class _Taking:
    """What a recv has taken so far: its replies, and whether its results were built."""

    replies: list[Reply] = dataclasses.field(default_factory=list)
    built: bool = False
    runtime: Runtime | None = None  # the one taken from: a pool closed since gets none back
