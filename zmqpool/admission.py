"""The control plane: REGISTER, FAILED and HEARTBEAT messages, and what the pool answers.

- A local worker registers on the local side under the identity the pool
  spawned it with (``w<index>.<secret>``, see :class:`~zmqpool.roster.Roster`)
  and gets exactly the envs it was spawned for, while it is starting.
- A remote worker registers on the remote side and gets free remote slots,
  or its own back (:meth:`~zmqpool.roster.Roster.plan_remote`). Nothing that
  arrives on the local side is admitted for a remote slot, and no local
  identity is admitted from the remote side.
- Specs must match: an env coming back must bring the specs it had; a remote
  slot the pool's ``remote_spec``; with a dense stack, every env the structure
  of the pool's specs (those of the first env registered: keys, classes,
  shapes, dtypes; bounds and category counts may differ, as in torchrl). A
  mismatch is refused with the first differing field. Each REGISTER's specs
  are decoded once, here.
- An admitted worker is given a fresh token (every result must carry it)
  and a WELCOME with the timings it must share with the pool.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import zmq

from zmqpool.broker import Broker
from zmqpool.codec import Decoder, Encoder, layout_of
from zmqpool.config import PoolConfig
from zmqpool.errors import NoRoomError, ProtocolError, RegistrationError, VersionMismatchError
from zmqpool.events import Event, WorkerFailed, WorkerRegistered
from zmqpool.layout import Layout, max_message_bytes
from zmqpool.limits import MAX_HEADER_BYTES, MAX_SPEC_BYTES, described
from zmqpool.policy import Liveness
from zmqpool.protocol import Failed, FailureKind, Refuse, Register, Welcome
from zmqpool.remote_failures import RemoteFailures
from zmqpool.roster import Link, Roster, WorkerPhase, WorkerRecord
from zmqpool.specs import spec_from_data, spec_to_data
from zmqpool.state import Ledger
from zmqpool.waiting import WaitingRoom
from zmqpool.wire import PAUSE_GC_ABOVE_BYTES, Command, Header, collector_paused, peek_command

log = logging.getLogger("zmqpool")

#: One env's registered specs once checked: as data, decoded, and their zero's layout.
Checked = tuple[Any, Any, Layout]

#: Layouts a remote connection may announce (each is kept while it is connected).
_REMOTE_LAYOUTS = 32
#: A heartbeat from a worker's own heartbeat socket carries this suffix.
_HEARTBEAT_SUFFIX = b"!hb"
#: The largest control message other than those below: a HEARTBEAT is a few dozen
#: bytes. Larger ones are dropped before they are unpacked, so that a peer cannot
#: make the trainer build a Python object for every byte of every heartbeat.
MAX_SMALL_CONTROL_BYTES = 4 << 10
#: The same for the remote side: a HEARTBEAT there is under 64 bytes, and anything
#: larger (a REGISTER, a FAILED) is charged to its key's byte budget before it is
#: unpacked. 4 KiB of empty arrays cost 80 us to unpack (1-1.5 ms with the cyclic
#: collector running), and a remote key's small messages had no rate at all.
MAX_SMALL_REMOTE_CONTROL_BYTES = 256
#: What may be larger: a REGISTER carries specs, a FAILED a traceback.
_LARGE_CONTROL = (Command.REGISTER, Command.FAILED)
#: Bytes of large control messages a remote key may have unpacked per second, and
#: at once: 100 workers sharing a key, each registering 40 KB of specs, start at once.
LARGE_CONTROL_BYTES_PER_S = 1 << 20
LARGE_CONTROL_BURST = 8 << 20
#: REGISTERs of any size a remote key may have read per second, and at once: each
#: costs the trainer its checks, a REFUSE and a log line, and a worker registers
#: once a start (every 0.2-5 s while unanswered); 200 workers sharing a key start at once.
REGISTERS_PER_S = 50
REGISTER_BURST = 200
#: Log lines a remote key's FAILEDs may cause per second, and at once (its host
#: restarts a failing worker every few seconds, at most 5 times by default).
FAILED_LOGS_PER_S = 0.2
FAILED_LOG_BURST = 5
#: Admitted workers whose WELCOME could not be routed, remembered at most.
_MAX_UNWELCOMED = 1024


class TokenBucket:
    """A token bucket per peer (bytes, or messages): ``rate`` a second, at most ``burst`` saved.

    Peers are CURVE keys the ZAP handler let in, so the buckets are as many as
    the authorized keys (at most).
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str | None, tuple[float, float]] = {}

    def take(self, peer: str | None, nbytes: int) -> bool:
        """Spend ``nbytes`` of ``peer``'s budget if it has them; whether it had."""
        now = time.monotonic()
        level, then = self._buckets.get(peer, (self.burst, now))
        level = min(self.burst, level + (now - then) * self.rate)
        if level < nbytes:
            self._buckets[peer] = (level, now)
            return False
        self._buckets[peer] = (level - nbytes, now)
        return True


