"""Test processes forked from a warm interpreter: torch, tensordict and torchrl imported once.

A fresh interpreter spends about 4 s of CPU importing torchrl before it does
anything (tensordict alone imports ``torch._dynamo``), and the suite starts
dozens of processes that do: the victims of the attack tests
(:class:`tests.hostile.Victim`) and the remote workers (``python -m workers``
in the test host's network namespace). On 2 cores that was a quarter of the
suite. So each test process keeps one launcher (this file, run as a script),
which imports those modules once, starts no thread and no ZeroMQ context (so
forking is safe, as for ``workers.zygote``), and forks each such process from
itself: :func:`popen` returns a :class:`WarmProcess`, which has the parts of
:class:`subprocess.Popen`'s interface the tests use.

The child becomes what ``python -m MODULE ARGS`` or ``python SCRIPT ARGS``
would be, but warm: the environment and working directory of the request, its
own stdin, stdout and stderr (passed as file descriptors over a Unix socket),
no other inherited descriptor, ``sys.argv`` as the interpreter sets it, a
path of its directory (the working one for ``-m``), the request's
``PYTHONPATH`` and the launcher's site (never ``tests/``), a ``__main__`` of
its own, generators of its own, SIGINT as Python's default, optionally a new
session and another network namespace (``setns``, what ``ip netns exec``
does for the network), and it exits as the interpreter would (``atexit``
handlers run; an uncaught exception prints its traceback and exits 1, a
``KeyboardInterrupt`` dies of SIGINT). What its imports ran at the launcher's
start stays: the launcher imports the checkout the test process imports, and
refuses to start otherwise, so a child runs the code under test. Interpreter
flags cannot change after start-up: ``PYTHONUNBUFFERED`` in the request's
environment is honoured by reopening stdout and stderr unbuffered, others are
the launcher's. A test of how a fresh interpreter starts (the command lines,
``--help``, import errors) still runs one.

Protocol (a ``SOCK_SEQPACKET`` pair, one JSON message per packet): the
launcher says ``{"ready": pid}`` once its imports are done; a request
``{"module"|"path": ..., "argv": [...], "env": {...}, "cwd": ..., "netns":
name|null, "new_session": bool}`` comes with three descriptors (the child's
0, 1, 2) and is answered ``{"spawned": pid}``; each child's death is reported
``{"exited": pid, "code": c}`` (``c`` as :attr:`subprocess.Popen.returncode`:
negative for a signal), since only the launcher, its parent, can reap it. At
end of file the launcher exits, and its children die with it
(``PR_SET_PDEATHSIG``): none outlives the test process.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
#: How often the launcher reaps its children when no request comes.
_REAP_EVERY_S = 0.05
_MAX_PACKET = 1 << 20


# ---------------------------------------------------------------- the launcher (server side)


class _Become(BaseException):
    """Raised in a forked child, caught at the script's top: leave the serving loop behind."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _reap(sock: socket.socket) -> None:
    from workers.zygote import reaped  # as the pool's fork server reaps its children

    for pid, code in reaped():
        _send(sock, {"exited": pid, "code": code})


def serve(sock: socket.socket) -> None:
    """Fork a child per request until end of file; a child leaves by raising :class:`_Become`."""
    _send(sock, {"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([sock], [], [], _REAP_EVERY_S)
        _reap(sock)
        if not readable:
            continue
        fds = array.array("i")
        data, ancdata, _, _ = sock.recvmsg(_MAX_PACKET, socket.CMSG_SPACE(3 * fds.itemsize))
        if not data:
            return
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        request = json.loads(data)
        request["fds"] = list(fds)
        # A Python thread here would be forked without its lock holders: refuse, do not hang.
        # (numpy's OpenBLAS starts native threads at import; it has fork handlers, and
        # workers.zygote forks with them too.)
        assert threading.active_count() == 1, f"{threading.enumerate()}: forking is unsafe"
        pid = os.fork()
        if pid == 0:
            sock.close()
            raise _Become(request)
        for fd in fds:
            os.close(fd)
        _send(sock, {"spawned": pid})


def _enter_netns(name: str) -> None:
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _stdio(unbuffered: bool) -> None:
    """New ``sys.stdin/stdout/stderr`` over descriptors 0-2, buffered as a fresh start would be."""

    def writer(fd: int, **kwargs: Any) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)  # -u: nothing held back
        return io.TextIOWrapper(binary, encoding="utf-8", write_through=unbuffered, **kwargs)

    reader = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), "utf-8")
    sys.stdin = sys.__stdin__ = reader
    sys.stdout = sys.__stdout__ = writer(1)
    sys.stderr = sys.__stderr__ = writer(2, errors="backslashreplace", line_buffering=True)


