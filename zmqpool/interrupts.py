"""A Ctrl-C lands between a pool's steps, never inside one.

A ``KeyboardInterrupt`` is raised wherever the main thread happens to be. Inside
a pool call that can be between the frames of a message, between a reply's
arrival and its delivery, or between a request's bookkeeping and its send: the
request is then lost, and its env stays busy for good. So while the main thread
holds a pool's gate, the pool's SIGINT handler (installed over whatever handler
was there, which it calls) holds the interrupt back, and raises it where
nothing is half done:

- before the call waits on its sockets or on another thread
  (:func:`wait_begins`), or while it waits, unless the call is held whole
  (:data:`WHOLE`: the sync calls, whose waits would leave requests behind);
- when the call ends; a recv then puts back the replies it took, for the next
  recv (:meth:`~zmqpool.pool.ZMQAsyncEnvPool._results`).

A second Ctrl-C while one is held is raised at once, as before: a wait that is
not on the sockets (a fork server that stopped answering, a send at its
high-water mark) stays interruptible, at the price of what it was doing.

Nothing here costs a system call: the handler is installed once, and holding
is a counter. Threads other than the main one never see a ``KeyboardInterrupt``
and are not counted. Only a Python-level handler is wrapped: with ``SIG_IGN``
or ``SIG_DFL`` (or a handler set outside Python) nothing is installed.
"""

from __future__ import annotations

import signal
import threading
from _signal import getsignal as _raw_handler  # signal.getsignal's enum lookup costs 4 us
from collections.abc import Callable
from types import FrameType
from typing import Any

_MAIN = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)
_get_ident = threading.get_ident

Handler = Callable[[int, FrameType | None], Any]


class InterruptState:
    """The main thread's place in pool calls, which the SIGINT handler reads.

    Set with plain attribute stores where it matters: a Python call is a point
    where a pending signal's handler may run, a store is not.
    """

    #: Pool calls the main thread is in (gates it holds, nested or not).
    depth = 0
    #: The main thread waits inside a pool call: an interrupt goes through at once.
    waiting = False
    #: The interrupt held back: the handler to call, and its arguments.
    held: tuple[Handler, int, FrameType | None] | None = None
    #: Pool calls the main thread is in that are held whole, waits and all (sync calls).
    whole = 0
    #: Pools open in this process: the handler is put back when none is left.
    pools = 0


STATE = InterruptState()


def attach() -> None:
    """A pool starts: install the handler (now, or at its first call in the main thread)."""
    STATE.pools += 1
    _install()


def detach() -> None:
    """A pool closes: with none left open, put back the handler it wrapped (if still its own)."""
    STATE.pools = max(0, STATE.pools - 1)
    if STATE.pools or _get_ident() != _MAIN:
        return
    current: Any = _raw_handler(_SIGINT)
    if _is_ours(current):
        signal.signal(signal.SIGINT, current._previous)


def hold() -> bool:
    """A pool call starts (before it takes its gate): in the main thread, hold interrupts back.

    Returns whether it holds (the main thread), for :func:`unhold`. The count is
    raised last: an interrupt before it is raised at once, with nothing taken.
    """
    if _get_ident() != _MAIN:
        return False
    state = STATE
    if state.pools and not getattr(_raw_handler(_SIGINT), "_zmqpool_holds", False):
        _install()  # not yet, or the caller set a handler of its own since: wrap that one
    if state.depth == 0:
        state.waiting = False
        state.whole = 0  # left raised by a call that an interrupt ended: it has ended
    state.depth += 1
    return True


def unhold() -> None:
    """Undo :func:`hold` for a call that failed to start; the exception raised stands for all."""
    STATE.depth -= 1
    if STATE.depth == 0:
        STATE.held = None


def release() -> None:
    """A pool call ends (its gate let go): at the outermost level, raise what was held back."""
    if _get_ident() != _MAIN:
        return
    state = STATE
    state.depth -= 1
    if state.depth == 0 and state.held is not None:
        raise_held()


def raise_held() -> None:
    """Call the handler of the interrupt held back, if any (which raises, as a rule)."""
    held = STATE.held
    if held is not None:
        STATE.held = None
        handler, signum, frame = held
        handler(signum, frame)


def wait_begins() -> bool:
    """A pool call is about to wait: raise what is held, then let interrupts through.

    Returns whether it opened the wait (the main thread, in a call, not waiting
    already); if so, the caller ends it with ``STATE.waiting = False`` in a
    ``finally`` (a store, not a call: a call is where a pending handler may
    run). An interrupt raised between this return and the caller's ``try``
    leaves ``waiting`` set; the next outermost :func:`hold` clears it.
    """
    state = STATE
    if _get_ident() != _MAIN or not state.depth or state.waiting or state.whole:
        return False
    raise_held()
    state.waiting = True
    return True


class Whole:
    """A call held whole: a Ctrl-C waits for its end, through its waits too (the sync calls).

    A sync ``step``, ``reset`` or ``set_seed`` interrupted in a wait would
    leave its requests in flight, and the next sync call would find them; held
    to its end, it is raised once every env answered (a second Ctrl-C still
    goes through at once). Use as ``with WHOLE:`` inside a pool call.
    """

    def __enter__(self) -> None:
        if _get_ident() == _MAIN:
            STATE.whole += 1

    def __exit__(self, *exc: object) -> None:
        if _get_ident() == _MAIN:
            STATE.whole -= 1


WHOLE = Whole()


def _install() -> None:
    if threading.get_ident() != _MAIN:
        return
    current = _raw_handler(_SIGINT)
    if not callable(current) or _is_ours(current):
        return  # SIG_IGN, SIG_DFL or a C-level handler: a Ctrl-C does not raise in Python
    signal.signal(signal.SIGINT, _holding(current))


def _is_ours(handler: Any) -> bool:
    return getattr(handler, "_zmqpool_holds", False)


def _holding(previous: Handler) -> Handler:
    """A SIGINT handler over ``previous``: held back in a pool call, else ``previous``.

    One per handler wrapped, each with its own ``previous``: a caller that sets
    a handler of its own and later puts back the one it found gets this one's
    behaviour back, not that of the handler it replaced in between.
    """

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        state = STATE
        if state.depth and not state.waiting and state.held is None:
            state.held = (previous, signum, frame)
            return
        state.held = None  # in a wait, or a second Ctrl-C: at once
        previous(signum, frame)

    on_sigint._zmqpool_holds = True  # type: ignore[attr-defined]
    on_sigint._previous = previous  # type: ignore[attr-defined]
    return on_sigint
