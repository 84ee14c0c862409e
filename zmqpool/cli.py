"""The ``zmqpool`` command (also ``python -m zmqpool``).

Subcommands:

- ``demo``: a local pool stepped asynchronously, with throughput and per-env
  stats (see :mod:`zmqpool.demo`);
- ``worker``: a worker process, exactly ``python -m workers``;
- ``keygen DIR``: CURVE key pairs for a trainer and its remote workers;
- ``bench``: ``scripts/bench.py`` of a source checkout, arguments passed on.

This is the only place besides :mod:`zmqpool.demo` that prints; the library
logs through :mod:`logging`.

Example:
    >>> from zmqpool.cli import main
    >>> main(["keygen", "/tmp/zmqpool-doc-keys", "--workers", "1"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from zmqpool.argtypes import positive_int, positive_seconds, seed

PROG = "zmqpool"
#: the demo's env; torch is imported only when a command needs it, not for --help.
DEFAULT_ENV = "zmqpool.demo:cartpole"
BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
#: The environment variable that tells the bench script the command that ran it.
BENCH_PROG_VARIABLE = "ZMQPOOL_BENCH_PROG"


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="step a local pool asynchronously and print throughput and per-env stats",
        description="Build a local pool, step it the way an async trainer does "
        "(send to all, recv min_get=1, resend to those that came back), print env-steps/s.",
        epilog="Exit status: 0 when the steps ran; 1 when the pool failed, with its error (an "
        "env's carries its worker's traceback); 2 for a bad argument, with a one-line error "
        "(an --env whose module cannot be imported, whatever its import raised, is named "
        "with that exception; a --seed "
        "outside 0 to 2**64 - 1: torchrl and gymnasium refuse negative seeds); 130 after "
        "Ctrl-C.",
    )
    demo.add_argument("--num-envs", type=positive_int, default=4, help="envs (default 4)")
    demo.add_argument("--steps", type=positive_int, default=2000, help="env-steps (default 2000)")
    demo.add_argument(
        "--envs-per-worker", type=positive_int, default=1, help="envs per process (default 1)"
    )
    demo.add_argument(
        "--env",
        default=DEFAULT_ENV,
        help=f"env maker, package.module:callable (default {DEFAULT_ENV}: gymnasium's CartPole-v1)",
    )
    demo.add_argument(
        "--kill-one",
        action="store_true",
        help="SIGKILL one worker halfway through and show the pool restart it",
    )
    demo.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="torch.manual_seed(SEED) and pool.set_seed(SEED): an integer from 0 to 2**64 - 1 "
        "(default 0)",
    )
    demo.add_argument(
        "--step-timeout",
        type=positive_seconds,
        default=60.0,
        help="a step longer than this many seconds (> 0) is hung: its env is restarted "
        "(default 60)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(handler=_cmd_demo, parser=demo)  # parser: its errors say "zmqpool demo"


def _add_keygen(sub: argparse._SubParsersAction) -> None:
    keygen = sub.add_parser(
        "keygen",
        help="write CURVE key pairs for a trainer and its remote workers",
        description="Write CURVE key pairs into DIR: server.key[_secret] for the trainer, "
        "workers/worker-N.key[_secret] for the workers and authorized/ with the workers' "
        "public keys (the pool's allow-list). Directories get mode 0700, secrets 0600.",
    )
    keygen.add_argument("dir", type=Path, help="directory to create or fill (must be private)")
    keygen.add_argument("--workers", type=positive_int, default=1, help="worker pairs (default 1)")
    keygen.add_argument(
        "--force",
        action="store_true",
        help="overwrite existing key files (without it, any key file in DIR is left alone: "
        "keygen refuses)",
    )
    keygen.set_defaults(handler=_cmd_keygen)


def _add_passthrough(sub: argparse._SubParsersAction) -> None:
    # Listed for --help only: main() hands their arguments on before argparse sees them.
    sub.add_parser("worker", add_help=False, help="run a worker process (= python -m workers)")
    sub.add_parser("bench", add_help=False, help="run scripts/bench.py (a source checkout's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A drop-in torchrl AsyncEnvPool over ZeroMQ.",
        epilog="Each subcommand has its own --help.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    _add_passthrough(sub)
    _add_keygen(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zmqpool`` command line; returns the exit status (130 after Ctrl-C)."""
    try:  # all of it: a Ctrl-C in the first seconds lands in torch's import
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        return 130