def become(request: dict[str, Any]) -> None:
    """In the forked child: set up as the request says, then run its module or script."""
    _die_with_parent()
    # A fresh interpreter's dispositions, whatever the launcher inherited from pytest.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["new_session"]:
        os.setsid()
    if request["netns"]:
        _enter_netns(request["netns"])
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _stdio(unbuffered=bool(request["env"].get("PYTHONUNBUFFERED")))
    _reseed()
    try:
        _run(request)
    except KeyboardInterrupt:  # as the interpreter: a traceback, atexit, then die of SIGINT
        traceback.print_exc()
        atexit._run_exitfuncs()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def _reseed() -> None:
    """Generators of their own, as fresh interpreters have (``random`` reseeds at fork)."""
    import numpy
    import torch

    numpy.random.seed()
    torch.seed()


def _run(request: dict[str, Any]) -> None:
    """Run the module or script in a new ``__main__``, with the path a fresh start has:
    its directory (the working one for ``-m``), the request's ``PYTHONPATH``, then the
    launcher's own (its first entry, the checkout, left out)."""
    import runpy
    import types

    module = request.get("module")
    first = os.getcwd() if module else str(Path(request["path"]).resolve().parent)
    pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *pythonpath, *(p for p in sys.path[1:] if p not in pythonpath)]
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    if module:
        sys.argv = ["-m", *request["argv"]]  # runpy puts the module's path in argv[0]
        runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]
        return
    path = request["path"]
    sys.argv = [path, *request["argv"]]
    main.__file__ = path
    main.__cached__ = None  # type: ignore[attr-defined]
    exec(compile(Path(path).read_bytes(), path, "exec"), main.__dict__)


def main() -> None:
    fd, parent, package_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    _die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    # The checkout, not tests/: the test process imports zmqpool from the one it runs in.
    sys.path[0] = str(ROOT)
    # The point of this process: import once, fork many times (as workers.zygote does).
    import msgpack  # noqa: F401
    import numpy  # noqa: F401
    import tensordict  # noqa: F401
    import torch  # noqa: F401
    import torchrl.envs  # noqa: F401
    import zmq  # noqa: F401

    import workers.cli
    import workers.serving  # noqa: F401
    import zmqpool
    import zmqpool.pool

    ours = str(Path(zmqpool.__file__).resolve().parent)
    if ours != package_dir:  # children would run other code than the tests import
        sys.exit(f"tests/warm.py: the launcher imports {ours}, the test process {package_dir}")
    sock = socket.socket(fileno=fd)
    try:
        serve(sock)
    except _Become as child:
        request = child.request
    else:
        os._exit(0)  # end of file: skip torch's slow teardown
    become(request)  # out of the except clause: the child's tracebacks are its own


# ---------------------------------------------------------------- the test side


