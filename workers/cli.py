"""Command line of a worker process.

Two ways to say which envs to host:

- ``--env package.module:callable [--kwargs JSON] [--num-envs K]``: build
  envs from an importable name (remote workers: code never crosses the wire).
- ``--maker-stdin``: read the env makers from standard input, cloudpickled.
  Only the pool that spawned this process writes there (local and trusted);
  nothing read from a socket is ever unpickled. It and ``--env-indices`` are
  the pool's own flags (``zmqpool.launcher``), hidden from ``--help``.
"""

from __future__ import annotations

import argparse
import logging
import re

from workers.defaults import DEFAULT_DTYPES, REGISTER_TIMEOUT_S, WORKER_THREADS_VAR
from workers.supervise import MAX_MAKER_FAILURES, die_with_parent
from zmqpool.argtypes import positive_int, positive_seconds

log = logging.getLogger("workers")


PROG = "python -m workers"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Host torchrl envs for a zmqpool trainer and answer its step/reset commands.",
        epilog="Exit status: 0 when the supervisor is stopped by SIGTERM or SIGINT, or when "
        "the pool of a --single-process worker closes (130 after its Ctrl-C); 2 when the pool "
        "refused the worker or did not answer within --register-timeout, or for a bad "
        "argument; 1 when an env maker failed (supervised: "
        f"{MAX_MAKER_FAILURES} times in a row in an env process that never registered) or "
        "for an unusable key file. The supervisor (without --single-process) restarts an env "
        "process that dies (a warning) and exits once none is left, with a one-line error "
        "saying why; an env process whose pool closed is started again for the next pool, "
        "logged at INFO (nothing at the default --log-level).",
    )
    parser.set_defaults(prog=prog)
    parser.add_argument(
        "--connect",
        required=True,
        type=_endpoint,
        help="the pool's ROUTER endpoint, tcp://HOST:PORT",
    )
    parser.add_argument(
        "--identity",
        help="routing identity of a --single-process worker (default: host-pid-<random>; "
        "one others can guess can be taken by another key's holder first); with a "
        "supervisor, each child's is <identity>-<k>-<random> (default identity: host-pid)",
    )
    makers = parser.add_mutually_exclusive_group()
    makers.add_argument("--env", help="importable env maker, package.module:callable")
    # The pool's own (zmqpool.launcher): a local worker's makers, pickled, on its stdin.
    makers.add_argument("--maker-stdin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--kwargs",
        default="{}",
        help="JSON keyword arguments for --env: an object, or a list of one object per env",
    )
    parser.add_argument(
        "--num-envs",
        type=positive_int,
        default=1,
        help="envs to host with --env: one process each, restarted when it dies (an env "
        f"process whose env maker fails {MAX_MAKER_FAILURES} times in a row before it ever "
        "registered is not restarted)",
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
    # The pool's own too: the env indices of a local worker.
    parser.add_argument("--env-indices", type=_env_indices, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, help="exit when this process dies")
    parser.add_argument(
        "--heartbeat-interval", type=positive_seconds, default=1.0, help="seconds, > 0 (default 1)"
    )
    parser.add_argument(
        "--register-timeout",
        type=positive_seconds,
        help=f"seconds to wait for the pool (default: {REGISTER_TIMEOUT_S:g} for local workers, "
        "forever for --env)",
    )
    parser.add_argument(
        "--torch-threads",
        type=_threads,
        help="torch intra-op threads in this worker (0: torch's default, one per core; "
        f"default: ${WORKER_THREADS_VAR}, else 1)",
    )
    parser.add_argument(
        "--default-dtype",
        choices=DEFAULT_DTYPES,
        help="torch.set_default_dtype before the envs are built (a local pool passes the "
        "trainer's when it is not float32; default: torch's, float32)",
    )
    parser.add_argument(
        "--log-level", type=str.upper, choices=LOG_LEVELS, default="WARNING", help="default WARNING"
    )
    return parser


def _threads(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--torch-threads must be >= 0, got {value}")
    return value


def _env_indices(text: str) -> list[int]:
    """``--env-indices``: comma-separated distinct pool env indices, each >= 0."""
    try:
        indices = [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated env indices, got {text!r}"
        ) from None
    if min(indices) < 0 or len(set(indices)) != len(indices):
        raise argparse.ArgumentTypeError(f"must be distinct env indices >= 0, got {indices}")
    return indices


_ENDPOINT = re.compile(r"tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+):(?P<port>\d+)|ipc://\S+")
#: A host name or IPv4 address as libzmq's connect takes it: a letter or digit first, then
#: letters, digits, '.', '-' or '_'. It refuses others with a ZMQError in each env process,
#: which the supervisor would restart for ever.
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_PORT = 65535


def _endpoint(text: str) -> str:
    """A ZeroMQ endpoint a worker can connect to: ``tcp://HOST:PORT`` (or ``ipc://PATH``).

    Checked here, not by a trial connect: libzmq starts a TCP connect in its
    I/O thread at once, so a trial would reach the pool (or whatever listens).
    """
    match = _ENDPOINT.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(f"must look like tcp://HOST:PORT, got {text!r}")
    host, port = match["host"], match["port"]
    if host == "*":  # the pool binds "any interface"; a worker connects to one host
        raise argparse.ArgumentTypeError(
            f"needs the pool's host name or address, not '*' (that is for bind), got {text!r}"
        )
    if host is not None and not host.startswith("[") and not _HOST.fullmatch(host):
        raise argparse.ArgumentTypeError(
            f"needs a host name or address (a letter or digit first, then letters, digits, "
            f"'.', '-' or '_'), got {host!r} in {text!r}"
        )
    if port is not None and not 1 <= int(port) <= _MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"needs a port from 1 to {_MAX_PORT}, got {port} in {text!r}"
        )
    return text


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """``python -m workers``: see ``--help``; 130 after a Ctrl-C, wherever it lands."""
    try:  # the whole run: a Ctrl-C while the envs' modules import is no traceback either
        return run(argv, prog=prog)
    except KeyboardInterrupt:
        return 130


def run(argv: list[str] | None, maker_payload: bytes | None = None, prog: str = PROG) -> int:
    """Run a worker; ``maker_payload`` replaces stdin for ``--maker-stdin`` (the fork server)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if bool(args.server_key) != bool(args.client_key):  # a usage error: status 2, as argparse's
        parser.error("give both --server-key and --client-key, or neither")
    logging.basicConfig(level=args.log_level, format="%(asctime)s worker %(levelname)s %(message)s")
    die_with_parent(args.parent_pid)
    # Only now what hosts envs, torch with it (seconds): --help and a bad flag answer at once.
    from workers.serving import start

    return start(parser, args, maker_payload)
