"""argparse value types shared by the ``zmqpool`` command and ``python -m workers``.

Kept free of heavy imports: ``zmqpool --help`` must not import torch.
"""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of envs, steps, workers)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


#: ``torch.manual_seed`` takes seeds below this (and negative ones, which torchrl's seed
#: chain and gymnasium refuse): a seed is an integer in ``[0, MAX_SEED]``.
MAX_SEED = 2**64 - 1


def seed(text: str) -> int:
    """An env seed: an integer from 0 to :data:`MAX_SEED` (torch, torchrl and gymnasium take it)."""
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**64 - 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """A duration in seconds: finite and > 0 (0 would make a heartbeat loop spin)."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value
