"""What a worker tells its pool when something went wrong, made to fit.

A control message over the pool's limit is lost without a word (libzmq drops
it at the ROUTER's ``MAXMSGSIZE``), taking the one explanation the user would
get with it. So a failure's text and traceback are clipped, keeping their
head and tail (:meth:`zmqpool.protocol.Failed.clipped`, the limits the
pool checks), and a REGISTER too large to send is explained instead (here):
which env's specs weigh, and which of their leaves.
"""

from __future__ import annotations

from typing import Any

import msgpack

from zmqpool.limits import MAX_CONTROL_BYTES


def oversized_registration(
    size: int,
    envs: list[int],
    specs: list[Any],
    names: dict[int, str],
    limit: int = MAX_CONTROL_BYTES,
    limit_name: str = "MAX_CONTROL_BYTES",
) -> tuple[int, str]:
    """The env whose specs weigh most in a too-large REGISTER, and what to tell the user.

    Example:
        >>> big = {"low": {"dtype": "uint8", "shape": [3], "data": bytes(2_000_000)}}
        >>> env, text = oversized_registration(2_000_100, [0, 1], [{}, big], {1: "Pixels"})
        >>> env, text[:64]
        (1, 'its REGISTER message is 2000100 bytes, over the limit of 1048512')
    """
    weights = [len(msgpack.packb(spec, use_bin_type=True)) for spec in specs]
    k = max(range(len(specs)), key=weights.__getitem__)
    env = envs[k]
    # The few tensors that make up the weight (a 4-byte action bound would only distract).
    tensors = [t for t in _tensor_fields(specs[k], ()) if 20 * t[0] >= weights[k]]
    tensors = sorted(tensors, reverse=True)[:3]
    where = ", ".join(f"{'/'.join(path)} ({nbytes} bytes)" for nbytes, path in tensors)
    text = (
        f"its REGISTER message is {size} bytes, over the limit of {limit} "
        f"bytes a pool takes (zmqpool.limits.{limit_name}). The specs of env {env} "
        f"({names.get(env, 'env')}) take {weights[k]} bytes"
        + (f", mostly per-element tensors: {where}" if where else "")
        + ". Specs travel whole at registration: masks, and bounds that vary along every "
        "dim, element by element (scalar or per-channel bounds take a few bytes). Declare "
        "such large leaves without them (Unbounded rather than Bounded, no mask), or with "
        "scalar bounds."
    )
    if len(specs) > 1:  # all of a worker's envs register in one message
        text += (
            f" This worker registers {len(specs)} envs at once: fewer envs per worker "
            "(the pool's envs_per_worker; a remote worker without --single-process) also helps."
        )
    return env, text


def _tensor_fields(data: Any, path: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]]:
    """``(bytes, path)`` of each tensor (``{"dtype", "shape", "data"}``) in spec data."""
    if isinstance(data, dict) and isinstance(data.get("data"), bytes):
        return [(len(data["data"]), path)]
    if not isinstance(data, (dict, list)):
        return []
    items = data.items() if isinstance(data, dict) else enumerate(data)
    found = []
    for key, value in items:
        # "entries" (a Composite's) says nothing a reader needs: keep the spec keys only.
        found += _tensor_fields(value, path if key == "entries" else (*path, str(key)))
    return found
