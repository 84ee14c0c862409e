"""What a worker tells its pool when something went wrong, made to fit.

A control message over the pool's limit is lost without a word (libzmq drops
it at the ROUTER's ``MAXMSGSIZE``), taking the one explanation the user would
get with it. So a failure's text and traceback are clipped, keeping their
head and tail, and a REGISTER too large to send is explained instead: which
env's specs weigh, and which of their leaves.
"""

from __future__ import annotations

from typing import Any

import msgpack

from zmqpool.wire import MAX_CONTROL_BYTES

#: The most characters of an error's text, and of its traceback, that a FAILED or
#: ERROR message carries. A header over the pool's limit is lost without a word
#: (its ROUTER's MAXMSGSIZE, the decoder's MAX_HEADER_BYTES), taking the one
#: explanation the user gets with it; at 4 UTF-8 bytes a character at worst,
#: both together stay under a quarter of :data:`~zmqpool.wire.MAX_CONTROL_BYTES`.
MAX_ERROR_CHARS = 4_000
MAX_TRACEBACK_CHARS = 60_000


def clipped_failure(body: dict[str, Any]) -> dict[str, Any]:
    """A FAILED or ERROR body with its ``"err"`` and ``"tb"`` clipped to fit any pool.

    Example:
        >>> body = clipped_failure({"err": "boom", "tb": "x" * 100_000, "kind": "env"})
        >>> body["err"], len(body["tb"]) <= MAX_TRACEBACK_CHARS, body["kind"]
        ('boom', True, 'env')
    """
    return {
        **body,
        "err": clip_middle(str(body.get("err", "")), MAX_ERROR_CHARS),
        "tb": clip_middle(str(body.get("tb", "")), MAX_TRACEBACK_CHARS),
    }


def clip_middle(text: str, limit: int) -> str:
    """``text``, or if longer than ``limit`` characters its head and tail around a marker.

    The tail gets two thirds: a traceback ends with the innermost frames and
    the exception, what a reader looks for first; its head says where it began.

    Example:
        >>> print(clip_middle("a" * 300 + "b" * 600, 78))
        aaaaaaaaaa
        ... [870 characters cut] ...
        bbbbbbbbbbbbbbbbbbbb
    """
    if len(text) <= limit:
        return text
    keep = max(0, limit - _MARKER_RESERVE)
    head = keep // 3
    marker = f"\n... [{len(text) - keep} characters cut] ...\n"
    return text[:head] + marker + text[len(text) - (keep - head) :]


#: Characters set aside for clip_middle's marker (its count has at most 19 digits).
_MARKER_RESERVE = 48


def oversized_registration(
    size: int, envs: list[int], specs: list[Any], names: dict[int, str]
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
        f"its REGISTER message is {size} bytes, over the limit of {MAX_CONTROL_BYTES} "
        f"bytes a pool takes (zmqpool.wire.MAX_CONTROL_BYTES). The specs of env {env} "
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
