"""A Ctrl-C lands between a pool's steps, never inside one.

A ``KeyboardInterrupt`` is raised wherever the main thread happens to be. Inside
a pool call that can be between the frames of a message, between a reply's
arrival and its delivery, or between a request's bookkeeping and its send: the
request is then lost, and its env stays busy for good. So while the main thread
holds a pool's gate, the pool's SIGINT handler (installed over whatever handler
was there, which it calls) holds the interrupt back, and raises it where
nothing is half done:

- before the call waits on its sockets or on another thread (:func:`unheld`),
  or while it waits;
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


class _State:
    """The main thread's holding depth, the interrupt held back, and how many pools are open."""

    depth = 0
    held: tuple[Handler, int, FrameType | None] | None = None
    pools = 0


_state = _State()


def attach() -> None:
    """A pool starts: install the handler (now, or at its first call in the main thread)."""
    _state.pools += 1
    _install()


def detach() -> None:
    """A pool closes: with none left open, put back the handler it wrapped (if still its own)."""
    _state.pools = max(0, _state.pools - 1)
    if _state.pools or threading.get_ident() != _MAIN:
        return
    current: Any = _raw_handler(_SIGINT)
    if _is_ours(current):
        signal.signal(signal.SIGINT, current._previous)


def hold() -> None:
    """The calling thread takes a pool's gate: in the main thread, hold interrupts back."""
    if _get_ident() != _MAIN:
        return
    state = _state
    if state.pools and not getattr(_raw_handler(_SIGINT), "_zmqpool_holds", False):
        _install()  # not yet, or the caller set a handler of its own since: wrap that one
    state.depth += 1


def release() -> None:
    """The gate is let go: at the outermost level, raise an interrupt held meanwhile."""
    if _get_ident() != _MAIN:
        return
    state = _state
    state.depth -= 1
    if state.depth == 0 and state.held is not None:
        raise_held()


def raise_held() -> None:
    """Call the handler of the interrupt held back, if any (which raises, as a rule)."""
    held = _state.held
    if held is not None:
        _state.held = None
        handler, signum, frame = held
        handler(signum, frame)


def unheld() -> int:
    """Before a wait: raise what is held, and let interrupts through until :func:`reheld`."""
    if threading.get_ident() != _MAIN:
        return 0
    depth, _state.depth = _state.depth, 0
    try:
        raise_held()
    except BaseException:
        _state.depth = depth
        raise
    return depth


def reheld(depth: int) -> None:
    """After a wait: hold interrupts back again, at the depth :func:`unheld` returned."""
    if depth:
        _state.depth = depth


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
        if _state.depth and _state.held is None:
            _state.held = (previous, signum, frame)
            return
        _state.held = None  # a second Ctrl-C: at once, whatever was half done
        previous(signum, frame)

    on_sigint._zmqpool_holds = True  # type: ignore[attr-defined]
    on_sigint._previous = previous  # type: ignore[attr-defined]
    return on_sigint
