"""The fork server: pay for ``import torch, torchrl`` once, then fork each worker in milliseconds.

A fresh interpreter needs seconds to import torchrl; a restart that waits for
that keeps an env out of the run for as long. The trainer starts this process
once for its pools (``python -m workers.zygote PARENT_PID REPORT_FD``, shared as
``zmqpool.forkservers`` says); it imports the heavy modules, starts no
thread and no ZeroMQ context (so forking is safe), and forks one child per
request. It is local and trusted, like a worker's stdin.

Pipes, all binary:

- stdin (pool -> zygote): requests, each an 8-byte big-endian length and a
  cloudpickled ``{"argv": [...], "payload": bytes, "affinity": cpus|None,
  "environ": {...}, "cwd": str}`` (the trainer's environment variables and
  working directory at the request: the pools of a process share one zygote,
  started with the first).
  End of file: exit.
- REPORT_FD (zygote -> pool), a pipe passed to it: 12-byte reports ``!iii`` = (kind, pid, status):
  ``READY`` once the imports are done, ``SPAWNED`` after each fork,
  ``EXITED`` with the exit code (negative: the signal) when a child dies,
  since only the zygote, its parent, can reap it. At end of file on stdin it
  reaps what has died and exits, so the pool reads every report to its end.

Its stdout and stderr are the trainer's, and so are its children's: an env's
``print()`` goes to the trainer's stdout, as under ``SerialEnv`` (the reports
had the zygote's stdout once, and every worker's stdout went to stderr).

It ignores SIGINT: a Ctrl-C in a terminal signals the whole process group,
the trainer, this process and its children alike, and the trainer decides
what a Ctrl-C means. This process has nothing to stop but itself, and
stops without a signal: at end of file on stdin (the last pool's
``close()``, or the trainer's death, which closes the pipe) and, should the
trainer die without closing it, by ``PR_SET_PDEATHSIG`` (SIGKILL). Each
child puts SIGINT back to Python's default before it becomes a worker (an
ignored signal would stay ignored through its envs' own ``exec``); the
worker then ignores it again once it knows it is a local one
(``workers.cli.run``), and a Ctrl-C before that ends it quietly, with
status 130.

Its children die with it (``PR_SET_PDEATHSIG``, set by each worker for its
parent): a worker orphaned by a killed zygote would have nobody to report its
death and nothing tying it to the trainer's life. The pool sees those deaths
through its own pidfds and restarts the workers from a new zygote.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Iterator

from zmqpool.launcher import EXITED, READY, REPORT, SPAWNED  # shared with the pool


def _read_exact(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return b""
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def reaped() -> Iterator[tuple[int, int]]:
    """(pid, exit code) of each child that has ended, without waiting (negative: a signal)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _reap(report_fd: int) -> None:
    for pid, code in reaped():
        os.write(report_fd, REPORT.pack(EXITED, pid, code))


def _child(request: dict, report_fd: int) -> None:
    """In the forked child: become a worker. Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the zygote's SIG_IGN is not ours
    os.close(report_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    code = 1
    try:
        # The trainer's now: the pools of a process share a zygote started earlier.
        os.environ.clear()
        os.environ.update(request["environ"])
        os.chdir(request["cwd"])
        if request.get("affinity") is not None:
            os.sched_setaffinity(0, set(request["affinity"]))
        from workers.cli import run

        code = run(request["argv"], maker_payload=request["payload"])
    except KeyboardInterrupt:  # Ctrl-C before run() could catch it (its imports): no traceback
        code = 130
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def serve(report_fd: int) -> None:
    import cloudpickle

    signal.signal(signal.SIGCHLD, lambda *_: _reap(report_fd))
    os.write(report_fd, REPORT.pack(READY, 0, 0))
    while True:
        header = _read_exact(0, 8)
        if not header:
            _reap(report_fd)  # the last exit codes, before the pool stops reading
            return
        request = cloudpickle.loads(_read_exact(0, int.from_bytes(header, "big")))
        pid = os.fork()
        if pid == 0:
            _child(request, report_fd)
        os.write(report_fd, REPORT.pack(SPAWNED, pid, 0))


def main() -> None:
    # First, before the seconds of imports: see the module's docstring on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The point of this process: import once, fork many times.
    import tensordict  # noqa: F401
    import torch  # noqa: F401
    import torchrl.envs  # noqa: F401
    import zmq  # noqa: F401

    import workers.serving  # noqa: F401  (what a child's workers.cli.run imports)
    from workers.supervise import die_with_parent

    die_with_parent(int(sys.argv[1]))
    serve(int(sys.argv[2]))
    os._exit(0)  # the pool closed our stdin; skip torch's slow teardown


if __name__ == "__main__":
    main()
