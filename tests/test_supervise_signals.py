"""A remote host's supervisor stops on SIGTERM and SIGINT (real processes).

Kubernetes and SLURM stop a job with SIGTERM, then SIGKILL after a grace
period; a terminal's Ctrl-C sends SIGINT. ``python -m workers --num-envs K``
(:class:`workers.supervise.Supervisor`) must then end its env processes and
exit at once, not wait in ``os.wait()`` for a child to die. The supervisor
here connects to a port that nobody listens on: its children wait to
register for ever, which is all this needs. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm

ROOT = Path(__file__).resolve().parent.parent
ENVS = 2
#: Importing torch and torchrl on a loaded 2-core machine, then forking ENVS children.
START_TIMEOUT_S = 120.0
#: How long the supervisor may take to stop once signalled ("about a second").
STOP_TIMEOUT_S = 5.0


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, pgid)`` of a process, from ``/proc``; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return fields[0], int(fields[1]), int(fields[2])


def _live(predicate) -> list[int]:
    """Pids of the processes (zombies aside) whose ``(state, ppid, pgid)`` match."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] != "Z" and predicate(*stat):
                found.append(int(entry))
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_supervisor_stops_its_children_and_exits_when_signalled(unused_port, signum, tmp_path):
    argv = [sys.executable, "-m", "workers", "--connect", f"tcp://127.0.0.1:{unused_port}"]
    argv += ["--env", "zmqpool.testing:CountingEnv", "--num-envs", str(ENVS)]
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    log = tmp_path / "supervisor.log"
    with log.open("w") as err:
        proc = warm.popen(argv, stderr=err, env=env, cwd=ROOT, start_new_session=True)
    group = proc.pid  # its own session: the supervisor and its children, nothing else
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        children: list[int] = []
        while len(children) < ENVS:
            assert proc.poll() is None, f"the supervisor exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no {ENVS} children in time:\n{log.read_text()}"
            time.sleep(0.1)
            children = _live(lambda state, ppid, pgid: ppid == proc.pid)
        # (A child signalled before it resets its handlers is SIGKILLed after the grace.)

        signalled = time.monotonic()
        os.kill(proc.pid, signum)
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the supervisor ignored {signum.name}: still alive after {STOP_TIMEOUT_S} s"
            )
        took = time.monotonic() - signalled
        assert code == 0, log.read_text()
        # Its children ended with it (the supervisor reaps them), and none was restarted.
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while left := _live(lambda state, ppid, pgid: pgid == group):
            assert time.monotonic() < deadline, f"left in the supervisor's group: {left}"
            time.sleep(0.05)
        assert all(_stat(pid) is None or _stat(pid)[0] == "Z" for pid in children)
        assert took < STOP_TIMEOUT_S
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        proc.wait(timeout=10)


RESTARTS = """
import sys, time
from pathlib import Path
from workers.supervise import REFUSED, Supervisor

runs = Path(sys.argv[1])

def child(k, identity):
    with runs.open("a") as out:
        out.write(f"{k}\\n")
    # env 0 is refused at once; env 1 dies twice, then is refused.
    return REFUSED if k == 0 or runs.read_text().split().count("1") > 2 else 1

started = time.monotonic()
code = Supervisor(2, child).run()
print(code, round(time.monotonic() - started, 2))
"""


def run_supervisor_script(script: str, runs) -> str:
    """Run ``script`` (a Supervisor driven in-process) with ``runs`` as its argument; its stdout."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", script, str(runs)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_supervisor_restarts_a_dead_child_after_its_backoff_but_not_a_refused_one(tmp_path):
    """Restarts are scheduled, not slept through: a refused child is not forked again, a dead
    one is (0.05 s, then 0.1 s later), and the supervisor ends once every child is refused,
    with the status of a refusal (2: a job runner must see that the worker failed)."""
    runs = tmp_path / "runs"
    code, took = run_supervisor_script(RESTARTS, runs).split()
    assert code == "2"
    assert sorted(runs.read_text().split()) == ["0", "1", "1", "1"]
    assert 0.15 <= float(took) < 10.0


BACKOFF_RESET = """
import sys, time
from pathlib import Path
from workers.supervise import REFUSED, Supervisor

