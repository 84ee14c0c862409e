"""A stopped fork server and a fork request bigger than its stdin pipe.

A fork request carries the env makers: a maker holding a 256 KiB closure
makes it bigger than a pipe's 64 KiB buffer, so a zygote that stopped
reading (SIGSTOP, wedged) must not block the trainer's write for ever. The
restart then costs at most ``register_timeout_s``, as for a zygote that does
not report: it is killed, replaced, and the worker forked from the new one.

The trainer runs in a subprocess: a regression hangs it, not the test run.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zmqpool.launcher import REPORT_WAIT_S, ForkedProcess, ForkServer, ForkServerDied

REPO = Path(__file__).resolve().parents[1]
REGISTER_TIMEOUT_S = 8.0

TRAINER = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    from tensordict import TensorDict
    from zmqpool import PoolConfig, ZMQAsyncEnvPool, keep_fork_server
    from zmqpool.testing import CountingEnv

    blob = os.urandom(256 * 1024)  # the fork request no longer fits a pipe's buffer

    def make(env_id):
        def maker():
            assert len(blob) == 256 * 1024
            return CountingEnv(env_id=env_id)
        return maker

    def act(envs):
        values = torch.full((len(envs), 1), 0.5)
        pool.async_step_send(TensorDict({"action": values}, [len(envs)]), env_index=envs)

    config = PoolConfig(
        register_timeout_s=float(sys.argv[2]),
        close_timeout_s=2.0,
        restart_backoff_s=0.01,
    )
    # The short register_timeout_s bounds the restart; a loaded machine's fork server
    # may take longer to import torch, so a pool that may wait for it warms it first.
    with keep_fork_server():
        ZMQAsyncEnvPool([make(0)], config=PoolConfig(register_timeout_s=120.0)).close()
        pool = ZMQAsyncEnvPool([make(0), make(1)], config=config)
    try:
        pool.reset()
        zygote = pool.fork_server_pid
        os.kill(zygote, signal.SIGSTOP)
        print("stopped", zygote, flush=True)
        os.kill(pool.worker_pid(0), signal.SIGKILL)
        awaited = set()
        start = time.monotonic()
        restarted = False
        while not restarted:  # until env 0 comes back, forked by a new fork server
            assert time.monotonic() - start < 120, "env 0 never restarted"
            idle = [e for e in (0, 1) if e not in awaited]
            if idle:
                act(idle)
                awaited.update(idle)
            begun = time.monotonic()
            try:
                out = pool.async_step_recv(min_get=1, timeout=2)
                awaited -= {int(e) for e in out["env_index"]}
                restarted = 0 in pool.last_restarted_envs
            except TimeoutError:
                pass
            print("recv", round(time.monotonic() - begun, 1), flush=True)
        assert pool.fork_server_pid != zygote  # a new one, or fresh interpreters
        print("restarted", round(time.monotonic() - start, 1), flush=True)
    finally:
        start = time.monotonic()
        pool.close()
        print("closed", round(time.monotonic() - start, 1), flush=True)
    """
)


