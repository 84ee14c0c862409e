"""Torch-free helpers for ``scripts/bench.py``.

- :class:`CountingGymEnv` is a numpy/gymnasium twin of
  :class:`zmqpool.testing.CountingEnv` with its default sizes (observation
  ``(4,)`` float32 holding ``(env_id, step_count, last_action, seed)``, action
  ``Box(-1, 1, (1,))``), for gymnasium's ``AsyncVectorEnv`` reference row.
- :func:`echo_peer` is the far end of the bare pyzmq round trip the benchmark
  compares the pool against: a DEALER that receives a request from the
  parent's ROUTER and answers with a fixed payload over PUSH to the parent's
  PULL. Run it as ``python -m zmqpool.benchenvs ROUTER_ADDR PULL_ADDR PEER_ID
  NBYTES``.

This module imports neither torch nor torchrl, so worker processes that only
need these helpers start in a fraction of a second.
"""

from __future__ import annotations

import sys
from typing import Any

import gymnasium as gym
import numpy as np
import zmq

__all__ = ["STOP", "CountingGymEnv", "echo_peer", "peer_sockets"]

#: The request that makes :func:`echo_peer` exit.
STOP = b"stop"
#: The first message a peer sends, so the parent's ROUTER learns its identity.
HELLO = b"hello"


class CountingGymEnv(gym.Env):
    """A gymnasium env with the dynamics of ``CountingEnv``'s default config.

    Args:
        env_id: written into every observation and added to every reward.
        max_steps: steps per episode (``None``: never terminates).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, env_id: int = 0, max_steps: int | None = None) -> None:
        self.env_id = env_id
        self.max_steps = max_steps
        self.count = 0
        self.seed_value = -1
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)

    def _observation(self, last_action: float) -> np.ndarray:
        values = (self.env_id, self.count, last_action, self.seed_value)
        return np.asarray(values, dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self.seed_value = int(seed)
        self.count = 0
        return self._observation(0.0), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.count += 1
        last_action = float(np.asarray(action).reshape(-1)[0])
        terminated = self.max_steps is not None and self.count >= self.max_steps
        reward = float(self.env_id + self.count)
        return self._observation(last_action), reward, terminated, False, {}


def peer_sockets(
    ctx: zmq.Context, router_addr: str, pull_addr: str, peer_id: bytes
) -> tuple[zmq.Socket, zmq.Socket]:
    """A bench peer's DEALER (named ``peer_id``) to the parent's ROUTER and PUSH to its PULL."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, peer_id)
    push = ctx.socket(zmq.PUSH)
    for sock in (dealer, push):
        sock.setsockopt(zmq.LINGER, 0)
    dealer.connect(router_addr)
    push.connect(pull_addr)
    return dealer, push


def echo_peer(
    router_addr: str, pull_addr: str, peer_id: bytes, nbytes: int, idle_s: float = 60.0
) -> None:
    """Answer every request from ``router_addr`` with ``nbytes`` bytes on ``pull_addr``.

    The reply is the multipart ``[peer_id, payload]``; the payload buffer is
    allocated once and sent without copying. The peer exits on :data:`STOP`
    or after ``idle_s`` seconds without a request (so it never outlives a
    parent that died).
    """
    ctx = zmq.Context()
    dealer, push = peer_sockets(ctx, router_addr, pull_addr, peer_id)
    payload = bytearray(nbytes)  # allocated once, sent without copying
    try:
        dealer.send(HELLO)
        while dealer.poll(int(idle_s * 1000)):
            if dealer.recv() == STOP:
                break
            push.send_multipart([peer_id, payload], copy=False)
    finally:
        ctx.destroy(linger=0)


def main(argv: list[str]) -> None:
    """``ROUTER_ADDR PULL_ADDR PEER_ID NBYTES``: run :func:`echo_peer`."""
    router_addr, pull_addr, peer_id, nbytes = argv
    echo_peer(router_addr, pull_addr, peer_id.encode(), int(nbytes))


if __name__ == "__main__":
    main(sys.argv[1:])