runs = Path(sys.argv[1])

def child(k, identity):
    with runs.open("a") as out:
        out.write(f"start {time.monotonic()}\\n")
    starts = runs.read_text().count("start")
    if starts <= 6:  # six quick deaths: the next restart would wait 0.05 * 2**6 = 3.2 s
        return 1
    if starts == 7:  # up longer than stable_s, then it dies
        time.sleep(0.6)
        with runs.open("a") as out:
            out.write(f"end {time.monotonic()}\\n")
        return 1
    return REFUSED

print(Supervisor(1, child, stable_s=0.5).run())
"""


def test_a_child_that_was_up_a_while_is_restarted_without_its_old_backoff(tmp_path):
    """Deaths back off while they come quickly (0.05 s, doubling to 5 s); a child that
    lived past ``stable_s`` starts over: its restart waits 0.05 s again, not 3.2 s."""
    runs = tmp_path / "runs"
    assert run_supervisor_script(BACKOFF_RESET, runs).strip() == "2"
    events = [line.split() for line in runs.read_text().splitlines()]
    starts = [float(t) for kind, t in events if kind == "start"]
    (end,) = [float(t) for kind, t in events if kind == "end"]
    assert len(starts) == 8
    assert starts[6] - starts[5] >= 1.5, "the sixth quick death waited 1.6 s"
    assert starts[7] - end < 1.5, f"restarted {starts[7] - end:.2f} s after a long life"


QUICK_CLEAN_EXITS = """
import sys, time
from pathlib import Path
from workers.supervise import REFUSED, Supervisor

runs = Path(sys.argv[1])

def child(k, identity):
    with runs.open("a") as out:
        out.write(f"{time.monotonic()}\\n")
    # exits 0 at once six times (an env maker calling sys.exit(0)), then is refused
    return 0 if len(runs.read_text().split()) <= 6 else REFUSED

print(Supervisor(1, child).run())
"""


def test_a_child_that_exits_0_at_once_is_backed_off_not_taken_for_a_closed_pool(tmp_path):
    """Exit code 0 is a pool's CLOSE only after the child was up a while: at once, it is a
    death, restarted after 0.05, 0.1, ... 1.6 s (3.15 s in all), not 20 times a second."""
    runs = tmp_path / "runs"
    assert run_supervisor_script(QUICK_CLEAN_EXITS, runs).strip() == "2"
    starts = [float(t) for t in runs.read_text().split()]
    assert len(starts) == 7
    assert starts[-1] - starts[0] >= 2.5, f"restarted within {starts[-1] - starts[0]:.2f} s"


MAKER_FAILURES = """
import sys
from pathlib import Path
from workers.supervise import MAX_MAKER_FAILURES, REFUSED, Supervisor, note_failure, note_registered

runs = Path(sys.argv[1])

def child(k, identity):
    with runs.open("a") as out:
        out.write(f"{k}\\n")
    starts = runs.read_text().split().count(str(k))
    if k == 1:  # a maker that never works
        note_failure("env maker raised RuntimeError('no')", maker=True)
        return 1
    # env 0 registered once, then its maker fails: restarted past MAX_MAKER_FAILURES
    if starts == 1:
        note_registered()
        return 1
    if starts <= MAX_MAKER_FAILURES + 2:
        note_failure("env maker raised RuntimeError('not now')", maker=True)
        return 1
    note_failure("refused: no free slot")
    return REFUSED

supervisor = Supervisor(2, child)
code = supervisor.run()
print(code)
print(supervisor.failure())
"""


def test_the_supervisor_gives_up_on_a_maker_that_never_worked_not_on_one_that_did(tmp_path):
    from workers.supervise import MAX_MAKER_FAILURES

    runs = tmp_path / "runs"
    code, failure = run_supervisor_script(MAKER_FAILURES, runs).strip().splitlines()
    started = runs.read_text().split()
    assert started.count("1") == MAX_MAKER_FAILURES
    assert started.count("0") == MAX_MAKER_FAILURES + 3
    assert code == "2"  # one child was refused
    assert failure == (
        "env process 0: refused: no free slot; env process 1: its env maker failed "
        f"{MAX_MAKER_FAILURES} times in a row: env maker raised RuntimeError('no')"
    )
