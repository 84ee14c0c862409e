"""Replies held to their env's specs (zmqpool/conformity.py), and spec cost counted as built.

The live case (one remote env replying off-spec in a mixed pool) is in
test_network_keys.py; these are the checks themselves.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Composite, Unbounded

from zmqpool.codec import layout_of
from zmqpool.conformity import ReplyCheck
from zmqpool.errors import ProtocolError
from zmqpool.specs import spec_from_data, spec_to_data
from zmqpool.testing import CountingEnv

SPEC = CountingEnv().specs


def next_part(observation_shape: tuple[int, ...], extra: bool = False):
    td = TensorDict({"observation": torch.zeros(observation_shape), "reward": torch.zeros(1)}, [])
    if extra:
        td["info"] = torch.zeros(7)  # not in the spec: not checked
    return layout_of(td)


def test_a_reply_leaf_off_its_spec_shape_is_named_once_per_layout():
    check = ReplyCheck(SPEC)
    assert check(next_part((4,))) is None
    assert check(next_part((4,), extra=True)) is None
    wrong = check(next_part((5,)))
    assert wrong == "replied with observation of shape [5]; its spec says [4]"
    assert check(next_part((5,))) == wrong  # the same verdict, from the cache


def test_a_dynamic_spec_dim_takes_any_size_and_a_heterogeneous_spec_is_not_held():
    spec = Composite(
        output_spec=Composite(
            full_observation_spec=Composite(observation=Unbounded(shape=(-1, 2))),
            full_reward_spec=Composite(reward=Unbounded(shape=(1,))),
            full_done_spec=Composite(done=Unbounded(shape=(1,), dtype=torch.bool)),
        )
    )
    check = ReplyCheck(spec)
    assert check(next_part((9, 2))) is None
    assert "spec says [-1, 2]" in (check(next_part((9, 3))) or "")
    assert ReplyCheck(object()).shapes == {}  # nothing to hold it to: nothing refused


def test_a_bounded_leaf_costs_its_box_and_zero_and_a_budget_refuses_it_before_building():
    big = Composite(obs=Bounded(low=0.0, high=1.0, shape=(1 << 20,)))  # 4 MiB of float32
    data = spec_to_data(big)
    assert spec_from_data(data, max_bytes=13 << 20).shape == big.shape  # 3 x 4 MiB fits
    with pytest.raises(ProtocolError, match="would cost more than 8388608 bytes"):
        spec_from_data(data, max_bytes=8 << 20)
