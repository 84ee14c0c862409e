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
#: The longest session token a header may carry (the pool's are shorter).
MAX_TOKEN_BYTES = 64
#: The most tensordict parts one message carries (a reply has one or two).
MAX_PARTS = 4
#: Layout ids are below this (a decoder holds far fewer: its ``max_layouts``).
MAX_LAYOUT_ID = 1 << 31

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

# ---------------------------------------------------------------- specs

#: Largest number of elements of one shape, and of one tree's tensor leaves together.
MAX_NUMEL = 2**31
#: Largest number of bytes one tree's tensor leaves may hold together (1 GiB).
#: torchrl materialises a leaf's bounds at its full shape (twice: low and
#: high), so a few bytes of spec data could otherwise cost the pool tens of GB.
MAX_SPEC_BYTES = 2**30
#: Deepest nesting of Composite / stacked specs, and of ``example_data``.
MAX_DEPTH = 32


def is_int(value: Any) -> bool:
    """Whether a received field is an integer (msgpack's bools are not)."""
    return isinstance(value, int) and not isinstance(value, bool)
