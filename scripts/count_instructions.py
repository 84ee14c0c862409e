"""The trainer's instructions per env-step, counted by valgrind: a figure that noise cannot move.

Timings on a shared 2-core machine move by 10-20% from one run to the next,
so a change worth 5% of the trainer's CPU cannot be told from noise by
``scripts/bench.py``. Callgrind counts the instructions a process executes
(user space, every thread: the trainer's Python, torch, numpy, msgpack and
libzmq, its I/O thread included), the same from one run of the same code to
the next within 1-3% (the number of polls a recv takes, and with env threads
how many replies travel joined, still depend on timing).

The workload is fixed whatever the machine's speed: rounds of one
``async_step_send`` to every env (a fresh action batch, as a policy makes)
and one ``async_step_recv(min_get=num_envs)``, whose ``env_index`` is read
back as a trainer reads it. The workers run outside valgrind at full speed,
and the trainer under it is some 50 times slower, so every recv finds every
reply in. Imports, set-up and warm-up rounds run with callgrind's
instrumentation off (``--instr-atstart=no``), and ``callgrind_control -i on``
switches it on for the measured rounds only.

What it does not count: kernel time (system calls, context switches), the
workers, and the cost of running cold, which on this machine makes the same
instructions take 1.5-5x as long after a sleep (see docs/PERFORMANCE.md). It
compares code, it does not predict throughput.

Needs valgrind (Debian's ``valgrind`` package: ``valgrind``, ``callgrind_control``).
Debian 12's valgrind (3.19) does not know ``pidfd_open``; under it the
measured process replaces ``os.pidfd_open`` with a pipe that never becomes
readable (worker deaths go unseen, which a count does not need) and leaves
with ``os._exit`` instead of closing the pool.

Example:
    python scripts/count_instructions.py                      # 64 envs, 16 per worker
    python scripts/count_instructions.py --num-envs 4 --envs-per-worker 1
    git worktree add /tmp/before HEAD~1
    python scripts/count_instructions.py --baseline /tmp/before   # both, and the ratio
    python scripts/count_instructions.py --dry-run           # the workload alone, no valgrind
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: How long the measured process may take to import and warm up under valgrind.
READY_TIMEOUT_S = 900.0
#: How long the measured rounds may take under valgrind once switched on.
ROUNDS_TIMEOUT_S = 1800.0
WARMUP_ROUNDS = 10
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


@dataclass
class Count:
    """One checkout's count: instructions over the measured rounds, and per env-step."""

    source: str
    num_envs: int
    envs_per_worker: int
    rounds: int
    instructions: int
    #: "trainer", or "worker STEP" (one worker's commands, counted in-process: --worker)
    workload: str = "trainer"

    @property
    def per_env_step(self) -> float:
        return self.instructions / (self.num_envs * self.rounds)


def parse_collected(log: str) -> int:
    """The instruction count callgrind reports at exit (``==PID== Collected : N``)."""
    found = _COLLECTED.findall(log)
    if not found:
        raise RuntimeError(f"callgrind reported no count; its log ends:\n{log[-2000:]}")
    return int(found[-1])


# ------------------------------------------------------------------ the measured process


def _pidfd_missing() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as err:
        return err.errno == errno.ENOSYS
    return False


