"""What a worker process does once its command line is read: build its envs, serve the pool.

:mod:`workers.cli` parses the arguments and imports this module only then:
it imports torch (seconds), which ``--help`` and a bad flag need not wait for.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import secrets
import signal
import sys
from typing import Any

from workers.defaults import REGISTER_TIMEOUT_S
from workers.hosting import EnvHost, EnvRecipe, maker_from_name, recipe_from_name
from workers.loop import Worker
from workers.supervise import (
    REFUSED,
    Supervisor,
    note_closed,
    note_failure,
    note_registered,
)
from zmqpool.errors import EnvMakerError, RegistrationError
from zmqpool.security import ClientKeys, InsecureKeyFileError

log = logging.getLogger("workers")


def start(
    parser: argparse.ArgumentParser, args: argparse.Namespace, maker_payload: bytes | None
) -> int:
    """What ``workers.cli.run`` does once the arguments are parsed: host the envs they name."""
    payload_keys = None
    if args.maker_stdin:
        indices, recipes, args.identity, payload_keys = _read_maker_payload(args, maker_payload)
    else:
        indices, recipes = _recipes_from_args(parser, args)
    remote = not args.env_indices and not args.maker_stdin
    if not remote:
        # A Ctrl-C in the trainer's terminal signals its whole process group, this worker
        # too: the trainer decides what it means (held back, its pool usable after it).
        # A local worker ends with its trainer (PR_SET_PDEATHSIG) or its pool's CLOSE.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    slots = _slots(parser, args) if remote else None  # before any env process is forked
    keys = payload_keys or _client_keys(args)
    if remote and not args.single_process:
        run_child = functools.partial(_serve_remote_child, args, keys, slots)
        supervisor = Supervisor(args.num_envs, run_child, args.identity)
        code = supervisor.run()
        if code:
            print(f"{args.prog}: gave up: {supervisor.failure()}", file=sys.stderr)
        return code
    # Unguessable by default: see workers/supervise.py on routing identities.
    default = f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(8)}"
    identity = (args.identity or default).encode()
    try:
        return serve(args, identity, indices, recipes, remote, keys, slots)
    except KeyboardInterrupt:  # Ctrl-C: serve closed the worker; no traceback
        return 130


class MakerPayloadError(ValueError):
    """What ``--maker-stdin`` read is not the pool's cloudpickled env makers."""


def _recipes_from_payload(
    data: bytes,
) -> tuple[list[int], list[EnvRecipe], str, ClientKeys | None]:
    """The pool's ``--maker-stdin`` payload: env indices, recipes, the worker's routing
    identity and, over loopback TCP, its CURVE keys (never on the command line, which any
    user may read); :class:`MakerPayloadError` if it is not one."""
    import cloudpickle

    if not data:
        raise MakerPayloadError("nothing on stdin (the pool writes the env makers there)")
    try:
        payload = cloudpickle.loads(data)
        indices = [int(i) for i in payload["indices"]]
        recipes = [EnvRecipe(maker, kwargs) for maker, kwargs in payload["recipes"]]
        sys_path = [str(p) for p in payload["sys_path"]]
        identity = payload["identity"]
        if type(identity) is not str or not identity:
            raise TypeError(f"its identity must be a non-empty str, got {identity!r}")
        keys = _payload_keys(payload.get("curve"))
    except Exception as err:  # garbage, a truncated pickle, a maker whose module won't import
        raise MakerPayloadError(f"not the pool's env makers: {type(err).__name__}: {err}") from err
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    return indices, recipes, identity, keys


def _payload_keys(curve: Any) -> ClientKeys | None:
    """The payload's ``[pool public, worker public, worker secret]`` (z85), or None (ipc)."""
    if curve is None:
        return None
    server_public, public, secret = curve
    for key in curve:
        if type(key) is not bytes or len(key) != 40:
            raise TypeError("its CURVE keys must be three z85 keys of 40 bytes")
    return ClientKeys(public, secret, server_public)