def _dispatch(args_list: list[str]) -> int:
    if args_list and args_list[0] in _PASSTHROUGH:  # they set up their own logging
        return _PASSTHROUGH[args_list[0]](args_list[1:])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "demo":
        from zmqpool.demo import load_env_maker

        try:
            load_env_maker(args.env)
        except ValueError as err:  # one line, as python -m workers --env says it
            args.parser.error(f"--env {args.env}: {err}")
    return int(args.handler(args))


# ------------------------------------------------------------------ demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from zmqpool.demo import DemoOptions, print_report, run_demo
    from zmqpool.errors import ZMQPoolError

    opts = DemoOptions(
        num_envs=args.num_envs,
        steps=args.steps,
        envs_per_worker=args.envs_per_worker,
        env=args.env,
        kill_one=args.kill_one,
        seed=args.seed,
        step_timeout_s=args.step_timeout,
        progress=not args.no_progress,
    )
    try:
        result = run_demo(opts)
    except (ZMQPoolError, TimeoutError) as err:
        print(f"{PROG} demo failed: {type(err).__name__}: {err}", file=sys.stderr)
        if opts.kill_one:
            print("(--kill-one needs the pool's hot restart of a dead worker)", file=sys.stderr)
        return 1
    print_report(opts, result)
    return 0


# ------------------------------------------------------------------ worker, bench


def _run_worker(argv: list[str]) -> int:
    from workers.cli import main as worker_main

    return worker_main(argv, prog=f"{PROG} worker")


def _run_bench(argv: list[str]) -> int:
    if not BENCH_SCRIPT.is_file():
        print(
            f"{PROG} bench runs scripts/bench.py from a source checkout, and this installation "
            f"has none (looked for {BENCH_SCRIPT}). Clone the repository and "
            "`pip install -e .` it, or run `python scripts/bench.py` from the clone.",
            file=sys.stderr,
        )
        return 2
    # The script's usage line names the command that ran it, not bench.py.
    env = {**os.environ, BENCH_PROG_VARIABLE: f"{PROG} bench"}
    return subprocess.call([sys.executable, str(BENCH_SCRIPT), *argv], env=env)


_PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {
    "worker": _run_worker,
    "bench": _run_bench,
}


# ------------------------------------------------------------------ keygen


def _cmd_keygen(args: argparse.Namespace) -> int:
    from zmqpool.security import write_keys

    try:
        pairs = write_keys(args.dir, args.workers, args.force)
    except ValueError as err:
        print(f"{PROG} keygen: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path under a file, a read-only or virtual file system (/proc)
        culprit = f" ({err.filename})" if err.filename else ""
        print(
            f"{PROG} keygen: cannot write keys into {args.dir}: {err.strerror}{culprit}",
            file=sys.stderr,
        )
        return 2
    # write_keys returns paths as DIR was given (relative to the cwd if DIR is);
    # both sides made absolute the same way (lexically), so either form lists the same.
    given = os.path.abspath(args.dir)
    directory = args.dir.resolve()
    print(f"wrote {len(pairs)} CURVE key pairs under {directory} (directories 0700, secrets 0600):")
    for pair in pairs:
        where = Path(os.path.abspath(pair.secret)).relative_to(given).with_suffix("")
        print(f"  {pair.name:<10} {where}.key, {where}.key_secret")
    print(f"  allow-list {len(pairs) - 1} public keys in authorized/")
    print(_KEYGEN_USAGE.format(dir=directory))
    return 0


_KEYGEN_USAGE = """
How to use them:
  trainer:  keeps server.key_secret; accepts only workers whose key is in authorized/
            (delete a file there to revoke that worker; read when the pool starts).
            ZMQAsyncEnvPool(..., remote_envs=K, bind="tcp://0.0.0.0:PORT", curve_keys="{dir}")
  worker N: gets {dir}/server.key and {dir}/workers/worker-N.key_secret, copied over a
            secure channel; a .key_secret never goes anywhere else.
  on worker host N:
            python -m workers --connect tcp://TRAINER:PORT --env pkg.mod:make_env --num-envs K \\
                --server-key server.key --client-key worker-N.key_secret"""
