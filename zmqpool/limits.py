"""Limits: every bound that a peer's message, layout or specs is held to, each defined once.

A peer is not trusted: before anything is allocated or looped over, each
count, length and size it sends is checked against a bound here, and refused
with a :class:`~zmqpool.errors.ProtocolError` beyond it. The header and
layouts are checked in :mod:`zmqpool.wire` and :mod:`zmqpool.layout`
(:mod:`zmqpool.wire` documents the format), specs in :mod:`zmqpool.specs`.
This module also owns :func:`is_int`, the test that a received field is an
integer before it is compared with a bound.

One bound serves both the wire and specs: :data:`MAX_DIMS`. A spec's shape is
the shape of the tensors that then travel as the wire's leaves, so the two
cannot differ: a spec with more dims than a leaf may have would be accepted at
registration and its env refused at every step.
"""

from __future__ import annotations

from typing import Any

# ---------------------------------------------------------------- messages

#: The largest header (frame 0). It is also the pool's ROUTER's ``MAXMSGSIZE``
#: when no layout needs more (:func:`zmqpool.layout.max_message_bytes`).
MAX_HEADER_BYTES = 1 << 20
#: The largest control message (a REGISTER, specs and all) a worker may send:
#: the pool's ROUTER refuses frames over :data:`MAX_HEADER_BYTES` (its
#: ``MAXMSGSIZE``), and under CURVE libzmq counts each frame's 33 bytes of
#: encryption against that limit too (measured). Over the limit, libzmq drops
#: the connection without a word to either side, so workers check first.
MAX_CONTROL_BYTES = MAX_HEADER_BYTES - 64
#: What one env's non-tensor values (strings, lists...) may pack to in a send:
#: they travel in the header, with room left for its fields and layouts. (A
#: worker's reply is held to the header limit itself, layouts and all.)
MAX_NONTENSOR_BYTES = MAX_HEADER_BYTES - (64 << 10)
#: What one env's reset keywords (``reset(seed=..., options=...)``) may pack to:
#: they travel in the RESET's header too, beside its non-tensor values, in the
#: room :data:`MAX_NONTENSOR_BYTES` leaves.
MAX_RESET_KWARGS_BYTES = 16 << 10
#: The longest session token a header may carry (the pool's are shorter).
MAX_TOKEN_BYTES = 64
#: The most tensordict parts one message carries (a reply has one or two).
MAX_PARTS = 4
#: A message joins a batch (:data:`~zmqpool.wire.Command.BATCH`) only if its
#: frames add up to at most this: batching saves a per-message cost, which
#: only small messages notice; larger ones keep their own frames (zero-copy).
MAX_BATCHED_MESSAGE_BYTES = 16 << 10
#: A batch's joined frame is at most this: half the smallest ``MAXMSGSIZE`` a
#: message socket gets (:data:`MAX_REMOTE_CONTROL_BYTES`, a remote results
#: PULL's floor), so a batch never costs a peer its connection.
MAX_BATCH_BYTES = 128 << 10
#: The most frames one batch may list (its messages' headers and tensor frames).
MAX_BATCH_FRAMES = 4096
#: Layout ids are below this (a decoder holds far fewer: its ``max_layouts``).
MAX_LAYOUT_ID = 1 << 31

# ---------------------------------------------------------------- a worker's sockets
#
# libzmq reads a TCP peer's CURVE handshake with the socket's frame decoder
# before the peer is authenticated, so a socket without ``MAXMSGSIZE`` lets any
# peer that can reach it announce a frame of gigabytes and have it allocated
# while the bytes arrive. Every socket a worker connects gets a limit before it
# connects (``MAXMSGSIZE`` is read per endpoint at connect time).

