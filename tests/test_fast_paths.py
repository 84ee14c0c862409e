"""The hot loop's shortcuts give what the general paths they bypass give.

- :class:`~zmqpool.batching.RowPacker`: each packed row of a batch is, byte for
  byte, what ``Encoder.encode`` makes of that row; stacking the rows is the batch.
- Decoding writable buffers (a worker's bytearrays: numpy views) gives what
  read-only zmq frames give (torch views).
- ``env_index_stack(idx)`` builds the object ``NonTensorStack(*idx)`` builds.
- ``step_next(env, td)`` is ``env.step(td)["next"]``.
- ``step_proc_data(env, out)`` is ``env._step_proc_data(out)``.
- ``step_and_maybe_reset(env, td)`` is ``env.step_and_maybe_reset(td)``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict
from torchrl.data import Unbounded
from torchrl.envs import EnvBase, StepCounter, TransformedEnv
from torchrl.testing.mocking_classes import CountingEnv as TorchRLCountingEnv
from torchrl.testing.mocking_classes import HeterogeneousCountingEnv, NestedCountingEnv

from tests.test_codec_properties import SETTINGS, as_received, canonical, tensordicts
from workers.hosting import EnvHost, step_and_maybe_reset, step_next, step_proc_data
from zmqpool import assembly
from zmqpool.batching import RowPacker, stack_parts
from zmqpool.codec import ZERO_COPY_THRESHOLD, Decoder, Encoder
from zmqpool.testing import CountingEnv
from zmqpool.wire import Command, Header, encode_message

EXCLUDE = ("env_index", "next")


@st.composite
def batches(draw) -> TensorDict:
    rows = draw(st.integers(1, 3))
    extra = tuple(draw(st.lists(st.integers(0, 2), max_size=1)))
    return draw(tensordicts(batch=(rows, *extra)))


def _packable(batch: TensorDict) -> bool:
    """Tensors only, every nested tensordict non-empty and of the batch's own batch size."""
    for value in batch.values():
        if not isinstance(value, torch.Tensor):
            if not isinstance(value, TensorDict) or value.batch_size != batch.batch_size:
                return False
            if not value.keys() or not _packable(value):
                return False
    return True


@SETTINGS
@given(batches(), st.sampled_from([1, ZERO_COPY_THRESHOLD]))
def test_a_packed_row_is_the_encoded_row(batch, threshold):
    rows = RowPacker(threshold).pack(batch)
    assert (rows is not None) == _packable(batch)
    if rows is None:
        return
    for i, row in enumerate(rows):
        encoded = Encoder(threshold).encode(batch[i])
        assert [bytes(b) for b in row.buffers] == [bytes(memoryview(f)) for f in encoded.frames]
        assert row.layout.to_data() == encoded.new_layout


@SETTINGS
@given(batches())
def test_stacking_packed_rows_is_the_batch(batch):
    rows = RowPacker().pack(batch)
    if rows is not None:
        assert canonical(stack_parts(rows)) == canonical(batch)
        assert canonical(rows[-1].to_tensordict()) == canonical(batch[len(rows) - 1])


@pytest.mark.parametrize("keys", [("action",), ("action", "mask")])
def test_packed_rows_are_copies_the_caller_s_batch_cannot_change(keys):
    """A packed row is what the request sent and what its result is rebuilt from: a
    batch changed in place after the send (a policy's buffer reused) must not reach it."""
    batch = TensorDict({key: torch.arange(6.0).reshape(3, 2) for key in keys}, [3])
    rows = RowPacker().pack(batch)
    assert rows is not None
    for value in batch.values():
        value.fill_(-1.0)
    for i, row in enumerate(rows):
        sent = row.to_tensordict()
        for key in keys:
            assert sent[key].tolist() == [2.0 * i, 2.0 * i + 1]


def test_packing_leaves_out_the_excluded_keys_and_non_tensors_fall_back():
    batch = TensorDict({"action": torch.arange(4.0).reshape(2, 2)}, [2])
    batch.set("env_index", assembly.env_index_stack([3, 5]))
    batch.set("next", TensorDict({"x": torch.zeros(2, 1)}, [2]))
    rows = RowPacker().pack(batch, exclude=EXCLUDE)
    assert rows is not None
    assert list(stack_parts(rows).keys()) == ["action"]
    batch.set_non_tensor("info", "text")
    assert RowPacker().pack(batch, exclude=EXCLUDE) is None


@SETTINGS
@given(tensordicts())
def test_writable_buffers_decode_like_zmq_frames(td):
    frames = encode_message(Header(Command.RESULT, 0, 1), [Encoder().encode(td)])
    header = Header.decode(bytes(memoryview(frames[0])))
    readonly = Decoder().decode(header, as_received(frames)[1:])[0]
    writable = Decoder().decode(header, [bytearray(memoryview(f)) for f in frames[1:]])[0]
    assert canonical(writable.to_tensordict()) == canonical(readonly.to_tensordict())


