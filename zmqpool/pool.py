"""``ZMQAsyncEnvPool``: torchrl's ``AsyncEnvPool``, with ZeroMQ as its transport.

The pool owns a :class:`~zmqpool.broker.Broker` (its sockets), a
:class:`~zmqpool.state.Ledger` (what is in flight and what is ready) and the
local worker processes. Its public methods are torchrl's, with torchrl's
semantics; everything zmqpool adds is a keyword argument with a safe default.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeGuard

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, lazy_stack
from torchrl.envs import AsyncEnvPool, EnvBase

from zmqpool.admission import Registrar
from zmqpool.assembly import Assembler
from zmqpool.broker import Broker, Event
from zmqpool.config import PoolConfig
from zmqpool.endpoints import (
    Endpoints,
    ipc_endpoints,
    make_private_dir,
    remove_private_dir,
    tcp_endpoints,
)
from zmqpool.errors import (
    EnvMakerError,
    PoolClosedError,
    RegistrationError,
    VersionMismatchError,
)
from zmqpool.launcher import Launcher, WorkerProcess, pickle_recipes, stop_all, worker_argv
from zmqpool.remote import RemoteSlots
from zmqpool.security import ServerKeys
from zmqpool.specs import spec_from_data
from zmqpool.state import Channel, Kind, Ledger, Reply
from zmqpool.stats import BatchStats, env_stats, stats_table
from zmqpool.supervisor import Supervisor
from zmqpool.validation import check_step_input
from zmqpool.wire import Command, Header

log = logging.getLogger("zmqpool")

#: Commands whose input must hold the actions: checked before anything is sent.
_CHECKED_COMMANDS = (Command.STEP, Command.STEP_RAW, Command.STEP_AND_MAYBE_RESET)
_ENV_INDEX = "env_index"


def _is_plain_batch(tensordict: Any) -> TypeGuard[TensorDict]:
    """A TensorDict itself (not a subclass or lazy stack) of one batch dim: the fast path."""
    return type(tensordict) is TensorDict and tensordict.batch_dims == 1


def _is_single_maker(env_makers: Any) -> bool:
    return not isinstance(env_makers, (Sequence, EnvBase))


class _RemoteSlot:
    """Stands in the env-maker list for an env that a remote worker will host."""

    def __repr__(self) -> str:
        return "<remote env slot>"


def _with_remote_slots(env_makers: Any, kwargs: Any, remote: int) -> tuple[list, Any]:
    makers = [env_makers] if _is_single_maker(env_makers) or isinstance(env_makers, EnvBase) else []
    makers = makers or list(env_makers)
    if kwargs is None or isinstance(kwargs, dict):
        kwargs = [dict(kwargs or {}) for _ in makers]
    if len(kwargs) != len(makers):
        raise ValueError(
            f"create_env_kwargs must be a dict or a list of {len(makers)} dicts, one per local env"
        )
    return makers + [_RemoteSlot()] * remote, list(kwargs) + [{}] * remote


def _check_network_args(remote: int, bind, keys, insecure: bool, local_transport: str) -> None:
    if not isinstance(remote, int) or isinstance(remote, bool) or remote < 0:
        raise ValueError(f"remote_envs must be a non-negative integer, got {remote!r}")
    if remote and bind is None:
        raise ValueError("remote_envs needs bind='tcp://HOST:PORT' for the workers to reach")
    if local_transport not in ("ipc", "tcp"):
        raise ValueError(f"local_transport must be 'ipc' or 'tcp', got {local_transport!r}")
    if bind is None:
        return
    if keys is None and not insecure:
        raise ValueError(
            f"binding {bind} without CURVE would let anyone who reaches it step your envs: "
            "pass curve_keys=DIR (made by `zmqpool keygen DIR`), or insecure=True to accept that"
        )
    if keys is None:
        log.warning("binding %s WITHOUT encryption or authentication (insecure=True)", bind)


class _Resources:
    """What must be released when the pool goes, even if it is dropped without ``close()``.

    Kept apart from the pool so a ``weakref.finalize`` can release it without
    holding the pool alive.
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.directory = make_private_dir()
        self.processes: dict[bytes, WorkerProcess] = {}
        self.broker: Broker | None = None
        self.launcher: Launcher | None = None
        self.closed = False

    def release(self, grace_s: float | None = None) -> None:
        """Close workers (waiting ``grace_s``, default the config's close timeout), then kill."""
        if self.closed:
            return
        self.closed = True
        if self.broker is not None:
            close = Header(Command.CLOSE).encode()
            for identity in list(self.broker.workers):
                self.broker.route(identity, [close])
        grace_s = self.config.close_timeout_s if grace_s is None else grace_s
        stop_all(list(self.processes.values()), grace_s)
        if self.launcher is not None:
            self.launcher.close()
        if self.broker is not None:
            self.broker.close()
        remove_private_dir(self.directory)


