"""Remote workers launched as Ray actors: ``ZMQAsyncEnvPool(..., remote_workers=RayWorkers(...))``.

Ray places the worker processes on its cluster, restarts them when they die
(``max_restarts``) and ends them when the pool closes; ZeroMQ stays the data
plane. The pool starts the actors once its TCP side is bound. For each actor
the trainer makes a CURVE key pair, authorizes its public key for that
actor's slots only, and hands the pair to the actor through Ray; no key file
is needed on the cluster.

Requires ``pip install 'zmqpool[ray]'`` and a Ray runtime the trainer is
connected to (``ray.init(...)``) before the pool is built.

Example:
    >>> import ray
    >>> from zmqpool import ZMQAsyncEnvPool
    >>> from zmqpool.ray_workers import RayWorkers
    >>> ray.init(num_cpus=2)  # doctest: +SKIP
    >>> pool = ZMQAsyncEnvPool(  # doctest: +SKIP
    ...     [], remote_workers=RayWorkers("zmqpool.testing:CountingEnv", count=2),
    ...     bind="tcp://127.0.0.1:5555",
    ... )
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

log = logging.getLogger("zmqpool")


@dataclasses.dataclass(frozen=True)
class LaunchContext:
    """What the pool gives a launcher once its remote side is bound."""

    endpoint: str  # the bound ROUTER endpoint (tcp://HOST:PORT)
    server_public: bytes  # the pool's CURVE public key (z85)
    slots: list[int]  # the env slots this launcher's workers are to fill
    authorize: Callable[[bytes, list[int]], None]  # admit a public key, for these slots only
    default_dtype: str = "float32"  # torch's, for the envs: the trainer's at construction


@dataclasses.dataclass(frozen=True)
class LostWorker:
    """A launched worker that is dead for good: its slots, and why (for the envs' error)."""

    slots: list[int]  # the env slots it hosted: the pool fails their requests
    reason: str  # names the worker and why it will not come back


class RemoteLauncher(Protocol):
    """What the pool needs of something that starts remote workers (``remote_workers=``).

    :class:`RayWorkers` is one. The pool reads :attr:`num_envs` when it is
    built, calls :meth:`start` once its TCP side is bound, :meth:`poll_failures`
    while it waits for registrations (it must not block), :meth:`failures` for
    its error message if they do not come in time, and :meth:`stop` when it closes.

    Once built, the pool also calls :meth:`poll_lost`, if the launcher has it
    (it is optional: a launcher without it is not asked), at most every
    ``zmqpool.supervisor.LAUNCHER_CHECK_S`` from its pumps; it must not block.
    """

    @property
    def num_envs(self) -> int: ...

    def start(self, ctx: LaunchContext) -> None: ...
    def poll_failures(self) -> list[str]: ...
    def failures(self, wait_s: float = 0.0) -> list[str]: ...
    def stop(self) -> None: ...

    def poll_lost(self) -> list[LostWorker]:
        """Workers newly known to be dead for good (each reported once), without waiting.

        Their envs' requests then fail with
        :class:`~zmqpool.errors.RemoteWorkerDeadError`, not after the pool's
        silence and ``rejoin_timeout_s``. Optional (see the class docstring).
        """
        ...


class RayWorkers:
    """``count`` Ray actors hosting ``envs_per_actor`` envs each; see the module docstring.

    Args:
        env: the env maker's import path, ``package.module:callable`` (installed
            on the cluster's nodes; code never crosses the wire).
        count: how many actors.
        envs_per_actor: envs hosted by each actor (in its one process).
        env_kwargs: keyword arguments for ``env``: one dict, or one per env.
        num_cpus, resources: each actor's Ray resource request.
        placement_strategy: ``"PACK"``, ``"SPREAD"``, ``"STRICT_PACK"`` or
            ``"STRICT_SPREAD"``: the actors go in one placement group of that
            strategy (None: Ray's default scheduling).
        max_restarts: how often Ray restarts a dead actor (-1: always).
        connect_host: the address actors reach the trainer at (default: the
            bound host, or this node's Ray address when bound to ``0.0.0.0``/``*``).
        register_timeout_s: how long an actor waits for the pool before failing.
        env_threads: step an actor's envs each in its own thread.
        inline_cheap_envs: with ``env_threads``, step inline the envs judged cheap
            (``PoolConfig.inline_cheap_envs``).
    """

    def __init__(
        self,
        env: str,
        count: int,
        envs_per_actor: int = 1,
        env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        num_cpus: float = 1,
        resources: dict[str, float] | None = None,
        placement_strategy: str | None = None,
        max_restarts: int = -1,
        connect_host: str | None = None,
        register_timeout_s: float = 60.0,
        env_threads: bool = False,
        inline_cheap_envs: bool = True,
    ) -> None:
        if not isinstance(count, int) or count < 1 or envs_per_actor < 1:
            raise ValueError(f"RayWorkers needs count >= 1 and envs_per_actor >= 1, got {count}")
        if ":" not in env:
            raise ValueError(f"env must be an import path package.module:callable, got {env!r}")
        self.env = env
        self.count = count
        self.envs_per_actor = envs_per_actor
        self.env_kwargs = _kwargs_per_env(env_kwargs, count * envs_per_actor)
        self.options: dict[str, Any] = {"num_cpus": num_cpus, "max_restarts": max_restarts}
        if resources:
            self.options["resources"] = dict(resources)
        self.placement_strategy = placement_strategy
        self.connect_host = connect_host
        self.register_timeout_s = register_timeout_s
        self.env_threads = env_threads
        self.inline_cheap_envs = inline_cheap_envs
        self.actors: list[Any] = []
        self._placement_group: Any = None
        # One status query in flight per actor, for poll_failures (index -> ObjectRef).
        self._status_queries: dict[int, Any] = {}
        self._watch = _DeathWatch()  # poll_lost's

    @property
    def num_envs(self) -> int:
        return self.count * self.envs_per_actor

    def start(self, ctx: LaunchContext) -> None:
        """Start the actors; each gets its own key pair, authorized for its own slots."""
        ray = _ray()
        from workers.ray_actor import EnvActor

        actor_class = ray.remote(EnvActor)
        connect = self._connect_endpoint(ctx.endpoint, ray)
        # Identities of this pool's actors, the same across restarts, unguessable by other
        # keys' holders (workers/supervise.py says why).
        run = os.urandom(8).hex()
        strategies = self._scheduling(ray)
        per = self.envs_per_actor
        for i in range(self.count):
            public, secret = zmq.curve_keypair()
            slots = ctx.slots[i * per : (i + 1) * per]
            ctx.authorize(public, slots)
            options = dict(self.options, **strategies[i])
            handle = actor_class.options(**options).remote(
                connect,
                f"ray-{run}-{i}".encode(),
                (public, secret, ctx.server_public),
                self.env,
                self.env_kwargs[i * per : (i + 1) * per],
                slots,
                self.register_timeout_s,
                self.env_threads,
                self.inline_cheap_envs,
                ctx.default_dtype,
            )
            self.actors.append(handle)
            self._watch.add(handle, slots, f"Ray actor {i} (ray-{run}-{i}, envs {slots})")
        log.info(
            "started %d Ray actors for env slots %s (connecting to %s)",
            self.count,
            ctx.slots,
            connect,
        )

    def _scheduling(self, ray: Any) -> list[dict[str, Any]]:
        if self.placement_strategy is None:
            return [{} for _ in range(self.count)]
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": self.options["num_cpus"], **self.options.get("resources", {})}
        group = ray.util.placement_group([bundle] * self.count, strategy=self.placement_strategy)
        self._placement_group = group
        return [
            {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, i)}
            for i in range(self.count)
        ]

    def _connect_endpoint(self, bound: str, ray: Any) -> str:
        host, port = bound.removeprefix("tcp://").rsplit(":", 1)
        if self.connect_host is not None:
            host = self.connect_host
        elif host in ("0.0.0.0", "*", "[::]"):
            host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{port}"

    def failures(self, wait_s: float = 0.0) -> list[str]:
        """What the actors that could not join say (the address and key they tried)."""
        ray = _ray()
        found = []
        for handle in self.actors:
            try:
                status = ray.get(handle.status.remote(wait_s), timeout=wait_s + 10.0)
            except Exception as err:  # a dead or unplaceable actor: say that
                found.append(_describe(err))
                continue
            if status["failure"]:
                found.append(status["failure"])
        return found

    def poll_failures(self) -> list[str]:
        """What actors have said so far about failing to join, without waiting.

        The pool calls this while it waits for registrations, so that an actor
        that gave up (wrong address, refused key) fails the construction then,
        not at the pool's own deadline. Each actor has one ``status`` query in
        flight; an answered one is read and, while the actor is still trying,
        asked again. An actor that died is not reported here: Ray may restart
        it (``max_restarts``); :meth:`failures` says so at the deadline.
        """
        ray = _ray()
        for i, handle in enumerate(self.actors):
            if i not in self._status_queries:
                self._status_queries[i] = handle.status.remote(0.0)
        answered, _ = ray.wait(
            list(self._status_queries.values()), num_returns=len(self._status_queries), timeout=0
        )
        answered_ids = {ref.hex() for ref in answered}
        found = []
        for i, ref in list(self._status_queries.items()):
            if ref.hex() not in answered_ids:
                continue
            del self._status_queries[i]  # asked again next time, unless done
            try:
                status = ray.get(ref, timeout=0)
            except Exception as err:  # died or restarting: not a verdict yet...
                if getattr(err, "actor_init_failed", False):  # ...unless its env maker failed:
                    found.append(_describe(err))  # Ray does not restart a failed constructor
                else:
                    log.debug("actor %d: status query failed: %s", i, err)
                continue
            if status["failure"]:
                found.append(status["failure"])
        return found

    def poll_lost(self) -> list[LostWorker]:
        """Actors newly known to be dead for good, and Ray's reason; without waiting.

        See :class:`_DeathWatch`. With a finite ``max_restarts``, an actor whose
        process died says so ("max_restarts=N exhausted").
        """
        if not self._watch.watched:
            return []
        lost = self._watch.poll(_ray())
        limit = self.options["max_restarts"]
        if limit >= 0:
            lost = [
                LostWorker(w.slots, f"{w.reason} (max_restarts={limit} exhausted)")
                if "worker process has died" in w.reason
                else w
                for w in lost
            ]
        return lost

    def actor_pids(self, timeout_s: float = 30.0) -> list[int]:
        """The process id of each actor now (a restarted actor has a new one)."""
        ray = _ray()
        return ray.get([handle.pid.remote() for handle in self.actors], timeout=timeout_s)

    def stop(self) -> None:
        """End every actor this launcher started (no restart) and its placement group."""
        if not self.actors and self._placement_group is None:
            return
        import ray

        if not ray.is_initialized():  # Ray shut down first (at exit): it ended the actors
            self.actors = []
            self._status_queries.clear()
            self._watch = _DeathWatch()
            self._placement_group = None
            return
        for handle in self.actors:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as err:  # already gone, or Ray shut down: nothing left to end
                log.debug("could not kill a Ray actor: %s", err)
        self.actors = []
        self._status_queries.clear()
        self._watch = _DeathWatch()
        if self._placement_group is not None:
            try:
                ray.util.remove_placement_group(self._placement_group)
            except Exception as err:
                log.debug("could not remove the placement group: %s", err)
            self._placement_group = None

    def __repr__(self) -> str:
        return f"RayWorkers({self.env!r}, count={self.count}, envs_per_actor={self.envs_per_actor})"


