"""Which of a threaded worker's envs step in its main thread: the short, busy ones.

With env threads (``PoolConfig.env_threads``, on by default), each hosted env
steps in its own thread, so that an env that waits (a simulator sleeping, or
releasing the GIL in C) does not hold up the others. For an env whose step is
short Python work, the thread only costs: its step competes for the GIL with
the others' at every torch op, and a worker of 16 such envs stepped them at
a median of 5.4 ms of wall time and 563 us of CPU each, where the same step
inline took 47 us of both (measured in docs/PERFORMANCE.md, session 26).

So an env's step is *judged* by running it inline (in the worker's main
thread): its thread's CPU time, and whether the thread gave up the CPU on its
own (a voluntary context switch: a sleep, a blocking read, a lock) or was only
preempted (other processes need the CPU: on a busy machine wall time says
nothing). A step that gave up the CPU *waited*, for its wall time less its CPU
time. A step is *clean* if no env thread had anything to run meanwhile (with
others stepping, every step waits for the GIL, up to ~10 ms measured).

- An env not judged yet steps inline, as a probe, one a message, before the
  message's other commands (after waiting up to :data:`PROBE_WAIT_S` for the
  env threads to finish what they run, so that it is clean); the message's
  other envs not judged yet go to their threads. Then the commands for env
  threads are handed to them, then those of cheap envs run inline, in order.
  An env's first :data:`WARMUP_STEPS` are not judged: a first step imports
  modules and fills caches. Once :data:`WAITING_SIBLINGS` envs of the worker
  were judged to wait, the worker probes no more: its envs are mostly alike,
  and the others keep their threads, unjudged.
- A step that did not wait and took at most :data:`HEAVY_STEP_S` of CPU
  makes the env *cheap*, clean or not: it keeps stepping inline, each step
  judged again. What is timed is the env's own work: the reply's encoding
  and sending cost the same in any thread.
- A clean step that waited :data:`STRIKE_WAIT_S` or more, or took more CPU
  than :data:`HEAVY_STEP_S`, is a strike (a shorter wait, a page fault or
  the GIL taken by the heartbeat thread, is neither: measured, 50 us let
  cheap envs strike out on a busy machine); so is an unclean one that waited
  :data:`WAITER_STEP_S` or more. An env with :data:`STRIKES` strikes (a strike
  is forgiven after :data:`FORGIVE_AFTER` cheap steps in a row) steps in its
  thread for good; so does one whose clean step waited :data:`WAITER_STEP_S`
  or more, or whose unclean step waited :data:`WAITED_S` or more.

What this costs envs that wait: two or three steps of two of them run
inline, each holding up the commands that arrive meanwhile. It cannot tell an env that will wait
for another env of the same worker (a rendezvous) if that one was quick
whenever it was judged: such an env, stepping inline, is held up until its
wait ends (or forever); ``PoolConfig(inline_cheap_envs=False)`` keeps every
env in its thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import NamedTuple

#: An env's first steps inline are not judged (the first imports modules, fills caches).
WARMUP_STEPS = 1
#: A step of at most this much CPU that never waited is cheap enough to run inline; one
#: that computes longer gains from a thread (torch ops release the GIL, so a worker's
#: heavy envs compute in parallel). Measured (docs/PERFORMANCE.md, session 29), 2 envs
#: of one worker: computing 1.6 ms a step, 1.4-1.8x the steps/s in threads (and judged
#: so at this bar); 0.55 ms, no difference beyond the noise. The cheapest env's own step
#: (a CountingEnv) run after 20 ms asleep on a slow day took up to 1.06 ms of CPU
#: (1.65 ms with its reply): a bar of 1 ms struck such envs out.
HEAVY_STEP_S = 0.002
#: A clean step that waited this long is a strike (a shorter wait is a page fault, the GIL).
STRIKE_WAIT_S = 0.001
#: How long a probe waits for the env threads to finish what they run before it steps.
PROBE_WAIT_S = 0.001
#: A clean step that waited this long sends its env to its thread at once.
WAITER_STEP_S = 0.010
#: A step whose wall time exceeds its CPU time by less than this did not wait (no need
#: to ask the OS); waits up to STRIKE_WAIT_S make a step neither cheap nor a strike.
SHORT_WAIT_S = 0.00005
#: A step that waited this long sends its env to its thread even if others stepped
#: meanwhile (a cheap step among busy env threads was measured at up to 9.6 ms).
WAITED_S = 0.050
#: Strikes (clean steps that waited, or computed long) that send an env to its thread.
STRIKES = 2
#: Envs judged to wait after which a worker probes no other env (they are mostly alike).
WAITING_SIBLINGS = 2
#: Cheap steps in a row after which an env's strikes are forgiven (a GC pause is not a wait).
FORGIVE_AFTER = 100


class StepTimes(NamedTuple):
    """An inline step, timed: wall clock, the thread's CPU time, and whether it gave up
    the CPU on its own (a voluntary context switch) at least once."""

    wall_s: float
    cpu_s: float
    waited: bool


@dataclasses.dataclass
class _Verdict:
    """One env's record: its steps timed, strikes, cheap steps since the last, verdicts."""

    steps: int = 0
    strikes: int = 0
    cheap_run: int = 0
    cheap: bool = False
    waits: bool = False