class ZMQAsyncEnvPool(AsyncEnvPool):
    """A drop-in :class:`torchrl.envs.AsyncEnvPool` whose envs run in processes reached over ZeroMQ.

    Args:
        env_makers: a callable returning an env, a list of them, or env
            instances (sent cloudpickled to the worker). Lambdas and closures
            work.
        stack: ``"dense"``, ``"maybe_dense"`` or ``"lazy"`` (heterogeneous envs).
        create_env_kwargs: a dict, or one dict per env.
        envs_per_worker: envs hosted by each worker process.
        worker_affinity: one CPU mask per worker, or a callable ``worker -> mask``.
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
        local_transport: ``"ipc"`` (default) or ``"tcp"`` (loopback) for local workers.
        backend, exchange: accepted for compatibility with code written for
            torchrl's pool; the transport is always ZeroMQ.

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
        backend: str | None = None,
        exchange: str | None = None,
    ) -> None:
        if backend not in (None, "multiprocessing"):
            raise ValueError(f"ZMQAsyncEnvPool runs envs in processes; backend={backend!r}")
        if exchange not in (None, "queue", "shm", "auto"):
            raise ValueError(f"exchange must be 'queue', 'shm' or 'auto', got {exchange!r}")
        if _is_single_maker(env_makers) and isinstance(create_env_kwargs, list):
            # One maker and one kwargs dict per env: torchrl refuses this; it means N envs.
            env_makers = [env_makers] * len(create_env_kwargs)
        if on_env_error not in ("raise", "restart"):
            raise ValueError(f"on_env_error must be 'raise' or 'restart', got {on_env_error!r}")
        _check_network_args(remote_envs, bind, curve_keys, insecure, local_transport)
        self.remote_envs, self.bind = remote_envs, bind
        self.curve_keys, self.local_transport = curve_keys, local_transport
        env_makers, create_env_kwargs = _with_remote_slots(
            env_makers, create_env_kwargs, remote_envs
        )
        self.num_local_envs = len(env_makers) - remote_envs
        self.on_env_error = on_env_error
        self.config = config or PoolConfig()
        #: env indices whose results in the latest recv were synthesized by a restart.
        self.last_restarted_envs: list[int] = []
        self._resources = _Resources(self.config)
        self._finalizer = weakref.finalize(self, _Resources.release, self._resources)
        self._outstanding = dict.fromkeys(Kind, 0)
        self._batch_stats = BatchStats()
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

    # ------------------------------------------------------------ set-up

    def _setup(self) -> tuple[Any, Any]:
        try:
            return self._start()
        except BaseException:
            self._resources.release(grace_s=0.0)  # a failed start owes its workers nothing
            raise

    def _start(self) -> tuple[Any, Any]:
        self._ledger = Ledger(self.num_envs)
        self._broker = self._make_broker()
        self._resources.broker = self._broker
        self._worker_envs = self._plan_workers()
        remote = None
        if self.remote_envs:
            indices = list(range(self.num_local_envs, self.num_envs))
            remote = RemoteSlots(indices, self.config.rejoin_timeout_s)
        self._registrar = Registrar(
            self._ledger, self._worker_envs, remote, same_specs=self.stack == "dense"
        )
        self._broker.admit = self._registrar.admit
        self._launcher = Launcher(self.config.fork_server, self.config.register_timeout_s)
        self._resources.launcher = self._launcher
        for worker_index in range(len(self._worker_envs)):
            self._spawn(worker_index)
        self._await_registration()
        self._supervisor = Supervisor(
            self._broker,
            self._ledger,
            self.config,
            self._worker_envs,
            self._registrar.local_identities,
            self._spawn,
            remote=remote,
            restart_on_env_error=self.on_env_error == "restart",
        )
        self._child_specs = [spec_from_data(self._registrar.specs[i]) for i in range(self.num_envs)]
        self._env_batch_sizes = [torch.Size(spec.shape) for spec in self._child_specs]
        self._assembler = Assembler(
            self.stack, self._stack_func, self._child_specs, self.config.zero_copy_threshold_bytes
        )
        specs: Any = torch.stack(list(self._child_specs))
        # Cloned, as torchrl's threading pool does: a lazy stack of specs (envs whose
        # non-tensor examples differ) shares the children, which torchrl then edits.
        return specs["output_spec"].clone(), specs["input_spec"].clone()

    def _make_broker(self) -> Broker:
        if self.local_transport == "tcp":
            local = Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        else:
            local = ipc_endpoints(self._resources.directory)
        tcp = tcp_endpoints(self.bind) if self.bind else None
        keys = ServerKeys.from_dir(self.curve_keys) if self.curve_keys else None
        return Broker(self._ledger, self.config, local, tcp, keys)

    @property
    def remote_endpoint(self) -> str | None:
        """Where remote workers connect (``--connect``), once bound."""
        return self._broker.tcp.router if self._broker.tcp else None

    def _plan_workers(self) -> list[tuple[int, ...]]:
        per, n = self.envs_per_worker, self.num_local_envs
        return [tuple(range(s, min(s + per, n))) for s in range(0, n, per)]

    def _identity(self, worker_index: int) -> bytes:
        return self._registrar.identity(worker_index)

    def _spawn(self, worker_index: int) -> None:
        indices = self._worker_envs[worker_index]
        payload = pickle_recipes(
            indices,
            [self.env_makers[i] for i in indices],
            [self.create_env_kwargs[i] for i in indices],
        )
        identity = self._identity(worker_index)
        argv = worker_argv(
            self._broker.router_ep,
            identity.decode(),
            indices,
            self.config.heartbeat_interval_s,
            self.config.env_threads,
        )
        affinity = None if self._worker_affinity is None else self._worker_affinity[worker_index]
        process = self._launcher.start(argv, payload, affinity)
        self._resources.processes[identity] = process
        self._broker.watch(identity, process)

    def _await_registration(self) -> None:
        deadline = time.monotonic() + self.config.register_timeout_s
        while len(self._registrar.specs) < self.num_envs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RegistrationError(self._missing_message())
            self._broker.poll(min(remaining, 0.1))
            for event in self._broker.take_events():
                self._on_setup_event(event)

    def _missing_message(self) -> str:
        missing = sorted(set(range(self.num_envs)) - set(self._registrar.specs))
        text = f"envs {missing} did not register within {self.config.register_timeout_s} s"
        remote = [e for e in missing if e >= self.num_local_envs]
        if remote:
            text += (
                f"; remote envs {remote} wait for workers to connect to {self.remote_endpoint} "
                "(python -m workers --connect ... --env package.module:callable)"
            )
        return text

    def _envs_of(self, identity: bytes) -> list[int]:
        """The env indices of one of our local workers."""
        return list(self._worker_envs[self._registrar.local_identities[identity]])

    def _on_setup_event(self, event: Event) -> None:
        if event.kind == "failed":
            detail = event.detail
            if detail.get("kind") == "register":  # built, but its REGISTER could not be sent
                raise RegistrationError(f"env {detail['env']}: {detail['err']}")
            if detail.get("kind") == "version":
                envs = self._envs_of(event.identity)
                raise VersionMismatchError(
                    f"the worker of envs {envs} runs another zmqpool than this trainer "
                    f"({detail['err']}); it imports zmqpool from its working directory or "
                    "sys.path: check both load the same install"
                )
            raise EnvMakerError(detail["env"], str(detail["err"]), str(detail["tb"]))
        if event.kind == "exited":
            # A FAILED message may still be in flight: give it a moment to arrive.
            self._broker.poll(0.5)
            for other in self._broker.take_events():
                if other.kind == "failed":
                    self._on_setup_event(other)
            envs = self._envs_of(event.identity)
            raise RegistrationError(
                f"the worker of envs {envs} exited with status {event.detail['status']} "
                "before registering (see its stderr above)"
            )

    # ------------------------------------------------------------ torchrl hooks

    def _get_child_specs(self) -> list:
        return self._child_specs

    @property
    def env_batch_sizes(self) -> list[torch.Size]:
        return self._env_batch_sizes

    @property
    def resolved_exchange(self) -> str:  # type: ignore[override]
        return "zmq"

    # torchrl's base methods read these counters to refuse overlapping calls.
    @property
    def _current_step(self) -> int:
        return self._outstanding[Kind.STEP]

    @property
    def _current_reset(self) -> int:
        return self._outstanding[Kind.RESET]

    @property
    def _current_step_reset(self) -> int:
        return self._outstanding[Kind.STEP_RESET]

    # ------------------------------------------------------------ sync API

    def step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Step every env; like ``EnvBase.step``, returns ``tensordict`` with ``"next"`` set."""
        self._check_idle(Kind.STEP)
        self._assembler.set_env_index(tensordict, list(range(tensordict.shape[0])))
        self.async_step_send(tensordict)
        replies = self._recv(Kind.STEP, self.num_envs, None, None, None)
        self._apply_edits(tensordict, replies)
        tensordict.set("next", self._assembler.stack_next(replies))
        return tensordict

    def _apply_edits(self, tensordict: TensorDictBase, replies: list[Reply]) -> None:
        """What an env wrote into its input, written into the caller's, as in-process.

        In place, into the caller's tensors: a rollout's root shares them with
        the previous step's ``"next"``, which an in-process env edits too.
        """
        edited = self._assembler.edited_roots(replies)
        if edited is not None:
            tensordict.update(edited.exclude(_ENV_INDEX), inplace=True)

    def step_and_maybe_reset(
        self, tensordict: TensorDictBase
    ) -> tuple[TensorDictBase, TensorDictBase]:
        """Like ``EnvBase.step_and_maybe_reset``: ``tensordict`` with ``"next"``, and the next root.

        torchrl's pool writes ``env_index`` into the caller's tensordict as a
        tensor, which breaks its own ``Collector``; here it stays a
        ``NonTensorStack``, as in every result.
        """
        self._check_idle(Kind.STEP_RESET)
        idx = list(range(tensordict.shape[0]))
        self._assembler.set_env_index(tensordict, idx)
        self.async_step_and_maybe_reset_send(tensordict)
        replies = self._recv(Kind.STEP_RESET, self.num_envs, None, None, None)
        self._apply_edits(tensordict, replies)
        tensordict.set("next", self._assembler.stack_next(replies))
        next_root = self._assembler.stack_roots(replies)
        self._assembler.set_env_index(next_root, idx)
        return tensordict, next_root

    def reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        self._check_open()
        return super().reset(tensordict, **kwargs)

    def _check_idle(self, kind: Kind) -> None:
        self._check_open()
        if self._outstanding[kind] > 0:
            raise RuntimeError("Some envs are still processing a step.")

    # ------------------------------------------------------------ sending

    def _send(
        self,
        command: Command,
        tensordict: TensorDictBase | None,
        env_index: int | list[int] | None,
        make_if_none: bool,
    ) -> None:
        self._check_open()
        self._check_env_index_arg(env_index)
        if isinstance(env_index, Sequence):
            env_index = self._check_indices(list(env_index), tensordict)
        tensordict, env_idx = self._tag_batch(tensordict, env_index, make_if_none)
        if command in _CHECKED_COMMANDS:
            strict = self.config.strict_inputs
            check_step_input(tensordict, env_idx, self.input_spec, self.num_envs, strict)
        per_env = isinstance(env_index, int)
        kind = Kind.STEP_RESET if command == Command.STEP_AND_MAYBE_RESET else None
        kind = kind or (Kind.STEP if command in (Command.STEP, Command.STEP_RAW) else Kind.RESET)
        self._refuse_lost(env_idx)
        if not per_env:
            busy = self._busy.intersection(env_idx)
            if busy:
                raise RuntimeError(
                    f"Some envs are still processing a step: envs that are busy: {sorted(busy)}, "
                    f"queried: {env_idx}."
                )
        # The payload is the input too: a result is rebuilt from what was sent.
        # Every payload is built (and refused if it cannot cross the wire) before any is sent.
        payloads = self._assembler.payloads(tensordict)
        for env, payload in zip(env_idx, payloads, strict=True):
            self._broker.send(env, command, payload, per_env, inputs=payload)
        if kind != Kind.RESET:
            for env in env_idx:
                self._batch_stats.record_action(env)
        if not per_env:
            self._busy.update(env_idx)
            self._outstanding[kind] += len(env_idx)

    def _maybe_make_tensordict(
        self, tensordict: TensorDictBase | None, env_index: Any, make_if_none: bool
    ) -> tuple[TensorDictBase, list[int]]:
        """torchrl's: the batch to send, with ``env_index`` set, and its env indices.

        torchrl's reads one index per element (``view(-1)``), so a pool of
        children with batch dims of their own sees every env repeated; here
        the indices are read along the env dim, and new tensordicts get the
        children's batch size.
        """
        if env_index is None:
            return self._indexed_batch(tensordict)
        if isinstance(env_index, int):
            return self._one_env_batch(tensordict, env_index, make_if_none), [env_index]
        env_index = list(env_index)
        if tensordict is None and make_if_none:
            tensordict = self._empty_batch(env_index)
        if tensordict is None:
            raise TypeError("a tensordict is needed to step envs")
        self._assembler.set_env_index(tensordict, env_index)
        return tensordict, env_index

    def _indexed_batch(self, tensordict: Any) -> tuple[TensorDictBase, list[int]]:
        if tensordict is None:
            raise TypeError("a tensordict with an 'env_index' entry, or env_index=, is needed")
        if _ENV_INDEX not in tensordict:
            raise KeyError(
                "the tensordict has no 'env_index' entry: pass env_index= or set it "
                "(results of this pool carry it)"
            )
        env_idx = _indices_along_env_dim(tensordict.get(_ENV_INDEX))
        if isinstance(env_idx, int):  # one env's own tensordict (NonTensorData index)
            if tensordict.shape != (1, *self.env_batch_sizes[env_idx]):
                tensordict = lazy_stack([tensordict])
            return tensordict, [env_idx]
        return tensordict, env_idx

    def _one_env_batch(self, tensordict: Any, env: int, make_if_none: bool) -> TensorDictBase:
        if tensordict is None and make_if_none:
            tensordict = TensorDict(batch_size=self.env_batch_sizes[env], device=self.device)
        if tensordict is None:
            raise TypeError(f"a tensordict is needed to step env {env}")
        tensordict.set(_ENV_INDEX, NonTensorData(env, batch_size=tensordict.batch_size))
        return lazy_stack([tensordict])  # unbind(0) gives the caller's tensordict back

    def _empty_batch(self, env_index: list[int]) -> TensorDictBase:
        sizes = [self.env_batch_sizes[i] for i in env_index]
        if self.stack == "dense" and len(set(sizes)) <= 1:
            lead = sizes[0] if sizes else torch.Size()
            return TensorDict(batch_size=(len(env_index), *lead), device=self.device)
        return LazyStackedTensorDict(*[TensorDict(batch_size=b, device=self.device) for b in sizes])

    def _tag_batch(
        self, tensordict: TensorDictBase | None, env_index: Any, make_if_none: bool
    ) -> tuple[TensorDictBase, list[int]]:
        """torchrl's ``_maybe_make_tensordict``, then the batch's indices checked against it.

        A plain batch with its env indices (the hot path) is tagged here, at a
        fraction of the cost: its ``env_index`` is the same ``NonTensorStack``.
        """
        if isinstance(env_index, list) and _is_plain_batch(tensordict):
            self._assembler.set_env_index(tensordict, env_index)
            return tensordict, env_index  # both checked by _check_indices already
        tensordict, env_idx = self._maybe_make_tensordict(tensordict, env_index, make_if_none)
        env_idx = self._check_indices(list(env_idx), tensordict)
        return tensordict, env_idx

    def _refuse_lost(self, env_idx: list[int]) -> None:
        for env in env_idx:
            lost = self._ledger.slots[env].lost
            if lost is not None:
                raise lost

    def _check_env_index_arg(self, env_index: Any) -> None:
        if isinstance(env_index, int) and not 0 <= env_index < self.num_envs:
            raise IndexError(f"env_index {env_index} is out of range for {self.num_envs} envs")

    def _check_indices(self, env_idx: list, tensordict: TensorDictBase | None) -> list[int]:
        """Refuse bad indices before anything is sent or written into the caller's tensordict."""
        if any(isinstance(i, bool) or not isinstance(i, (int, torch.Tensor)) for i in env_idx):
            raise TypeError(f"env indices must be integers, got {env_idx}")
        env_idx = [int(i) for i in env_idx]
        bad = [i for i in env_idx if not 0 <= i < self.num_envs]
        if bad:
            raise IndexError(f"env indices {bad} are out of range for {self.num_envs} envs")
        if len(set(env_idx)) != len(env_idx):
            raise ValueError(f"env indices {env_idx} repeat an env")
        if tensordict is not None and tensordict.batch_size[:1] != torch.Size([len(env_idx)]):
            raise ValueError(
                f"the tensordict's batch size {tuple(tensordict.batch_size)} does not match "
                f"the {len(env_idx)} env indices {env_idx}"
            )
        return env_idx

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
        once ``min_get`` are in, the call keeps collecting until the deadline
        or ``max_get`` results, as torchrl documents (deadline batching).
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
        replies = self._recv(kind, min_get, env_index, max_get, timeout)
        ready_at = [(r.env, r.ready_at) for r in replies]
        per_env = env_index is not None
        self._batch_stats.record_batch(ready_at, 1 if per_env else max_get, kind != Kind.RESET)
        if per_env:  # torchrl's per-env channel: the env's own tensordict
            return self._assembler.assemble_one(replies[0])
        return self._assembler.assemble(replies)

    def _recv(
        self,
        kind: Kind,
        min_get: int | None,
        env_index: int | None,
        max_get: int | None,
        timeout: float | None,
    ) -> list[Reply]:
        self._check_open()
        if env_index is not None:
            self._check_env_index_arg(env_index)
            self._check_awaited((kind, env_index))
            return self._note_restarted(self._collect((kind, env_index), 1, 1, None))
        min_get = self.min_get if min_get is None else min_get
        self._check_recv_args(kind, min_get, max_get, timeout)
        replies = self._note_restarted(self._collect((kind, None), min_get, max_get, timeout))
        self._outstanding[kind] -= len(replies)
        self._busy.difference_update(r.env for r in replies)
        return replies

    def _note_restarted(self, replies: list[Reply]) -> list[Reply]:
        self.last_restarted_envs = [r.env for r in replies if r.synthesized]
        return replies

    def _check_awaited(self, channel: Channel) -> None:
        """An env's own channel: refuse a recv that nothing was sent for (it would wait forever)."""
        if self._ledger.count_ready(channel) or self._ledger.in_flight(channel):
            return
        raise RuntimeError(
            f"env {channel[1]} has no {channel[0].value} in flight on its own channel: "
            f"send one with env_index={channel[1]} first"
        )

    def _check_recv_args(self, kind: Kind, min_get: int, max_get: int | None, timeout) -> None:
        if min_get < 1:
            raise ValueError(f"min_get must be positive, got {min_get}.")
        if max_get is not None and max_get < min_get:
            raise ValueError(f"max_get ({max_get}) must be >= min_get ({min_get}).")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be non-negative, got {timeout}.")
        if min_get > self._outstanding[kind]:
            raise RuntimeError(
                f"Cannot await {min_get} {kind.value} when only "
                f"{self._outstanding[kind]} are in flight."
            )

    def _collect(
        self, channel: Channel, min_get: int, max_get: int | None, timeout: float | None
    ) -> list[Reply]:
        """Wait (up to ``timeout``) for ``min_get`` replies, then batch until the deadline.

        Without a ``timeout``, what else is ready now is taken and nothing is
        waited for; with one, the call keeps collecting until the deadline or
        until ``max_get`` replies (or every request of the channel) are in.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = self._pump(0)
        while self._ledger.count_ready(channel) < min_get:
            self._raise_ready_error(channel)
            remaining = self._remaining(deadline)
            if remaining <= 0:
                raise TimeoutError(
                    f"async recv timed out: {self._ledger.count_ready(channel)}/{min_get} results "
                    f"after {timeout}s; they remain available to the next call."
                )
            drained = self._pump(remaining)
        if deadline is not None:
            drained = self._batch_until(channel, max_get, deadline, drained)
        if not drained:  # a pump that read everything just now left nothing to take
            self._pump(0)
        self._raise_ready_error(channel)
        return sorted(self._ledger.take(channel, max_get), key=lambda r: r.env)

    def _batch_until(
        self, channel: Channel, max_get: int | None, deadline: float, drained: bool
    ) -> bool:
        """Deadline batching: pump until ``deadline`` or until there is nothing more to wait for."""
        wanted = self._outstanding[channel[0]] if channel[1] is None else 1
        if max_get is not None:
            wanted = min(wanted, max_get)
        while self._ledger.count_ready(channel) < wanted:
            if self._ledger.first_error(channel) is not None:
                break
            remaining = self._remaining(deadline)
            if remaining <= 0:
                break
            drained = self._pump(remaining)
        return drained

    def _remaining(self, deadline: float | None) -> float:
        if deadline is None:
            return self.config.heartbeat_interval_s
        return min(deadline - time.monotonic(), self.config.heartbeat_interval_s)

    def _pump(self, timeout_s: float) -> bool:
        """Move frames in, then let the supervisor act on deaths, timers and silences.

        Returns whether every socket was read to the end.
        """
        wake = self._supervisor.next_wakeup() - time.monotonic()
        drained = self._broker.poll(max(0.0, min(timeout_s, wake)))
        for event in self._broker.take_events():
            self._supervisor.on_event(event)
        self._supervisor.tick(time.monotonic(), judge=drained)
        return drained

    def _raise_ready_error(self, channel: Channel) -> None:
        reply = self._ledger.first_error(channel)
        if reply is None:
            return
        self._ledger.remove(channel, reply)
        if channel[1] is None:
            self._outstanding[channel[0]] -= 1
            self._busy.discard(reply.env)
        assert reply.error is not None
        raise reply.error

    # ------------------------------------------------------------ seeding, closing

    def _set_seed(self, seed: int | None) -> None:
        """Seed env ``i`` with ``seed + i`` (torchrl's pool raises NotImplementedError)."""
        self._check_open()
        if self._busy:
            raise RuntimeError(f"cannot seed while envs {sorted(self._busy)} are busy")
        for env in range(self.num_envs):
            body = {"seed": None if seed is None else int(seed) + env}
            self._broker.send(env, Command.SEED, None, True, inputs=None, body=body)
        for env in range(self.num_envs):
            self._collect((Kind.RESET, env), 1, 1, self.config.register_timeout_s)

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

    def env_stats(self, *, reset: bool = False) -> dict[int, dict[str, Any]]:
        """Per env: steps, restarts, the last restart's cause, step latency (ms, p50 and p99).

        ``reset=True`` clears the latencies after the snapshot.

        Example:
            >>> pool.env_stats()[0]["restarts"]  # doctest: +SKIP
            0
        """
        result = {slot.index: env_stats(slot) for slot in self._ledger.slots}
        if reset:
            for slot in self._ledger.slots:
                slot.latencies_s.clear()
        return result

    def stats_table(self) -> str:
        """:meth:`env_stats` as a table for people."""
        return stats_table(self.env_stats())

    # ------------------------------------------------------------ processes

    @property
    def fork_server_pid(self) -> int | None:
        """The pid of the fork server that local workers are forked from (None: none running)."""
        return self._launcher.fork_server_pid

    def worker_processes(self) -> dict[int, WorkerProcess]:
        """Each local worker's process (``pid``, ``exit_status()``), by worker index.

        A worker being restarted is absent. Remote workers are not ours to list.
        """
        return self._supervisor.worker_processes()

    def worker_pid(self, env_index: int) -> int | None:
        """The pid of the local process hosting env ``env_index`` now.

        None for a remote env, or while its worker is being restarted.

        Example:
            >>> os.kill(pool.worker_pid(0), signal.SIGKILL)  # doctest: +SKIP
        """
        self._check_env_index_arg(env_index)
        if env_index >= self.num_local_envs:
            return None
        process = self.worker_processes().get(env_index // self.envs_per_worker)
        return None if process is None else process.pid

    def _check_open(self) -> None:
        if self._resources.closed:
            raise PoolClosedError("the pool is closed")

    def shutdown(self) -> None:
        """Stop every worker (bounded by ``config.close_timeout_s``) and remove the sockets."""
        self._resources.release()
        self.is_closed = True

    def __repr__(self) -> str:
        state = "closed" if self._resources.closed else "open"
        return f"{type(self).__name__}(num_envs={self.num_envs}, stack={self.stack!r}, {state})"


def _indices_along_env_dim(value: Any) -> int | list[int]:
    """The env indices in an ``env_index`` entry, one per env (its first dim).

    A scalar (``NonTensorData`` or a 0-d tensor) is one env's own tensordict.
    An entry expanded over a child's batch dims holds its env's index in
    every element: the first one stands for the row.
    """
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            return int(value)
        return value.reshape(value.shape[0], -1)[:, 0].tolist()
    if isinstance(value, NonTensorData):
        return _first(value.data) if value.batch_dims else value.data
    data = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(data, list):
        return data
    return [_first(item) for item in data]


def _first(item: Any) -> Any:
    while isinstance(item, list) and item:
        item = item[0]
    return item
