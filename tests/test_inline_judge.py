"""Which of a threaded worker's envs step inline (:mod:`workers.inline`), judged from times.

The judge is pure bookkeeping: these feed it step times as a worker would and
read its answers. That a worker acts on them, with real threads and sleeps,
is in ``tests/test_env_threads.py``.
"""

from __future__ import annotations

from workers.inline import (
    FORGIVE_AFTER,
    HEAVY_STEP_S,
    WAITED_S,
    WAITER_STEP_S,
    WAITING_SIBLINGS,
    WARMUP_STEPS,
    InlineJudge,
    StepTimes,
)

CHEAP = StepTimes(wall_s=0.0002, cpu_s=0.0002, waited=False)
#: Preempted (wall far above CPU) but never gave up the CPU: still only computing.
PREEMPTED = StepTimes(wall_s=0.004, cpu_s=0.0002, waited=False)
SLEPT = StepTimes(wall_s=0.003, cpu_s=0.0002, waited=True)  # waited, but under WAITER_STEP_S
LONG_WAIT = StepTimes(wall_s=WAITER_STEP_S + 0.001, cpu_s=0.0002, waited=True)
LONG_COMPUTE = StepTimes(wall_s=0.005, cpu_s=HEAVY_STEP_S * 2.5, waited=False)


def judged(*steps: tuple[StepTimes, bool]) -> InlineJudge:
    """A judge that saw env 0's warm-up, then ``steps``."""
    judge = InlineJudge()
    for step, clean in [(LONG_WAIT, True)] * WARMUP_STEPS + list(steps):
        judge.record(0, step, clean)
    return judge


def test_an_env_not_judged_steps_inline_as_a_probe():
    judge = InlineJudge()
    assert judge.unjudged(0) and judge.runs_inline(0)


def test_a_short_step_that_never_waited_makes_an_env_cheap_even_preempted_or_unclean():
    for step, clean in [(CHEAP, True), (PREEMPTED, True), (CHEAP, False)]:
        judge = judged((step, clean))
        assert judge.cheap(0) and not judge.unjudged(0) and judge.runs_inline(0)


def test_a_clean_long_wait_sends_the_env_to_its_thread_for_good():
    judge = judged((CHEAP, True), (LONG_WAIT, True), *[(CHEAP, True)] * 5)
    assert judge.waits(0) and not judge.cheap(0) and not judge.runs_inline(0)


def test_two_strikes_send_the_env_to_its_thread_and_one_is_forgiven_after_cheap_steps():
    assert judged((CHEAP, True), (SLEPT, True), (LONG_COMPUTE, True)).waits(0)
    one_strike = judged((CHEAP, True), (SLEPT, True))
    assert one_strike.cheap(0) and not one_strike.waits(0)
    forgiven = judged((SLEPT, True), *[(CHEAP, True)] * FORGIVE_AFTER, (SLEPT, True))
    assert forgiven.cheap(0) and not forgiven.waits(0)
    not_yet = judged((SLEPT, True), *[(CHEAP, True)] * (FORGIVE_AFTER - 1), (SLEPT, True))
    assert not_yet.waits(0)


def test_a_short_wait_in_a_clean_step_is_not_held_against_it():
    blip = StepTimes(wall_s=0.00025, cpu_s=0.0002, waited=True)  # 50 us: a page fault
    short = StepTimes(wall_s=0.0009, cpu_s=0.0002, waited=True)  # 700 us: the GIL, a read
    assert judged((blip, True), (short, True), (short, True)).unjudged(0)
    assert judged((CHEAP, True), (short, True), (short, True)).cheap(0)
    assert judged((SLEPT, True), (SLEPT, True)).waits(0)  # 2.8 ms, twice: two strikes


def test_a_wait_among_busy_env_threads_counts_only_when_long():
    contended = StepTimes(wall_s=0.009, cpu_s=0.0008, waited=True)  # the GIL, not a sleep
    judge = judged((contended, False), (contended, False))
    assert judge.unjudged(0) and not judge.waits(0)
    long_wait = StepTimes(wall_s=WAITER_STEP_S + 0.002, cpu_s=0.0002, waited=True)
    assert judged((long_wait, False), (long_wait, False)).waits(0)  # two strikes
    very_long = StepTimes(wall_s=WAITED_S + 0.01, cpu_s=0.0002, waited=True)
    assert judged((CHEAP, False), (very_long, False)).waits(0)


def test_an_env_s_first_step_is_not_judged():
    judge = InlineJudge()
    for _ in range(WARMUP_STEPS):
        judge.record(0, LONG_WAIT, True)
    assert judge.unjudged(0) and judge.runs_inline(0)


def test_envs_are_judged_apart():
    judge = judged((LONG_WAIT, True))
    for _ in range(WARMUP_STEPS + 1):
        judge.record(1, CHEAP, True)
    assert judge.waits(0) and judge.cheap(1)
    assert judge.runs_inline(1) and not judge.runs_inline(0)


def test_once_envs_of_the_worker_were_judged_to_wait_the_others_keep_their_threads():
    judge = InlineJudge()
    for env in range(WAITING_SIBLINGS + 1):  # env 0 cheap, then waiters
        for _ in range(WARMUP_STEPS):
            judge.record(env, CHEAP, True)
        judge.record(env, CHEAP if env == 0 else LONG_WAIT, True)
    assert judge.runs_inline(0)  # judged cheap: still inline
    assert judge.unjudged(WAITING_SIBLINGS + 1) and not judge.may_probe()
    assert not judge.runs_inline(WAITING_SIBLINGS + 1)  # not probed: its thread


def test_a_step_that_only_computed_up_to_heavy_step_s_is_cheap_and_longer_strikes():
    # The cheapest env's own step, run after 20 ms asleep on a slow day, took up to
    # 1.06 ms of CPU: a bar of 1 ms struck such envs out.
    cold = StepTimes(wall_s=0.0016, cpu_s=HEAVY_STEP_S * 0.75, waited=False)
    assert judged((cold, True), (cold, True), (cold, True)).cheap(0)
    heavy = StepTimes(wall_s=0.003, cpu_s=HEAVY_STEP_S * 1.25, waited=False)
    assert judged((heavy, True), (heavy, True)).waits(0)  # two strikes: its thread
    assert judged((heavy, False), (heavy, False)).unjudged(0)  # unclean: never held against it