def run_workload(num_envs: int, per_worker: int, rounds: int, handshake: Path | None) -> None:
    """Warm up, then (after the parent switched the count on) run ``rounds`` measured rounds.

    ``handshake``: a folder where this process says it is ready and waits to be told
    to go; None runs the rounds at once (``--dry-run``).
    """
    under_valgrind = handshake is not None and _pidfd_missing()
    if under_valgrind:
        os.pidfd_open = lambda pid, flags=0: os.pipe()[0]  # type: ignore[assignment]
    import torch
    from tensordict import TensorDict

    from zmqpool import ZMQAsyncEnvPool
    from zmqpool.testing import CountingEnv

    kwargs = [{"env_id": i} for i in range(num_envs)]
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=kwargs, envs_per_worker=per_worker)
    pool.reset()
    envs = list(range(num_envs))

    def one_round() -> None:
        pool.async_step_send(TensorDict({"action": torch.zeros(num_envs, 1)}, [num_envs]), envs)
        result = pool.async_step_recv(min_get=num_envs)
        if sorted(result.get("env_index").tolist()) != envs:
            raise RuntimeError("a round did not return every env")

    for _ in range(WARMUP_ROUNDS):
        one_round()
    if handshake is not None:
        (handshake / "ready").write_text(str(os.getpid()))
        _wait_for(handshake / "go", READY_TIMEOUT_S)
    for _ in range(rounds):
        one_round()
    print(f"done: {rounds} rounds of {num_envs} env-steps", flush=True)
    if under_valgrind:
        os._exit(0)  # the pool's close() needs the pidfds this process does not have
    pool.close()


def run_worker_workload(command: str, rounds: int, handshake: Path | None) -> None:
    """One worker's side: ``rounds`` commands handled by ``Worker.handle``, in this process.

    The commands are what a pool sends one env (encoded by the trainer's own
    encoder), read off a real DEALER-less worker whose replies go out on a
    real PUSH to a PULL in this process (drained, not decoded, after each
    round): the worker's decode, its env's step, the encode and the send,
    with the env's own step (``zmqpool.testing.CountingEnv``) included.
    """
    import tempfile as _tempfile

    from zmqpool.wire import Command

    # Removed after, as a test's --dry-run leaves nothing in /tmp (os._exit included).
    with _tempfile.TemporaryDirectory(prefix="zmqpool-count-worker-") as folder:
        _handle_rounds(Command[command], rounds, handshake, folder)


def _handle_rounds(kind: Any, rounds: int, handshake: Path | None, folder: str) -> None:
    """:func:`run_worker_workload` in ``folder`` (its sockets' ipc files)."""
    import torch
    import zmq
    from tensordict import TensorDict

    from workers.hosting import EnvHost
    from workers.loop import Worker
    from zmqpool.codec import Encoder
    from zmqpool.testing import CountingEnv
    from zmqpool.wire import Command, Header, encode_message

    worker = Worker(f"ipc://{folder}/nobody", b"w0", EnvHost({0: CountingEnv(env_id=0)}))
    pull = worker.context.socket(zmq.PULL)
    pull.bind(f"ipc://{folder}/results")
    worker.push = worker.context.socket(zmq.PUSH)
    worker.push.connect(f"ipc://{folder}/results")
    worker.token = b"t" * 16
    encoder = Encoder()

    def message(command: Command, seq: int, td: TensorDict | None) -> list[bytes]:
        parts = [] if td is None else [encoder.encode(td)]
        return [
            bytes(memoryview(f).cast("B")) for f in encode_message(Header(command, 0, seq), parts)
        ]

    def handle(frames: list[bytes]) -> None:
        worker.handle(frames)
        pull.recv_multipart()  # the reply, so that nothing queues up

    handle(message(Command.RESET, 1, None))
    action = TensorDict({"action": torch.zeros(1)}, [])
    commands = [message(kind, seq, action) for seq in range(2, 2 + WARMUP_ROUNDS * 10 + rounds)]
    for frames in commands[: WARMUP_ROUNDS * 10]:
        handle(frames)
    if handshake is not None:
        (handshake / "ready").write_text(str(os.getpid()))
        _wait_for(handshake / "go", READY_TIMEOUT_S)
    for frames in commands[WARMUP_ROUNDS * 10 :]:
        handle(frames)
    print(f"done: {rounds} {kind.name} commands", flush=True)
    if handshake is not None and _pidfd_missing():
        shutil.rmtree(folder, ignore_errors=True)  # os._exit skips the with's clean-up
        os._exit(0)
    pull.close(linger=0)  # ours, in the worker's context: closed before it terminates that
    worker.close()


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.05)