#: Fields of a spec's data (``spec_to_data``) that hold values, not structure: the
#: bounds, category counts, masks and examples that may differ between the envs of
#: a dense stack (its shapes and dtypes are compared all the same).
SPEC_VALUES = frozenset({"low", "high", "n", "nvec", "mask", "example_data"})


def first_difference(
    a: Any, b: Any, path: str = "specs", ignored: frozenset[str] = frozenset()
) -> str | None:
    """Where two plain-data trees first differ, as a readable path, or None.

    Dict entries named in ``ignored`` are not compared (when present on both sides).
    """
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{path}/{key} (present on one side only)"
            if key in ignored:
                continue
            found = first_difference(a[key], b[key], f"{path}/{key}", ignored)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]", ignored)
            if found:
                return found
        return None
    return None if a == b else f"{path}: {described(a, 60)} here, {described(b, 60)} expected"


class Registrar:
    """Reads control messages, admits workers into the roster, answers them; see the docstring.

    Args:
        roster, ledger, broker, config, liveness: the pool's.
        events: where it reports admissions and failed starts.
        same_specs: every env must register specs of one structure (``stack="dense"``).
        remote_spec: the specs every remote worker must bring (an env's
            ``specs``), if the user gave them.
        remote_failures: where FAILEDs of remote workers are noted (they need
            not have registered: see :mod:`zmqpool.remote_failures`).
    """

    def __init__(
        self,
        roster: Roster,
        ledger: Ledger,
        broker: Broker,
        config: PoolConfig,
        liveness: Liveness,
        events: list[Event],
        same_specs: bool,
        remote_spec: Any = None,
        remote_failures: RemoteFailures | None = None,
    ) -> None:
        self.roster = roster
        self.ledger = ledger
        self.broker = broker
        self.config = config
        self.liveness = liveness
        self.events = events
        self.same_specs = same_specs
        self.remote_spec = remote_spec
        self._remote_set = frozenset(roster.remote_indices)
        self._large_control_budget = TokenBucket(LARGE_CONTROL_BYTES_PER_S, LARGE_CONTROL_BURST)
        self._register_budget = TokenBucket(REGISTERS_PER_S, REGISTER_BURST)  # a token a REGISTER
        self._failed_log_budget = TokenBucket(FAILED_LOGS_PER_S, FAILED_LOG_BURST)
        self.remote_failures = RemoteFailures() if remote_failures is None else remote_failures
        #: REGISTERs that found no room yet wait for a live worker's slots (see _on_register).
        self._waiting = WaitingRoom(2 * config.heartbeat_timeout_s)
        #: Admitted workers whose last WELCOME could not be routed (see _on_register).
        self._unwelcomed: set[bytes] = set()
        self.revoked: set[str] = set()
        self.remote_spec_data = None if remote_spec is None else spec_to_data(remote_spec)

    def remote_reference(self) -> Any:
        """The specs remote slots are held to, decoded (None: none, each brings its own)."""
        if self.remote_spec is not None:
            return self.remote_spec
        if self.same_specs and self.roster.local:
            return self.roster.envs[self.roster.local[0].envs[0]].spec
        return None

    def on_control(self, identity: bytes, frames: list[zmq.Frame], remote: bool) -> None:
        try:
            if frames and len(frames[0]) > PAUSE_GC_ABOVE_BYTES:
                # Paused until the message's objects are gone (see collector_paused).
                with collector_paused():
                    self._on_message(identity, frames, remote)
            else:
                self._on_message(identity, frames, remote)
        except RecursionError:  # a peer's data nested deeper than Python recurses: dropped
            self.ledger.drop("a control message nested too deep")

    def _on_message(self, identity: bytes, frames: list[zmq.Frame], remote: bool) -> None:
        if not frames:
            self.ledger.drop("control message without a header")
            return
        data = frames[0].buffer
        small = MAX_SMALL_REMOTE_CONTROL_BYTES if remote else MAX_SMALL_CONTROL_BYTES
        if len(data) > small and not self._may_unpack(data, frames[0], remote):
            return
        key = peer_key(frames[0]) if remote else None
        try:
            header = Header.decode(data)
        except VersionMismatchError as err:
            # Refused unread, yet still a REFUSE and a log line: within the key's REGISTER rate.
            if self._within_register_rate(key, remote):
                self._refuse_version(identity, err, remote, key)
            return
        except ProtocolError as err:
            self.ledger.drop(f"malformed control header: {type(err).__name__}")
            return
        if header.command == Command.REGISTER:
            if self._within_register_rate(key, remote):
                self._on_register(identity, key, header, remote)
        elif header.command == Command.HEARTBEAT:
            self._on_heartbeat(identity, key, remote)
        elif header.command == Command.FAILED:
            self._on_failed(identity, key, header, remote)
        else:
            self.ledger.drop("unexpected command on the control socket")

    def _may_unpack(self, data: memoryview, first: zmq.Frame, remote: bool) -> bool:
        """Whether a large control message is worth unpacking (dropped and counted if not).

        Checked before unpacking: a body is up to one Python object per byte,
        ~0.1 us each. Only a REGISTER or a FAILED may be large, and a remote
        key gets :data:`LARGE_CONTROL_BYTES_PER_S` of them (a worker registers
        once a start; a key flooding registrations costs the trainer a bounded
        share of its time, not all of it).
        """
        if peek_command(data) not in _LARGE_CONTROL:
            self.ledger.drop("a large control message that is not a registration")
            return False
        if remote and not self._large_control_budget.take(peer_key(first), len(data)):
            self.ledger.drop("large control messages from one key beyond its rate")
            return False
        return True

    # ------------------------------------------------------------ who is talking

    def _sender(self, identity: bytes, key: str | None, remote: bool) -> WorkerRecord | None:
        """The record of a worker that may speak on this side with this key, or None."""
        record = self.roster.worker(identity)
        if record is None or record.remote != remote or record.key != key:
            return None
        return record

    def _on_heartbeat(self, identity: bytes, key: str | None, remote: bool) -> None:
        record = self._sender(identity.removesuffix(_HEARTBEAT_SUFFIX), key, remote)
        if record is None or record.link is None:
            self.ledger.drop("heartbeat from an identity that is not a registered worker")
            return
        self.liveness.heard(record.identity, time.monotonic())

    def _on_failed(self, identity: bytes, key: str | None, header: Header, remote: bool) -> None:
        record = None if remote else self._sender(identity, key, remote)
        if record is None and not remote:
            self.ledger.drop("FAILED from an identity that is not a worker")
            return
        try:
            failed = Failed.from_body(header.body)
        except ProtocolError as err:
            self.ledger.drop(f"malformed FAILED: {type(err).__name__}")
            return
        if record is None:  # remote: its host restarts it; the trainer hears why
            self._on_remote_failed(key, failed)
            return
        # kind MAKER: the env maker raised; REGISTER: its REGISTER would not fit.
        self.roster.failed_to_start(record, failed.tb)
        self.events.append(
            WorkerFailed(identity, failed.kind, failed.err, failed.tb, header.env, failed.base)
        )

    def _on_remote_failed(self, key: str | None, failed: Failed) -> None:
        """Noted for the errors of envs waiting for a remote worker, and logged (rationed).

        Known by its key alone: a worker that could not start never registered
        (the ZAP handler let its key in, so the notes are as many as the keys).
        """
        text = self.remote_failures.note(key, failed)
        if self._failed_log_budget.take(key, 1):
            log.warning("%s (its host restarts it, or gives up)", text)

    def _within_register_rate(self, key: str | None, remote: bool) -> bool:
        """Whether a remote key may have one more REGISTER checked now; else it is dropped."""
        if not remote or self._register_budget.take(key, 1):
            return True
        self.ledger.drop("REGISTERs from one key beyond its rate")
        return False

    def _refuse_version(
        self, identity: bytes, err: VersionMismatchError, remote: bool, key: str | None
    ) -> None:
        # A worker of another version cannot read our REFUSE (it reads the
        # version first and stops); our own process cannot tell us either, so
        # the pool hears of it here.
        self._refuse(identity, err, remote, key)
        record = self._sender(identity, None, remote)
        if record is not None and not record.remote:
            self.events.append(WorkerFailed(identity, FailureKind.VERSION, str(err)))

    def _may_be_a_replacement(self, identity: bytes, key: str | None, count: int) -> bool:
        """Whether a REGISTER that found no room should wait for a live worker's silence.

        When live remote workers hold slots it may take (any key's: a host died
        and another took over; its own key's over the quota too, whose slots it
        may take); for at most two heartbeat timeouts from its first try: by
        then a worker it replaces has been found silent; those still live are
        others, and the newcomer is refused "no room".
        """
        if not self.roster.held_by_live(key, count):
            return False
        return self._waiting.may_wait(key, identity, time.monotonic())

    def _tell_setup(self, identity: bytes, reason: str, remote: bool) -> None:
        """A worker this pool started and refused: construction raises, saying why.

        Refused, it exits; without this the trainer heard only its exit status,
        the reason (a spec mismatch, say) in the worker's stderr.
        """
        record = self._sender(identity, None, remote)
        if record is not None and not record.remote and record.phase is WorkerPhase.STARTING:
            self.events.append(WorkerFailed(identity, FailureKind.REFUSED, reason))

    def _refuse(self, identity: bytes, err: Exception, remote: bool, key: str | None) -> None:
        reason = str(err)
        self.ledger.refuse(identity, reason, type(err).__name__, key)
        refusal = Header(Command.REFUSE, body=Refuse.because(reason).to_body())
        self.broker.route(identity, [refusal.encode()], remote)

    # ------------------------------------------------------------ REGISTER

    def _on_register(self, identity: bytes, key: str | None, header: Header, remote: bool) -> None:
        try:
            reg = Register.from_body(header.body)
            record, specs = self._admit(identity, key, reg, remote)
        except NoRoomError as err:
            if self._may_be_a_replacement(identity, key, len(reg.specs)):
                # A live worker holding the slots is likely the one it replaces, gone
                # while the pool was not listening or not yet found silent: no answer,
                # so it asks again (with backoff) and gets them once that one is.
                self.ledger.drop("a REGISTER for slots a live worker holds: it waits")
                return
            self._refuse(identity, err, remote, key)
            return
        except (RegistrationError, ProtocolError) as err:
            self._refuse(identity, err, remote, key)
            self._tell_setup(identity, str(err), remote)
            return
        self._waiting.admitted(key, identity)
        if record is None:  # a duplicate: our WELCOME was lost; say it again
            known = self.roster.worker(identity)
            if known is not None and known.link is not None:
                lost = identity in self._unwelcomed
                if self._send_welcome(known.link) and lost and known.remote:
                    self._resend_after_lost_welcome(known, reg)
            return
        self._welcome(record, reg, specs, remote)

    def _resend_after_lost_welcome(self, record: WorkerRecord, reg: Register) -> None:
        """A remote worker's WELCOME could not be routed: what followed it is sent again.

        It came from a connection the worker had left (it connects again when a
        REGISTER goes unanswered, ``workers.loop``), read after the worker left
        it: the WELCOME and the requests sent after it (a rejoin's, as resets)
        went nowhere. Now it is heard again, they go again, with the layouts
        they name (a late reply to the first sending is void).
        """
        assert record.link is not None
        record.link.encoder.forget()
        self.events.append(WorkerRegistered(record.identity, list(record.envs), reg, True))

    def _admit(
        self, identity: bytes, key: str | None, reg: Register, remote: bool
    ) -> tuple[WorkerRecord | None, list[Checked]]:
        """The record to go live and its envs' (data, decoded) specs; None: a duplicate."""
        record = self.roster.worker(identity)
        if not remote:
            if record is None or record.remote:
                raise RegistrationError(f"{identity!r} is not a worker this pool started")
            return self._admit_local(record, reg)
        if record is not None and not record.remote:
            raise RegistrationError("a local worker's identity, from the remote side")
        if key is not None and key in self.revoked:
            raise RegistrationError("this worker's key was revoked")
        return self._admit_remote(identity, key, reg)

    def _admit_local(
        self, record: WorkerRecord, reg: Register
    ) -> tuple[WorkerRecord | None, list[Checked]]:
        link = record.link
        if link is not None and link.incarnation == reg.incarnation:
            return None, []  # it asked twice: answer, change nothing
        if record.phase is not WorkerPhase.STARTING:
            raise RegistrationError(
                f"worker {record.identity!r} of envs {list(record.envs)} is "
                f"{record.phase.value}, not starting: refused"
            )
        if tuple(reg.envs) != record.envs:  # Register.from_body: as many specs as envs
            raise RegistrationError(
                f"worker {record.identity!r} offers envs {list(reg.envs)}, not {list(record.envs)}"
            )
        specs = [self._check_spec(env, s) for env, s in zip(record.envs, reg.specs, strict=True)]
        return record, specs

    def _admit_remote(
        self, identity: bytes, key: str | None, reg: Register
    ) -> tuple[WorkerRecord | None, list[Checked]]:
        if not self.roster.remote_indices:
            raise RegistrationError("this pool has no remote env slots (remote_envs=0)")
        for spec in reg.specs:
            self._compare(None, spec)  # a wrong spec says more than "no free slot"
        wanted = None if reg.slots is None else list(reg.slots)
        count, cap = len(reg.specs), self.config.max_slots_per_key
        claim = self.roster.plan_remote(identity, key, reg.incarnation, count, wanted, cap)
        if claim.duplicate:
            return None, []
        specs = [self._check_spec(env, s) for env, s in zip(claim.envs, reg.specs, strict=True)]
        if not self.same_specs:  # its own envs too: the first worker has nothing to stack with
            for _, spec, _ in specs[1:]:
                _check_stack(spec, specs[0][1], f"its env {claim.envs[0]}'s")
        cause = "its remote worker came back as a new process"
        return self.roster.take_remote(identity, key, claim, cause), specs

    def _check_spec(self, env: int, data: Any) -> Checked:
        """Compared, then decoded (only here, once): the specs as data, decoded, and the layout
        of their zero (what bounds the worker's frames).

        A remote worker's are decoded under the lower remote budget
        (``PoolConfig.max_remote_spec_bytes``), after the comparison: specs
        that differ from the reference are refused before anything is built.
        The env's own specs again (a rejoin: the comparison was exact) are
        not built again: a peer re-registering in a loop would otherwise cost
        the trainer a build (and its zero) per message.
        """
        self._compare(env, data)
        known = self.roster.envs[env]
        if known.spec_data is not None and known.layout is not None:
            return data, known.spec, known.layout
        remote = env in self._remote_set
        budget = self.config.max_remote_spec_bytes if remote else MAX_SPEC_BYTES
        try:
            spec = spec_from_data(data, max_bytes=budget)
            layout = layout_of(spec.zero())
        except Exception as err:  # a peer's specs: whatever they break is a refusal
            raise RegistrationError(f"specs that cannot be built: {err}") from None
        if remote:
            self._check_stacks(env, spec)
        return data, spec, layout

    def _check_stacks(self, env: int, spec: Any) -> None:
        """A remote env's specs must stack with the others', or the pool's specs could not be
        made (construction would fail for every env): refused, that peer alone.

        Compared with one other env's, built already (a local env's in a mixed
        pool): stacking is decided leaf by leaf, class against class. A dense
        pool's were compared in full already.
        """
        if self.same_specs:
            return
        other = next((e for e in self.roster.envs if e.spec is not None and e.index != env), None)
        if other is not None:
            _check_stack(spec, other.spec, f"env {other.index}'s")

    def _compare(self, env: int | None, data: Any) -> None:
        """Against the env's own earlier specs, a remote slot's against ``remote_spec``, and
        with a dense stack against the pool's (the local envs register first).

        The last, for a local env, only in structure (keys, classes, shapes,
        dtypes): envs whose bounds or category counts differ stack densely, as
        in torchrl's pool and ``SerialEnv``. A remote env's are held exactly.
        """
        ignored: frozenset[str] = frozenset()
        remote = env is None or env in self._remote_set
        reference = None if env is None else self.roster.envs[env].spec_data
        if reference is None and remote:
            reference = self.remote_spec_data
        if reference is None and self.same_specs:
            reference = next((e.spec_data for e in self.roster.envs if e.spec_data), None)
            ignored = frozenset() if remote else SPEC_VALUES  # a remote env's are exact
        if reference is not None:
            where = first_difference(data, reference, ignored=ignored)
            if where:
                slot = "a new env" if env is None else f"env {env}"
                raise RegistrationError(f"spec mismatch for {slot}: {where}")

    def _welcome(
        self, record: WorkerRecord, reg: Register, specs: list[Checked], remote: bool
    ) -> None:
        # What its specs hold bounds the frames this worker sends; a remote one's, the
        # remote side's cap too (`remote_spec` or PoolConfig.max_remote_frame_bytes).
        limit = max_message_bytes(layout for _, _, layout in specs)
        if remote:  # a header may take MAX_HEADER_BYTES whatever the cap
            limit = min(limit, max(self.broker.remote_frame_cap, MAX_HEADER_BYTES))
        link = Link(
            record.identity,
            os.urandom(16),
            reg.pid,
            reg.incarnation,
            Decoder(_REMOTE_LAYOUTS if remote else 256, limit, own_small_frames=True),
            Encoder(self.config.zero_copy_threshold_bytes, copy_own_frames=True),
            record.envs,
            remote,
            record.key,
            reg.batches,
        )
        rejoin = self.roster.go_live(record, link, specs, reg.set_state)
        self.liveness.heard(record.identity, time.monotonic())
        self._send_welcome(link)
        self.events.append(WorkerRegistered(record.identity, list(record.envs), reg, rejoin))

    def _send_welcome(self, link: Link) -> bool:
        """Route ``link``'s WELCOME; whether it could be (noted for a duplicate REGISTER)."""
        tcp = self.broker.tcp if link.remote else None
        limit = link.decoder.max_frame_bytes
        welcome = Welcome(
            token=link.token,
            envs=link.envs,
            results=tcp.results if tcp else self.broker.results_endpoint(limit),
            beats=tcp.beats if tcp else None,
            epoch=self.broker.epoch,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            heartbeat_liveness=self.config.heartbeat_liveness,
            max_frame=limit,
            piece=self.broker.remote_piece if link.remote else 0,
        )
        header = Header(Command.WELCOME, body=welcome.to_body())
        routed = self.broker.route(link.identity, [header.encode()], link.remote)
        if routed:
            self._unwelcomed.discard(link.identity)
        elif len(self._unwelcomed) < _MAX_UNWELCOMED:  # identities of admitted workers only
            self._unwelcomed.add(link.identity)
        return routed


def peer_key(frame: zmq.Frame) -> str | None:
    """The CURVE public key (z85) libzmq authenticated the sender of ``frame`` with.

    None without CURVE (``insecure``): there is no key to know a peer by.
    """
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:  # no ZAP handler answered for this connection
        return None


def _check_stack(spec: Any, other: Any, whose: str) -> None:
    """Refuse ``spec`` unless it stacks with ``other`` (a RegistrationError naming ``whose``)."""
    try:  # torch.stack of Composites is lazy: its leaves stack when read
        stacked: Any = torch.stack([other, spec])
        for key in stacked.keys(include_nested=True, leaves_only=True):
            stacked[key]
    except Exception as err:  # whatever torchrl raises for these specs
        raise RegistrationError(f"specs that do not stack with {whose}: {err}") from None