def test_an_encoder_announces_a_packed_layout_once_per_connection():
    encoder = Encoder()
    row = RowPacker().pack(TensorDict({"a": torch.zeros(2, 3)}, [2]))
    assert row is not None
    first, second = encoder.encode(row[0]), encoder.encode(row[1])
    assert first.new_layout is not None and second.new_layout is None
    assert first.layout_id == second.layout_id
    encoder.forget()  # the peer was replaced: announce again
    assert encoder.encode(row[0]).new_layout is not None


def test_a_packed_part_keeps_its_own_layout_beside_an_equal_tensordict():
    # The same keys, packed by another threshold: each travels with its own layout.
    encoder, decoder = Encoder(zero_copy_threshold=1), Decoder()
    batch = TensorDict({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, 1)}, [2])
    rows = RowPacker(ZERO_COPY_THRESHOLD).pack(batch)
    assert rows is not None
    for part in (encoder.encode(batch[0]), encoder.encode(rows[0]), encoder.encode(batch[0])):
        frames = as_received(encode_message(Header(Command.RESULT, 0, 1), [part]))
        got = decoder.decode(Header.decode(frames[0]), frames[1:])[0].to_tensordict()
        assert canonical(got) == canonical(batch[0])


@pytest.mark.parametrize("idx", [[0], [2, 0, 1], list(range(7))])
def test_env_index_stack_builds_what_non_tensor_stack_builds(idx):
    # Private on purpose: the shortcut writes tensordict objects' __dict__ directly, so
    # only a comparison of their state (the module's own check, run at import to pick
    # the path) shows it builds what tensordict builds; and unless this tensordict
    # takes the shortcut, the test would compare NonTensorStack with itself.
    assert assembly._FAST_ITEMS
    fast, slow = assembly.env_index_stack(idx), NonTensorStack(*idx)
    assert assembly._same_state(fast, slow)
    assert fast.tolist() == idx and fast.batch_size == slow.batch_size


def _next_of(stepper, td: TensorDict) -> dict:
    env = CountingEnv(env_id=2)
    env.reset()
    return canonical(stepper(env, td.clone()))


def test_step_next_is_the_next_of_env_step():
    td = TensorDict({"action": torch.tensor([0.5])}, [])
    expected = _next_of(lambda env, t: env.step(t).get("next"), td)
    assert _next_of(step_next, td) == expected
    partial = td.clone()
    partial.set("_step", torch.tensor(True))  # partial steps: EnvBase.step itself
    assert _next_of(step_next, partial) == expected


class _OwnStep(CountingEnv):
    def step(self, tensordict):
        out = super().step(tensordict)
        out.set(("next", "stepped_by"), torch.ones(1))
        return out


def test_an_env_with_its_own_step_keeps_it():
    env = _OwnStep()
    env.reset()
    assert type(env).step is not EnvBase.step
    out = step_next(env, TensorDict({"action": torch.zeros(1)}, []))
    assert out["stepped_by"].tolist() == [1.0]


# ------------------------------------------- step_proc_data: skipped only where a no-op


def _stepped(env: EnvBase) -> TensorDict:
    """A step's raw output (``env._step``), before torchrl's post-processing."""
    td = env.reset()
    td.update(env.full_action_spec.zero())
    return env._step(td)


def _proc_matches(env: EnvBase, edit=None) -> TensorDict:
    """step_proc_data gives what ``env._step_proc_data`` gives, on the same raw output."""
    out = _stepped(env)
    if edit is not None:
        edit(out)
    expected = canonical(env._step_proc_data(out.clone()))
    got = step_proc_data(env, out.clone())
    assert canonical(got) == expected
    return got


@pytest.mark.parametrize(
    "make",
    [
        lambda: CountingEnv(env_id=1),
        lambda: CountingEnv(env_id=1, obs_shape=(2, 3)),
        lambda: TorchRLCountingEnv(),
        lambda: TorchRLCountingEnv(batch_size=[2]),
        lambda: NestedCountingEnv(),
        lambda: NestedCountingEnv(nest_done=False, nest_reward=False),
        lambda: HeterogeneousCountingEnv(),
    ],
)
def test_step_proc_data_is_env_step_proc_data(make):
    _proc_matches(make())


def test_a_complete_output_is_returned_as_it_is():
    env = CountingEnv()
    out = _stepped(env)
    assert step_proc_data(env, out) is out


def test_an_incomplete_output_is_completed_as_torchrl_does():
    env = CountingEnv()
    # A missing done flag is filled in, a reward of another shape is reshaped.
    got = _proc_matches(env, lambda out: out.del_("done"))
    assert got.get("done", None) is not None
    got = _proc_matches(env, lambda out: out.set("reward", out["reward"].reshape(1, 1)))
    assert got["reward"].shape == (1,)
    # No reward: torchrl's error, not a silent pass.
    no_reward = _stepped(env).exclude("reward")
    with pytest.raises(Exception) as torchrl_error:
        env._step_proc_data(no_reward.clone())
    with pytest.raises(torchrl_error.type):
        step_proc_data(env, no_reward)


