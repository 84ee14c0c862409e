"""Batching, trainer side only: a batch's rows into per-env parts, replies into a batch.

The trainer sends each env its row of a batch and stacks the envs' replies
into one batch. This module owns both fast paths, which work on frames rather
than tensordicts: :class:`RowPacker` packs every row of a batch into a part
of its own in one pass (what :class:`~zmqpool.codec.Encoder` would make of
each row), and :func:`stack_parts` stacks parts of one layout straight from
their frames. Workers never import it (a test holds them to that): they
encode and decode one tensordict at a time (:mod:`zmqpool.codec`). The
format: :mod:`zmqpool.wire`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from zmqpool.codec import (
    NO_VALUES,
    NUMPY_DTYPES,
    ZERO_COPY_THRESHOLD,
    Buffer,
    DecodedPart,
    as_array,
    flatten,
    nontensor_stack,
    tensordict_from_leaves,
)
from zmqpool.layout import Key, Layout, Leaf, build_layout


class RowPacker:
    """Packs every row of a batch (its first dim) into a part of its own, in one pass.

    What :meth:`Encoder.encode` would make of each row, as a
    :class:`DecodedPart` whose buffers are the frames: small leaves are copied
    column by column into one ``(rows, packed_nbytes)`` array, each large one
    into an array of its own (the pool's commands: the caller may change the
    batch once the send returns), its rows' frames views of it. Batches with
    non-tensor values or nested batch sizes are left to per-row tensordicts
    (``pack`` returns None).

    Example:
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"action": torch.arange(6.0).reshape(3, 2)}, [3])
        >>> rows = RowPacker().pack(batch)
        >>> rows[2].to_tensordict()["action"].tolist()
        [4.0, 5.0]
    """

    def __init__(self, zero_copy_threshold: int = ZERO_COPY_THRESHOLD) -> None:
        self.zero_copy_threshold = zero_copy_threshold
        self._layouts: dict[tuple, Layout] = {}

    def pack(self, batch: TensorDictBase, exclude: Sequence[str] = ()) -> list[DecodedPart] | None:
        """One part per row of ``batch`` without its top-level keys ``exclude``; or None."""
        flat = flatten(batch)
        if flat.branches or flat.classes:
            return None
        if any(key[0] not in exclude for key in flat.nontensor_keys):
            return None
        leaves = [(key, t) for key, t in flat.tensors if key[0] not in exclude]
        rows = batch.batch_size[0] if batch.batch_dims else 0
        if not rows:
            return None
        layout = self._layout(tuple(batch.batch_size[1:]), leaves)
        # A row's bytes: a C-contiguous (rows, n) array viewed as bytes is (rows, n * size).
        columns = [
            np.ascontiguousarray(as_array(t)).reshape(rows, -1).view(np.uint8) for _, t in leaves
        ]
        return _split_rows(layout, columns, rows)

    def _layout(self, batch: tuple[int, ...], leaves: list[tuple[Key, torch.Tensor]]) -> Layout:
        # A list made into a tuple, and shapes as torch gives them (a tuple subclass):
        # a generator and a tuple() per leaf cost more, for every batch sent.
        signature = (batch, tuple([(key, t.dtype, t.shape[1:]) for key, t in leaves]))
        layout = self._layouts.get(signature)
        if layout is None:
            specs = [
                (key, t.dtype, tuple(t.shape[1:]), _row_nbytes(t) >= self.zero_copy_threshold)
                for key, t in leaves
            ]
            layout = build_layout(batch, specs, (), [], [])
            self._layouts[signature] = layout
        return layout


def _row_nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _split_rows(layout: Layout, columns: list[np.ndarray], rows: int) -> list[DecodedPart]:
    leaves, size = layout.leaves, layout.packed_nbytes
    if len(leaves) == 1 and not leaves[0].own_frame and leaves[0].nbytes == size and size:
        return _byte_rows(layout, columns[0].tobytes(), rows)  # one leaf, no padding: an action
    own = []
    packed = np.zeros((rows, size), dtype=np.uint8)
    for leaf, column in zip(leaves, columns, strict=True):
        if leaf.own_frame:
            own.append(column.copy())  # C order: each row a contiguous view of the copy
        else:
            packed[:, leaf.offset : leaf.offset + leaf.nbytes] = column
    has_packed = len(own) < len(leaves)
    if has_packed and not own and size:  # small leaves only (the usual case): a frame a row
        return _byte_rows(layout, packed.tobytes(), rows)
    flat = packed.reshape(-1).data  # a new array: the batch may change after the send
    parts = []
    for row in range(rows):
        buffers: list[Buffer] = [flat[row * size : (row + 1) * size]] if has_packed else []
        buffers += [np.ascontiguousarray(column[row]).data for column in own]
        parts.append(DecodedPart(layout, buffers, NO_VALUES))
    return parts


def _byte_rows(layout: Layout, data: bytes, rows: int) -> list[DecodedPart]:
    """Each row of ``data`` (a copy: the batch may change after the send) a part of its own.

    Bytes in a tuple: the cyclic collector tracks neither (a list and a view
    would be two more objects per request in flight, see ``NO_VALUES``).
    """
    size = layout.packed_nbytes
    starts = range(0, rows * size, size)
    return [DecodedPart(layout, (data[at : at + size],), NO_VALUES) for at in starts]


def stack_parts(parts: Sequence[DecodedPart]) -> TensorDict:
    """Stack parts of one layout into a batch, straight from their frames.

    Each frame position is joined over the parts into one ``(parts, bytes)``
    array (one copy), then each leaf is one column slice of it, copied out
    contiguous: a few array ops per leaf, none per part.
    """
    layout = parts[0].layout
    stacked = _stack_leaves(layout, [p.buffers for p in parts])
    values = [
        _stack_values(layout, i, [p.nontensor[i] for p in parts])
        for i in range(len(layout.nontensor_keys))
    ]
    return tensordict_from_leaves(layout, stacked, values, lead=(len(parts),))


def _stack_leaves(layout: Layout, buffers: list[Sequence[Buffer]]) -> list[torch.Tensor]:
    count = len(buffers)
    frames = [
        _joined([b[i] for b in buffers], count, size) for i, size in enumerate(layout.frame_sizes)
    ]
    return [_leaf_of_rows(frames[leaf.frame], leaf, count) for leaf in layout.leaves]


def _joined(buffers: list[Buffer], count: int, size: int) -> np.ndarray:
    if not size:
        return np.empty((count, 0), dtype=np.uint8)
    return np.frombuffer(bytearray().join(buffers), dtype=np.uint8).reshape(count, size)


def _leaf_of_rows(frame: np.ndarray, leaf: Leaf, count: int) -> torch.Tensor:
    """``leaf``'s column of the joined ``(count, frame bytes)`` array, as a new tensor."""
    if not leaf.nbytes:  # numpy and torch refuse to reinterpret zero bytes
        return torch.empty((count, *leaf.shape), dtype=leaf.dtype)
    if leaf.nbytes == frame.shape[1]:
        contiguous = frame  # the whole frame (a large leaf): already a fresh copy
    else:
        # C order and fresh strides (a one-row view keeps odd ones torch refuses)
        contiguous = frame[:, leaf.offset : leaf.offset + leaf.nbytes].copy()
    dtype = NUMPY_DTYPES[leaf.dtype]
    if dtype is None:
        return torch.from_numpy(contiguous).view(leaf.dtype).reshape(count, *leaf.shape)
    return torch.from_numpy(contiguous.view(dtype).reshape(count, *leaf.shape))


def _stack_values(layout: Layout, index: int, values: list[Any]) -> NonTensorStack:
    batch = layout.nontensor_batches[index]
    if layout.stacked[index]:
        return NonTensorStack(*(nontensor_stack(v, len(batch)) for v in values))
    if batch:
        return NonTensorStack(*(NonTensorData(v, batch_size=batch) for v in values))
    return NonTensorStack(*values)