class WarmProcess:
    """A launcher's child, with the parts of :class:`subprocess.Popen` the tests use."""

    def __init__(
        self, launcher: Launcher, pid: int, argv: list[str], streams: dict[str, IO | None]
    ) -> None:
        self._launcher = launcher
        self.pid = pid
        self.args = argv
        self.stdin = streams["stdin"]
        self.stdout = streams["stdout"]
        self.stderr = streams["stderr"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.exit_code(self.pid, timeout_s=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._launcher.exit_code(self.pid, timeout_s=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = code
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # as Popen: a reaped pid may be someone else's now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """What the child's stdout and stderr pipes still hold, read to their end, and wait."""
        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.stdin.close()
        out: dict[str, str] = {}

        def read(name: str, stream: IO) -> None:
            out[name] = stream.read()
            stream.close()

        readers = [
            threading.Thread(target=read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return out.get("stdout"), out.get("stderr")


class Launcher:
    """The test process's end of a launcher: sends requests, collects the children's exits."""

    def __init__(self, ready_timeout_s: float = 180.0) -> None:
        import zmqpool

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        package_dir = str(Path(zmqpool.__file__).resolve().parent)
        argv = [sys.executable, str(HERE), str(theirs.fileno()), str(os.getpid()), package_dir]
        self._proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], cwd=ROOT)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time: replies come in order
        self._changed = threading.Condition()
        self._spawned: list[int] = []
        self._exits: dict[int, int] = {}
        self._ended = False
        readable, _, _ = select.select([ours], [], [], ready_timeout_s)
        if not readable or "ready" not in json.loads(ours.recv(_MAX_PACKET) or b"{}"):
            self.close()
            raise RuntimeError(f"the warm launcher was not ready in {ready_timeout_s} s")
        threading.Thread(target=self._read, name="warm-launcher", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_PACKET)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._ended = True
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "spawned" in message:
                    self._spawned.append(message["spawned"])
                    self._exits.pop(message["spawned"], None)  # an earlier child's, pid reused
                else:
                    self._exits[message["exited"]] = message["code"]
                self._changed.notify_all()

    def _await(self, ready: Any, timeout_s: float | None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: ready() or self._ended, timeout=timeout_s)

    def exit_code(self, pid: int, timeout_s: float | None) -> int | None:
        self._await(lambda: pid in self._exits, timeout_s)
        with self._changed:
            if pid not in self._exits and self._ended:
                raise RuntimeError(f"the warm launcher ended before its child {pid}")
            return self._exits.pop(pid, None)

    def spawn(self, request: dict[str, Any], fds: list[int], timeout_s: float = 60.0) -> int:
        with self._lock:
            payload = json.dumps(request).encode()
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            self._sock.sendmsg([payload], ancillary)
            if not self._await(lambda: self._spawned, timeout_s) or not self._spawned:
                raise RuntimeError(f"the warm launcher did not fork within {timeout_s} s")
            with self._changed:
                return self._spawned.pop(0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)


_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


def launcher() -> Launcher:
    """This test process's launcher, started at first use and ended at its exit."""
    global _launcher
    with _launcher_lock:
        if _launcher is None:
            _launcher = Launcher()
            atexit.register(_launcher.close)
        return _launcher


def _end(stream: int | IO | None, fd: int) -> tuple[int, IO | None]:
    """(the child's descriptor ``fd``, our end of its pipe or None), as ``Popen(text=True)``."""
    if stream == subprocess.PIPE:
        read, write = os.pipe()
        if fd == 0:
            return read, io.TextIOWrapper(open(write, "wb"), encoding="utf-8", write_through=True)
        return write, open(read, encoding="utf-8")
    if stream is None:
        return os.dup(fd), None
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    return os.dup(stream if isinstance(stream, int) else stream.fileno()), None


def popen(
    argv: list[str],
    *,
    stdin: int | IO | None = None,
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    netns: str | None = None,
    start_new_session: bool = False,
) -> WarmProcess:
    """Start ``argv`` (``[sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, SCRIPT, ...]``)
    forked from the launcher, as :class:`subprocess.Popen` with ``text=True`` would start it."""
    if argv[0] != sys.executable:
        raise ValueError(f"not a Python command line: {argv}")
    module = argv[2] if argv[1] == "-m" else None
    request = {
        "module": module,
        "path": None if module else str(Path(argv[1]).resolve()),
        "argv": argv[3:] if module else argv[2:],
        "env": dict(os.environ if env is None else env),
        "cwd": str(Path(cwd or os.getcwd()).resolve()),
        "netns": netns,
        "new_session": start_new_session,
    }
    ends = [_end(stdin, 0), _end(stdout, 1), _end(stderr, 2)]
    try:
        pid = launcher().spawn(request, [theirs for theirs, _ in ends])
    finally:
        for theirs, _ in ends:
            os.close(theirs)
    streams = dict(zip(("stdin", "stdout", "stderr"), (ours for _, ours in ends), strict=True))
    return WarmProcess(launcher(), pid, argv, streams)


if __name__ == "__main__":
    main()