class _DeathWatch:
    """Finds which actors are dead for good, from status queries' answers already in.

    Each watched actor has one ``status`` query in flight; :meth:`poll` looks at
    the answered ones (``ray.wait`` with no timeout) and asks again. A query
    that fails is not a verdict by itself: it may have been in flight when the
    process died, and Ray restarts it (``max_restarts``). Ray queues a query
    sent to an actor it is restarting, and fails at once, with
    ``ActorDiedError``, one sent to an actor it will not restart; so a query
    sent after one failed with ``ActorDiedError``, failing with it too, is the
    verdict. ``ActorUnavailableError`` ("the actor is restarting") never
    counts. A failed constructor (``actor_init_failed``: the env maker raised
    when Ray restarted it) is a verdict at once: Ray does not restart those.
    An answered query clears the actor's first failure.
    """

    def __init__(self) -> None:
        #: Per watched actor (by index): its handle, slots and name.
        self.watched: dict[int, tuple[Any, list[int], str]] = {}
        self._queries: dict[int, Any] = {}  # index -> the ObjectRef in flight
        self._failed_once: set[int] = set()

    def add(self, handle: Any, slots: list[int], name: str) -> None:
        self.watched[len(self.watched)] = (handle, list(slots), name)

    def poll(self, ray: Any) -> list[LostWorker]:
        died = getattr(ray.exceptions, "ActorDiedError", ray.exceptions.RayActorError)
        for i, (handle, _, _) in self.watched.items():
            if i not in self._queries:
                self._queries[i] = handle.status.remote(0.0)
        refs = list(self._queries.values())
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        answered_ids = {ref.hex() for ref in answered}
        lost = []
        for i, ref in list(self._queries.items()):
            if ref.hex() not in answered_ids:
                continue
            del self._queries[i]
            try:
                ray.get(ref, timeout=0)
            except Exception as err:
                _, slots, name = self.watched[i]
                if not isinstance(err, died):  # unavailable for now, restarting: no verdict
                    log.debug("%s: a status query failed, not dead: %s", name, err)
                elif getattr(err, "actor_init_failed", False) or i in self._failed_once:
                    reason = f"{name} is dead for good: {_describe(err)}"
                    log.debug("%s", reason)  # the pool logs it as an error, with its envs
                    del self.watched[i]  # reported once
                    self._failed_once.discard(i)
                    lost.append(LostWorker(slots, reason))
                else:
                    log.debug("%s: a status query failed (restarting?): %s", name, err)
                    self._failed_once.add(i)
                continue
            self._failed_once.discard(i)
        return lost


