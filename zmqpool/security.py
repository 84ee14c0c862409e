"""CURVE for TCP: key files, the pool's allow-list, and socket options on both sides.

Key directory made by ``zmqpool keygen DIR``::

    DIR/server.key, DIR/server.key_secret       the pool's pair (keep the secret on the trainer)
    DIR/workers/worker-N.key[_secret]           one pair per worker host (copy the secret there)
    DIR/authorized/worker-N.key                 the allow-list: public keys the pool accepts

A worker needs ``server.key`` (to know the pool) and its own ``.key_secret``.
Deleting a key's file from ``authorized/`` (read when a pool starts) keeps
pools started later from accepting it; a running pool revokes a key with
``ZMQAsyncEnvPool.revoke_worker_key()``. Local ipc endpoints use no CURVE:
they live in a 0700 directory. Over loopback TCP (``local_transport="tcp"``)
the local side has CURVE too, with a pair made in memory for each local worker
(:meth:`zmqpool.broker.Broker.authorize_local`), under a ZAP domain of its own.

Secrets stay secret: a secret key file that its group or others may read is
refused when loaded (:class:`InsecureKeyFileError`, saying ``chmod 600``), and
the reprs of :class:`ServerKeys` and :class:`ClientKeys` leave the secret out.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from zmqpool.errors import ZMQPoolError


class InsecureKeyFileError(ZMQPoolError, PermissionError):
    """A secret key file that users other than its owner may read (or write).

    Attributes:
        path: the file.
        mode: its permission bits.
    """

    def __init__(self, path: Path, mode: int) -> None:
        self.path = path
        self.mode = mode
        super().__init__(
            f"secret key file {path} is open to other users (mode {mode:04o}); "
            f"a secret key must be readable by its owner only: chmod 600 {path}"
        )

    def __reduce__(self) -> tuple[type, tuple[Path, int]]:
        return type(self), (self.path, self.mode)


def check_secret_file(path: str | os.PathLike) -> None:
    """Raise :class:`InsecureKeyFileError` if ``path``'s group or others have any access to it."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise InsecureKeyFileError(Path(path), mode)


@dataclasses.dataclass(frozen=True)
class ServerKeys:
    """The pool's CURVE pair and the directory of worker public keys it accepts."""

    public: bytes
    secret: bytes = dataclasses.field(repr=False)  # never in a repr, a log or a traceback
    authorized_dir: str | None  # None: only keys authorized in memory (launched workers)

    @classmethod
    def ephemeral(cls) -> ServerKeys:
        """A pair made in memory for this pool, with no allow-list directory.

        For workers the pool launches itself, whose keys it makes and
        authorizes one by one (:meth:`zmqpool.broker.Broker.authorize`).
        """
        public, secret = zmq.curve_keypair()
        return cls(public, secret, None)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> ServerKeys:
        root = Path(directory)
        secret_file = root / "server.key_secret"
        authorized = root / "authorized"
        if not secret_file.is_file() or not authorized.is_dir():
            raise FileNotFoundError(
                f"{root} is not a key directory (no server.key_secret or authorized/); "
                f"make one with: zmqpool keygen {root}"
            )
        check_secret_file(secret_file)
        public, secret = zmq.auth.load_certificate(str(secret_file))
        assert secret is not None
        return cls(public, secret, str(authorized))


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """A worker's CURVE pair and the pool's public key."""

    public: bytes
    secret: bytes = dataclasses.field(repr=False)  # never in a repr, a log or a traceback
    server_public: bytes
    #: The file the pair was read from (``--client-key``), to name when the pool refuses it.
    secret_file: str | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def from_files(cls, server_key: str, client_secret_key: str) -> ClientKeys:
        server_public, _ = zmq.auth.load_certificate(server_key)
        public, secret = zmq.auth.load_certificate(client_secret_key)
        # A public key given for the secret one: say so first, not "chmod 600" (its usual mode
        # is 0644), which would only lead to this same message.
        if secret is None:
            raise ValueError(
                f"{client_secret_key} holds no secret key: give the .key_secret file, "
                "not the public .key"
            )
        check_secret_file(client_secret_key)
        return cls(public, secret, server_public, str(client_secret_key))


