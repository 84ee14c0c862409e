"""The pool's constructor arguments: remote slots appended to the env list, network checks."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq.auth
from torchrl.envs import EnvBase

from zmqpool.endpoints import tcp_endpoints

log = logging.getLogger("zmqpool")


def is_single_maker(env_makers: Any) -> bool:
    return not isinstance(env_makers, (Sequence, EnvBase))


class RemoteSlot:
    """Stands in the env-maker list for an env that a remote worker will host."""

    def __repr__(self) -> str:
        return "<remote env slot>"


def with_remote_slots(env_makers: Any, kwargs: Any, remote: int) -> tuple[list, list[dict]]:
    """One maker and one kwargs dict per env, remote slots last."""
    single = is_single_maker(env_makers) or isinstance(env_makers, EnvBase)
    makers = [env_makers] if single else list(env_makers)
    if kwargs is None or isinstance(kwargs, dict):
        kwargs = [dict(kwargs or {}) for _ in makers]
    if len(kwargs) != len(makers):
        raise ValueError(
            f"create_env_kwargs must be a dict or a list of {len(makers)} dicts, one per local env"
        )
    return makers + [RemoteSlot()] * remote, list(kwargs) + [{}] * remote


def check_remote_envs(remote_envs: Any) -> None:
    if not isinstance(remote_envs, int) or isinstance(remote_envs, bool):
        raise TypeError(f"remote_envs must be an int, got {type(remote_envs).__name__}")
    if remote_envs < 0:
        raise ValueError(f"remote_envs must be >= 0, got {remote_envs!r}")


def check_network_args(remote: int, bind, keys, insecure: bool, local_transport: str) -> None:
    """The network arguments, checked before any process starts (a ValueError naming one)."""
    check_remote_envs(remote)
    if remote and bind is None:
        raise ValueError("remote_envs needs bind='tcp://HOST:PORT' for the workers to reach")
    if local_transport not in ("ipc", "tcp"):
        raise ValueError(f"local_transport must be 'ipc' or 'tcp', got {local_transport!r}")
    if bind is None:
        return
    tcp_endpoints(bind)  # its form: tcp://HOST:PORT
    if keys not in (None, "in memory") and not os.path.isdir(keys):
        raise FileNotFoundError(f"curve_keys {str(keys)!r} is not a directory (`zmqpool keygen`)")
    if keys is None and not insecure:
        raise ValueError(
            f"binding {bind} without CURVE would let anyone who reaches it step your envs: "
            "pass curve_keys=DIR (made by `zmqpool keygen DIR`), or insecure=True to accept that"
        )
    if keys is None:
        log.warning("binding %s WITHOUT encryption or authentication (insecure=True)", bind)


def public_key_of(key: str | bytes | os.PathLike) -> str:
    """A CURVE public key as z85 text: given as such (40 characters), or a ``.key`` file."""
    if isinstance(key, bytes):
        key = key.decode("ascii")
    text = str(key)
    if len(text) == 40 and not Path(text).exists():
        return text
    public, _ = zmq.auth.load_certificate(text)
    return public.decode("ascii")
