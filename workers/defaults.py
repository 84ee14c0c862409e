"""Defaults a worker's command line shows in ``--help``, in a module that imports nothing.

``python -m workers --help`` and its argument errors answer before torch is
imported (seconds): :mod:`workers.cli` parses with these alone, and imports
what hosts envs (:mod:`workers.serving`) only once the arguments are read.
"""

#: How long a worker waits for its pool's WELCOME (sending REGISTER again with
#: backoff) before it gives up: the default of :class:`~workers.loop.Worker` and of
#: ``python -m workers``'s local workers, and as long as a pool waits for its envs by
#: default (``PoolConfig.register_timeout_s``). A remote worker started with ``--env``
#: waits forever unless given ``--register-timeout``. Every other timing the
#: worker shares with its pool comes in the WELCOME (:class:`~zmqpool.protocol.Welcome`).
REGISTER_TIMEOUT_S = 120.0

#: Environment variable: torch threads per worker process (0: torch's default).
WORKER_THREADS_VAR = "ZMQPOOL_WORKER_THREADS"

#: What ``torch.set_default_dtype`` takes: a worker's ``--default-dtype`` choices.
DEFAULT_DTYPES = ("float16", "bfloat16", "float32", "float64")
