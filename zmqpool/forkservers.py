"""One fork server for the pools of a process, and a way to keep it between pools.

A fork server (:class:`~zmqpool.launcher.ForkServer`) costs what a fresh
interpreter costs: seconds of CPU importing torch and torchrl, and a few
hundred MB. Pools made in one process (a training pool and an evaluation
pool, or pools made one after another) fork their workers from one
(:data:`SHARED`, the default; ``PoolConfig(share_fork_server=False)`` gives a
pool its own). It starts with the first pool that needs a local worker and
ends with the last one's ``close()``, unless :func:`keep_fork_server` keeps
it: then the next pool forks its workers at once instead of importing torch
again.

What sharing costs: the workers of every pool are the zygote's children, so
if it dies (the OOM killer) every pool restarts its local workers from a new
one, each request in flight answered by a truncation, and each pool warns
once, as it would for a fork server of its own.

Each request to the zygote carries the trainer's environment variables and
working directory as they are then, so a worker forked from a zygote started
earlier sees what one forked from a new zygote would.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

from zmqpool import launcher
from zmqpool.launcher import ForkServer

log = logging.getLogger("zmqpool")

OnDeath = Callable[[ForkServer], None]


class SharedForkServers:
    """The process's fork server, lent to launchers (:class:`~zmqpool.launcher.ForkServers`).

    A server is closed once nobody holds it: no launcher, and no
    :func:`keep_fork_server` for the current one. A launcher learns of its
    death itself, through ``alive()``, in its own thread, so no callback
    reaches into another pool's launcher from this one's. A dead one is never lent
    again; the next :meth:`acquire` starts a new one, so the launchers that
    replace it after its death all get the same replacement.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # In a forked child: the parent's zygote is the parent's (its pipes and
        # its pid to die with), so the child starts from nothing.
        self._current: ForkServer | None = None
        self._holders: dict[ForkServer, int] = {}  # how many launchers hold each
        self._keepers = 0

    def acquire(self, on_death: OnDeath) -> ForkServer:
        """The live fork server, held once more. ``on_death`` is not called: see the class."""
        with launcher.FORK_LOCK:
            server = self._live()
            self._holders[server] += 1
            return server

    def release(self, server: ForkServer, on_death: OnDeath) -> None:
        """Held once less; closed if nobody holds it now."""
        with launcher.FORK_LOCK:
            if self._holders.get(server):
                self._holders[server] -= 1  # a launcher releases what it holds once
            self._close_if_unheld(server)

    def keep(self) -> None:
        """Hold the fork server (starting it now) until :meth:`unkeep`."""
        with launcher.FORK_LOCK:
            self._keepers += 1
            try:
                self._live()
            except OSError as err:  # the pools will try again, and say so
                log.warning("could not start a fork server to keep: %s", err)

    def unkeep(self) -> None:
        with launcher.FORK_LOCK:
            self._keepers -= 1
            if self._current is not None:
                self._close_if_unheld(self._current)

    def _live(self) -> ForkServer:
        """The current fork server, started if there is none or it died."""
        current = self._current
        if current is not None and current.exited():
            self._current = None
            self._close_if_unheld(current)  # its holders release it as they learn of its death
        if self._current is None:
            self._current = ForkServer(on_death=self._on_death)
            self._holders[self._current] = 0
        return self._current

    def _on_death(self, server: ForkServer) -> None:
        """Lend it no more. Each launcher holding it learns of the death itself (``alive()``),
        in its own thread, and releases it for the replacement the next acquire starts."""
        if server is self._current:
            self._current = None
        self._close_if_unheld(server)

    def _close_if_unheld(self, server: ForkServer) -> None:
        if self._holders.get(server) or (server is self._current and self._keepers):
            return
        self._holders.pop(server, None)
        if server is self._current:
            self._current = None
        server.close()


#: The fork server of this process's pools (``PoolConfig(share_fork_server=True)``).
SHARED = SharedForkServers()


@contextlib.contextmanager
def keep_fork_server() -> Iterator[None]:
    """Keep the pools' shared fork server alive inside the block, even with no pool open.

    It starts now (importing torch in the background while the block goes
    on), and each pool made inside forks its workers from it in milliseconds
    instead of paying for a new one's imports. It ends at the end of the
    block, or with the last pool still open after it.

    Example:
        >>> from zmqpool import ZMQAsyncEnvPool, keep_fork_server
        >>> from zmqpool.testing import CountingEnv
        >>> with keep_fork_server():
        ...     for _ in range(2):  # the second pool forks from the first's fork server
        ...         pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{}])
        ...         _ = pool.reset()
        ...         pool.close()
    """
    SHARED.keep()
    try:
        yield
    finally:
        SHARED.unkeep()
