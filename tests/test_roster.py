"""The roster's lifecycles, as plain objects with a clock: no sockets, no processes.

The roster is the one owner of worker and env records (``zmqpool/roster.py``);
these tests drive it through its own methods only and read the phases it
reports. The live behaviour (restarts, rejoins, truncations) is tested with
real processes in test_restart.py, test_process_deaths.py and test_remote.py.
"""

from __future__ import annotations

import logging

import pytest

from zmqpool.codec import Decoder, Encoder
from zmqpool.errors import CrashLoopError, NoRoomError, RegistrationError
from zmqpool.roster import EnvPhase, Link, Roster, WorkerPhase
from zmqpool.specs import spec_to_data
from zmqpool.state import Kind, Ledger, Reply
from zmqpool.testing import CountingEnv
from zmqpool.wire import Command

SPEC = CountingEnv().specs
SPEC_DATA = spec_to_data(SPEC)


class FakeProcess:
    """What the roster keeps of a process: its pidfd."""

    def __init__(self, pidfd: int) -> None:
        self.pidfd = pidfd
        self.pid = 1000 + pidfd


def link_for(identity: bytes, envs: tuple[int, ...], incarnation: bytes = b"i0", key=None):
    remote = key is not None
    return Link(identity, b"t" * 16, 1, incarnation, Decoder(), Encoder(), envs, remote, key)


def register(roster: Roster, record, incarnation: bytes = b"i0") -> bool:
    link = link_for(record.identity, record.envs, incarnation, record.key)
    return roster.go_live(record, link, [(SPEC_DATA, SPEC, None)] * len(record.envs))


def phases(roster: Roster) -> list[str]:
    return [env.phase.value for env in roster.envs]


def test_a_local_worker_lives_dies_is_respawned_and_its_envs_come_back_fresh():
    roster = Roster(3, [(0, 1), (2,)], [])
    first, second = roster.local
    assert [w.phase for w in roster.local] == [WorkerPhase.STARTING] * 2
    assert first.identity != second.identity and first.identity.startswith(b"w0.")
    for index, record in enumerate(roster.local):
        roster.spawned(record, FakeProcess(index + 10), 0.0)
        assert register(roster, record) is False  # a first registration is no rejoin
    assert phases(roster) == ["live"] * 3 and roster.registered() == 3
    assert roster.by_pidfd(10) is first and roster.processes() and len(roster.linked()) == 2

    roster.killing(first, "hung: no reply", "tb")
    assert first.phase is WorkerPhase.KILLING
    assert roster.exited(first, "signal 9") == ("hung: no reply", "tb")  # the pool's cause wins
    assert roster.by_pidfd(10) is None and first.link is None
    assert phases(roster) == ["waiting", "waiting", "live"]
    assert [roster.envs[i].restarts for i in range(3)] == [1, 1, 0]
    assert roster.envs[0].last_restart_cause == "hung: no reply"

    roster.respawn_due(first, at=5.0)
    assert roster.due(4.9) == [] and roster.due(5.0) == [first] and roster.next_respawn() == 5.0
    roster.spawned(first, FakeProcess(11), 0.0)
    assert register(roster, first, b"i1") is True  # rebuilt: a rejoin
    assert phases(roster) == ["fresh", "fresh", "live"]
    assert roster.begin(0, resets=False) is True  # a fresh env's step is sent as a reset
    assert roster.begin(0, resets=False) is False  # then it is live
    assert roster.begin(1, resets=True) is False  # a reset to a fresh env is just a reset
    assert phases(roster) == ["live"] * 3


def test_respawns_due_come_in_worker_order_and_a_respawned_worker_is_no_longer_due():
    roster = Roster(3, [(0,), (1,), (2,)], [])
    for index, record in enumerate(roster.local):
        roster.spawned(record, FakeProcess(index + 10), 0.0)
        register(roster, record)
    assert roster.due(100.0) == [] and roster.next_respawn() == float("inf")
    third, first = roster.local[2], roster.local[0]
    for record, at in ((third, 2.0), (first, 3.0)):
        roster.killing(record, "hung", "")
        roster.exited(record, "signal 9")
        roster.respawn_due(record, at=at)
    assert roster.next_respawn() == 2.0
    assert roster.due(2.5) == [third] and roster.due(3.0) == [first, third]
    roster.spawned(third, FakeProcess(20), 0.0)
    assert roster.due(10.0) == [first] and roster.next_respawn() == 3.0
    roster.spawned(first, FakeProcess(21), 0.0)
    assert roster.due(10.0) == [] and roster.next_respawn() == float("inf")


