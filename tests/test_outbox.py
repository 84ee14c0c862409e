"""The outbox: a call's packed rows, encoded at the end, make the messages encoding each would.

The reference is the long way: every row encoded on its own, in order, by an
encoder with the same history, then :func:`joined_messages`. The outbox must
send exactly those frames, byte for byte, whether it takes its shortcut (every
row of one command and known layout) or not.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from zmqpool.batching import RowPacker
from zmqpool.codec import Encoder
from zmqpool.limits import MAX_BATCH_BYTES, MAX_BATCHED_MESSAGE_BYTES
from zmqpool.outbox import Outbox
from zmqpool.roster import Link
from zmqpool.wire import Command, Header, Row, command_rows, holds_replies, joined_messages


def _link(identity: bytes, encoder: Encoder) -> Link:
    # The outbox reads a link's identity, side and encoder; nothing here decodes.
    return Link(identity, b"t" * 16, 1, b"i", None, encoder, (0, 1, 2, 3), False)  # type: ignore[arg-type]


def _parts(rows: int, width: int = 3, threshold: int | None = None, dtype=torch.float32):
    batch = TensorDict(
        {
            "action": torch.arange(rows * width, dtype=dtype).reshape(rows, width),
            "flag": torch.arange(rows) % 2 == 0,
        },
        [rows],
    )
    packer = RowPacker() if threshold is None else RowPacker(threshold)
    parts = packer.pack(batch)
    assert parts is not None
    return parts


def _kept(parts, envs, command=Command.STEP, seqs=None):
    seqs = seqs or [10 + env for env in envs]
    return [(command, env, seq, part) for env, seq, part in zip(envs, seqs, parts, strict=True)]


def _the_long_way(encoder: Encoder, entries, hold: bool = False) -> list[list[bytes]]:
    rows = [
        Row(entry[0], entry[1], entry[2], [encoder.encode(entry[3])])
        if type(entry) is tuple
        else entry
        for entry in entries
    ]
    return [[bytes(f) for f in m] for m in joined_messages(rows, b"", hold)]


def _sent(
    entries, known: list | None = None, hold: bool = False
) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """What the outbox sends for ``entries``, and what the long way sends, both after
    ``known`` parts were encoded on the connection (their layouts announced); ``hold``:
    each COMMANDS asks for its replies to be held."""
    ours, theirs = Encoder(), Encoder()
    for part in known or []:
        ours.encode(part)
        theirs.encode(part)
    outbox = Outbox()
    link = _link(b"w0", ours)
    for entry in entries:
        outbox.add(link, entry)
    [(sent_link, messages)] = list(outbox.messages(hold))
    assert sent_link is link
    return [[bytes(f) for f in m] for m in messages], _the_long_way(theirs, entries, hold)


def test_rows_of_a_known_layout_go_as_one_commands_built_from_their_frames():
    parts = _parts(4)
    ours, theirs = _sent(_kept(parts, [3, 0, 2, 1]), known=parts[:1])
    assert ours == theirs and len(ours) == 1
    header = Header.decode(ours[0][0])
    assert command_rows(header, 4) == (Command.STEP, [3, 0, 2, 1], [13, 10, 12, 11])
    assert ours[0][1] == b"".join(bytes(p.buffers[0]) for p in parts)


@pytest.mark.parametrize("announced", [True, False])
def test_held_the_commands_ask_for_it_both_ways(announced):
    parts = _parts(3)
    ours, theirs = _sent(_kept(parts, [0, 1, 2]), known=parts[:1] if announced else None, hold=True)
    assert ours == theirs
    joined = Header.decode(ours[-1][0])
    assert joined.command == Command.COMMANDS and holds_replies(joined)


def test_the_first_use_of_a_layout_announces_it_alone_and_the_rest_join_after_it():
    ours, theirs = _sent(_kept(_parts(3), [0, 1, 2]))
    assert ours == theirs
    headers = [Header.decode(m[0]) for m in ours]
    assert [h.command for h in headers] == [Command.STEP, Command.COMMANDS]
    assert "L" in headers[0].body and command_rows(headers[1], 3)[1] == [1, 2]


@pytest.mark.parametrize(
    "case",
    ["two layouts", "two commands", "an env twice", "a row alone", "an encoded row first"],
)
def test_rows_that_do_not_all_join_go_the_long_way(case):
    parts = _parts(3)
    wide = _parts(2, width=5)
    known = [parts[0], wide[0]]
    entries: list = _kept(parts, [0, 1, 2])
    if case == "two layouts":
        entries.insert(1, _kept(wide[:1], [3])[0])
    elif case == "two commands":
        entries[2] = _kept(parts[2:], [2], Command.STEP_AND_MAYBE_RESET)[0]
    elif case == "an env twice":
        entries.append(_kept(parts[:1], [0], seqs=[99])[0])
    elif case == "a row alone":
        entries = entries[:1]
    else:
        encoder = Encoder()
        encoder.encode(parts[0])
        entries.insert(0, Row(Command.STEP, 3, 7, [encoder.encode(parts[1])]))
    ours, theirs = _sent(entries, known=known)
    assert ours == theirs


def test_rows_with_frames_of_their_own_join_frame_by_frame():
    # A threshold of 8 bytes gives "action" (3 float64: 24 bytes) a frame of its own.
    parts = _parts(3, threshold=8, dtype=torch.float64)
    assert len(parts[0].buffers) == 2
    ours, theirs = _sent(_kept(parts, [2, 1, 0]), known=parts[:1])
    assert ours == theirs and len(ours) == 1 and len(ours[0]) == 3


def test_rows_beyond_the_batch_limits_go_the_long_way():
    big = _parts(2, width=MAX_BATCHED_MESSAGE_BYTES // 4 + 1)  # each row over the message limit
    ours, theirs = _sent(_kept(big, [0, 1]), known=big[:1])
    assert ours == theirs and len(ours) == 2
    width = MAX_BATCHED_MESSAGE_BYTES // 8  # half the limit a row: 17 rows pass the batch's
    many = _parts(MAX_BATCH_BYTES // (width * 4) + 1, width=width)
    ours, theirs = _sent(_kept(many, list(range(len(many)))), known=many[:1])
    assert ours == theirs and len(ours) == 2


def test_each_worker_gets_its_own_rows_in_order():
    parts = _parts(4)
    encoders = {b"a": Encoder(), b"b": Encoder()}
    links = {name: _link(name, encoder) for name, encoder in encoders.items()}
    outbox = Outbox()
    for env, part in enumerate(parts):
        outbox.add(links[b"a" if env % 2 else b"b"], (Command.STEP, env, env, part))
    sent = {link.identity: messages for link, messages in outbox.messages()}
    assert sorted(sent) == [b"a", b"b"]
    for name, messages in sent.items():
        envs = [Header.decode(m[0]).env for m in messages]
        assert envs == ([1, 3] if name == b"a" else [0, 2])  # an announcement, then a row