def _describe(err: BaseException) -> str:
    """One line for a dead actor: Ray's "The actor ... because ..." line (its first
    otherwise), or, for a failed constructor, the env maker's exception (``TypeError: ...``)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    because = [line for line in lines if line.startswith("The actor") and "because" in line]
    text = because[-1] if because else (lines[0] if lines else "")
    text = text.split(" Some common causes include")[0]  # Ray's generic advice
    if getattr(err, "actor_init_failed", False) and lines:
        text = "its env maker raised when Ray (re)started it: " + lines[-1]
    return f"{type(err).__name__}: {text}"


def _kwargs_per_env(kwargs: Any, num_envs: int) -> list[dict[str, Any]]:
    if kwargs is None or isinstance(kwargs, dict):
        return [dict(kwargs or {}) for _ in range(num_envs)]
    kwargs = list(kwargs)
    if len(kwargs) != num_envs or not all(isinstance(k, dict) for k in kwargs):
        raise ValueError(f"env_kwargs must be a dict or a list of {num_envs} dicts, one per env")
    return kwargs


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("RayWorkers needs Ray: pip install 'zmqpool[ray]'") from None
    if not ray.is_initialized():
        raise RuntimeError("RayWorkers: connect to a Ray cluster first (ray.init(...))")
    return ray