#: The most bytes a frame's CURVE encryption adds to it (libzmq counts them
#: against ``MAXMSGSIZE``; 33 measured, see :data:`MAX_CONTROL_BYTES`).
CURVE_FRAME_OVERHEAD = 64
#: ``MAXMSGSIZE`` of a worker's beats DEALER (the pool's heartbeats) and of its sockets
#: that receive no messages at all (its PUSH): a PING is a header of under 100
#: bytes (an epoch of at most 64), and the handshake commands a CURVE server
#: sends (WELCOME: 168 bytes; READY: its socket type and identity) fit too.
MAX_BEAT_BYTES = 1 << 10
#: ``HANDSHAKE_IVL`` of a worker's TCP connections, in milliseconds: a peer that
#: has not finished the ZMTP and CURVE handshake by then is dropped (libzmq's
#: default is 30 s, time enough to trickle a frame of gigabytes in).
TCP_HANDSHAKE_MS = 5_000

# ---------------------------------------------------------------- layouts

#: The most tensor leaves, non-tensor keys, nested tensordicts, lazy stacks or
#: tensorclasses one layout may list, each; and the most members of a lazy stack.
MAX_LEAVES = 4096
#: The longest key path (nesting depth) of a layout's entries.
MAX_KEY_DEPTH = 16
#: The longest name of one key in a key path, in characters.
MAX_KEY_NAME = 256
#: The most dims a shape may have: a layout's batch sizes and leaf shapes, and a
#: spec's shapes (the same tensors: see the module docstring). 16 leaves room
#: below numpy 1.x's 32 dims for the batch dims the trainer stacks in front.
MAX_DIMS = 16
#: The largest size of one dim of a layout's shapes.
MAX_DIM_SIZE = 1 << 40
#: A leaf, and any frame, larger than this is refused: a layout claiming more is
#: refused when announced. Zero-size dims do not make a shape free: the product
#: of its dims, zeros counted as one, is held to the same bound, since torch
#: computes strides from them.
MAX_LEAF_BYTES = 1 << 32
#: (A decoder's default ``max_frame_bytes``; a connection's is its ``MAXMSGSIZE``.)
MAX_FRAME_BYTES = 1 << 32
#: The longest name a tensorclass may travel as (``"module:qualname"``).
MAX_CLASS_NAME = 512
#: The most bytes of layouts one connection's decoder keeps (each estimated once,
#: when announced: :func:`zmqpool.layout.layout_footprint`); announcing more is a
#: :class:`~zmqpool.errors.ProtocolError` (the reply's env's error). A layout is
#: kept some 20 times its wire size at worst (deep keys of short names: 273 KB of
#: header, 4.4 MiB of objects), so ``max_layouts`` (256; 32 for a remote peer) of
#: them alone would be gigabytes. Legitimate layouts cost 1-2 KiB (a few leaves)
#: to ~150 KiB (300 leaves, keys 3 deep): 32 such, the most a remote decoder
#: holds, take 5 MiB; the largest layout a header can announce (1 MiB of it)
#: about 20 MiB. Layouts are interned weakly and checks note their verdicts on
#: the layout itself, so what a peer made the trainer keep goes with its decoder.
MAX_PEER_LAYOUT_BYTES = 32 << 20

# ---------------------------------------------------------------- specs

