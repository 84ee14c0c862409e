"""The roster: who hosts which env, and where each worker and each env is in its life.

The one owner of worker and env records: its methods are the only code that
changes them. Everything else reads them, or asks the roster to move a record
on. Plain objects with a clock, no sockets.

A worker's life (:class:`WorkerPhase`)::

    local   STARTING ──registers──▶ LIVE ──the pool kills it──▶ KILLING
               ▲                     │ exits                      │ exits
               └──── respawn ── RESPAWN_DUE ◀─────────────────────┘
                                     │ a crash loop
                                     ▼
                                    LOST

    remote  LIVE ──silent──▶ VACANT ──registers again──▶ LIVE
                                │ rejoin_timeout_s passes
                                ▼
                               LOST (its slots are free for any worker)

An env's life (:class:`EnvPhase`): ``NEW`` until its first worker registers,
then ``LIVE``. When its worker goes, ``WAITING``: its requests wait in the
ledger. When a worker registers for it again, its env was rebuilt: ``FRESH``
(its next step is sent as a reset, answered as a truncation; an env that
``set_seed`` seeded is seeded first, with :func:`restart_seed`), then ``LIVE``
again. ``LOST`` when the pool gives up on it (a crash loop, no rejoin): its
requests fail until a worker takes the slot again.

Remote workers register with a stable identity and a fresh *incarnation* id
per process: a new identity takes free remote slots (never filled, or left
by a worker that went silent); a known identity gets its own slots back;
the same incarnation again is a duplicate REGISTER, answered without
disturbing the roster (the WELCOME again; and a remote worker's requests in
flight, if its last WELCOME could not be routed). A remote worker that
registers again while its process lives does so as a new incarnation.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from zmqpool.codec import Decoder, Encoder
from zmqpool.conformity import ReplyCheck
from zmqpool.errors import NoRoomError, RegistrationError
from zmqpool.launcher import WorkerProcess


class WorkerPhase(enum.Enum):
    STARTING = "starting"  # a local process spawned, not registered yet
    LIVE = "live"  # registered: its envs' requests go to it
    KILLING = "killing"  # the pool killed it (hung, silent, an env raised); its exit is due
    RESPAWN_DUE = "respawn due"  # dead; a new process starts at ``respawn_at``
    VACANT = "vacant"  # a remote worker went silent; its slots wait for a rejoin
    LOST = "lost"  # given up: a crash loop, or no rejoin in time


class EnvPhase(enum.Enum):
    NEW = "new"  # no worker has registered for it yet
    LIVE = "live"
    FRESH = "fresh"  # rebuilt by a restart: its next step is sent as a reset
    WAITING = "waiting"  # its worker is gone; its requests wait for the next one
    LOST = "lost"  # its requests fail with ``EnvRecord.lost``


@dataclasses.dataclass(eq=False)
class Link:
    """A registered worker connection: what its REGISTER was answered with."""

    identity: bytes
    token: bytes  # every result it sends must carry it
    pid: int
    incarnation: bytes
    decoder: Decoder
    encoder: Encoder
    envs: tuple[int, ...]
    remote: bool  # on the remote (TCP) side of the broker
    key: str | None = None  # the CURVE public key (z85) it authenticated with, remote only
    batches: bool = False  # it asked for a call's commands in one message (REGISTER)


@dataclasses.dataclass(eq=False)
class WorkerRecord:
    identity: bytes
    envs: tuple[int, ...]
    local_index: int | None  # None: a remote worker
    phase: WorkerPhase
    key: str | None = None  # a remote worker's CURVE public key (z85): what it is known by
    process: WorkerProcess | None = None  # local, while its process is watched
    link: Link | None = None  # while LIVE or KILLING
    kill_cause: str = ""  # why the pool killed it (KILLING)
    kill_traceback: str = ""
    maker_traceback: str = ""  # a FAILED report from its last start
    respawn_at: float = float("inf")  # RESPAWN_DUE
    started_at: float = 0.0  # STARTING: when its process was spawned (time.monotonic())

    @property
    def remote(self) -> bool:
        return self.local_index is None


@dataclasses.dataclass(eq=False)
class EnvRecord:
    index: int
    phase: EnvPhase = EnvPhase.NEW
    holder: WorkerRecord | None = None  # whose slot it is (a vacant remote holder included)
    link: Link | None = None  # where its requests go now (LIVE, FRESH)
    spec_data: Any = None  # its registered specs, as plain data
    spec: Any = None  # the same, decoded (once, at registration)
    layout: Any = None  # the layout of its spec's zero (what bounds its worker's frames)
    check: Any = None  # its replies' layouts held to its spec (a conformity.ReplyCheck)
    set_state: bool = False  # it honours a reset's state (its worker's REGISTER says)
    seed: int | None = None  # what set_seed gave it (its SEED answered), across rebuilds
    reseed: int | None = None  # rebuilt since: the seed its first reset sets first
    restarts: int = 0
    last_restart_cause: str | None = None
    lost: Exception | None = None  # LOST: what every request raises
    vacant_since: float | None = None  # a remote env whose worker went silent


@dataclasses.dataclass(frozen=True)
class Claim:
    """The remote slots a REGISTER would get."""

    envs: list[int]
    rejoin: bool  # the envs were hosted before: requests in flight get truncations
    duplicate: bool  # the same process registering again


class Roster:
    """Worker and env records of one pool; see the module docstring.

    Args:
        num_envs: every env slot, local and remote.
        worker_envs: the env indices of each local worker, by worker index.
        remote_indices: the slots remote workers fill.
    """

    def __init__(
        self, num_envs: int, worker_envs: Sequence[tuple[int, ...]], remote_indices: Sequence[int]
    ) -> None:
        self.envs = [EnvRecord(i) for i in range(num_envs)]
        self.remote_indices = list(remote_indices)
        secret = os.urandom(6).hex()  # a remote peer cannot guess a local identity
        self.local = [
            WorkerRecord(f"w{i}.{secret}".encode(), tuple(envs), i, WorkerPhase.STARTING)
            for i, envs in enumerate(worker_envs)
        ]
        self._workers = {record.identity: record for record in self.local}
        self._by_pidfd: dict[int, WorkerRecord] = {}
        self._reserved: dict[int, str] = {}  # remote slot -> the only key that may take it
        #: Whether a worker has asked for batched commands (never reset): until
        #: one has, a call's commands go one by one, without an outbox.
        self.batching = False
        #: The envs given up on (see :meth:`lose`) and not taken up again since.
        self.lost: set[int] = set()
        # The local workers made RESPAWN_DUE (and maybe respawned since), by worker index,
        # and the remote envs made vacant (and maybe filled since): what due(), next_respawn()
        # and expired(), which run at every pump, look at instead of every worker or slot.
        self._respawns: dict[int, WorkerRecord] = {}
        self._vacant: dict[int, EnvRecord] = {}
        # The local workers spawned (and maybe registered since), by worker index:
        # what overdue() and next_register_deadline() look at.
        self._starting: dict[int, WorkerRecord] = {}

    # ------------------------------------------------------------ lookups

    def worker(self, identity: bytes) -> WorkerRecord | None:
        return self._workers.get(identity)

    def by_pidfd(self, pidfd: int) -> WorkerRecord | None:
        return self._by_pidfd.get(pidfd)

    def workers(self) -> Iterator[WorkerRecord]:
        return iter(list(self._workers.values()))

    def linked(self) -> list[Link]:
        """Every registered connection (LIVE or KILLING workers)."""
        return [w.link for w in self._workers.values() if w.link is not None]

    def processes(self) -> list[WorkerProcess]:
        return [w.process for w in self.local if w.process is not None]

    def registered(self) -> int:
        """How many envs have registered specs."""
        return sum(env.spec_data is not None for env in self.envs)

    def all_set_state(self) -> bool:
        """Whether every env honours a reset's state, as its worker last registered it."""
        return all(env.set_state for env in self.envs)

    # ------------------------------------------------------------ local processes

    def spawned(self, record: WorkerRecord, process: WorkerProcess, now: float) -> None:
        record.phase, record.process = WorkerPhase.STARTING, process
        record.respawn_at, record.started_at = float("inf"), now
        self._by_pidfd[process.pidfd] = record
        assert record.local_index is not None, "only local workers are spawned"
        self._starting[record.local_index] = record

    def killing(self, record: WorkerRecord, cause: str, traceback: str) -> None:
        record.phase = WorkerPhase.KILLING
        record.kill_cause, record.kill_traceback = cause, traceback

    def failed_to_start(self, record: WorkerRecord, traceback: str) -> None:
        record.maker_traceback = traceback

    def exited(self, record: WorkerRecord, cause: str) -> tuple[str, str]:
        """Its process is gone: its envs wait. Returns the cause (the pool's if it killed
        it, else ``cause``) and the last traceback known."""
        # Keyed by the pidfd it was watched under (a released process no longer has one).
        self._by_pidfd = {fd: r for fd, r in self._by_pidfd.items() if r is not record}
        record.process = None
        if record.phase is WorkerPhase.KILLING:
            cause, traceback = record.kill_cause, record.kill_traceback
        else:
            traceback = ""
        traceback = traceback or record.maker_traceback
        record.kill_cause = record.kill_traceback = record.maker_traceback = ""
        self._unlink(record, cause)
        return cause, traceback

    def respawn_due(self, record: WorkerRecord, at: float) -> None:
        record.phase, record.respawn_at = WorkerPhase.RESPAWN_DUE, at
        assert record.local_index is not None, "only local workers are respawned"
        self._respawns[record.local_index] = record

    def due(self, now: float) -> list[WorkerRecord]:
        """The local workers whose respawn is due at ``now``, by worker index."""
        if not self._respawns:  # the usual pump: nothing to look at
            return []
        self._forget_respawned()
        return [
            self._respawns[i] for i in sorted(self._respawns) if self._respawns[i].respawn_at <= now
        ]

    def next_respawn(self) -> float:
        """When the next respawn is due (``inf``: none is)."""
        if not self._respawns:
            return float("inf")
        self._forget_respawned()
        return min((w.respawn_at for w in self._respawns.values()), default=float("inf"))

    def overdue(self, now: float, timeout_s: float) -> list[WorkerRecord]:
        """The local workers spawned more than ``timeout_s`` before ``now`` and not registered."""
        if not self._starting:  # the usual pump: nobody is starting
            return []
        self._forget_started()
        return [
            self._starting[i]
            for i in sorted(self._starting)
            if now - self._starting[i].started_at > timeout_s
        ]

    def next_register_deadline(self, timeout_s: float) -> float:
        """When the next starting worker is overdue (``inf``: none is starting)."""
        if not self._starting:
            return float("inf")
        self._forget_started()
        return min((w.started_at for w in self._starting.values()), default=float("inf")) + (
            timeout_s
        )

    def _forget_started(self) -> None:
        for index, record in list(self._starting.items()):
            if record.phase is not WorkerPhase.STARTING or record.process is None:
                del self._starting[index]

    def _forget_respawned(self) -> None:
        for index, record in list(self._respawns.items()):
            if record.phase is not WorkerPhase.RESPAWN_DUE:
                del self._respawns[index]

    # ------------------------------------------------------------ registration

    def go_live(
        self,
        record: WorkerRecord,
        link: Link,
        specs: Sequence[tuple[Any, Any, Any]],
        set_state: Sequence[bool] | None = None,
    ) -> bool:
        """``record`` registered with ``link`` for its envs, whose (data, decoded, layout) specs
        are given, and whether each honours a reset's state (None: none does).

        Returns whether it is a rejoin: its envs were hosted before and are
        now rebuilt (their requests in flight are sent again, steps as resets).
        """
        record.phase, record.link = WorkerPhase.LIVE, link
        self.batching |= link.batches
        rejoin = False
        honours = [False] * len(record.envs) if set_state is None else set_state
        for index, (data, spec, layout), state in zip(record.envs, specs, honours, strict=True):
            env = self.envs[index]
            env.set_state = state
            rejoin |= env.phase is not EnvPhase.NEW
            if env.phase is not EnvPhase.NEW:  # rebuilt: unseeded, as every new env is
                env.reseed = None if env.seed is None else restart_seed(env.seed, env.restarts)
            env.phase = EnvPhase.FRESH if env.phase is not EnvPhase.NEW else EnvPhase.LIVE
            env.holder, env.link, env.lost, env.vacant_since = record, link, None, None
            self.lost.discard(index)
            if env.spec_data != data or env.check is None:
                env.check = ReplyCheck(spec)
            env.spec_data, env.spec, env.layout = data, spec, layout
        return rejoin

    def plan_remote(
        self,
        identity: bytes,
        key: str | None,
        incarnation: bytes,
        count: int,
        wanted: list[int] | None,
        max_per_key: int | None = None,
    ) -> Claim:
        """Which remote slots a REGISTER would get (changes nothing; :meth:`take_remote` commits).

        ``key``: the CURVE key it authenticated with. An identity belongs to
        the key it first registered with; a vacant slot goes back to its
        holder's key first. ``wanted``: the slots the worker asks for
        (``--slots``); granted only if all are free. ``max_per_key``: how
        many slots one key may hold.
        """
        known = self._workers.get(identity)
        if known is not None and known.remote:
            if known.key != key:
                raise RegistrationError(f"identity {identity!r} is held by another key")
            return self._replan(known, incarnation, count)
        free = [i for i in self.remote_indices if self._is_free(i) and self._may_take(i, key)]
        # Slots its own key left vacant first: a host that restarted under a new identity.
        free.sort(key=lambda i: not self._vacated_by(i, key))
        if wanted is not None:
            if len(wanted) != count or not set(wanted) <= set(self.remote_indices):
                raise RegistrationError(
                    f"slots {wanted} asked for are not {count} of the pool's remote slots "
                    f"{self.remote_indices}"
                )
            if not set(wanted) <= set(free):  # held: maybe by its own host's old worker
                raise NoRoomError(f"no room: slots {wanted} asked for are not free (free: {free})")
            free = list(wanted)
        if count < 1 or len(free) < count:
            raise NoRoomError(
                f"no room: asked for {count} env slots, {len(free)} of the pool's "
                f"{len(self.remote_indices)} remote slots are free"
            )
        taken = free[:count]
        self._check_quota(key, taken, max_per_key)
        hosted = any(self.envs[i].phase is not EnvPhase.NEW for i in taken)
        return Claim(taken, rejoin=hosted, duplicate=False)

    def reserve(self, key: str, slots: Sequence[int]) -> None:
        """Only ``key`` may take ``slots``, and ``key`` may take no other slot (a launcher's)."""
        for index in slots:
            if index not in self.remote_indices:
                raise ValueError(f"env {index} is not a remote slot")
            self._reserved[index] = key

    def _may_take(self, index: int, key: str | None) -> bool:
        owner = self._reserved.get(index)
        if owner is not None:
            return owner == key
        return key is None or key not in self._reserved.values()

    def _check_quota(self, key: str | None, taken: list[int], max_per_key: int | None) -> None:
        """``key`` may hold ``taken`` besides its slots, less those ``taken`` takes over.

        A replacement host (a new identity) takes the slots its key's worker set
        aside left, which its key held already: they count once. Over the quota
        while a live worker of the key holds as many slots (the host it replaces,
        not found silent yet), it is no room, which admission lets it wait out.
        """
        if max_per_key is None or key is None:
            return
        mine = [i for w in self._workers.values() if w.remote and w.key == key for i in w.envs]
        held = len(set(mine) - set(taken))
        if held + len(taken) <= max_per_key:
            return
        message = (
            f"key {key[:8]}... holds {len(mine)} env slots and asks for {len(taken)}: "
            f"over the {max_per_key} a key may hold (PoolConfig.max_slots_per_key)"
        )
        if self.held_live(key, len(taken)):
            raise NoRoomError(message)
        raise RegistrationError(message)

    def _vacated_by(self, index: int, key: str | None) -> bool:
        holder = self.envs[index].holder
        return holder is not None and key is not None and holder.key == key

    def held_live(self, key: str | None, count: int) -> bool:
        """Whether a live remote worker of ``key`` holds ``count`` env slots.

        A new worker of that key asking for as many, with no slot free, is most
        likely its replacement (the host restarted while the pool was not
        listening, so the old one is not yet known to be gone).
        """
        return key is not None and any(
            w.phase is WorkerPhase.LIVE and len(w.envs) == count for w in self.keyed(key)
        )

    def held_by_live(self, key: str | None, count: int) -> bool:
        """Whether ``count`` slots ``key`` may take are free or held by live remote workers.

        A new worker asking for them, with too few free, may replace one of
        those workers, on another host or under another key: its host died and
        is not found silent yet. (A replacement that started in a second was
        refused, and the env was lost while it ran.)
        """
        takeable = [
            i
            for i in self.remote_indices
            if self._may_take(i, key) and (self._is_free(i) or self._held_by_live_remote(i))
        ]
        return len(takeable) >= count

    def _held_by_live_remote(self, index: int) -> bool:
        holder = self.envs[index].holder
        return holder is not None and holder.remote and holder.phase is WorkerPhase.LIVE

    def keyed(self, key: str) -> list[WorkerRecord]:
        """The remote workers known by ``key``."""
        return [w for w in self._workers.values() if w.remote and w.key == key]

    def _is_free(self, index: int) -> bool:
        holder = self.envs[index].holder
        return holder is None or holder.phase in (WorkerPhase.VACANT, WorkerPhase.LOST)

    def _replan(self, known: WorkerRecord, incarnation: bytes, count: int) -> Claim:
        if count != len(known.envs):
            raise RegistrationError(
                f"worker {known.identity!r} held {len(known.envs)} env slots and now offers {count}"
            )
        same = known.link is not None and known.link.incarnation == incarnation
        duplicate = same and known.phase is WorkerPhase.LIVE
        return Claim(list(known.envs), rejoin=not duplicate, duplicate=duplicate)

    def take_remote(
        self, identity: bytes, key: str | None, claim: Claim, cause: str
    ) -> WorkerRecord:
        """Commit a claim: ``identity`` (known by ``key``) holds ``claim.envs``."""
        record = self._workers.get(identity)
        if record is None:
            record = WorkerRecord(identity, tuple(claim.envs), None, WorkerPhase.STARTING, key)
            self._workers[identity] = record
        for index in claim.envs:
            previous = self.envs[index].holder
            if previous is not None and previous is not record:
                self._release(previous)
        if record.link is not None:  # it came back as a new process before its silence was seen
            self._unlink(record, cause)
        return record

    def _release(self, record: WorkerRecord) -> None:
        """A vacant remote worker's slots went to another: it holds nothing any more."""
        for index in record.envs:
            if self.envs[index].holder is record:
                self.envs[index].holder = None
        self._workers.pop(record.identity, None)

    # ------------------------------------------------------------ losing workers and envs

    def vacate(self, record: WorkerRecord, now: float, cause: str) -> None:
        """A remote worker went silent: its slots wait ``rejoin_timeout_s`` for it or another."""
        self._unlink(record, cause)
        record.phase = WorkerPhase.VACANT
        for index in record.envs:
            self.envs[index].vacant_since = now
            if index in self.remote_indices:  # what expired() reports: remote slots only
                self._vacant[index] = self.envs[index]

    def expired(self, now: float, timeout_s: float) -> list[int]:
        """Remote envs vacant longer than ``timeout_s`` (each reported once)."""
        if not self._vacant:  # the usual pump: no remote slot is vacant
            return []
        late = []
        for index in sorted(self._vacant):  # in slot order, as every remote slot was looked at
            env = self._vacant[index]
            if env.vacant_since is None:  # filled again since
                del self._vacant[index]
                continue
            if now - env.vacant_since > timeout_s:
                del self._vacant[index]
                env.vacant_since = None
                late.append(env.index)
                if env.holder is not None and env.holder.phase is WorkerPhase.VACANT:
                    env.holder.phase = WorkerPhase.LOST
        return late

    def lose(self, envs: Sequence[int], error: Exception) -> None:
        """Give up on ``envs``: every request on them raises ``error``."""
        for index in envs:
            env = self.envs[index]
            env.phase, env.lost, env.link = EnvPhase.LOST, error, None
            env.vacant_since = None  # a vacancy lost before it expired: not reported again
            self._vacant.pop(index, None)
            self.lost.add(index)
            if env.holder is not None and env.holder.local_index is not None:
                env.holder.phase = WorkerPhase.LOST

    def note_cause(self, record: WorkerRecord, cause: str) -> None:
        """What now stands in the way of ``record``'s envs (``env_stats``' last restart cause)."""
        for index in record.envs:
            self.envs[index].last_restart_cause = cause

    def _unlink(self, record: WorkerRecord, cause: str) -> None:
        """``record``'s connection is gone: its envs wait (restart counted, with its cause)."""
        record.link = None
        for index in record.envs:
            env = self.envs[index]
            if env.holder is not record:
                continue
            env.restarts += 1
            env.last_restart_cause = cause
            env.link = None
            if env.phase is not EnvPhase.LOST:
                env.phase = EnvPhase.WAITING

    # ------------------------------------------------------------ sending

    def owe_truncation(self, index: int) -> None:
        """Env ``index``'s restart truncation never reached the caller: it is owed again.

        Its next step goes as a reset and is answered as a truncation, as a
        rebuilt env's first step is (``FRESH``). An env that is not live now
        (its worker gone again) comes back fresh anyway.
        """
        env = self.envs[index]
        if env.phase is EnvPhase.LIVE:
            env.phase = EnvPhase.FRESH

    def begin(self, index: int, resets: bool) -> bool:
        """A command goes to env ``index``; whether it is fresh and the command must be a reset.

        ``resets``: the command begins an episode itself (a reset), or not (a step).
        A fresh env that gets a step was rebuilt and never reset: the caller sends
        a reset instead. Either way the env is then live.
        """
        env = self.envs[index]
        if env.phase is not EnvPhase.FRESH:
            return False
        env.phase, env.reseed = EnvPhase.LIVE, None
        return not resets

    def seeded(self, index: int, seed: int | None) -> None:
        """``set_seed`` gave env ``index`` ``seed``: a rebuilt env is seeded from it, not
        from an older one."""
        env = self.envs[index]
        env.seed, env.reseed = seed, None


def restart_seed(seed: int, restarts: int) -> int:
    """The seed of an env rebuilt for its ``restarts``-th time, from the one ``set_seed`` gave it.

    Not ``seed`` itself: the env would replay its first episodes (data twice
    in a replay buffer) and, if it crashed on its own, run the same path into
    the crash again. Derived, so that a run with the same seeds and the same
    crashes is the same run; 32 bits, which every env's seeding takes.

    Example:
        >>> restart_seed(7, 1) == restart_seed(7, 1) != restart_seed(7, 2)
        True
    """
    sequence = np.random.SeedSequence([seed % 2**64, restarts])
    return int(sequence.generate_state(1, np.uint32)[0])