def make_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """CURVE server options; they apply to endpoints bound after this call."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def start_authenticator(context: zmq.Context, keys: ServerKeys, domain: str) -> ThreadAuthenticator:
    """ZAP handler: a CURVE client connects only if its public key is in ``authorized/``.

    Only for ``domain``, the ZAP domain every CURVE server socket of the pool
    enforces: pyzmq looks a key up under the request's domain (``"*"`` only for
    a request without one, which none of ours makes). Without ``authorized/``,
    keys are authorized one by one (launched workers), in memory.
    """
    auth = ThreadAuthenticator(context, log=None)
    auth.start()
    serve_domain(auth, keys, domain)
    return auth


def serve_domain(auth: ThreadAuthenticator, keys: ServerKeys, domain: str) -> None:
    """Let a running ZAP handler answer ``domain`` too: from ``authorized/``, or in memory.

    One handler answers a context's every domain (the local side's over TCP, the
    remote side's), each its own allow-list: a key is good for its domain alone.
    """
    if keys.authorized_dir is not None:
        auth.configure_curve(domain=domain, location=keys.authorized_dir)
    else:
        auth.certs[domain] = {}


@dataclasses.dataclass(frozen=True)
class KeyPair:
    """The two files of one CURVE identity: ``NAME.key`` (public), ``NAME.key_secret``."""

    name: str
    public: Path
    secret: Path


def _private_dir(directory: Path) -> None:
    """Create ``directory`` with mode 0700, or check that an existing one is private."""
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        directory.chmod(0o700)  # mkdir's mode is filtered by the umask
        return
    if not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a directory")
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o077:
        raise ValueError(
            f"{directory} is open to other users (mode {mode:04o}); "
            f"use a new directory or `chmod 700 {directory}` first"
        )


def _check_no_keys(directory: Path, workers: int) -> None:
    """Refuse to replace any key file (a public one too) or to empty ``authorized/``."""
    names = ["server"] + [f"workers/worker-{i}" for i in range(workers)]
    files = [directory / f"{name}.{ext}" for name in names for ext in ("key", "key_secret")]
    files += sorted((directory / "authorized").glob("*.key"))
    existing = [str(p.relative_to(directory)) for p in files if p.exists()]
    if existing:
        raise ValueError(f"{directory} already holds {existing}; pass --force to replace them")


def _new_pair(directory: Path, name: str) -> KeyPair:
    old_umask = os.umask(0o077)  # no moment in which a secret is readable by others
    try:
        public, secret = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old_umask)
    pair = KeyPair(name, Path(public), Path(secret))
    pair.secret.chmod(0o600)
    pair.public.chmod(0o644)
    return pair


def _authorize(directory: Path, pairs: list[KeyPair]) -> None:
    """Make ``authorized/`` hold exactly these workers' public keys (stale ones are revoked)."""
    allowed = directory / "authorized"
    for old in allowed.glob("*.key"):
        old.unlink()
    for pair in pairs:
        copy = allowed / pair.public.name
        copy.write_bytes(pair.public.read_bytes())
        copy.chmod(0o644)


def write_keys(directory: str | os.PathLike, workers: int, force: bool = False) -> list[KeyPair]:
    """Write the pool's ``server`` pair and ``worker-N`` pairs, and authorize the workers.

    Directories get mode 0700 and secret files 0600. Existing keys are kept
    unless ``force``; with it, ``authorized/`` is emptied of older keys.

    Example:
        >>> import tempfile, pathlib
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     pairs = write_keys(pathlib.Path(tmp) / "keys", workers=2)
        >>> [p.name for p in pairs]
        ['server', 'worker-0', 'worker-1']
    """
    directory = Path(directory)
    _private_dir(directory)
    if not force:
        _check_no_keys(directory, workers)
    for sub in ("workers", "authorized"):
        _private_dir(directory / sub)
    worker_pairs = [_new_pair(directory / "workers", f"worker-{i}") for i in range(workers)]
    _authorize(directory, worker_pairs)
    return [_new_pair(directory, "server"), *worker_pairs]