#: Largest number of elements of one shape, and of one tree's tensor leaves together.
MAX_NUMEL = 2**31
#: Largest number of bytes one tree's tensor leaves may hold together (1 GiB).
#: torchrl materialises a leaf's bounds at its full shape (twice: low and
#: high), so a few bytes of spec data could otherwise cost the pool tens of GB.
MAX_SPEC_BYTES = 2**30
#: Deepest nesting of Composite / stacked specs, and of ``example_data``.
MAX_DEPTH = 32
#: Most frames of one message that are kept (a header, and per part a packed
#: frame and its own-frame leaves). libzmq holds a whole message before it can
#: be read; this bounds what the pool keeps of one, not what libzmq took in.
MAX_MESSAGE_FRAMES = 1 + MAX_PARTS * 256
#: Most non-tensor values one layout may carry (each stacked one counted per
#: element): each becomes a Python object in the trainer.
MAX_NONTENSOR_ITEMS = 16384
#: The remote side's frame limit for control messages (a REGISTER and its
#: specs). libzmq applies it to the CURVE handshake too, before any key is
#: checked: a keyless peer can make the pool hold at most this much per
#: connection, for the handshake interval.
MAX_REMOTE_CONTROL_BYTES = 256 << 10
#: The least frame limit of the remote results port. A remote worker's reply
#: may hold frames far larger (an image, up to ``PoolConfig.max_remote_frame_bytes``
#: or what ``remote_spec`` implies), but a port's limit is also what any peer,
#: keyless included, can make the pool hold per connection during the CURVE
#: handshake. So the port takes frames of a *piece*'s size, and a reply with a
#: larger frame travels as a BATCH of one message whose joined frame is cut into
#: pieces (:func:`zmqpool.wire.pieced_message`); the pool joins them, each frame
#: held to its sender's limit first.
MIN_REMOTE_PIECE_BYTES = MAX_REMOTE_CONTROL_BYTES
#: A frame of the remote results cap fits in this many pieces (so the piece, and
#: what a keyless connection holds, is 1/128 of the cap, but at least
#: :data:`MIN_REMOTE_PIECE_BYTES`).
REMOTE_PIECES_PER_FRAME = 128
#: The most pieces one message may come in: what the pool reads of a message
#: (:data:`MAX_MESSAGE_FRAMES`) after the BATCH header. A worker answers a
#: reply too large for them with an error instead.
MAX_PIECES = MAX_MESSAGE_FRAMES - 1
#: Messages libzmq queues for the pool per remote connection (its RCVHWM; the
#: default is 1,000) before it stops reading that connection. What a peer can
#: make the trainer hold between two of its calls is this many messages per
#: connection: at 1,000, eight connections of 256 KiB messages held 2 GB. A
#: message is held whole, and only its frames are limited (MAXMSGSIZE): one of
#: many frames from an authorized key is held entire (README, Known limits).
#: A worker sends the control socket a REGISTER, its rare FAILEDs and
#: heartbeats (dropped by it when the queue is full), and the results socket
#: no more messages at a time than it has requests in flight; more waits in
#: the worker (PUSH blocks), nothing is lost.
REMOTE_CONTROL_QUEUE = 16
REMOTE_RESULTS_QUEUE = 64


def max_pieced_bytes(max_frame: int) -> int:
    """The most bytes one reply in pieces may join to, from a worker whose frames are at most
    ``max_frame``: a header, and :data:`MAX_PARTS` parts of at most ``max_frame`` each (a
    layout's leaves with their headroom). Held before the pieces are joined (the one copy).

    Example:
        >>> max_pieced_bytes(1 << 20) == 5 << 20
        True
    """
    return MAX_HEADER_BYTES + MAX_PARTS * max_frame


def remote_piece_bytes(frame_cap: int) -> int:
    """The remote results port's frame limit, for replies whose frames reach ``frame_cap``.

    Example:
        >>> remote_piece_bytes(64 << 20) == 512 << 10
        True
        >>> remote_piece_bytes(4096) == MIN_REMOTE_PIECE_BYTES
        True
    """
    return max(MIN_REMOTE_PIECE_BYTES, -(-frame_cap // REMOTE_PIECES_PER_FRAME))


def is_int(value: Any) -> bool:
    """Whether a received field is an integer (msgpack's bools are not).

    An exact-type test: msgpack yields plain ``int``s, and booleans as ``bool``
    (an ``int`` subclass, refused). A third of the cost of two ``isinstance``
    tests, on every header of every message.
    """
    return type(value) is int


#: Types whose repr a peer cannot make costly or deep (a str or bytes is cut first).
_SCALARS = (type(None), bool, int, float, str, bytes)


def described(value: Any, limit: int = 40) -> str:
    """A peer's value for an error message: a scalar's repr (cut to ``limit``), else its type.

    Never a container's repr: a list nested a thousand deep is a 1 KB message
    whose repr raises ``RecursionError``, and a wide one a long message.
    """
    if type(value) not in _SCALARS:
        return f"a {type(value).__name__}"
    if type(value) in (str, bytes):
        value = value[: limit + 1]
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
