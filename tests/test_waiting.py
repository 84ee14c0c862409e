"""The waiting room of remote newcomers (:mod:`zmqpool.waiting`), on a clock of its own.

Findings of session 61's hostile audit of ``Registrar``'s table, then keyed
by identity alone, never expired, and cleared whole at 1,024 entries: a key
adding 50 identities a second made another key's newcomer wait 57 s instead
of 20 (100 a second: never refused in 300 s); an identity that once waited
was refused at once as a genuine replacement an hour later; and another key
presenting that identity first started its clock.
"""

from __future__ import annotations

from zmqpool.waiting import WaitingRoom

WINDOW = 20.0


def refused_after(room: WaitingRoom, key: str, identity: bytes, start: float, **between) -> float:
    """Seconds until ``identity`` of ``key``, asking once a second from ``start``, is refused.

    ``between``: ``flood=(key, per_second)``, new identities of another key each second.
    """
    flood_key, per_second = between.get("flood", (None, 0))
    for second in range(300):
        for i in range(per_second):
            room.may_wait(flood_key, b"flood-%d-%d" % (second, i), start + second)
        if not room.may_wait(key, identity, start + second):
            return second
    raise AssertionError("never refused within 300 s")


def test_a_newcomer_waits_its_window_then_is_refused_and_a_later_try_waits_afresh():
    room = WaitingRoom(WINDOW)
    assert refused_after(room, "KEY-0", b"gpu-3", start=0) == WINDOW
    # Its host starts it again an hour later (a fixed --identity): a new start.
    assert refused_after(room, "KEY-0", b"gpu-3", start=3600) == WINDOW


def test_another_keys_newcomers_neither_lengthen_nor_shorten_a_newcomers_wait():
    room = WaitingRoom(WINDOW, cap=1024)
    room.may_wait("KEY-1", b"gpu-3", 0)  # another key takes the identity first
    flood = ("KEY-1", 100)  # and adds 100 identities a second: 10 times the cap in 100 s
    assert refused_after(room, "KEY-0", b"gpu-3", start=60, flood=flood) == WINDOW
    assert room.waiting("KEY-1") <= 1024


def test_one_not_heard_from_for_longer_than_the_gap_starts_afresh():
    room = WaitingRoom(WINDOW, gap_s=30)
    assert room.may_wait("KEY-0", b"w", 0)
    assert room.may_wait("KEY-0", b"w", 15)  # within its window
    assert not room.may_wait("KEY-0", b"w", 15 + 29)  # heard within the gap: its window is over
    assert room.may_wait("KEY-0", b"w", 15 + 29 + 31)  # forgotten when refused: a new start
    assert room.may_wait("KEY-0", b"x", 100)
    assert room.may_wait("KEY-0", b"x", 100 + 31)  # 31 s of silence: gave up, back afresh
    assert room.may_wait("KEY-0", b"x", 100 + 31 + 19)


def test_an_admitted_newcomer_is_forgotten_and_a_key_remembers_at_most_cap():
    room = WaitingRoom(WINDOW, cap=8)
    room.may_wait("KEY-0", b"w", 0)
    room.admitted("KEY-0", b"w")
    assert room.waiting("KEY-0") == 0
    room.admitted("KEY-9", b"w")  # a key never seen: nothing to forget
    for i in range(20):
        room.may_wait("KEY-0", b"%d" % i, 1)
    assert 0 < room.waiting("KEY-0") <= 8