def _line_within(
    proc: subprocess.Popen, timeout_s: float, what: str | tuple[str, ...], log: Path
) -> list[str]:
    """The trainer's next line, split; fails if it takes longer than ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""  # it prints whole lines, flushed
    if not line.strip():
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(
            f"no {what!r} within {timeout_s} s (exit {proc.returncode}):\n{log.read_text()}"
        )
    words = line.split()
    assert words[0] in ((what,) if isinstance(what, str) else what), line
    return words


@pytest.mark.timeout(400)
def test_a_stopped_fork_server_costs_a_restart_at_most_register_timeout(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    log = tmp_path / "stderr.txt"  # a file: a full stderr pipe would stall the trainer
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(REPO), str(REGISTER_TIMEOUT_S)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    zygote = None
    try:
        zygote = int(_line_within(proc, 180.0, "stopped", log)[1])
        # A restart waits for the stopped zygote up to register_timeout_s, then kills it.
        while True:
            words = _line_within(proc, REGISTER_TIMEOUT_S + 10.0, ("recv", "restarted"), log)
            if words[0] == "restarted":
                break
            assert float(words[1]) <= REGISTER_TIMEOUT_S + 5.0
        assert float(_line_within(proc, 20.0, "closed", log)[1]) <= 10.0
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if zygote is not None:  # never leave a stopped process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(zygote, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


class _SilentZygote:
    """A fork server that is alive and reports nothing (stopped): what each question waited."""

    pid = 0

    def __init__(self) -> None:
        self.waits: list[float] = []

    def alive(self) -> bool:
        return True

    def status_of(self, pid: int, wait_s: float) -> None:
        self.waits.append(wait_s)


def test_a_silent_fork_server_holds_a_worker_s_death_up_once():
    """The runtime asks a dead worker its status and then its cause: with a zygote that
    stopped reporting, each question waited REPORT_WAIT_S for the report (2 s a death)."""
    child = subprocess.Popen(["sleep", "60"])
    zygote = _SilentZygote()
    process = None
    try:
        process = ForkedProcess(child.pid, zygote)  # type: ignore[arg-type]
        assert process.exit_status() is None and zygote.waits == []  # alive: nothing asked
        child.kill()
        assert process.wait(10.0)  # its pidfd says it died (a zombie: not reaped yet)
        assert process.exit_status() is None and process.exit_cause() is None
        assert process.exit_status() is None
        assert zygote.waits == [REPORT_WAIT_S, 0.0, 0.0]
    finally:
        if process is not None:
            process.release()  # its pidfd
        child.kill()
        child.wait(timeout=10)


def test_a_report_already_in_the_pipe_is_read_without_waiting():
    """``status_of(pid, wait_s=0)`` (a death asked about again) reads what the zygote
    reported: it returned None without a look, and the report stayed unread."""
    server = ForkServer()
    try:
        # A worker whose arguments are refused: it exits at once, and the zygote reports it.
        process = server.start(["--no-such-flag"], b"", None, timeout_s=120.0)
        assert process.wait(60.0)
        deadline = time.monotonic() + 30.0
        status = None
        while status is None and time.monotonic() < deadline:
            status = server.status_of(process.pid, wait_s=0.0)
        assert status is not None and status > 0, status  # its exit code (refused arguments)
        process.release()
    finally:
        server.close()


def _stopped_fork_server_s_death(ready: bool) -> list[str]:
    """How a fork server stopped (SIGSTOP) before or after its imports was described at its
    death, which the pool caused: it was asked to fork with a 0.5 s timeout."""
    deaths: list[str] = []
    server = ForkServer(on_death=lambda dead: deaths.append(dead.describe()))
    try:
        deadline = time.monotonic() + 120.0
        while ready and not server.ready:
            assert server.alive() and time.monotonic() < deadline, "no READY within 120 s"
            time.sleep(0.05)
        os.kill(server.pid, signal.SIGSTOP)  # not ready: stopped in imports that take seconds
        with pytest.raises(ForkServerDied, match=r"did not answer within 0\.5 s"):
            server.start(["--no-such-flag"], b"", None, timeout_s=0.5)
        return deaths
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGKILL)
        server.close()


def test_a_fork_server_the_pool_killed_for_its_silence_is_not_said_to_have_been_killed():
    """A zygote that does not answer is killed by the pool; its death's description said
    "killed by SIGKILL", as if someone else had killed it, in the warning a user reads, and
    did not say that one still importing torch was busy, not hung."""
    assert _stopped_fork_server_s_death(ready=True) == [
        "killed by the pool: it did not answer within 0.5 s"
    ]
    assert _stopped_fork_server_s_death(ready=False) == [
        "killed by the pool: it did not answer within 0.5 s, still importing torch"
    ]
