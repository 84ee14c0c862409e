"""Every timing and limit of the pool, in one frozen, checked object.

Tests shrink these instead of sleeping longer; each field carries its unit.
"""

from __future__ import annotations

import dataclasses
import math

from zmqpool.codec import ZERO_COPY_THRESHOLD

_BOOL_FIELDS = (
    "fork_server",
    "share_fork_server",
    "env_threads",
    "inline_cheap_envs",
    "strict_inputs",
    "io_thread_batch_sched",
)

#: Fields whose None means "not set" (documented at each).
_OPTIONAL_FIELDS = (
    "step_timeout_s",
    "remote_step_timeout_s",
    "max_slots_per_key",
    "worker_torch_threads",
)

#: Whole-number fields and their least value.
_INT_FIELDS = {
    "heartbeat_liveness": 1,
    "max_restarts": 0,
    "zero_copy_threshold_bytes": 0,
    "max_remote_frame_bytes": 1,
    "max_remote_spec_bytes": 1,
    "max_slots_per_key": 1,
    "worker_torch_threads": 0,
}

#: Durations that may be 0 (every other one must be > 0); none may be NaN or infinite.
_ZERO_OK_SECONDS = ("close_timeout_s", "restart_backoff_s", "restart_backoff_max_s")


class PoolConfigTypeError(TypeError, ValueError):
    """A :class:`PoolConfig` field of the wrong type.

    A TypeError; also a ValueError, which this error was before it had a type of its own.
    """


