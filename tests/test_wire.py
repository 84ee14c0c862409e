"""The wire codec: exact round trips, zero-copy large leaves, ProtocolError for malformed input."""

from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from zmqpool import codec
from zmqpool.codec import ZERO_COPY_THRESHOLD, Decoder, Encoder
from zmqpool.errors import ProtocolError, VersionMismatchError
from zmqpool.limits import MAX_BATCH_BYTES, MAX_BATCH_FRAMES, MAX_BATCHED_MESSAGE_BYTES
from zmqpool.wire import (
    PROTOCOL_VERSION,
    Command,
    Header,
    Row,
    batch_messages,
    check_header_room,
    command_rows,
    encode_message,
    joined_messages,
    peek_command,
    peek_sender,
    pieced_message,
    results_rows,
    split_batch,
)

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def as_received(frames):
    """What a peer gets: read-only buffers, like zmq frames."""
    return [memoryview(bytes(f)) for f in frames]


def round_trip(td, encoder=None, decoder=None):
    encoder, decoder = encoder or Encoder(), decoder or Decoder()
    frames = as_received(encode_message(Header(Command.RESULT, 1, 2), [encoder.encode(td)]))
    header = Header.decode(frames[0])
    return decoder.decode(header, frames[1:])[0].to_tensordict()


def sample(dtype, shape):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


FLOAT8 = [
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]


def test_the_float8_dtypes_round_trip_bit_for_bit():
    # Session 62's audit: refused as "cannot cross the wire", where torchrl's pool passes
    # them; one byte each, packed small and in a frame of their own large.
    small = {f"small_{i}": torch.randn(3, 5).to(d) for i, d in enumerate(FLOAT8)}
    large = {f"large_{i}": torch.randn(ZERO_COPY_THRESHOLD).to(d) for i, d in enumerate(FLOAT8)}
    td = TensorDict({**small, **large}, [])
    out = round_trip(td)
    for key, value in td.items():
        assert out[key].dtype == value.dtype and out[key].shape == value.shape
        assert torch.equal(out[key].view(torch.uint8), value.view(torch.uint8)), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_rl_dtype_round_trips_exactly(dtype):
    td = TensorDict({"x": sample(dtype, (3, 5)), "scalar": sample(dtype, ())}, [])
    out = round_trip(td)
    for key in ("x", "scalar"):
        assert out[key].dtype == dtype and out[key].shape == td[key].shape
        assert torch.equal(out[key], td[key])


def test_empty_noncontiguous_nested_and_batched():
    base = torch.arange(12.0).reshape(3, 4)
    td = TensorDict(
        {
            "empty": torch.empty(0, 7),
            "transposed": base.t(),  # not contiguous
            "strided": base[:, ::2],
            "a": {"b": {"c": torch.ones(2, 2, dtype=torch.int64)}},
        },
        batch_size=[],
    )
    out = round_trip(td)
    assert out["empty"].shape == (0, 7)
    assert torch.equal(out["transposed"], base.t())
    assert torch.equal(out["strided"], base[:, ::2])
    assert torch.equal(out["a", "b", "c"], td["a", "b", "c"])
    batched = TensorDict({"obs": torch.randn(2, 3)}, batch_size=[2])
    assert round_trip(batched).batch_size == torch.Size([2])


def test_non_tensor_plain_data_round_trips_and_objects_are_refused():
    td = TensorDict({"x": torch.zeros(1)}, [])
    td.set_non_tensor("info", {"text": "hi", "n": [1, 2]})
    assert round_trip(td).get_non_tensor("info") == {"text": "hi", "n": [1, 2]}
    td.set_non_tensor("bad", object())
    with pytest.raises(ProtocolError, match="not plain data"):
        Encoder().encode(td)


def test_numpy_scalars_cross_as_the_python_numbers_they_hold():
    td = TensorDict({"x": torch.zeros(1)}, [])
    info = {
        "n": np.int32(3),
        "ok": np.bool_(False),
        "xs": (np.float16(0.5), np.uint8(7)),
        "by_id": {np.int64(2): "a"},  # a key too
    }
    td.set_non_tensor("info", info)
    back = round_trip(td).get_non_tensor("info")
    assert back == {"n": 3, "ok": False, "xs": [0.5, 7], "by_id": {2: "a"}}
    assert [type(k) for k in back["by_id"]] == [int]
    td.set_non_tensor("info", {"when": np.datetime64("2026-12-06")})  # a datetime: not plain
    with pytest.raises(ProtocolError, match="not plain data"):
        Encoder().encode(td)


