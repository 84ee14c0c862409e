"""Local worker processes: start, watch, stop.

A local worker runs ``python -m workers``'s code. Its env makers reach it
cloudpickled through a pipe from this process (local and trusted), never over
a socket, which is why lambdas and closures work here while torchrl's
spawn-based pool rejects them. Its death is seen at once through a pidfd that
the broker polls next to its sockets.

Two ways to start one, behind one interface (:class:`WorkerProcess`):

- :class:`ForkServer` (default): a zygote process that imported torch and
  torchrl once forks each worker in tens of milliseconds, so a restart costs
  milliseconds, not the seconds of a fresh interpreter's imports;
- :class:`LocalProcess`: a fresh interpreter per worker (the fallback).

Any of these processes may die, the fork server included (the OOM killer
picks processes by size, and a zygote with torch loaded is a candidate). The
workers it forked die with it (``PR_SET_PDEATHSIG``), and their pidfds, ours,
still say so at once; only their exit status is lost, since the zygote was the
one that reaped them. The :class:`Launcher` then warns once
(:class:`ForkServerWarning`) and starts a new fork server without waiting for
it: while it imports torch, a restart is put off
(:class:`ForkServerStarting`), not the trainer. After
:data:`FORK_SERVER_REPLACEMENTS` replacements it gives up on fork servers and
starts fresh interpreters, as with ``PoolConfig(fork_server=False)``.

The fork server and fresh interpreters die with the trainer the same way;
they are started from one thread that lives as long as the process
(:class:`_Spawner`), since the signal fires when the parent *thread* ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn, Protocol

import cloudpickle

log = logging.getLogger("zmqpool")


def pickle_recipes(
    indices: Sequence[int],
    makers: Sequence[Any],
    kwargs: Sequence[dict],
    identity: str,
    curve: tuple[bytes, bytes, bytes] | None = None,
) -> bytes:
    """The stdin payload of a local worker; fails here, naming the env, if a maker won't pickle.

    ``identity``, its routing identity (``w<index>.<secret>``), travels here, not on its
    command line: ``/proc/PID/cmdline`` is every user's to read. So does ``curve``, over
    loopback TCP (``local_transport="tcp"``): the pool's public key and the worker's
    own pair (z85), which the pool made and authorized for it, so that no other
    process of the machine completes a handshake with its ports. The stdin pipe (or
    the fork server's) is the trainer's alone.
    """
    recipes = []
    for index, maker, kw in zip(indices, makers, kwargs, strict=True):
        try:
            cloudpickle.dumps(maker)
        except Exception as err:
            raise TypeError(
                f"env maker {index} ({maker!r}) cannot be sent to a worker process: {err}"
            ) from err
        recipes.append((maker, dict(kw)))
    payload = {
        "indices": list(indices),
        "recipes": recipes,
        "sys_path": list(sys.path),
        "identity": identity,
        "curve": None if curve is None else list(curve),
    }
    return cloudpickle.dumps(payload)


class WorkerProcess(Protocol):
    """What the broker and the pool need of a worker process."""

    @property
    def pid(self) -> int: ...
    @property
    def pidfd(self) -> int: ...

    def exit_status(self) -> int | None: ...
    def exit_cause(self) -> str | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout_s: float) -> bool: ...
    def release(self) -> None: ...


class _Spawner:
    """The one thread this process starts its fork servers and fresh-interpreter workers from.

    ``PR_SET_PDEATHSIG``, by which they die with the trainer, fires when the
    *thread* that started them ends, not the process: a pool made in a thread
    that then returns (an executor's, an evaluation thread's) lost its workers
    and the shared fork server with them. This daemon thread lives as long as
    the process (a forked child makes its own), so they die only with the process.
    """

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="zmqpool-spawner", daemon=True).start()

    def _run(self) -> None:
        while True:
            start, future = self._requests.get()
            try:
                future.set_result(start())
            except BaseException as err:  # for the caller to raise
                future.set_exception(err)

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(*args, **kwargs)``, started from this thread (waits for it)."""
        future: Future[subprocess.Popen] = Future()
        self._requests.put((lambda: subprocess.Popen(*args, **kwargs), future))
        try:
            return future.result()
        except BaseException:
            future.add_done_callback(_kill_unclaimed)  # interrupted (Ctrl-C): nobody holds it
            raise


def _kill_unclaimed(future: Future[subprocess.Popen]) -> None:
    if future.exception() is None:
        proc = future.result()
        proc.kill()
        proc.wait()


_SPAWNER: _Spawner | None = None
_SPAWNER_LOCK = threading.Lock()


def _popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """Start a child process that dies with this process, whichever thread asks (see _Spawner)."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = _Spawner()
        spawner = _SPAWNER
    return spawner.popen(*args, **kwargs)


def _new_spawner() -> None:
    global _SPAWNER, _SPAWNER_LOCK
    _SPAWNER, _SPAWNER_LOCK = None, threading.Lock()  # a forked child: the thread is not here


os.register_at_fork(after_in_child=_new_spawner)


def _child_env() -> dict[str, str]:
    """The environment of a worker: ours, with our sys.path importable (as multiprocessing does)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


class _Watched:
    """What both kinds of worker process share: a pidfd, released once."""

    pidfd: int

    def exit_cause(self) -> str | None:
        """Why it died when its exit status cannot say (None: the status says it)."""
        return None

    def kill(self) -> None:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        """Kill if still alive, reap, and close the pidfd."""
        self.kill()
        self.wait(5.0)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class LocalProcess(_Watched):
    """One worker in a fresh interpreter, and the pidfd that says when it exits."""

    def __init__(self, argv: list[str], payload: bytes, cpu_affinity: Sequence[int] | None) -> None:
        self.argv = argv
        self.proc = _popen(
            argv,
            stdin=subprocess.PIPE,
            close_fds=True,
            env=_child_env(),
            preexec_fn=_affinity_setter(cpu_affinity),
        )
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it already died; the pidfd will say so
        self.pidfd = os.pidfd_open(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_status(self) -> int | None:
        """None while alive; the exit code (negative: the signal) once dead."""
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return False
        return True


def _affinity_setter(cpu_affinity: Sequence[int] | None):
    if cpu_affinity is None:
        return None
    cpus = set(cpu_affinity)

    def set_affinity() -> None:
        os.sched_setaffinity(0, cpus)

    return set_affinity


#: The fork server's reports on its pipe: (kind, pid, exit code).
REPORT = struct.Struct("!iii")
#: ``READY``: its imports are done (pid 0), so a fork now takes milliseconds.
SPAWNED, EXITED, READY = 1, 2, 3

#: The exit code of a worker whose env thread died (``workers.threads``):
#: sysexits' EX_SOFTWARE. Its traceback is on the worker's stderr.
ENV_THREAD_DIED = 70

#: One lock for every fork server of this process and for who holds them
#: (:mod:`zmqpool.forkservers`): reading a zygote's end of file, under it,
#: calls its ``on_death``, which may close it and start another; with one
#: lock, no two threads can take two locks in opposite orders. Held for a
#: fork (milliseconds, unless the zygote is still importing) and a read of
#: its reports, never on an env step's path.
FORK_LOCK = threading.RLock()


def _new_fork_lock() -> None:
    global FORK_LOCK
    FORK_LOCK = threading.RLock()  # a forked child: another thread may have held ours


os.register_at_fork(after_in_child=_new_fork_lock)

#: New fork servers started after the first died, before the launcher gives up
#: on them and starts fresh interpreters: a zygote the OOM killer keeps choosing
#: would otherwise cost a torch import every time.
FORK_SERVER_REPLACEMENTS = 3


def describe_status(status: int | None) -> str:
    """An exit status (negative: the signal) for people: ``killed by SIGKILL``."""
    if status is None:
        return "exited (status unknown)"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    if status == ENV_THREAD_DIED:
        return f"exited with code {status}: an env thread died (traceback on the worker's stderr)"
    return f"exited with code {status}"


class ForkServerWarning(RuntimeWarning):
    """The fork server died (or the pool stopped using it); warned once per event."""


class ForkServerStarting(RuntimeError):
    """A new fork server is still importing torch: no worker can be forked yet.

    The supervisor puts the restart off by :attr:`retry_after_s` instead of
    making the trainer wait seconds for the imports.
    """

    retry_after_s = 0.05


class ForkServerDied(OSError):
    """The fork server died (or stopped answering) while asked to fork."""


class _Vanished(OSError):
    """A forked worker was gone, and reaped, before we could open its pidfd."""


def _warn(message: str) -> None:
    log.warning("%s", message)
    warnings.warn(message, ForkServerWarning, stacklevel=2)


#: Where our ``workers`` package is: installed (or checked out) beside ``zmqpool``.
_WORKERS_DIR = Path(__file__).resolve().parents[1] / "workers"

#: ``python -m MODULE`` with *our* ``workers`` package: ``-m`` would import the
#: first ``workers`` on sys.path, and a user's project may well have its own
#: (the trainer's script folder and working directory come first). The rest of
#: our sys.path comes in through PYTHONPATH.
_RUN_MODULE = """\
import importlib.util, runpy, sys
where, module = sys.argv.pop(1), sys.argv.pop(1)
spec = importlib.util.spec_from_file_location(
    "workers", where + "/__init__.py", submodule_search_locations=[where])
sys.modules["workers"] = package = importlib.util.module_from_spec(spec)
spec.loader.exec_module(package)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def module_argv(module: str) -> list[str]:
    """The command line of ``python -m module`` (a module of our ``workers`` package)."""
    return [sys.executable, "-c", _RUN_MODULE, str(_WORKERS_DIR), module]


#: How many leading items of :func:`worker_argv` name the program (the rest are its arguments).
_PROGRAM_ARGS = len(module_argv("workers"))


def worker_argv(
    router: str,
    indices: Sequence[int],
    heartbeat_s: float,
    env_threads: bool = False,
    torch_threads: int | None = None,
    inline_cheap: bool = True,
    default_dtype: str = "float32",
) -> list[str]:
    threads = ["--env-threads"] if env_threads and len(indices) > 1 else []
    if threads and not inline_cheap:
        threads.append("--no-inline-cheap")
    if torch_threads is not None:
        threads += ["--torch-threads", str(torch_threads)]
    if default_dtype != "float32":  # the trainer's torch.set_default_dtype
        threads += ["--default-dtype", default_dtype]
    return [
        *module_argv("workers"),
        "--connect",
        router,
        "--env-indices",
        ",".join(str(i) for i in indices),
        "--maker-stdin",
        "--parent-pid",
        str(os.getpid()),
        "--heartbeat-interval",
        str(heartbeat_s),
        *threads,
    ]


#: How long a worker's death waits for its fork server's report of its exit status
#: (sent as the zygote reaps it: milliseconds, unless the zygote is stopped or wedged).
REPORT_WAIT_S = 1.0


class ForkedProcess(_Watched):
    """A worker forked by the :class:`ForkServer`; the zygote reaps it and reports its status."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.server = server
        self.pidfd = os.pidfd_open(pid)  # ProcessLookupError: already dead and reaped
        self._status: int | None = None
        self._status_known = False
        #: its death was waited on for a report once: a zygote that is stopped
        #: (alive, silent) holds up a recv once per death, not at each question.
        self._report_awaited = False

    def _dead(self, timeout_s: float) -> bool:
        if self.pidfd < 0:
            return True
        ready, _, _ = select.select([self.pidfd], [], [], max(timeout_s, 0.0))
        return bool(ready)

    def exit_status(self) -> int | None:
        """None while alive; then the zygote's report, or None if it died before reporting."""
        if self._status_known:
            return self._status
        if not self._dead(0.0):
            return None
        wait_s = 0.0 if self._report_awaited else REPORT_WAIT_S
        self._report_awaited = True
        self._status = self.server.status_of(self.pid, wait_s=wait_s)
        # A live zygote that has not reported yet may still; a dead one never will.
        self._status_known = self._status is not None or not self.server.alive()
        return self._status

    def exit_cause(self) -> str | None:
        if self.exit_status() is not None or self.server.alive():
            return None
        return f"killed with its fork server (pid {self.server.pid}, {self.server.describe()})"

    def kill(self) -> None:
        if self.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def wait(self, timeout_s: float) -> bool:
        return self._dead(timeout_s)


class ForkServer:
    """The client of ``workers.zygote``: ask it to fork a worker, learn how children died.

    Its report pipe is the only way to its children's exit statuses; end of
    file on it means the zygote is gone (``on_death`` is called once, unless
    we closed it). Nothing here ever reads a closed pipe: the processes it
    forked keep asking it for statuses after its death, and get what was
    read before.

    The pools of one process may share it (:mod:`zmqpool.forkservers`), each
    from its own thread: :data:`FORK_LOCK` keeps a request and the report
    that answers it together.
    """

    def __init__(self, on_death: Callable[[ForkServer], None] | None = None) -> None:
        # Its reports come on a pipe of their own: its stdout is the trainer's, for envs' prints.
        self._reports, write_end = os.pipe()
        try:
            self.proc = _popen(
                [*module_argv("workers.zygote"), str(os.getpid()), str(write_end)],
                stdin=subprocess.PIPE,
                pass_fds=(write_end,),
                close_fds=True,
                env=_child_env(),
            )
        except BaseException:
            os.close(self._reports)
            raise
        finally:
            os.close(write_end)  # the zygote's now: its end of file is the zygote's death
        self.on_death = on_death
        self.started_at = time.monotonic()
        self.statuses: dict[int, int] = {}
        self.ready = False  # READY read: it has imported torch and forks in milliseconds
        self.closed = False  # our side of its pipes is closed
        self._eof = False  # its report pipe ended: it is dead
        self._closing = False
        self._killed_because: str | None = None  # why the pool killed it, if it did
        self._spawned: list[int] = []
        self._partial = b""
        self._lock = FORK_LOCK

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """Whether it can still fork (reads what it reported so far; never waits)."""
        self._read_reports(0.0)
        return not self.exited()

    def exited(self) -> bool:
        """Whether it is known to be gone, without reading its pipe."""
        return self.closed or self._eof or self.proc.poll() is not None

    def describe(self) -> str:
        """How it ended (after its death): ``killed by SIGKILL``, or why the pool killed it."""
        if self._killed_because is not None:  # "killed by SIGKILL" alone would blame someone else
            return f"killed by the pool: it {self._killed_because}"
        return describe_status(self.proc.poll())

    def start(
        self, argv: list[str], payload: bytes, cpu_affinity: Sequence[int] | None, timeout_s: float
    ) -> ForkedProcess:
        """Fork a worker running ``argv`` (the arguments after ``python -m workers``).

        Waits for the fork (through the imports, for a zygote not yet ready).
        Raises :class:`ForkServerDied` if the zygote is dead or does not answer
        within ``timeout_s`` (it is then killed).
        """
        argv = _with_parent(argv, self.proc.pid)  # a forked worker's parent is the zygote
        request = cloudpickle.dumps(
            {
                "argv": argv,
                "payload": payload,
                "affinity": cpu_affinity,
                # The trainer's as they are now: a shared zygote started earlier.
                "environ": _child_env(),
                "cwd": os.getcwd(),
            }
        )
        with self._lock:
            return self._fork(request, timeout_s)

    def _fork(self, request: bytes, timeout_s: float) -> ForkedProcess:
        if not self.alive():
            raise ForkServerDied(f"the fork server (pid {self.pid}) is dead")
        deadline = time.monotonic() + timeout_s
        try:
            sent = self._send(len(request).to_bytes(8, "big") + request, deadline)
        except OSError as err:  # BrokenPipeError: it died since
            raise ForkServerDied(f"the fork server (pid {self.pid}) is dead: {err}") from err
        if not sent:  # half a request may be in its pipe: it cannot be used again anyway
            self._unresponsive(self._silent("did not read a fork request", timeout_s))
        while not self._spawned:
            if not self.alive():
                raise ForkServerDied(f"the fork server (pid {self.pid}) died while forking")
            if time.monotonic() > deadline:
                self._unresponsive(self._silent("did not answer", timeout_s))
            self._read_reports(0.1)
        pid = self._spawned.pop(0)
        try:
            return ForkedProcess(pid, self)
        except ProcessLookupError as err:
            self.statuses.pop(pid, None)
            raise _Vanished(f"forked worker {pid} died before it could be watched") from err

    def _send(self, data: bytes, deadline: float) -> bool:
        """Write ``data`` into its stdin by ``deadline``; False if it did not take it in time.

        A request holds the env makers, easily more than the pipe's 64 KiB; a
        blocking write to a zygote that stopped reading (SIGSTOP, wedged) would
        block for ever, in the trainer's recv and holding the locks that
        ``close()`` needs. The pipe is non-blocking: one write when it has room.
        """
        assert self.proc.stdin is not None
        fd = self.proc.stdin.fileno()  # written only here, never through the buffered file
        os.set_blocking(fd, False)
        view = memoryview(data)
        while True:
            with contextlib.suppress(BlockingIOError):  # full: nothing written
                view = view[os.write(fd, view) :]
            if not view:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            select.select([], [fd], [], remaining)  # room, or its death (then EPIPE)

    def _silent(self, what: str, timeout_s: float) -> str:
        # It reads requests only once its imports are done: then "silent" means importing.
        doing = "" if self.ready else ", still importing torch"
        return f"{what} within {timeout_s} s{doing}"

    def _unresponsive(self, what: str) -> NoReturn:
        self._killed_because = what
        self.proc.kill()  # a zygote that does not answer is as good as dead
        self._read_reports(1.0)  # its end of file: on_death
        raise ForkServerDied(f"the fork server (pid {self.pid}) {what}")

    def status_of(self, pid: int, wait_s: float) -> int | None:
        """A dead child's exit status, as the zygote reported it (None: no report came)."""
        deadline = time.monotonic() + wait_s
        while pid not in self.statuses and not (self.closed or self._eof):
            remaining = deadline - time.monotonic()
            self._read_reports(min(max(remaining, 0.0), 0.01))  # once at least: it may be in
            if remaining <= 0:
                break
        return self.statuses.pop(pid, None)

    def _read_reports(self, timeout_s: float) -> None:
        with self._lock:
            self._read_reports_unlocked(timeout_s)

    def _read_reports_unlocked(self, timeout_s: float) -> None:
        if self.closed or self._eof:
            return
        fd = self._reports
        ready, _, _ = select.select([fd], [], [], max(timeout_s, 0.0))
        if not ready:
            return
        chunk = os.read(fd, 65536)
        if not chunk:
            self._on_eof()
            return
        data = self._partial + chunk
        cut = len(data) - len(data) % REPORT.size
        self._partial = data[cut:]
        for offset in range(0, cut, REPORT.size):
            kind, pid, status = REPORT.unpack_from(data, offset)
            if kind == SPAWNED:
                self._spawned.append(pid)
            elif kind == EXITED:
                self.statuses[pid] = status
            elif kind == READY:
                self.ready = True

    def _on_eof(self) -> None:
        """Its pipe closes as it exits: reap it (briefly), then say so, unless we closed it."""
        self._eof = True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)
        if not self._closing and self.on_death is not None:
            self.on_death(self)

    def close(self) -> None:
        """End it: end of file on its stdin makes it reap and report its last children and exit.

        What it reports before exiting (the exit codes of the workers stopped
        just before) stays readable through :meth:`status_of`. A zygote still
        there after a second is killed.
        """
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self._closing = True
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        deadline = time.monotonic() + 1.0
        while not self._eof and (remaining := deadline - time.monotonic()) > 0:
            self._read_reports(remaining)
        self.closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):
            os.close(self._reports)