def test_new_specs_are_checked_against_not_the_cached_ones():
    env = CountingEnv()
    step_proc_data(env, _stepped(env))  # the checks are cached now
    env.reward_spec = Unbounded(shape=(2,))  # unlocks the specs, so torchrl empties its cache
    out = _stepped(env)  # a reward of shape (1,): torchrl's view to (2,) fails
    with pytest.raises(RuntimeError):
        env._step_proc_data(out.clone())
    with pytest.raises(RuntimeError):
        step_proc_data(env, out)


def test_type_checks_and_unlocked_specs_keep_torchrl_path():
    env = CountingEnv()
    env.run_type_checks = True
    out = _stepped(env)
    out.set("reward", out["reward"].double())  # a type error only the type checks see
    with pytest.raises(TypeError):
        step_proc_data(env, out)
    env = CountingEnv()
    env.set_spec_lock_(False)  # torchrl caches nothing then: neither do we
    out = _stepped(env)
    out.del_("done")
    assert step_proc_data(env, out).get("done", None) is not None


class _OwnProcData(CountingEnv):
    def _step_proc_data(self, next_tensordict_out):
        return super()._step_proc_data(next_tensordict_out).set("proc", torch.ones(1))


def test_an_env_with_its_own_step_proc_data_keeps_it():
    env = _OwnProcData()
    assert step_proc_data(env, _stepped(env))["proc"].tolist() == [1.0]


# ------------------------------------ step_and_maybe_reset: torchrl's, with a lean step


def _rollout_of(stepper, make, steps: int = 7) -> list:
    """Each step's (result, next root), stepping one env from reset with ``stepper``."""
    torch.manual_seed(0)
    env = make()
    env.set_seed(0)
    root = env.reset()
    seen = []
    for _ in range(steps):
        root.update(env.full_action_spec.zero())
        result, root = stepper(env, root)
        seen.append((canonical(result.clone()), canonical(root.clone())))
    return seen


@pytest.mark.parametrize(
    "make",
    [
        lambda: CountingEnv(env_id=1, max_steps=3),  # episode ends: resets on the way
        lambda: TorchRLCountingEnv(max_steps=3),
        lambda: TorchRLCountingEnv(max_steps=3, batch_size=[2]),
        lambda: NestedCountingEnv(max_steps=3),
        lambda: HeterogeneousCountingEnv(max_steps=3),
        lambda: TransformedEnv(CountingEnv(env_id=1, max_steps=3), StepCounter(max_steps=2)),
    ],
)
def test_step_and_maybe_reset_is_torchrl_s(make):
    expected = _rollout_of(lambda env, td: env.step_and_maybe_reset(td), make)
    assert _rollout_of(step_and_maybe_reset, make) == expected


def test_step_and_maybe_reset_leaves_partial_steps_to_torchrl(monkeypatch):
    env = CountingEnv()
    td = env.reset()
    td.set("action", torch.zeros(1))
    td.set("_step", torch.tensor(True))
    calls = []
    original = EnvBase.step_and_maybe_reset
    monkeypatch.setattr(
        EnvBase, "step_and_maybe_reset", lambda self, t: calls.append(1) or original(self, t)
    )
    step_and_maybe_reset(env, td)
    assert calls


# ------------------------------------------- an env that edits its input: the root comes back


class _Editing(CountingEnv):
    """Edits its input as told: ``"inplace"``, ``"new_key"``, ``"replace"`` or not at all."""

    def __init__(self, edit: str | None) -> None:
        super().__init__()
        self.edit = edit

    def _step(self, tensordict):
        if self.edit == "inplace":
            tensordict["action"].add_(1)
        elif self.edit == "new_key":
            tensordict.set("seen", torch.ones(1))
        elif self.edit == "replace":
            tensordict.set("action", tensordict["action"] + 1)
        return super()._step(tensordict)


@pytest.mark.parametrize("command", [Command.STEP, Command.STEP_AND_MAYBE_RESET])
@pytest.mark.parametrize("edit", [None, "inplace", "new_key", "replace"])
@pytest.mark.parametrize("nested", [False, True])
def test_an_edited_input_travels_back(command, edit, nested):
    env = _Editing(edit)
    td = env.reset() if command == Command.STEP_AND_MAYBE_RESET else TensorDict({}, [])
    td.set("action", torch.zeros(1))
    if nested:  # a tree: input_state falls back to leaf_state
        td.set(("extra", "x"), torch.zeros(2))
    parts = EnvHost({0: env}).run(command, 0, td, {})
    plain = 2 if command == Command.STEP_AND_MAYBE_RESET else 1
    assert len(parts) == plain + (edit is not None)
    if edit is not None:
        assert parts[-1].get("action", None) is not None and parts[-1].get("next", None) is None