def test_a_vacant_slot_filled_again_is_not_lost_later():
    roster = Roster(2, [], [0, 1])
    worker = roster.take_remote(b"a", "KEY", roster.plan_remote(b"a", "KEY", b"i", 2, None), "")
    register(roster, worker)
    roster.vacate(worker, now=0.0, cause="silent")
    back = roster.take_remote(b"a", "KEY", roster.plan_remote(b"a", "KEY", b"j", 2, None), "")
    register(roster, back, b"j")
    assert phases(roster) == ["fresh", "fresh"]
    assert roster.expired(now=100.0, timeout_s=5.0) == []


def test_a_death_the_pool_did_not_cause_keeps_its_own_cause_and_a_crash_loop_is_lost():
    roster = Roster(1, [(0,)], [])
    (record,) = roster.local
    roster.spawned(record, FakeProcess(3), 0.0)
    register(roster, record)
    roster.failed_to_start(record, "maker traceback")
    assert roster.exited(record, "exit status 1") == ("exit status 1", "maker traceback")
    error = CrashLoopError([0], "crash loop")
    roster.lose([0], error)
    assert roster.envs[0].phase is EnvPhase.LOST and roster.envs[0].lost is error
    assert record.phase is WorkerPhase.LOST


def test_remote_slots_are_claimed_vacated_rejoined_and_lost_by_the_clock():
    roster = Roster(3, [(0,)], [1, 2])
    claim = roster.plan_remote(b"host-a", "KEY-A", b"i0", 2, None)
    assert claim.envs == [1, 2] and not claim.rejoin and not claim.duplicate
    worker = roster.take_remote(b"host-a", "KEY-A", claim, "came back")
    assert worker.remote and worker.key == "KEY-A"
    register(roster, worker)
    assert roster.plan_remote(b"host-a", "KEY-A", b"i0", 2, None).duplicate  # asked twice

    roster.vacate(worker, now=10.0, cause="silent")
    assert worker.phase is WorkerPhase.VACANT and phases(roster)[1:] == ["waiting"] * 2
    assert roster.expired(now=11.0, timeout_s=5.0) == []
    rejoin = roster.plan_remote(b"host-a", "KEY-A", b"i1", 2, None)  # its own slots back
    assert rejoin.envs == [1, 2] and rejoin.rejoin and not rejoin.duplicate

    assert roster.expired(now=15.5, timeout_s=5.0) == [1, 2]
    assert roster.expired(now=20.0, timeout_s=5.0) == []  # reported once
    assert worker.phase is WorkerPhase.LOST
    # A lost remote slot is free for any worker; taking it releases the old holder.
    other = roster.plan_remote(b"host-b", "KEY-B", b"j0", 2, None)
    assert other.envs == [1, 2] and other.rejoin
    roster.take_remote(b"host-b", "KEY-B", other, "came back")
    assert roster.worker(b"host-a") is None and roster.keyed("KEY-A") == []


def test_an_identity_belongs_to_its_key_and_keys_are_capped_and_preferred():
    roster = Roster(4, [], [0, 1, 2, 3])
    a = roster.take_remote(b"a", "KEY-A", roster.plan_remote(b"a", "KEY-A", b"i", 2, None), "")
    register(roster, a)
    with pytest.raises(RegistrationError, match="held by another key"):
        roster.plan_remote(b"a", "KEY-B", b"i", 2, None)
    with pytest.raises(RegistrationError, match="max_slots_per_key"):
        roster.plan_remote(b"a2", "KEY-A", b"i", 1, None, max_per_key=2)
    with pytest.raises(RegistrationError, match="no room"):
        roster.plan_remote(b"c", "KEY-C", b"i", 3, None)
    b = roster.take_remote(b"b", "KEY-B", roster.plan_remote(b"b", "KEY-B", b"i", 2, None), "")
    register(roster, b)
    roster.vacate(a, now=0.0, cause="silent")
    roster.vacate(b, now=0.0, cause="silent")
    # KEY-B's host came back under a new identity: the slots its key left come first.
    assert roster.plan_remote(b"b-new", "KEY-B", b"k", 2, None).envs == [2, 3]
    assert roster.plan_remote(b"a-new", "KEY-A", b"k", 2, None).envs == [0, 1]


def test_slots_asked_for_by_name_must_all_be_free():
    roster = Roster(3, [], [0, 1, 2])
    taken = roster.take_remote(b"a", None, roster.plan_remote(b"a", None, b"i", 1, [1]), "")
    register(roster, taken)
    # Held: no room, which a replacement of the holder's host waits out (remote audit: a
    # refusal, and a host restarted with --slots exited, its envs lost).
    with pytest.raises(NoRoomError, match="asked for are not free"):
        roster.plan_remote(b"b", None, b"i", 2, [1, 2])
    with pytest.raises(RegistrationError, match="not 2 of the pool's remote slots") as info:
        roster.plan_remote(b"b", None, b"i", 2, [2, 7])
    assert not isinstance(info.value, NoRoomError)  # slots that do not exist: refused
    assert roster.plan_remote(b"b", None, b"i", 2, [0, 2]).envs == [0, 2]