def _read_maker_payload(
    args: argparse.Namespace, maker_payload: bytes | None
) -> tuple[list[int], list[EnvRecipe], str, ClientKeys | None]:
    """``_recipes_from_payload`` of stdin (or of the fork server's copy); a one-line exit."""
    data = maker_payload if maker_payload is not None else sys.stdin.buffer.read()
    try:
        return _recipes_from_payload(data)
    except MakerPayloadError as err:
        raise SystemExit(" ".join(f"{args.prog}: --maker-stdin: {err}".split())) from None


def _recipes_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[int], list[EnvRecipe]]:
    if not args.env:
        parser.error("give --env package.module:callable")
    indices = args.env_indices or list(range(args.num_envs))
    args.num_envs = len(indices)
    kwargs = _kwargs_list(parser, args)
    try:  # checked here, once: not in each env process, restarted for ever
        maker = maker_from_name(args.env)
    except ValueError as err:
        parser.error(f"--env {args.env}: {err}")
    return indices, [EnvRecipe(maker, kw) for kw in kwargs]


def _client_keys(args: argparse.Namespace) -> ClientKeys | None:
    """The CURVE keys of ``--server-key`` and ``--client-key``; a one-line exit if unusable.

    Given both or neither: :func:`run` checked that (an argparse error).
    """
    if not args.server_key:
        return None
    for flag, path in (("--server-key", args.server_key), ("--client-key", args.client_key)):
        if not os.path.exists(path):
            raise SystemExit(f"{args.prog}: {flag} {path}: no such file")
        if not os.path.isfile(path):
            raise SystemExit(f"{args.prog}: {flag} {path}: not a file")
    try:
        return ClientKeys.from_files(args.server_key, args.client_key)
    except InsecureKeyFileError as err:  # a secret others can read: say how to fix it, no traceback
        raise SystemExit(f"{args.prog}: {err}") from None
    except (OSError, ValueError) as err:  # unreadable, not a key file, a public key as secret
        raise SystemExit(f"{args.prog}: {err}") from None


def _serve_remote_child(
    args: argparse.Namespace,
    keys: ClientKeys | None,
    slots: list[int] | None,
    k: int,
    identity: bytes,
) -> int:
    kwargs = json.loads(args.kwargs)
    kwargs = kwargs[k] if isinstance(kwargs, list) else kwargs
    mine = None if slots is None else [slots[k]]
    return serve(args, identity, [0], [recipe_from_name(args.env, kwargs)], True, keys, mine)


def _slots(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int] | None:
    if not args.slots:
        return None
    try:
        slots = [int(i) for i in args.slots.split(",")]
    except ValueError:
        parser.error(f"--slots must be comma-separated env indices, got {args.slots!r}")
    if len(slots) != args.num_envs:
        parser.error(f"--slots must name {args.num_envs} env indices (--num-envs), got {slots}")
    if min(slots) < 0 or len(set(slots)) != len(slots):
        parser.error(f"--slots must name distinct env indices >= 0, got {slots}")
    return slots


def _kwargs_list(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[dict]:
    """``--kwargs`` as one dict per env."""
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as err:
        parser.error(f"--kwargs is not JSON ({err}): {args.kwargs!r}")
    if isinstance(kwargs, dict):
        return [kwargs] * args.num_envs
    one_per_env = isinstance(kwargs, list) and len(kwargs) == args.num_envs
    if one_per_env and all(isinstance(k, dict) for k in kwargs):
        return kwargs
    parser.error(f"--kwargs must be a JSON object or a list of {args.num_envs} objects")


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
        host = EnvHost.build(indices, recipes, args.torch_threads, args.default_dtype)
    except EnvMakerError as err:
        note_failure(err.reason, maker=True)
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
        note_registered()
        worker.serve()
        note_closed()  # serve() returns on the pool's CLOSE: no failure for the supervisor
    except RegistrationError as err:
        note_failure(str(err))
        log.error("%s", err)
        return REFUSED
    finally:
        worker.close()
    return 0
