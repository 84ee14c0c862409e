"""A remote host's supervisor: K env processes, each restarted when it dies.

``python -m workers --connect tcp://HOST:PORT --env pkg.mod:make --num-envs K``
runs this: it imports torch and torchrl once, then forks one worker process
per env (fast, like the pool's fork server). Each child has a stable
identity, ``<host>-<supervisor pid>-<k>-<nonce>`` (``--identity`` replaces
``<host>-<supervisor pid>``), so when it crashes and is
forked again it rejoins the pool as the same worker: the pool answers its
requests in flight with truncations, as for a local restart. The nonce (64
random bits, one per supervisor) keeps it unguessable: a ZeroMQ ROUTER keeps
a routing identity for whoever connects with it first, so another key's
holder who could name it (or its heartbeat socket's, ``<identity>!hb``)
ahead of the worker would have the worker's messages ignored. A child that cannot
register (exit code 2: refused by the pool for wrong specs or no free slot, no
answer within ``--register-timeout``, or specs too large to send) is not
restarted; nor is one whose env maker failed ``MAX_MAKER_FAILURES`` times in a
row before that child ever registered (a maker that cannot work). Once no child
is left, the supervisor exits non-zero (2 if a child was refused, else 1), with
a one-line error saying why each gave up. A child whose pool closed it (the
trainer's ``pool.close()``: exit code 0, and it noted the CLOSE) is no
failure (one that exits 0 otherwise, an env maker calling ``sys.exit(0)``, is a
death, backed off): it is started again after 0.05 s, never backed off
further, to wait for the next pool, and said at INFO level, not as a warning.
SIGTERM or SIGINT (how Kubernetes, SLURM or Ctrl-C stop a job) stops it at
once: it sends its children SIGTERM, SIGKILLs those still alive after a grace
period, and exits 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("workers")

REFUSED = 2
#: An env process whose env maker fails this many times in a row, before it ever
#: registered, is not restarted: that maker cannot work (a bug, a missing package).
MAX_MAKER_FAILURES = 5


def die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGKILL us when ``parent_pid`` dies, so no worker outlives its parent."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


_BACKOFF_S = (0.05, 5.0)
#: A child that lived this long died of something else than its start: the backoff
#: of its restart starts over (deaths are counted while they come quickly).
STABLE_S = 10.0
#: How often the supervisor looks for dead children and for a stop request.
_POLL_S = 0.1
#: How long children get to end after SIGTERM, when the supervisor stops, before SIGKILL.
_STOP_GRACE_S = 3.0


class _ChildNotes:
    """What each child tells its supervisor besides its exit code, in memory shared at fork.

    Per child: whether it ever registered with the pool, whether its last run
    ended on its pool's CLOSE, and the one-line reason of its last failure (an
    env maker's error, a refusal), for the supervisor's final error.
    """

    SIZE = 512

    def __init__(self, count: int) -> None:
        self.memory = mmap.mmap(-1, max(count, 1) * self.SIZE)

    def registered(self, k: int) -> bool:
        return self.memory[k * self.SIZE] == 1

    def reason(self, k: int) -> str:
        """The last failure child ``k`` noted, one line, or "" if none."""
        raw = self.memory[k * self.SIZE + 3 : (k + 1) * self.SIZE]
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def maker_failed(self, k: int) -> bool:
        return self.memory[k * self.SIZE + 1] == 1

    def closed(self, k: int) -> bool:
        """Whether child ``k``'s last run ended on its pool's CLOSE (cleared at each start)."""
        return self.memory[k * self.SIZE + 2] == 1

    def clear_failure(self, k: int) -> None:
        self.memory[k * self.SIZE + 1 : (k + 1) * self.SIZE] = bytes(self.SIZE - 1)

    def note(
        self,
        k: int,
        *,
        registered: bool = False,
        failure: str = "",
        maker: bool = False,
        closed: bool = False,
    ) -> None:
        """In child ``k``: it registered, its pool closed it, or it ends for ``failure``
        (the maker's: ``maker``)."""
        base = k * self.SIZE
        if registered:
            self.memory[base] = 1
        if closed:
            self.memory[base + 2] = 1
        if failure:
            text = " ".join(failure.split()).encode()[: self.SIZE - 4]
            self.clear_failure(k)
            self.memory[base + 1] = int(maker)
            self.memory[base + 3 : base + 3 + len(text)] = text


#: In a supervised child: its notes and its number (None elsewhere).
_mine: tuple[_ChildNotes, int] | None = None


def note_registered() -> None:
    """Tell the supervisor (if any) that this env process registered with the pool."""
    if _mine is not None:
        _mine[0].note(_mine[1], registered=True)


def note_closed() -> None:
    """Tell the supervisor (if any) that this env process ends because its pool closed."""
    if _mine is not None:
        _mine[0].note(_mine[1], closed=True)


def note_failure(reason: str, *, maker: bool = False) -> None:
    """Tell the supervisor (if any) why this env process is about to give up."""
    if _mine is not None:
        _mine[0].note(_mine[1], failure=reason, maker=maker)


class Supervisor:
    """Forks ``count`` children running ``run_child(k)`` and keeps them alive."""

    def __init__(
        self,
        count: int,
        run_child: Callable[[int, bytes], int],
        prefix: str | None = None,
        stable_s: float = STABLE_S,
    ) -> None:
        self.count = count
        self.run_child = run_child
        self.stable_s = stable_s
        self.children: dict[int, int] = {}  # pid -> k
        self.deaths: dict[int, int] = {}  # k -> consecutive quick deaths
        self.started: dict[int, float] = {}  # k -> when it was last forked (time.monotonic())
        self.restarts: dict[int, float] = {}  # k -> when to fork it again (time.monotonic())
        self.maker_failures: dict[int, int] = {}  # k -> env maker failures in a row
        #: k -> why that child was not restarted (one line each).
        self.gave_up: dict[int, str] = {}
        self.refused = False  # a child was refused by (or could not reach) the pool
        self.notes = _ChildNotes(count)
        self.stopping = False
        self.prefix = prefix or f"{socket.gethostname()}-{os.getpid()}"
        self.nonce = secrets.token_hex(8)

    def identity(self, k: int) -> bytes:
        """Child ``k``'s routing identity: ``<prefix>-<k>-<nonce>`` (prefix: ``--identity``)."""
        return f"{self.prefix}-{k}-{self.nonce}".encode()

    def start(self, k: int) -> None:
        identity = self.identity(k)
        supervisor = os.getpid()
        self.notes.clear_failure(k)  # before the fork: a quick child may note its own at once
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                global _mine
                _mine = (self.notes, k)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                die_with_parent(supervisor)  # no orphan env process if the supervisor dies
                code = self.run_child(k, identity)
            except SystemExit as exit_:  # os._exit below would swallow its message
                code = _exit_code(exit_)
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)
                    note_failure(exit_.code)
            except BaseException as err:
                traceback.print_exc()
                note_failure(f"{type(err).__name__}: {err}")
            finally:
                sys.stderr.flush()
                os._exit(code)
        self.children[pid] = k
        self.started[k] = time.monotonic()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        for k in range(self.count):
            self.start(k)
        while (self.children or self.restarts) and not self.stopping:
            self._reap_one()
        self._kill_all()
        if self.stopping or not self.gave_up:
            return 0
        return REFUSED if self.refused else 1

    def failure(self) -> str:
        """Why the children were not restarted, one line: ``env processes K, L: REASON; ...``."""
        by_reason: dict[str, list[int]] = {}
        for k, why in sorted(self.gave_up.items()):
            by_reason.setdefault(why, []).append(k)
        return "; ".join(
            f"env process{'es' if len(ks) > 1 else ''} {', '.join(map(str, ks))}: {why}"
            for why, ks in by_reason.items()
        )

    def _reap_one(self) -> None:
        """Reap a child that died and schedule its restart, or wait at most ``_POLL_S``.

        Never blocks for long, so that a stop request is seen at once. A blocking
        ``os.wait()`` was not enough: a signal does not end it, since Python runs the
        handler (which only sets ``stopping``) and then retries the call (PEP 475),
        so SIGTERM went unnoticed until a child happened to die. Nor does the
        restart backoff sleep here: a restart is due at a time, checked each pass.
        """
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child: only restarts are pending
            pid, status = 0, 0
        if pid == 0:
            self._start_due()
            return
        k = self.children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if k is None or self.stopping:
            return
        reason = self.notes.reason(k)
        if code == REFUSED:
            log.error("env process %d could not register with the pool; not restarting it", k)
            self.gave_up[k] = reason or "could not register with the pool"
            self.refused = True
            return
        if self.notes.maker_failed(k) and not self.notes.registered(k):
            failures = self.maker_failures[k] = self.maker_failures.get(k, 0) + 1
            if failures >= MAX_MAKER_FAILURES:
                log.error(
                    "env process %d: its env maker failed %d times in a row and it never "
                    "registered; not restarting it",
                    k,
                    failures,
                )
                self.gave_up[k] = f"its env maker failed {failures} times in a row: {reason}"
                return
        else:
            self.maker_failures.pop(k, None)
        if code == 0 and self.notes.closed(k):  # its pool closed it (CLOSE): no failure
            log.info("env process %d: its pool closed; starting it again for the next pool", k)
            self.restarts[k] = time.monotonic() + _BACKOFF_S[0]
            return
        if time.monotonic() - self.started.get(k, 0.0) >= self.stable_s:
            self.deaths.pop(k, None)  # it had been up a while: not one of a run of quick deaths
        delay = min(_BACKOFF_S[0] * 2 ** self.deaths.get(k, 0), _BACKOFF_S[1])
        self.deaths[k] = self.deaths.get(k, 0) + 1
        log.warning("env process %d (pid %d) ended (%d); restarting in %.2f s", k, pid, code, delay)
        self.restarts[k] = time.monotonic() + delay

    def _start_due(self) -> None:
        """Fork the children whose restart is due; else sleep until one is, ``_POLL_S`` at most."""
        now = time.monotonic()
        for k, when in sorted(self.restarts.items()):
            if when <= now and not self.stopping:
                del self.restarts[k]
                self.start(k)
        # A signal does not cut this sleep short either (PEP 475), hence the short bound.
        pause = min([_POLL_S, *(when - now for when in self.restarts.values())])
        time.sleep(max(pause, 0.0))

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _kill_all(self) -> None:
        """SIGTERM the children, reap them; SIGKILL those alive after ``_STOP_GRACE_S``."""
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            deadline = time.monotonic() + _STOP_GRACE_S
            while self.children and time.monotonic() < deadline:
                for pid in list(self.children):
                    try:
                        done, _ = os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:  # reaped already
                        done = pid
                    if done:
                        del self.children[pid]
                if self.children:
                    time.sleep(0.01)
            if not self.children:
                return
        log.error("env processes %s outlived SIGKILL; leaving them", sorted(self.children))


def _exit_code(exit_: SystemExit) -> int:
    """The process exit code ``sys.exit(code)`` means (a message: 1)."""
    if exit_.code is None:
        return 0
    return exit_.code if isinstance(exit_.code, int) else 1