def test_a_newcomer_of_any_key_waits_only_for_slots_a_live_worker_holds_that_it_may_take():
    """A host died and another, under another key, took over at once: it found no room
    while the dead one was not yet found silent, and was refused for good (warm
    starts showed it: the env was lost while its replacement ran)."""
    roster = Roster(3, [], [0, 1, 2])
    a = roster.take_remote(b"a", "KEY-A", roster.plan_remote(b"a", "KEY-A", b"i", 2, None), "")
    register(roster, a)
    with pytest.raises(NoRoomError):
        roster.plan_remote(b"b", "KEY-B", b"i", 2, None)
    assert roster.held_by_live("KEY-B", 2) and roster.held_by_live("KEY-B", 3)
    roster.vacate(a, now=0.0, cause="silent")  # set aside: not live, its slots free
    assert roster.held_by_live("KEY-B", 3)
    assert not roster.held_by_live("KEY-B", 4)  # more than the pool has
    reserved = Roster(2, [], [0, 1])
    reserved.reserve("KEY-A", [0, 1])  # a launcher's slots: no other key may take them
    c = reserved.take_remote(b"c", "KEY-A", reserved.plan_remote(b"c", "KEY-A", b"i", 2, None), "")
    register(reserved, c)
    assert reserved.held_by_live("KEY-A", 2) and not reserved.held_by_live("KEY-B", 1)


def test_a_replacement_host_takes_its_keys_slots_within_the_quota_and_no_more():
    """With max_slots_per_key, a replacement host (same key, new identity) of a worker:

    - still live (not found silent yet): over the quota is no room, which it waits
      out (it was refused, and the host's worker exited; remote audit);
    - set aside: it takes the slots that worker left, which count once (they
      counted twice: refused);
    - other slots while that worker's wait for a rejoin: refused, so that the
      key cannot hold both (review: a key went over its quota so).
    """
    roster = Roster(4, [], [0, 1, 2, 3])
    a = roster.take_remote(b"a", "KEY", roster.plan_remote(b"a", "KEY", b"i", 2, None, 2), "")
    register(roster, a)
    with pytest.raises(NoRoomError, match="max_slots_per_key"):
        roster.plan_remote(b"a-new", "KEY", b"k", 2, None, max_per_key=2)
    roster.vacate(a, now=0.0, cause="silent")
    assert roster.plan_remote(b"a-new", "KEY", b"k", 2, None, max_per_key=2).envs == [0, 1]
    with pytest.raises(RegistrationError, match="max_slots_per_key") as info:
        roster.plan_remote(b"b-new", "KEY", b"k", 2, [2, 3], max_per_key=2)
    assert not isinstance(info.value, NoRoomError)


def test_refusals_are_logged_rationed_per_kind_and_key(caplog):
    """A key's run of refusals of one kind (1st, 2nd, 4th... logged as warnings) does not
    hide another key's reason, nor another kind of its own (README: remote workers)."""
    ledger = Ledger(1)
    warned = []
    with caplog.at_level(logging.DEBUG, logger="zmqpool"):
        for who, kind, key in [
            *[(b"a", "RegistrationError", "K1")] * 3,
            (b"b", "RegistrationError", "K2"),
            (b"a", "NoRoomError", "K1"),
            (b"a", "RegistrationError", "K1"),
        ]:
            caplog.clear()
            ledger.refuse(who, f"{kind} of {key}", kind, key)
            (record,) = caplog.records
            warned.append(record.levelno == logging.WARNING)
    assert warned == [True, True, False, True, True, True]  # the last: K1's 4th of its kind
    assert ledger.refused == 6


def test_requests_given_up_on_wait_for_no_recv_and_their_replies_are_dropped():
    # set_seed past its deadline (session 62): its reply came later as a reset nobody sent.
    ledger = Ledger(1)
    channel = (Kind.RESET, 0)
    late = ledger.open_request(0, Command.SEED, True, None, None, None, 0.0)
    ledger.abandon(channel, 0)
    assert ledger.awaiting(channel) == 0
    nxt = ledger.open_request(0, Command.RESET, True, None, None, None, 0.0)
    assert ledger.match(0, late.seq, 1.0) is late  # the env answers in order
    ledger.deliver(Reply(0, late), 1.0)
    assert ledger.count_ready(channel) == 0 and ledger.dropped
    assert ledger.match(0, nxt.seq, 2.0) is nxt
    ledger.deliver(Reply(0, nxt), 2.0)
    assert [r.pending for r in ledger.take(channel, None)] == [nxt]
    come_just_now = ledger.open_request(0, Command.SEED, True, None, None, None, 3.0)
    ledger.deliver(Reply(0, ledger.match(0, come_just_now.seq, 3.0)), 3.0)
    ledger.abandon(channel, 0)  # a reply already in is dropped as well
    assert ledger.awaiting(channel) == 0 and ledger.count_ready(channel) == 0