def test_large_leaves_are_read_without_a_copy():
    big = torch.randn(ZERO_COPY_THRESHOLD // 4 + 1)
    td = TensorDict({"big": big, "small": torch.ones(3)}, [])
    encoded = Encoder().encode(td)
    assert len(encoded.frames) == 2  # one packed frame, one zero-copy frame
    frames = as_received(encode_message(Header(Command.RESULT), [encoded]))
    part = Decoder().decode(Header.decode(frames[0]), frames[1:])[0]
    address = np.frombuffer(frames[2], dtype=np.uint8).ctypes.data
    assert part.tensors[0].data_ptr() == address  # a view on the received frame
    assert torch.equal(part.tensors[0], big)


def test_layouts_are_announced_once_then_referenced():
    encoder, decoder = Encoder(), Decoder()
    td = TensorDict({"obs": torch.randn(4)}, [])
    first = encode_message(Header(Command.RESULT), [encoder.encode(td)])
    second = encode_message(Header(Command.RESULT), [encoder.encode(td)])
    assert "L" in Header.decode(first[0]).body
    assert Header.decode(second[0]).body is None
    assert len(second[0]) < 24  # per-step headers stay tiny
    for frames in (first, second):
        frames = as_received(frames)
        decoder.decode(Header.decode(frames[0]), frames[1:])


def test_a_layout_id_announced_again_decodes_as_the_new_layout():
    # A restarted worker's new encoder numbers its layouts from 0 again, maybe for
    # other keys: messages after the new announcement decode by it, not by what
    # the decoder worked out for that id before.
    decoder = Decoder()
    for td in (TensorDict({"obs": torch.randn(4)}, []), TensorDict({"x": torch.ones(2, 3)}, [])):
        encoder = Encoder()
        for _ in range(2):  # announced, then referred to by id
            frames = as_received(encode_message(Header(Command.RESULT), [encoder.encode(td)]))
            part = decoder.decode(Header.decode(frames[0]), frames[1:])[0]
            got = part.to_tensordict()
            assert set(got.keys()) == set(td.keys())
            keys = list(td.keys())  # iterating a TensorDict walks its batch dim, not its keys
            assert all(torch.equal(got[k], td[k]) for k in keys)


def fields(**override):
    base = {
        "version": PROTOCOL_VERSION,
        "command": int(Command.RESULT),
        "env": 0,
        "seq": 1,
        "token": b"",
        "layouts": [],
        "body": None,
    }
    base.update(override)
    return msgpack.packb(list(base.values()), use_bin_type=True)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never valid msgpack
        b"not msgpack at all \xff\xfe",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"version": 1}),
        fields()[:-2],  # truncated
        fields(command=999),
        fields(command="STEP"),
        fields(env="0"),
        fields(seq=-1),
        fields(token="text"),
        fields(layouts=[-1]),
        fields(layouts=[0] * 99),
        fields(body=[1]),
        # msgpack's booleans are not integers, though Python's bool is an int
        fields(version=True),
        fields(command=True),
        fields(env=False),
        fields(seq=True),
        fields(layouts=[True]),
    ],
)
def test_malformed_headers_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        Header.decode(frame)


def test_a_header_that_cannot_be_packed_leaves_the_next_one_whole():
    """Headers are packed by a Packer kept per thread: one that raises midway must not
    leave its bytes in front of the next header."""
    with pytest.raises(TypeError):
        Header(Command.SEED, env=1, seq=2, body={"seed": object()}).encode()
    header = Header(Command.STEP, env=3, seq=4, token=b"t", layouts=(1,))
    assert header.encode() == msgpack.packb(
        [PROTOCOL_VERSION, int(Command.STEP), 3, 4, b"t", [1], None], use_bin_type=True
    )
    assert Header.decode(header.encode()) == header


