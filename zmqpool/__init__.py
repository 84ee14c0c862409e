"""zmqpool: a drop-in torchrl ``AsyncEnvPool`` whose transport is ZeroMQ.

Example:
    >>> from zmqpool import ZMQAsyncEnvPool
    >>> from zmqpool.testing import CountingEnv
    >>> pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": i} for i in range(2)])
    >>> pool.reset()["observation"][:, 0].tolist()
    [0.0, 1.0]
    >>> pool.close()
"""

from typing import TYPE_CHECKING, Any

from zmqpool.errors import (
    BatchSizeMismatchError,
    CrashLoopError,
    EnvBusyError,
    EnvError,
    EnvLostError,
    EnvMakerError,
    InputError,
    MissingKeyError,
    NothingInFlightError,
    PoolClosedError,
    ProtocolError,
    RecvTimeoutError,
    RegistrationError,
    RemoteWorkerDeadError,
    TooFewInFlightError,
    VersionMismatchError,
    ZMQPoolError,
)

if TYPE_CHECKING:
    from zmqpool.config import PoolConfig
    from zmqpool.forkservers import keep_fork_server
    from zmqpool.pool import ZMQAsyncEnvPool

#: Imported on first use: they pull in torch and torchrl (seconds), which the
#: CLI's --help and keygen do not need.
_LAZY = {
    "PoolConfig": "zmqpool.config",
    "ZMQAsyncEnvPool": "zmqpool.pool",
    "keep_fork_server": "zmqpool.forkservers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zmqpool' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "BatchSizeMismatchError",
    "CrashLoopError",
    "EnvBusyError",
    "EnvError",
    "EnvLostError",
    "EnvMakerError",
    "InputError",
    "MissingKeyError",
    "NothingInFlightError",
    "PoolClosedError",
    "PoolConfig",
    "ProtocolError",
    "RecvTimeoutError",
    "RegistrationError",
    "RemoteWorkerDeadError",
    "TooFewInFlightError",
    "VersionMismatchError",
    "ZMQAsyncEnvPool",
    "ZMQPoolError",
    "__version__",
    "keep_fork_server",
]
