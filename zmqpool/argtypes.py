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


def positive_seconds(text: str) -> float:
    """A duration in seconds: finite and > 0 (0 would make a heartbeat loop spin)."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value
