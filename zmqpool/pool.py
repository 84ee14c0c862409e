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

import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn, TypeGuard

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, lazy_stack
from torchrl.envs import AsyncEnvPool, EnvBase

from zmqpool.assembly import Assembler
from zmqpool.config import PoolConfig
from zmqpool.errors import (
    PoolClosedError,
)
from zmqpool.launcher import WorkerProcess
from zmqpool.runtime import PoolPlan, Resources, Runtime
from zmqpool.specs import spec_from_data
from zmqpool.state import Channel, Kind, Reply
from zmqpool.stats import BatchStats, env_stats, stats_table
from zmqpool.validation import check_step_input
from zmqpool.wire import Command

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
        self._resources = Resources(self.config)
        self._finalizer = weakref.finalize(self, Resources.release, self._resources)
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
        self._runtime = Runtime(self._plan(), self._resources)
        spec_data = self._runtime.start()
        self._child_specs = [spec_from_data(data) for data in spec_data]
        self._env_batch_sizes = [torch.Size(spec.shape) for spec in self._child_specs]
        self._assembler = Assembler(
            self.stack, self._stack_func, self._child_specs, self.config.zero_copy_threshold_bytes
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
        )

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
        if self._awaiting(kind) > 0:
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
        self._runtime.refuse_lost(env_idx)
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
            self._runtime.send(env, command, payload, per_env)
        if kind != Kind.RESET:
            for env in env_idx:
                self._batch_stats.record_action(env)
        if not per_env:
            self._busy.update(env_idx)

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
            channel: Channel = (kind, env_index)
            replies = self._runtime.collect(channel, 1, 1, None, self._raise_taken)
            return self._note_restarted(replies)
        min_get = self.min_get if min_get is None else min_get
        self._check_recv_args(kind, min_get, max_get, timeout)
        replies = self._runtime.collect((kind, None), min_get, max_get, timeout, self._raise_taken)
        replies = self._note_restarted(replies)
        self._busy.difference_update(r.env for r in replies)
        return replies

    def _note_restarted(self, replies: list[Reply]) -> list[Reply]:
        self.last_restarted_envs = [r.env for r in replies if r.synthesized]
        return replies

    def _check_awaited(self, channel: Channel) -> None:
        """An env's own channel: refuse a recv that nothing was sent for (it would wait forever)."""
        if self._runtime.awaiting(channel):
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
        if min_get > self._awaiting(kind):
            raise RuntimeError(
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

    def _set_seed(self, seed: int | None) -> None:
        """Seed env ``i`` with ``seed + i`` (torchrl's pool raises NotImplementedError)."""
        self._check_open()
        if self._busy:
            raise RuntimeError(f"cannot seed while envs {sorted(self._busy)} are busy")
        self._runtime.set_seed(seed, self._raise_taken)

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
        ledger = self._runtime.ledger
        result = {slot.index: env_stats(slot) for slot in ledger.slots}
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

        A worker being restarted is absent. Remote workers are not ours to list.
        """
        return self._runtime.worker_processes()

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