def _with_parent(argv: list[str], parent_pid: int) -> list[str]:
    argv = list(argv)
    if "--parent-pid" in argv:
        argv[argv.index("--parent-pid") + 1] = str(parent_pid)
    return argv


class ForkServers(Protocol):
    """Where a :class:`Launcher` gets its fork server, and gives it back.

    :class:`PrivateForkServers` starts one per launcher and calls its
    ``on_death`` as soon as any read finds the zygote gone;
    :class:`zmqpool.forkservers.SharedForkServers` lends one to the pools of
    a process, and each launcher sees its death itself, in its own thread, the
    next time it asks whether it is alive. Either way the launcher then
    releases the dead one and acquires another.
    """

    def acquire(self, on_death: Callable[[ForkServer], None]) -> ForkServer: ...
    def release(self, server: ForkServer, on_death: Callable[[ForkServer], None]) -> None: ...


class PrivateForkServers:
    """A fork server of its own for each launcher: its death touches only that pool's workers."""

    def acquire(self, on_death: Callable[[ForkServer], None]) -> ForkServer:
        return ForkServer(on_death=on_death)

    def release(self, server: ForkServer, on_death: Callable[[ForkServer], None]) -> None:
        server.close()


class Launcher:
    """Starts local workers, through the fork server when it is enabled and alive.

    The fork server comes from ``servers`` (one of its own unless told). A
    dead one is replaced at once (the replacement imports torch in the
    background; until it is ready, :meth:`start` raises
    :class:`ForkServerStarting`), up to :data:`FORK_SERVER_REPLACEMENTS`
    times; then, or if a replacement cannot start, workers start as fresh
    interpreters. Each of these events is warned once
    (:class:`ForkServerWarning`, and the ``zmqpool`` log).
    """

    def __init__(
        self, use_fork_server: bool, timeout_s: float, servers: ForkServers | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.use_fork_server = use_fork_server
        self.servers = servers if servers is not None else PrivateForkServers()
        self.fork_server: ForkServer | None = None
        #: how many fork servers were started to replace a dead one.
        self.replacements = 0

    @property
    def fork_server_pid(self) -> int | None:
        """The pid of the fork server in use (None: none running, or fresh interpreters)."""
        server = self.fork_server
        if server is None or not server.alive():
            return None
        return server.pid

    def start(
        self, argv: list[str], payload: bytes, cpu_affinity: Sequence[int] | None
    ) -> WorkerProcess:
        """Start one worker; raises :class:`ForkServerStarting` while a replacement zygote loads."""
        with FORK_LOCK:  # a shared zygote's death, read by another pool, replaces ours
            return self._start(argv, payload, cpu_affinity)

    def _start(
        self, argv: list[str], payload: bytes, cpu_affinity: Sequence[int] | None
    ) -> WorkerProcess:
        for _ in range(3):
            server = self._fork_server()
            if server is None:
                break
            try:
                return server.start(argv[_PROGRAM_ARGS:], payload, cpu_affinity, self.timeout_s)
            except _Vanished as err:
                log.warning("%s; forking it again", err)
            except ForkServerDied as err:
                log.debug("%s", err)  # on_death replaced it (or gave up): try again
        return LocalProcess(argv, payload, cpu_affinity)

    def _fork_server(self) -> ForkServer | None:
        """The fork server to use now (None: start fresh interpreters)."""
        if not self.use_fork_server:
            return None
        if self.fork_server is None:
            # Only once a local worker is wanted; the first start waits through its imports.
            self.fork_server = self._new_fork_server()
        server = self.fork_server
        if server is not None and not server.alive():
            self._on_death(server)  # its end of file may already have said so: once only
            server = self.fork_server
        if server is None or server.ready or not self.replacements:
            return server
        if time.monotonic() - server.started_at > self.timeout_s:
            self._give_up(f"the new fork server did not start within {self.timeout_s} s")
            return None
        raise ForkServerStarting(
            f"the fork server died; its replacement (pid {server.pid}) is still importing "
            "torch, and no worker can be forked before it is ready"
        )

    def _new_fork_server(self, context: str = "") -> ForkServer | None:
        try:
            return self.servers.acquire(self._on_death)
        except OSError as err:  # fork itself failed (memory, process limits)
            self._give_up(f"{context}could not start a fork server ({err})")
            return None

    def _on_death(self, server: ForkServer) -> None:
        """The fork server died: say so, once, and start a new one (or stop using them)."""
        if server is not self.fork_server:
            return  # a fork server already replaced, or closed
        what = f"the fork server (pid {server.pid}) died ({server.describe()})"
        self.fork_server = None
        self.servers.release(server, self._on_death)
        if self.replacements >= FORK_SERVER_REPLACEMENTS:
            self._give_up(f"{what}, after {self.replacements} replacements")
            return
        self.replacements += 1
        self.fork_server = self._new_fork_server(f"{what}; ")
        if self.fork_server is not None:
            _warn(
                f"{what}; the workers it had forked died with it and are restarted "
                f"(their requests in flight get truncations) from a new fork server "
                f"(pid {self.fork_server.pid})"
            )

    def _give_up(self, why: str) -> None:
        server, self.fork_server, self.use_fork_server = self.fork_server, None, False
        if server is not None:
            self.servers.release(server, self._on_death)
        _warn(
            f"{why}: local workers start as fresh interpreters from now on "
            "(a restart takes seconds, not milliseconds)"
        )

    def close(self) -> None:
        with FORK_LOCK:
            server, self.fork_server = self.fork_server, None
            if server is not None:
                self.servers.release(server, self._on_death)


def stop_all(processes: Sequence[WorkerProcess], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` in all for the processes to exit, then kill the rest."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        if not process.wait(deadline - time.monotonic()):
            if timeout_s > 0:
                log.warning("worker pid %d did not exit in time; killing it", process.pid)
            process.kill()
    for process in processes:
        process.release()
