"""zmqpool: a drop-in torchrl ``AsyncEnvPool`` whose transport is ZeroMQ.

Example:
    >>> from zmqpool import ZMQAsyncEnvPool
    >>> from zmqpool.testing import CountingEnv
    >>> pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": i} for i in range(2)])
    >>> pool.reset()["observation"][:, 0].tolist()
    [0.0, 1.0]
    >>> pool.close()
"""

from zmqpool.config import PoolConfig
from zmqpool.errors import (
    CrashLoopError,
    EnvError,
    EnvLostError,
    EnvMakerError,
    PoolClosedError,
    ProtocolError,
    RegistrationError,
    VersionMismatchError,
    ZMQPoolError,
)
from zmqpool.pool import ZMQAsyncEnvPool

__version__ = "0.1.0"

__all__ = [
    "CrashLoopError",
    "EnvError",
    "EnvLostError",
    "EnvMakerError",
    "PoolClosedError",
    "PoolConfig",
    "ProtocolError",
    "RegistrationError",
    "VersionMismatchError",
    "ZMQAsyncEnvPool",
    "ZMQPoolError",
    "__version__",
]