@pytest.mark.parametrize("version", [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 99])
def test_version_mismatch_is_its_own_error(version):
    # PROTOCOL_VERSION - 1: a pool of the previous version, which could not read
    # the specs this one sends (broadcast bounds), refuses rather than misreads.
    with pytest.raises(VersionMismatchError, match=f"version {version} "):
        Header.decode(fields(version=version))


def announced(layout_data, layout_id=0):
    return Header(Command.RESULT, layouts=(layout_id,), body={"L": {layout_id: layout_data}})


@pytest.mark.parametrize(
    "layout",
    [
        {"b": [], "t": [[["x"], "float128", [1], False]], "n": []},  # unknown dtype
        {"b": [], "t": [[["x"], "float32", [-1], False]], "n": []},  # negative size
        {"b": [], "t": [[["x"], "float32", [1 << 35, 1 << 35], True]], "n": []},  # 10+ GB
        {"b": [], "t": [[[], "float32", [1], False]], "n": []},  # empty key
        {"b": [], "t": [["x", "float32", [1], False]], "n": []},  # key not a path
        {"b": [], "t": [[["x"], "float32", [1], False]] * 2, "n": []},  # key twice
        {"b": [], "t": "nope", "n": []},
        {"t": [], "n": []},
    ],
)
def test_malformed_layouts_raise_protocol_error(layout):
    with pytest.raises(ProtocolError):
        parts = Decoder().decode(announced(layout), [b"\0" * 4])
        parts[0].to_tensordict()


def test_frames_must_match_the_layout():
    encoder = Encoder()
    td = TensorDict({"obs": torch.randn(4)}, [])
    frames = as_received(encode_message(Header(Command.RESULT), [encoder.encode(td)]))
    header = Header.decode(frames[0])
    with pytest.raises(ProtocolError, match="tensor frames"):
        Decoder().decode(header, frames[1:] + frames[1:])
    with pytest.raises(ProtocolError, match="bytes where the layout says"):
        Decoder().decode(header, [memoryview(b"\0" * 3)])
    with pytest.raises(ProtocolError, match="unknown layout"):
        Decoder().decode(Header(Command.RESULT, layouts=(5,)), [])


# ---------------------------------------------------------------- batches


def _message(env: int, payload: bytes = b"") -> list[bytes]:
    frames = [Header(Command.RESULT, env, env + 1, b"t" * 16).encode()]
    return [*frames, payload] if payload else frames


def _split(frames: list[bytes], max_messages: int = 64) -> list[list[bytes]]:
    header = Header.decode(frames[0])
    assert header.command == Command.BATCH
    return [[bytes(f) for f in m] for m in split_batch(header, frames[1:], max_messages)]


def test_small_messages_travel_as_one_batch_in_order():
    messages = [_message(env, bytes([env]) * (env * 7)) for env in range(5)]
    [batch] = batch_messages(messages, env=3, token=b"t" * 16)
    header = Header.decode(batch[0])
    assert (header.env, header.token, header.layouts) == (3, b"t" * 16, ())
    assert len(batch) == 2  # the header, and every message's frames joined
    assert _split(batch) == messages


def test_a_single_or_large_message_goes_as_it_is_in_its_place():
    big = _message(1, bytes(MAX_BATCHED_MESSAGE_BYTES + 1))
    assert batch_messages([_message(0)], env=0) == [_message(0)]
    out = batch_messages([_message(0), _message(2), big, _message(3), _message(4)], env=0)
    assert [Header.decode(m[0]).command for m in out] == [
        Command.BATCH,
        Command.RESULT,
        Command.BATCH,
    ]
    assert _split(out[0]) == [_message(0), _message(2)]
    assert out[1] is big
    assert _split(out[2]) == [_message(3), _message(4)]


