"""A worker as a Ray actor: Ray places, restarts and ends the process; ZeroMQ carries the data.

:class:`EnvActor` is a plain class; :class:`zmqpool.ray_workers.RayWorkers`
makes it a Ray actor (``ray.remote(**options)(EnvActor)``) and starts
``count`` of them, placed by Ray (``placement_strategy``). Its constructor
builds the envs (by import path: no code crosses the wire) and runs an
ordinary :class:`~workers.loop.Worker` in a thread: it registers with the
pool over TCP+CURVE with the key pair the trainer made for it, asking for
the slots reserved for that key, then answers commands.

When Ray restarts a dead actor, it runs the constructor again with the same
arguments: the new process registers under the same identity and key with a
new incarnation, which the pool takes as a rejoin (its requests in flight are
answered by restart truncations).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from workers.hosting import EnvHost, recipe_from_name
from workers.loop import Worker
from zmqpool.errors import RegistrationError
from zmqpool.security import ClientKeys

log = logging.getLogger("workers")


class EnvActor:
    """Hosts ``len(slots)`` envs for a pool at ``connect``; see the module docstring.

    Args:
        connect: the pool's ROUTER endpoint (``tcp://HOST:PORT``).
        identity: this actor's routing identity (the same across Ray's restarts).
        keys: its CURVE pair and the pool's public key (z85 bytes).
        env: ``package.module:callable``; ``env_kwargs``: one dict per slot.
        slots: the pool's env indices reserved for this actor's key.
        register_timeout_s: how long to wait for the pool before failing.
        default_dtype: torch's default dtype for the envs (the trainer's).
    """

    def __init__(
        self,
        connect: str,
        identity: bytes,
        keys: tuple[bytes, bytes, bytes],
        env: str,
        env_kwargs: list[dict[str, Any]],
        slots: list[int],
        register_timeout_s: float,
        env_threads: bool = False,
        inline_cheap: bool = True,
        default_dtype: str = "float32",
    ) -> None:
        self.connect = connect
        self.public = keys[0]
        self.failure: str | None = None
        self.registered = threading.Event()
        recipes = [recipe_from_name(env, kwargs) for kwargs in env_kwargs]
        host = EnvHost.build(list(range(len(slots))), recipes, default_dtype=default_dtype)
        self.worker = Worker(
            connect,
            identity,
            host,
            register_timeout_s=register_timeout_s,
            remote_slots=True,
            keys=ClientKeys(keys[0], keys[1], keys[2]),
            slots=list(slots),
            env_threads=env_threads,
            inline_cheap=inline_cheap,
        )
        self.thread = threading.Thread(target=self._run, name="zmqpool-ray-worker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.register()
            self.registered.set()
            self.worker.serve()
        except RegistrationError as err:
            self.failure = (
                f"could not join the pool at {self.connect} with key "
                f"{self.public.decode('ascii')}: {err}"
            )
            log.error("%s", self.failure)
        except Exception as err:  # the thread's end must be visible to status()
            self.failure = f"worker loop ended: {type(err).__name__}: {err}"
            log.exception("ray worker loop failed")
        finally:
            self.worker.close()

    def pid(self) -> int:
        """This actor's process id (what a test or an operator kills)."""
        return os.getpid()

    def status(self, wait_s: float = 0.0) -> dict[str, Any]:
        """Whether it registered (waiting up to ``wait_s``), and why it failed if it did."""
        deadline = time.monotonic() + wait_s
        while not self.registered.is_set() and self.failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.registered.wait(min(remaining, 0.1))
        return {"registered": self.registered.is_set(), "failure": self.failure, "pid": os.getpid()}

    def stop(self) -> None:
        """Close the connection (the pool closing); the actor is then killed by the launcher."""
        self.worker.close()
