"""Command line of a worker process.

Two ways to say which envs to host:

- ``--env package.module:callable [--kwargs JSON] [--num-envs K]``: build
  envs from an importable name (remote workers: code never crosses the wire).
- ``--maker-stdin``: read the env makers from standard input, cloudpickled.
  Only the pool that spawned this process writes there (local and trusted);
  nothing read from a socket is ever unpickled.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys

from workers.hosting import EnvHost, EnvRecipe, recipe_from_name
from workers.loop import Worker
from zmqpool.errors import EnvMakerError, RegistrationError

log = logging.getLogger("workers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workers",
        description="Host torchrl envs for a zmqpool trainer and answer its step/reset commands.",
    )
    parser.add_argument("--connect", required=True, help="the pool's ROUTER endpoint")
    parser.add_argument("--identity", help="routing identity (default: host-pid)")
    parser.add_argument("--env", help="importable env maker, package.module:callable")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments for --env")
    parser.add_argument("--num-envs", type=int, default=1, help="envs to host with --env")
    parser.add_argument("--env-indices", help="comma-separated pool indices (local workers)")
    parser.add_argument(
        "--maker-stdin", action="store_true", help="read cloudpickled makers from stdin"
    )
    parser.add_argument("--parent-pid", type=int, help="exit when this process dies")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    parser.add_argument("--register-timeout", type=float, default=120.0, help="seconds")
    parser.add_argument("--log-level", default="WARNING")
    return parser


def die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGKILL us when the pool's process dies, so no worker outlives it."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _recipes_from_payload(data: bytes) -> tuple[list[int], list[EnvRecipe]]:
    import cloudpickle

    payload = cloudpickle.loads(data)
    sys.path[:0] = [p for p in payload["sys_path"] if p not in sys.path]
    recipes = [EnvRecipe(maker, kwargs) for maker, kwargs in payload["recipes"]]
    return list(payload["indices"]), recipes


def _recipes_from_args(args: argparse.Namespace) -> tuple[list[int], list[EnvRecipe]]:
    if not args.env:
        raise SystemExit("python -m workers: give --env package.module:callable or --maker-stdin")
    kwargs = json.loads(args.kwargs)
    if not isinstance(kwargs, dict):
        raise SystemExit("python -m workers: --kwargs must be a JSON object")
    indices = (
        [int(i) for i in args.env_indices.split(",")]
        if args.env_indices
        else list(range(args.num_envs))
    )
    return indices, [recipe_from_name(args.env, kwargs) for _ in indices]


def main(argv: list[str] | None = None) -> int:
    """``python -m workers``: see ``--help``."""
    return run(argv)


def run(argv: list[str] | None, maker_payload: bytes | None = None) -> int:
    """Run a worker; ``maker_payload`` replaces stdin for ``--maker-stdin`` (the fork server)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s worker %(message)s")
    die_with_parent(args.parent_pid)
    if args.maker_stdin:
        data = maker_payload if maker_payload is not None else sys.stdin.buffer.read()
        indices, recipes = _recipes_from_payload(data)
    else:
        indices, recipes = _recipes_from_args(args)
    identity = (args.identity or f"{os.uname().nodename}-{os.getpid()}").encode()
    worker = Worker(
        args.connect,
        identity,
        EnvHost({}),
        heartbeat_interval_s=args.heartbeat_interval,
        register_timeout_s=args.register_timeout,
        remote_slots=not args.env_indices and not args.maker_stdin,
    )
    try:
        worker.host = EnvHost.build(indices, recipes)
    except EnvMakerError as err:
        worker.report_maker_failure(err)
        log.error("%s", err)
        return 1
    try:
        worker.register()
        worker.serve()
    except RegistrationError as err:
        log.error("%s", err)
        return 2
    finally:
        worker.close()
    return 0