def test_batches_stay_under_their_size_and_frame_limits():
    payload = bytes(MAX_BATCHED_MESSAGE_BYTES - 200)
    messages = [_message(i, payload) for i in range(3 * MAX_BATCH_BYTES // len(payload))]
    out = batch_messages(messages, env=0)
    assert all(len(m) == 2 and len(m[1]) <= MAX_BATCH_BYTES for m in out)
    assert [m for b in out for m in _split(b, len(messages))] == messages
    many = [[Header(Command.RESULT, 0, i).encode()] for i in range(MAX_BATCH_FRAMES + 10)]
    out = batch_messages(many, env=0)
    assert len(out) == 2 and len(Header.decode(out[0][0]).body["len"]) <= MAX_BATCH_FRAMES


@pytest.mark.parametrize(
    "body, frames, max_messages",
    [
        ({"n": [1], "len": [3]}, [b"abcd"], 4),  # sizes add up to less than the frame
        ({"n": [1], "len": [5]}, [b"abcd"], 4),  # ... or more
        ({"n": [2], "len": [4]}, [b"abcd"], 4),  # more frames counted than sized
        ({"n": [1, 1], "len": [2, 2]}, [b"abcd"], 1),  # more messages than the peer may send
        ({"n": [], "len": []}, [b""], 4),  # no message
        ({"n": [0, 1], "len": [4]}, [b"abcd"], 4),  # a message of no frames
        ({"n": [True], "len": [4]}, [b"abcd"], 4),  # a boolean is not a count
        ({"n": [1], "len": [True, 3]}, [b"abcd"], 4),
        ({"n": [1], "len": [-1]}, [b""], 4),
        ({"n": [1], "len": [4]}, [b"ab", b"cd"], 4),  # one joined frame, not two
        ({"n": [1], "len": [4]}, [], 4),
        ({"n": "1", "len": [4]}, [b"abcd"], 4),
        ({"len": [4]}, [b"abcd"], 4),
        (None, [b"abcd"], 4),
        ({"n": [1] * (MAX_BATCH_FRAMES + 1), "len": [0] * (MAX_BATCH_FRAMES + 1)}, [b""], 10**6),
    ],
)
def test_malformed_batches_raise_protocol_error(body, frames, max_messages):
    with pytest.raises(ProtocolError):
        split_batch(Header(Command.BATCH, -1, 0, body=body), frames, max_messages)


# ---------------------------------------------------------------- pieces


def test_a_message_in_pieces_comes_back_whole_each_piece_within_its_size():
    """A remote reply with frames over the port's limit travels cut (wire: pieces)."""
    image = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and 4 bytes
    message = [*_message(2, b"packed"), image]
    [header_frame, *pieces] = pieced_message(message, env=2, token=b"t" * 16, piece=256 << 10)
    header = Header.decode(header_frame)
    assert (header.command, header.env, header.token) == (Command.BATCH, 2, b"t" * 16)
    assert len(pieces) == 5 and all(memoryview(p).nbytes <= 256 << 10 for p in pieces)
    out = split_batch(header, pieces, max_messages=1, max_frame=2 << 20)
    assert [[bytes(f) for f in m] for m in out] == [message]


@pytest.mark.parametrize(
    "case, max_frame, error",
    [
        ("pieces from a peer that may not send them", None, "one joined frame, not 5"),
        ("a frame over its sender's limit", 1 << 20, "a frame of 1048580 bytes"),
        ("pieces short of the sizes listed", 2 << 20, "add up to"),
        ("pieces beyond the sizes listed", 2 << 20, "add up to"),
        ("more than a reply of its sender's joins to", 64 << 10, "join to at most"),
        ("two messages in pieces", 2 << 20, "must carry one message, not 2"),
    ],
)
def test_pieces_are_checked_before_they_are_joined(case, max_frame, error):
    message = [*_message(2, b"packed"), bytes(1 << 20) + b"tail"]
    if case == "more than a reply of its sender's joins to":  # 1 MiB and 4 frames of 64 KiB
        message = [*_message(2), *[bytes(60 << 10)] * 30]
    [header_frame, *pieces] = pieced_message(message, env=2, token=b"t" * 16, piece=256 << 10)
    header = Header.decode(header_frame)
    if case == "pieces short of the sizes listed":
        pieces = pieces[:-1]
    elif case == "pieces beyond the sizes listed":
        pieces = [*pieces, b"x"]
    elif case == "two messages in pieces":
        sizes = header.body["len"]
        body = {"n": [1, len(sizes) - 1], "len": sizes}
        header = Header(Command.BATCH, 2, 0, b"t" * 16, body=body)
    with pytest.raises(ProtocolError, match=error):
        split_batch(header, pieces, 2, max_frame)


# ---------------------------------------------------------------- rows joined


def _rows(encoder: Encoder, values: list[float], first_env: int = 0) -> list[Row]:
    tds = [
        TensorDict({"obs": torch.full((3,), v), "done": torch.tensor([v > 1])}, []) for v in values
    ]
    return [
        Row(Command.RESULT, first_env + i, 10 + i, [encoder.encode(td)]) for i, td in enumerate(tds)
    ]


def _learned(encoder: Encoder) -> Decoder:
    """A decoder that knows what ``encoder`` announced (the rows then announce nothing)."""
    decoder = Decoder()
    announce = _rows(encoder, [0.0])[0]
    decoder.decode(Header.decode(announce.message(b"")[0]), announce.message(b"")[1:])
    return decoder


def test_rows_of_one_layout_travel_joined_and_come_apart_as_each_env_sent_them():
    encoder = Encoder()
    decoder = _learned(encoder)
    [message] = joined_messages(_rows(encoder, [1.0, 2.0, 3.0], first_env=4), b"t" * 16)
    header = Header.decode(message[0])
    assert (header.command, header.env, header.seq, header.token) == (
        Command.RESULTS,
        4,
        0,
        b"t" * 16,
    )
    assert results_rows(header, 3) == ([4, 5, 6], [10, 11, 12])
    rows = decoder.decode_rows(header, as_received(message[1:]), 3)
    for value, parts in zip([1.0, 2.0, 3.0], rows, strict=True):
        td = parts[0].to_tensordict()
        assert td["obs"].tolist() == [value] * 3 and td["done"].tolist() == [value > 1]


def test_a_row_that_announces_or_differs_or_an_error_breaks_the_run_in_its_place():
    encoder = Encoder()
    first = _rows(encoder, [1.0])  # announces its layout: alone, as a RESULT
    same = _rows(encoder, [2.0, 3.0], first_env=1)
    x = TensorDict({"x": torch.ones(2)}, [])
    encoder.encode(x)  # announced before: this row differs by its layout alone
    other = [Row(Command.RESULT, 3, 13, [encoder.encode(x)])]
    error = [Header(Command.ERROR, 4, 14, b"", body={"err": "e", "tb": ""}).encode()]
    tail = _rows(encoder, [4.0, 5.0], first_env=5)
    out = joined_messages([*first, *same, *other, error, *tail], b"")
    headers = [Header.decode(m[0]) for m in out]
    assert [(h.command, h.env) for h in headers] == [
        (Command.RESULT, 0),
        (Command.RESULTS, 1),
        (Command.RESULT, 3),
        (Command.ERROR, 4),
        (Command.RESULTS, 5),
    ]
    assert out[3] is error
    assert headers[1].body == {"envs": [1, 2], "seqs": [10, 11]}


def test_a_second_row_of_an_env_begins_the_next_run():
    # A peer takes each env once per RESULTS; a worker's queue may hold two replies of one env.
    encoder = Encoder()
    _learned(encoder)
    a, b = _rows(encoder, [1.0, 2.0])
    again = Row(Command.RESULT, 0, 12, a.parts)
    out = joined_messages([a, b, again], b"")
    headers = [Header.decode(m[0]) for m in out]
    assert [(h.command, h.env) for h in headers] == [(Command.RESULTS, 0), (Command.RESULT, 0)]
    assert results_rows(headers[0], 2) == ([0, 1], [10, 11])
    assert headers[1].seq == 12


def test_rows_announced_before_join_as_one_message_within_the_batch_limit():
    # What joined_messages tells in one pass (the usual outbox), it must tell as the long way.
    encoder = Encoder()
    td = TensorDict({"obs": torch.zeros(MAX_BATCHED_MESSAGE_BYTES // 2, dtype=torch.uint8)}, [])
    encoder.encode(td)  # announced before
    rows = [Row(Command.RESULT, i, 1, [encoder.encode(td)]) for i in range(40)]
    [one] = joined_messages(rows[:3], b"")
    assert results_rows(Header.decode(one[0]), 3) == ([0, 1, 2], [1, 1, 1])
    out = joined_messages(rows, b"")
    assert len(out) > 1 and all(sum(len(f) for f in m[1:]) <= MAX_BATCH_BYTES for m in out)
    assert [e for m in out for e in results_rows(Header.decode(m[0]), 40)[0]] == list(range(40))


def test_a_batch_holds_at_most_max_messages():
    messages = [_message(env) for env in range(5)]
    out = batch_messages(messages, env=0, max_messages=2)
    assert [Header.decode(m[0]).command for m in out] == [Command.BATCH] * 2 + [Command.RESULT]
    assert [m for b in out[:2] for m in _split(b, 2)] + out[2:] == messages


def test_joined_rows_stay_under_the_batch_limit_and_large_rows_go_alone():
    encoder = Encoder()
    row_bytes = MAX_BATCHED_MESSAGE_BYTES // 2
    tds = [TensorDict({"obs": torch.zeros(row_bytes, dtype=torch.uint8)}, []) for _ in range(40)]
    rows = [Row(Command.RESULT, i, 1, [encoder.encode(td)]) for i, td in enumerate(tds)]
    out = joined_messages(rows, b"")
    assert Header.decode(out[0][0]).command == Command.RESULT  # the announcing row
    assert all(sum(len(f) for f in m[1:]) <= MAX_BATCH_BYTES for m in out)
    envs = [e for m in out[1:] for e in results_rows(Header.decode(m[0]), 40)[0]]
    assert envs == list(range(1, 40)) and len(out) > 2
    big = TensorDict({"obs": torch.zeros(MAX_BATCHED_MESSAGE_BYTES + 1, dtype=torch.uint8)}, [])
    encoder.encode(big)  # announced
    large = [Row(Command.RESULT, i, 1, [encoder.encode(big)]) for i in range(2)]
    assert [Header.decode(m[0]).command for m in joined_messages(large, b"")] == [
        Command.RESULT,
        Command.RESULT,
    ]


@pytest.mark.parametrize(
    "env, body",
    [
        (0, None),
        (0, {"envs": [0, 1]}),
        (0, {"envs": [0, 1], "seqs": [1, 1], "L": {}}),  # a RESULTS announces nothing
        (0, {"envs": [0], "seqs": [1]}),  # one row is a RESULT
        (0, {"envs": [0, 1, 2], "seqs": [1, 1, 1]}),  # more rows than the sender's envs
        (0, {"envs": [0, 1], "seqs": [1]}),
        (0, {"envs": [0, 0], "seqs": [1, 2]}),  # an env twice
        (1, {"envs": [0, 1], "seqs": [1, 1]}),  # not the header's env first
        (0, {"envs": [0, True], "seqs": [1, 1]}),
        (0, {"envs": [0, 1], "seqs": [1, -1]}),
        (0, {"envs": "01", "seqs": [1, 1]}),
    ],
)
def test_malformed_results_headers_raise_protocol_error(env, body):
    with pytest.raises(ProtocolError):
        results_rows(Header(Command.RESULTS, env, 0, body=body), 2)


def _commands(encoder: Encoder, values: list[float], command=Command.STEP) -> list[Row]:
    tds = [TensorDict({"action": torch.full((2,), v)}, []) for v in values]
    return [Row(command, i, 20 + i, [encoder.encode(td)]) for i, td in enumerate(tds)]


def test_commands_of_one_kind_and_layout_travel_joined_and_come_apart_per_env():
    encoder = Encoder()
    announcing, *rest = _commands(encoder, [0.0, 1.0, 2.0])
    decoder = Decoder()
    decoder.decode(Header.decode(announcing.message(b"")[0]), announcing.message(b"")[1:])
    message, joined = joined_messages([announcing, *rest], b"")  # the announcing row alone
    assert Header.decode(message[0]).command == Command.STEP
    header = Header.decode(joined[0])
    assert (header.command, header.env, header.seq, header.token) == (Command.COMMANDS, 1, 0, b"")
    assert header.body == {"c": int(Command.STEP), "envs": [1, 2], "seqs": [21, 22]}
    assert command_rows(header, 3) == (Command.STEP, [1, 2], [21, 22])
    rows = decoder.decode_rows(header, as_received(joined[1:]), 2)
    assert [parts[0].to_tensordict()["action"].tolist() for parts in rows] == [[1.0] * 2, [2.0] * 2]


def test_commands_join_only_with_the_same_command_and_never_with_a_body():
    encoder = Encoder()
    _commands(encoder, [0.0])[0].message(b"")  # announce the layout
    steps = _commands(encoder, [1.0, 2.0])
    resets = [Row(Command.RESET, 2 + i, 1, []) for i in range(2)]  # a restart's resets: no input
    seed = [Header(Command.SEED, 4, 1, body={"seed": 3}).encode()]
    seeds = [Row(Command.SEED, 5 + i, 1, []) for i in range(2)]  # never joined: SEED needs its body
    out = joined_messages([*steps, *resets, seed, *seeds], b"")
    headers = [Header.decode(m[0]) for m in out]
    assert [(h.command, h.env) for h in headers] == [
        (Command.COMMANDS, 0),
        (Command.COMMANDS, 2),
        (Command.SEED, 4),
        (Command.SEED, 5),
        (Command.SEED, 6),
    ]
    assert headers[1].body == {"c": int(Command.RESET), "envs": [2, 3], "seqs": [1, 1]}
    assert out[1][1:] == [] and out[2] is seed


@pytest.mark.parametrize(
    "body",
    [
        None,
        {"envs": [0, 1], "seqs": [1, 1]},  # no command
        {"c": int(Command.STEP), "envs": [0, 1], "seqs": [1, 1], "L": {}},  # announces nothing
        {"c": int(Command.SEED), "envs": [0, 1], "seqs": [1, 1]},  # needs a body
        {"c": int(Command.CLOSE), "envs": [0, 1], "seqs": [1, 1]},
        {"c": int(Command.COMMANDS), "envs": [0, 1], "seqs": [1, 1]},
        {"c": int(Command.RESULT), "envs": [0, 1], "seqs": [1, 1]},
        {"c": 99, "envs": [0, 1], "seqs": [1, 1]},
        {"c": True, "envs": [0, 1], "seqs": [1, 1]},
        {"c": int(Command.STEP), "envs": [0], "seqs": [1]},  # one row is a STEP
        {"c": int(Command.STEP), "envs": [0, 1, 2], "seqs": [1, 1, 1]},  # more than the envs
        {"c": int(Command.STEP), "envs": [0, 0], "seqs": [1, 2]},
        {"c": int(Command.STEP), "envs": [1, 0], "seqs": [1, 1]},  # not the header's env first
        {"c": int(Command.STEP), "envs": [0, 1], "seqs": [1, -1]},
    ],
)
def test_malformed_commands_headers_raise_protocol_error(body):
    with pytest.raises(ProtocolError):
        command_rows(Header(Command.COMMANDS, 0, 0, body=body), 2)


def test_joined_frames_of_the_wrong_size_or_layout_raise_protocol_error():
    encoder = Encoder()
    decoder = _learned(encoder)
    [message] = joined_messages(_rows(encoder, [1.0, 2.0]), b"")
    header, frames = Header.decode(message[0]), as_received(message[1:])
    assert len(decoder.decode_rows(header, frames, 2)) == 2
    short = [memoryview(bytes(frames[0])[:-1])]
    with pytest.raises(ProtocolError, match="joined frame"):
        decoder.decode_rows(header, short, 2)
    with pytest.raises(ProtocolError, match="joined frame"):
        decoder.decode_rows(header, frames, 3)  # the frame holds two rows, not three
    with pytest.raises(ProtocolError, match="frames"):
        decoder.decode_rows(header, [*frames, b""], 2)
    with pytest.raises(ProtocolError, match="unknown layout"):
        Decoder().decode_rows(header, frames, 2)
    labelled = TensorDict({"obs": torch.ones(3)}, [])
    labelled.set_non_tensor("label", "x")
    tagged = Row(Command.RESULT, 0, 1, [encoder.encode(labelled)])
    decoder.decode(Header.decode(tagged.message(b"")[0]), tagged.message(b"")[1:])
    nontensor = Header(Command.RESULTS, 0, 0, layouts=(tagged.parts[0].layout_id,))
    with pytest.raises(ProtocolError, match="tensors only"):
        decoder.decode_rows(nontensor, tagged.message(b"")[1:], 2)


@pytest.mark.parametrize(
    "body",
    [{"seed": np.int64(7)}, {"seed": 2**64}, {"kw": {"x": object()}}],
    ids=["numpy", "too-large", "object"],
)
def test_a_header_msgpack_cannot_pack_is_a_protocol_error(body):
    """The runtime answers its request with an error on a ProtocolError here; a TypeError
    from msgpack escaped it and left the request in flight, unsent (seeding audit)."""
    with pytest.raises(ProtocolError, match="cannot be packed"):
        check_header_room([], body)


@pytest.mark.parametrize("peek", [peek_command, peek_sender])
def test_peeking_a_header_builds_none_of_a_peers_containers(peek):
    """A 256 KiB header whose first field is 262,000 empty arrays, RESULT's command after.

    Peeked whole, before any budget or sender check, it cost the trainer 161-478 ms
    (10 a second from one key: 200 local steps did not end within 170 s). A peek
    reads scalars only: an array or a map where one belongs is not a header.
    """
    count = (256 << 10) - 300
    bomb = b"\x97\xdd" + count.to_bytes(4, "big") + b"\x90" * count
    bomb += msgpack.packb(int(Command.RESULT)) + b"\x00\x00\xc4\x00\x90\xc0"
    tracemalloc.start()
    try:
        peeked = peek(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peeked is None
    # A copy of its bytes (the unpacker's buffer), not 262,000 lists (17 MB).
    assert peak < 2 * len(bomb), f"peeking allocated {peak} bytes"
    honest = Header(Command.RESULT, env=3, token=b"t" * 16).encode()
    assert peek_command(honest) is Command.RESULT
    assert peek_sender(honest) == (3, b"t" * 16)


def _frame_bytes(part):
    return [bytes(memoryview(f).cast("B")) for f in part.frames]


@pytest.mark.parametrize(
    "make",
    [
        lambda: TensorDict(
            {
                "obs": torch.randn(4),
                "reward": torch.ones(1),
                "done": torch.zeros(1, dtype=torch.bool),
            },
            [],
        ),
        lambda: TensorDict(
            {"big": torch.randn(ZERO_COPY_THRESHOLD // 4 + 1), "s": torch.tensor(3)}, []
        ),
        lambda: TensorDict({"b": torch.ones(2, 3, dtype=torch.int64), "a": torch.zeros(2)}, [2]),
    ],
    ids=["cheap-step", "own-frame-and-scalar", "batched"],
)
def test_a_known_flat_layout_encodes_to_the_same_frames_without_the_walk(make, monkeypatch):
    encoder = Encoder()
    first = encoder.encode(make())
    td = make()
    expected = _frame_bytes(Encoder().encode(td))  # a fresh encoder's walk
    monkeypatch.setattr(codec, "flatten", _no_walk)  # the second time: found by its entries
    again = encoder.encode(td)
    monkeypatch.undo()
    assert (again.layout_id, again.layout, again.new_layout) == (
        first.layout_id,
        first.layout,
        None,
    )
    assert _frame_bytes(again) == expected
    out = round_trip(td)
    assert all(torch.equal(out[key], value) for key, value in td.items())


def _no_walk(td):
    raise AssertionError("flatten called for a layout the encoder knows")


def test_tensordicts_that_are_not_flat_dense_tensors_keep_the_walk(monkeypatch):
    walked = []
    real = codec.flatten
    monkeypatch.setattr(codec, "flatten", lambda td: walked.append(1) or real(td))
    encoder = Encoder()
    nested = TensorDict({"a": torch.ones(1), "next": TensorDict({"b": torch.ones(1)}, [])}, [])
    with_data = TensorDict({"a": torch.ones(1)}, [])
    with_data.set_non_tensor("note", "x")
    sparse_free = TensorDict({"a": torch.nn.Parameter(torch.ones(1))}, [])  # a Tensor subclass
    for td in (nested, with_data, sparse_free):
        first, second = encoder.encode(td), encoder.encode(td)
        assert _frame_bytes(first) == _frame_bytes(second)
    assert len(walked) == 6  # each of them walked both times