def _check_seconds(name: str, value: object) -> None:
    """A duration: a finite real number, > 0 (or >= 0 for those in ``_ZERO_OK_SECONDS``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise PoolConfigTypeError(f"PoolConfig.{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"PoolConfig.{name} must be a finite number of seconds, got {value!r}")
    if name in _ZERO_OK_SECONDS:
        if value < 0:
            raise ValueError(f"PoolConfig.{name} must be >= 0, got {value!r}")
    elif value <= 0:
        raise ValueError(f"PoolConfig.{name} must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Timings and limits of a :class:`~zmqpool.ZMQAsyncEnvPool`.

    Example:
        >>> from zmqpool import PoolConfig
        >>> PoolConfig(step_timeout_s=5.0).step_timeout_s
        5.0
    """

    #: how long construction waits for every env slot to register; also bounds
    #: a restarted worker's registration (one later is killed: a death), a
    #: replacement fork server's start and each env's ``set_seed`` reply.
    register_timeout_s: float = 120.0
    #: how long ``close()`` waits for workers to exit before killing them (a
    #: worker not registered yet, a restart under way, is killed at once;
    #: remote workers, which it cannot kill, get 0.5 s more at most to leave).
    close_timeout_s: float = 3.0
    #: an env step or reset running longer than this is hung (None: never): a
    #: local worker is killed and restarted; a remote worker's slots are
    #: vacated (its token void) and wait ``rejoin_timeout_s`` for a worker. A
    #: worker that steps its envs in turn (without ``env_threads``, or a
    #: remote one) gets this much for each of its requests in flight, counted
    #: from its last reply.
    step_timeout_s: float | None = None
    #: a remote env's ``step_timeout_s`` when that is None: a remote worker that
    #: keeps beating but never answers would otherwise hold its env's requests
    #: (and a sync call on the pool) for ever (None: as local envs, no limit).
    remote_step_timeout_s: float | None = 300.0
    #: how often local workers and the pool's beacon send heartbeats (a remote
    #: worker sends at its own ``--heartbeat-interval``).
    heartbeat_interval_s: float = 1.0
    #: missed heartbeats after which a worker is declared silent.
    heartbeat_liveness: int = 10
    #: restarts of one env within ``restart_window_s``: its next death there
    #: (more than this many deaths) is a crash loop and raises.
    max_restarts: int = 5
    restart_window_s: float = 60.0
    #: first restart delay, doubled for each restart within the window, up
    #: to ``restart_backoff_max_s``.
    restart_backoff_s: float = 0.05
    restart_backoff_max_s: float = 2.0
    #: a remote worker silent past the heartbeat timeout has this long to
    #: rejoin (itself or a replacement) before its envs are reported lost.
    rejoin_timeout_s: float = 60.0
    #: leaves at least this large travel in the pool's commands as a frame of
    #: their own, copied at the send (workers' replies: always 64 KiB, zero-copy).
    zero_copy_threshold_bytes: int = ZERO_COPY_THRESHOLD
    #: the largest frame a remote worker's reply may hold (a result's leaf; a
    #: header may take 1 MiB whatever this says) when the remote slots have no
    #: reference spec to size it from
    #: (a remote-only pool without ``remote_spec``, or a stack other than
    #: ``"dense"``); a worker answers a larger output with its env's error. The
    #: results port itself takes frames of 1/128 of this (at least 256 KiB), and
    #: larger frames come in pieces (``zmqpool.limits.remote_piece_bytes``).
    max_remote_frame_bytes: int = 64 << 20
    #: what a remote worker's specs may cost the trainer once built (a
    #: bounded leaf's low, high and zero at full shape), checked before
    #: anything is built; local envs get ``zmqpool.limits.MAX_SPEC_BYTES``.
    max_remote_spec_bytes: int = 256 << 20
    #: how many remote env slots one worker key may hold (None: any number).
    max_slots_per_key: int | None = None
    #: fork local workers from a process that imported torchrl once (restarts
    #: in milliseconds); False starts each worker as a fresh interpreter.
    fork_server: bool = True
    #: fork them from the fork server this process's pools share (one torch
    #: import for all of them; :func:`zmqpool.keep_fork_server` keeps it between
    #: pools); False gives this pool one of its own, whose death (the OOM
    #: killer) touches no other pool's workers.
    share_fork_server: bool = True
    #: with ``envs_per_worker > 1``: step each of a worker's envs in its own
    #: thread (as torchrl does), so an env that waits does not hold up the
    #: others; False steps them one after another (cheaper for cheap envs), and
    #: a worker then answers the commands of one call in one message.
    env_threads: bool = True
    #: with env threads: step inline (in the worker's main thread) the envs whose
    #: steps are short and never wait, judged by timing a few of their steps
    #: (``workers.inline``): a thread only slows such a step down. False keeps every
    #: env in its thread, for envs that wait for another env of their worker.
    inline_cheap_envs: bool = True
    #: refuse a step input whose actions (or state entries) have another dtype
    #: or shape than the spec, at the send. Off by default, as in torchrl: the
    #: env gets the caller's tensors as they are (envs cast, or broadcast).
    strict_inputs: bool = False
    #: run the trainer's ZeroMQ I/O threads under ``SCHED_BATCH`` (Linux; elsewhere
    #: nothing changes). Woken by each send, a normal I/O thread preempts the
    #: trainer's thread in the middle of a batch of sends; a batch-scheduled one
    #: waits its turn and then writes the whole batch, with fewer context
    #: switches (measured in docs/PERFORMANCE.md). False: the OS's default.
    io_thread_batch_sched: bool = True
    #: torch intra-op threads in each local worker (``torch.set_num_threads``):
    #: None leaves it to the worker (``ZMQPOOL_WORKER_THREADS``, else 1, as
    #: ParallelEnv's ``num_sub_threads``); 0 keeps torch's default (one per core).
    worker_torch_threads: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in _OPTIONAL_FIELDS:
                continue
            if field.name in _BOOL_FIELDS:
                if not isinstance(value, bool):
                    raise PoolConfigTypeError(
                        f"PoolConfig.{field.name} must be a bool, got {value!r}"
                    )
            elif field.name in _INT_FIELDS:
                if not isinstance(value, int) or isinstance(value, bool):
                    raise PoolConfigTypeError(
                        f"PoolConfig.{field.name} must be an int, got {value!r}"
                    )
                if value < _INT_FIELDS[field.name]:
                    raise ValueError(
                        f"PoolConfig.{field.name} must be >= {_INT_FIELDS[field.name]}, "
                        f"got {value!r}"
                    )
            else:
                _check_seconds(field.name, value)
        if self.restart_backoff_s > self.restart_backoff_max_s:
            raise ValueError(
                f"PoolConfig.restart_backoff_s ({self.restart_backoff_s!r}) must not exceed "
                f"PoolConfig.restart_backoff_max_s ({self.restart_backoff_max_s!r})"
            )

    @property
    def heartbeat_timeout_s(self) -> float:
        """Silence after which a worker is declared dead."""
        return self.heartbeat_interval_s * self.heartbeat_liveness
