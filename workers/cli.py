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
import functools
import json
import logging
import os
import secrets
import sys

from workers.hosting import WORKER_THREADS_VAR, EnvHost, EnvRecipe, recipe_from_name
from workers.loop import REGISTER_TIMEOUT_S, Worker
from workers.supervise import REFUSED, Supervisor, die_with_parent
from zmqpool.errors import EnvMakerError, RegistrationError
from zmqpool.security import ClientKeys, InsecureKeyFileError

log = logging.getLogger("workers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workers",
        description="Host torchrl envs for a zmqpool trainer and answer its step/reset commands.",
    )
    parser.add_argument("--connect", required=True, help="the pool's ROUTER endpoint")
    parser.add_argument(
        "--identity",
        help="routing identity of a --single-process worker (default: host-pid-<random>; "
        "one others can guess can be taken by another key's holder first); with a "
        "supervisor, each child's is <identity>-<k>-<random> (default identity: host-pid)",
    )
    parser.add_argument("--env", help="importable env maker, package.module:callable")
    parser.add_argument(
        "--kwargs",
        default="{}",
        help="JSON keyword arguments for --env: an object, or a list of one object per env",
    )
    parser.add_argument(
        "--num-envs",
        type=int,
        default=1,
        help="envs to host with --env: one process each, restarted when it dies",
    )
    parser.add_argument(
        "--single-process",
        action="store_true",
        help="host the --num-envs envs in this one process, without a supervisor",
    )
    parser.add_argument(
        "--env-threads",
        action="store_true",
        help="with several envs in this process: step each in its own thread, so an env "
        "that waits does not hold up the others (those judged cheap step inline)",
    )
    parser.add_argument(
        "--no-inline-cheap",
        action="store_true",
        help="with --env-threads: keep every env in its thread, even those whose steps are "
        "short and never wait (for envs that wait for another env of this process)",
    )
    parser.add_argument(
        "--slots", help="comma-separated pool env indices to ask for (default: any free slots)"
    )
    parser.add_argument("--server-key", help="the pool's CURVE public key file (server.key)")
    parser.add_argument("--client-key", help="this worker's CURVE secret key file (.key_secret)")
    parser.add_argument("--env-indices", help="comma-separated pool indices (local workers)")
    parser.add_argument(
        "--maker-stdin", action="store_true", help="read cloudpickled makers from stdin"
    )
    parser.add_argument("--parent-pid", type=int, help="exit when this process dies")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    parser.add_argument(
        "--register-timeout",
        type=float,
        help=f"seconds to wait for the pool (default: {REGISTER_TIMEOUT_S:g} for local workers, "
        "forever for --env)",
    )
    parser.add_argument(
        "--torch-threads",
        type=_threads,
        help="torch intra-op threads in this worker (0: torch's default, one per core; "
        f"default: ${WORKER_THREADS_VAR}, else 1)",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser


def _threads(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--torch-threads must be >= 0, got {value}")
    return value


def _recipes_from_payload(data: bytes) -> tuple[list[int], list[EnvRecipe]]:
    import cloudpickle

    payload = cloudpickle.loads(data)
    sys.path[:0] = [p for p in payload["sys_path"] if p not in sys.path]
    recipes = [EnvRecipe(maker, kwargs) for maker, kwargs in payload["recipes"]]
    return list(payload["indices"]), recipes


def _recipes_from_args(args: argparse.Namespace) -> tuple[list[int], list[EnvRecipe]]:
    if not args.env:
        raise SystemExit("python -m workers: give --env package.module:callable or --maker-stdin")
    indices = (
        [int(i) for i in args.env_indices.split(",")]
        if args.env_indices
        else list(range(args.num_envs))
    )
    args.num_envs = len(indices)
    return indices, [recipe_from_name(args.env, kw) for kw in _kwargs_list(args)]


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
    remote = not args.env_indices and not args.maker_stdin
    keys = _client_keys(args)
    if remote and not args.single_process:
        run_child = functools.partial(_serve_remote_child, args, keys)
        return Supervisor(args.num_envs, run_child, args.identity).run()
    # Unguessable by default: see workers/supervise.py on routing identities.
    default = f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(8)}"
    identity = (args.identity or default).encode()
    return serve(args, identity, indices, recipes, remote, keys, _slots(args) if remote else None)


def _client_keys(args: argparse.Namespace) -> ClientKeys | None:
    if bool(args.server_key) != bool(args.client_key):
        raise SystemExit("python -m workers: give both --server-key and --client-key, or neither")
    if not args.server_key:
        return None
    try:
        return ClientKeys.from_files(args.server_key, args.client_key)
    except InsecureKeyFileError as err:  # a secret others can read: say how to fix it, no traceback
        raise SystemExit(f"python -m workers: {err}") from None


def _serve_remote_child(
    args: argparse.Namespace, keys: ClientKeys | None, k: int, identity: bytes
) -> int:
    kwargs = _kwargs_list(args)[k]
    slots = _slots(args)
    mine = None if slots is None else [slots[k]]
    return serve(args, identity, [0], [recipe_from_name(args.env, kwargs)], True, keys, mine)


def _slots(args: argparse.Namespace) -> list[int] | None:
    if not args.slots:
        return None
    slots = [int(i) for i in args.slots.split(",")]
    if len(slots) != args.num_envs:
        raise SystemExit(f"python -m workers: --slots must name {args.num_envs} env indices")
    return slots


def _kwargs_list(args: argparse.Namespace) -> list[dict]:
    """``--kwargs`` as one dict per env."""
    kwargs = json.loads(args.kwargs)
    if isinstance(kwargs, dict):
        return [kwargs] * args.num_envs
    one_per_env = isinstance(kwargs, list) and len(kwargs) == args.num_envs
    if one_per_env and all(isinstance(k, dict) for k in kwargs):
        return kwargs
    raise SystemExit(
        f"python -m workers: --kwargs must be a JSON object or a list of {args.num_envs} objects"
    )


def serve(
    args: argparse.Namespace,
    identity: bytes,
    indices: list[int],
    recipes: list[EnvRecipe],
    remote: bool,
    keys: ClientKeys | None,
    slots: list[int] | None = None,
) -> int:
    """Build the envs, register, answer commands; the exit code says how it ended."""
    timeout = args.register_timeout
    if timeout is None:
        timeout = None if remote else REGISTER_TIMEOUT_S

    def connect(host: EnvHost) -> Worker:
        return Worker(
            args.connect,
            identity,
            host,
            heartbeat_interval_s=args.heartbeat_interval,
            register_timeout_s=timeout,
            remote_slots=remote,
            keys=keys,
            slots=slots,
            env_threads=args.env_threads,
            inline_cheap=not args.no_inline_cheap,
        )

    # The envs first: their specs bound what the worker's sockets accept, set before they connect.
    try:
        host = EnvHost.build(indices, recipes, args.torch_threads)
    except EnvMakerError as err:
        failed = connect(EnvHost({}))
        try:
            failed.report_maker_failure(err)
        finally:
            failed.close()
        log.error("%s", err)
        return 1
    worker = connect(host)
    try:
        worker.register()
        worker.serve()
    except RegistrationError as err:
        log.error("%s", err)
        return REFUSED
    finally:
        worker.close()
    return 0
