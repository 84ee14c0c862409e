"""Restart and liveness decisions, with a fake clock: no sockets, no sleeping."""

from zmqpool.policy import Liveness, RestartPolicy
from zmqpool.state import BATCH_CHANNEL, Pending
from zmqpool.supervisor import sent_as
from zmqpool.wire import Command


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(max_restarts=10, window_s=100, backoff_s=0.1, backoff_max_s=0.5)
    delays = [policy.on_death("w", now=0.0).restart_at for _ in range(5)]
    assert delays == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_crash_loop_past_the_limit_within_the_window():
    policy = RestartPolicy(max_restarts=2, window_s=10, backoff_s=0.0, backoff_max_s=0.0)
    assert [policy.on_death("w", now=t).crash_loop for t in (0, 1, 2)] == [False, False, True]
    assert not policy.on_death("other", now=2).crash_loop  # per worker


def test_a_worker_that_stayed_up_a_window_starts_afresh():
    policy = RestartPolicy(max_restarts=2, window_s=10, backoff_s=0.0, backoff_max_s=0.0)
    policy.on_death("w", now=0)
    policy.on_death("w", now=1)
    decision = policy.on_death("w", now=50)
    assert not decision.crash_loop and decision.deaths_in_window == 1


def test_silence_is_judged_only_while_listening():
    live = Liveness(timeout_s=3.0, pause_s=1.0)
    live.heard("w0", now=0.0)
    live.listening(now=0.5)
    assert live.silent(now=2.0) == []
    live.listening(now=3.9)  # a trainer away for 3.4 s: not the worker's silence
    assert live.silent(now=4.0) == []
    live.listening(now=4.5)
    assert live.silent(now=7.5) == ["w0"]


def test_any_message_is_a_beat_and_forgotten_workers_are_not_judged():
    live = Liveness(timeout_s=1.0, pause_s=10.0)
    live.heard("w0", now=0.0)
    live.heard("w1", now=0.0)
    live.heard("w0", now=5.0)
    live.forget("w1")
    live.listening(now=5.5)
    assert live.silent(now=5.5) == []


def test_silence_is_told_least_recently_heard_first_whatever_order_the_times_come_in():
    """silent() stops at the first key still within time: a key heard again goes last,
    and a time older than the newest one (a drain's, read before) does not reorder them."""
    live = Liveness(timeout_s=2.0, pause_s=100.0)
    live.heard("a", now=0.0)
    live.heard("b", now=1.0)
    live.heard("c", now=1.5)
    live.heard("a", now=2.0)  # heard again: now the most recent
    assert live.silent(now=3.2) == ["b"]
    live.heard("b", now=1.9)  # a time read before "a"'s: counted as "a"'s, after it
    assert live.silent(now=3.6) == ["c"]
    assert live.silent(now=4.1) == ["c", "a", "b"]
    live.forget("c")
    assert live.silent(now=4.1) == ["a", "b"]


def test_silence_adds_up_across_the_trainers_pauses():
    """Polls of 0.9 s between pauses of 4.1 s, each shorter than the 2 s timeout: a worker
    heard from no more is silent after the third poll began. Before, each pause gave
    it a fresh start, and it was never found."""
    live = Liveness(timeout_s=2.0, pause_s=1.0)
    live.heard("w0", now=0.0)
    for start in (0.0, 5.0, 10.0):
        live.listening(now=start)
        assert live.silent(now=start) == []
        live.listening(now=start + 0.9)  # the poll's end; then the trainer's own work
    assert live.silent(now=10.5) == ["w0"]  # 0.9 + 0.9 + 0.5 s of listening


def test_after_a_pause_the_order_holds():
    live = Liveness(timeout_s=1.0, pause_s=1.0)
    live.heard("a", now=0.0)
    live.listening(now=0.0)
    live.heard("b", now=0.5)
    live.listening(now=10.0)  # the trainer was away: both resume at 10 (b's 0.5 is clipped)
    live.heard("a", now=10.5)
    assert live.silent(now=11.2) == ["b"]
    assert live.silent(now=11.6) == ["b", "a"]


def test_a_hang_is_named_by_the_command_its_env_got():
    """A step cut short by a restart goes to the rebuilt env as a reset: a hang there is
    that reset's (failure audit: the cause used to say "no reply to STEP")."""
    pending = Pending(1, Command.STEP, BATCH_CHANNEL[Command.STEP], None, None, None, 0.0)
    assert sent_as(pending) == "STEP"
    pending.synth = True
    assert sent_as(pending) == "the RESET sent in place of a STEP (after a restart)"