# ------------------------------------------------------------------ the counting parent


def count(
    source: Path, num_envs: int, per_worker: int, rounds: int, worker: str | None = None
) -> Count:
    """Run the workload on checkout ``source``'s zmqpool under callgrind; count the measured
    rounds. Its workers are ``source``'s too (they are launched from beside its zmqpool)."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="zmqpool-count-") as tmp:
        handshake, log = Path(tmp), Path(tmp) / "callgrind.log"
        argv = [
            "valgrind",
            "--tool=callgrind",
            "--trace-children=no",
            "--instr-atstart=no",
            f"--callgrind-out-file={tmp}/callgrind.out",
            f"--log-file={log}",
            sys.executable,
            __file__,  # this script, with ``source``'s zmqpool first on the path
            "--child",
            str(handshake),
            "--num-envs",
            str(num_envs),
            "--envs-per-worker",
            str(per_worker),
            "--rounds",
            str(rounds),
            *(["--worker", worker] if worker else []),
        ]
        env = {**os.environ, "PYTHONPATH": str(source), "PYTHONHASHSEED": "0"}
        with subprocess.Popen(argv, env=env, cwd=tmp) as child:
            try:
                _switch_on_when_ready(child, handshake)
                child.wait(timeout=ROUNDS_TIMEOUT_S)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait(timeout=30)
            if child.returncode != 0:
                raise RuntimeError(f"the measured process exited with {child.returncode}")
        instructions = parse_collected(log.read_text())
        if worker:
            return Count(str(source), 1, 1, rounds, instructions, f"worker {worker}")
        return Count(str(source), num_envs, per_worker, rounds, instructions)


def _switch_on_when_ready(child: subprocess.Popen, handshake: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (handshake / "ready").exists():
        if child.poll() is not None:
            raise RuntimeError(f"the measured process exited early ({child.returncode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {READY_TIMEOUT_S:.0f} s under valgrind")
        time.sleep(0.2)
    pid = (handshake / "ready").read_text().strip()
    subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
    (handshake / "go").touch()


def report(counts: list[Count]) -> str:
    lines = [
        f"{c.source}: {c.per_env_step:,.0f} instructions per env-step ({_what(c)})" for c in counts
    ]
    if len(counts) == 2:
        ratio = counts[1].per_env_step / counts[0].per_env_step
        lines.append(f"this checkout / baseline: {ratio:.3f} ({ratio - 1:+.1%})")
    return "\n".join(lines)


def _what(c: Count) -> str:
    if c.workload != "trainer":
        return f"{c.workload}, in-process, {c.rounds} commands"
    return f"{c.num_envs} envs, {c.envs_per_worker} per worker, {c.rounds} rounds"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--num-envs", type=int, default=64, help="envs in the pool")
    parser.add_argument(
        "--envs-per-worker", type=int, default=16, help="envs hosted by each worker process"
    )
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout, counted first (unset: none)"
    )
    parser.add_argument("--json", type=Path, help="write the counts here (JSON)")
    parser.add_argument("--dry-run", action="store_true", help="the workload alone, no valgrind")
    parser.add_argument(
        "--worker",
        choices=("STEP", "STEP_AND_MAYBE_RESET"),
        help="count one worker's handling of this command instead of the trainer",
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None or args.dry_run:
        if args.worker:
            run_worker_workload(args.worker, args.rounds, args.child)
        else:
            run_workload(args.num_envs, args.envs_per_worker, args.rounds, args.child)
        return 0
    sources = ([args.baseline.resolve()] if args.baseline else []) + [REPO]
    counts = [
        count(s, args.num_envs, args.envs_per_worker, args.rounds, args.worker) for s in sources
    ]
    print(report(counts))
    if args.json:
        rows = [{**asdict(c), "per_env_step": c.per_env_step} for c in counts]
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