class InlineJudge:
    """Per env: run its next command inline, or in its thread? See the module docstring."""

    def __init__(self) -> None:
        self._verdicts: dict[int, _Verdict] = {}
        self._cheap: set[int] = set()  # the envs judged cheap (and not to wait)
        self._waiters = 0  # the envs judged to wait

    def runs_inline(self, env: int) -> bool:
        """Whether env ``env``'s next command may run inline (its thread being idle):
        if it was judged cheap, or, not judged yet, as a probe (see :meth:`may_probe`)."""
        if env in self._cheap:
            return True
        verdict = self._verdicts.get(env)
        return (verdict is None or not verdict.waits) and self.may_probe()

    def may_probe(self) -> bool:
        """Whether an env not judged yet may step inline to be judged: not once
        :data:`WAITING_SIBLINGS` envs of this worker were judged to wait (a worker's
        envs are mostly alike: the others then keep their threads, unjudged)."""
        return self._waiters < WAITING_SIBLINGS

    def record(self, env: int, step: StepTimes, clean: bool) -> None:
        """How an inline step of env ``env`` went; ``clean``: no env thread had anything to run."""
        verdict = self._verdicts.setdefault(env, _Verdict())
        verdict.steps += 1
        if verdict.waits or verdict.steps <= WARMUP_STEPS:  # judged for good, or warming up
            return  # (a first step imports modules, fills caches: it says nothing)
        waited_s = step.wall_s - step.cpu_s if step.waited else 0.0
        if not step.waited and step.cpu_s <= HEAVY_STEP_S:  # clean or not: it only computed
            verdict.cheap = True
            self._cheap.add(env)
            verdict.cheap_run += 1
            if verdict.cheap_run >= FORGIVE_AFTER:
                verdict.strikes = verdict.cheap_run = 0
            return
        if clean:
            if waited_s < STRIKE_WAIT_S and step.cpu_s <= HEAVY_STEP_S:
                return  # a short wait (a page fault, the GIL, a log line): neither
            self._strike(env, verdict, waited_s >= WAITER_STEP_S)
        elif waited_s >= WAITER_STEP_S:  # others stepped too, and held the GIL: only long waits
            self._strike(env, verdict, waited_s >= WAITED_S)

    def _strike(self, env: int, verdict: _Verdict, out: bool) -> None:
        verdict.strikes += 1
        verdict.cheap_run = 0
        if out or verdict.strikes >= STRIKES:
            verdict.waits, verdict.cheap = True, False
            self._cheap.discard(env)
            self._waiters += 1

    def unjudged(self, env: int) -> bool:
        """Whether env ``env`` has no verdict yet (a step of it inline is a probe)."""
        verdict = self._verdicts.get(env)
        return verdict is None or not (verdict.cheap or verdict.waits)

    def waits(self, env: int) -> bool:
        """Whether env ``env`` was judged to wait (it steps in its thread for good)."""
        verdict = self._verdicts.get(env)
        return verdict is not None and verdict.waits

    def cheap(self, env: int) -> bool:
        """Whether env ``env`` was judged cheap (it steps inline)."""
        return env in self._cheap

    def all_cheap(self, envs: Collection[int]) -> bool:
        """Whether every env of ``envs`` was judged cheap."""
        return self._cheap.issuperset(envs)
