"""Random subsets, min_get=1, hundreds of steps: nothing lost, duplicated or misrouted."""

from __future__ import annotations

import random

from tests.conftest import NUM_ENVS
from tests.exactly_once import ExactlyOnce

STEPS = 600


def test_async_random_subsets_deliver_every_step_exactly_once(pool):
    ExactlyOnce(pool, NUM_ENVS, STEPS, random.Random(0)).run()
