"""The far end of ``scripts/bench.py``'s ``zmq-floor`` row: a hand-written pyzmq pool's worker.

:func:`floor_peer` is what a worker of the leanest pool one could write on pyzmq and
torchrl does, and nothing more: a DEALER receives an action as raw bytes from the
parent's ROUTER, copies it into a preallocated TensorDict, steps the env as zmqpool's
workers do (:func:`workers.hosting.step_next`), and pushes the observation, reward and
done flag back to the parent's PULL as raw frames. No msgpack header, no spec, no keys,
no request ids, no restarts, no input checks. It runs torch with one intra-op thread,
as zmqpool's workers do (:func:`workers.hosting.limit_torch_threads`). A peer that did
more than a worker (``env.step``'s bookkeeping, or OpenMP threads contending for the
cores) would be no floor: ``docs/PERFORMANCE.md`` (session 35) has the figures. The row
measures what ZeroMQ and the env cost on this machine, so the bench can say whether a
target is within a bare pyzmq pool's reach before it holds zmqpool to it.

Run it as ``python -m zmqpool.benchfloor ROUTER_ADDR PULL_ADDR PEER_ID KWARGS_JSON [KEYS]``,
``KWARGS_JSON`` being :class:`zmqpool.testing.CountingEnv`'s keyword arguments
(``obs_dtype`` as a dtype name) and ``KEYS`` the comma-separated keys of the step's
``"next"`` it sends (default :data:`REPLY_KEYS`; the ``zmq-lean`` row asks for all five).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
import zmq
from tensordict import TensorDict, TensorDictBase

from workers.hosting import limit_torch_threads, step_next
from zmqpool.benchenvs import HELLO, STOP, peer_sockets
from zmqpool.testing import CountingEnv

__all__ = ["REPLY_KEYS", "env_kwargs_from_json", "env_kwargs_to_json", "floor_peer"]

#: Frames at least this big go out without a copy (pyzmq's own rule of thumb).
ZERO_COPY_BYTES = 64 << 10
#: The leaves of a step's ``"next"`` a peer sends unless asked for others.
REPLY_KEYS = ("observation", "reward", "done")


def env_kwargs_to_json(kwargs: dict[str, Any]) -> str:
    """``CountingEnv`` kwargs as JSON: a dtype by its name, tuples as lists."""
    out = dict(kwargs)
    if "obs_dtype" in out:
        out["obs_dtype"] = str(out["obs_dtype"]).removeprefix("torch.")
    return json.dumps(out)


def env_kwargs_from_json(text: str) -> dict[str, Any]:
    """The inverse of :func:`env_kwargs_to_json`."""
    kwargs = json.loads(text)
    if "obs_dtype" in kwargs:
        kwargs["obs_dtype"] = getattr(torch, kwargs["obs_dtype"])
    if "obs_shape" in kwargs:
        kwargs["obs_shape"] = tuple(kwargs["obs_shape"])
    if "step_sleep_s" in kwargs:
        kwargs["step_sleep_s"] = tuple(kwargs["step_sleep_s"])
    return kwargs


def _frame(tensor: torch.Tensor) -> tuple[Any, bool]:
    """A tensor's bytes as a frame, and whether it is big enough to send without a copy."""
    array = tensor.detach().contiguous().numpy()
    return array, array.nbytes >= ZERO_COPY_BYTES


def floor_peer(
    router_addr: str,
    pull_addr: str,
    peer_id: bytes,
    env_kwargs: dict[str, Any],
    idle_s: float = 60.0,
    keys: tuple[str, ...] = REPLY_KEYS,
) -> None:
    """Step a ``CountingEnv`` once per request; reply ``[peer_id, *keys' leaves]``
    (by default its observation, reward and done flag).

    The peer exits on :data:`~zmqpool.benchenvs.STOP` or after ``idle_s``
    seconds without a request (so it never outlives a parent that died).
    """
    limit_torch_threads()  # before the env makes a tensor: as a zmqpool worker runs
    env = CountingEnv(**env_kwargs)
    env.reset()
    td = TensorDict({"action": torch.zeros(env.action_spec.shape)})  # as the serial row's
    action_array = td.get("action").numpy()  # shares the tensor's memory
    ctx = zmq.Context()
    dealer, push = peer_sockets(ctx, router_addr, pull_addr, peer_id)
    try:
        dealer.send(HELLO)
        while dealer.poll(int(idle_s * 1000)):
            request = dealer.recv(copy=False)
            if request.bytes == STOP:
                break
            # numpy, not torch.frombuffer: the frame's buffer is read-only
            action_array[:] = np.frombuffer(request.buffer, dtype=action_array.dtype)
            nxt = step_next(env, td)
            _reply(push, peer_id, nxt, keys)
            if bool(nxt.get("done").any()):
                env.reset()
    finally:
        ctx.destroy(linger=0)
        env.close()


def _reply(push: zmq.Socket, peer_id: bytes, nxt: TensorDictBase, keys: tuple[str, ...]) -> None:
    """Send the step's leaves under ``keys`` as raw frames."""
    frames = [_frame(nxt.get(key)) for key in keys]
    big = any(zero_copy for _, zero_copy in frames)
    push.send_multipart([peer_id, *(frame for frame, _ in frames)], copy=not big)


def main(argv: list[str]) -> None:
    """``ROUTER_ADDR PULL_ADDR PEER_ID KWARGS_JSON [KEYS]``: run :func:`floor_peer`."""
    router_addr, pull_addr, peer_id, kwargs_json, *rest = argv
    keys = tuple(rest[0].split(",")) if rest else REPLY_KEYS
    kwargs = env_kwargs_from_json(kwargs_json)
    floor_peer(router_addr, pull_addr, peer_id.encode(), kwargs, keys=keys)


if __name__ == "__main__":
    main(sys.argv[1:])
