"""Which envs a call addresses: torchrl's ``env_index`` conventions, checked before sending.

A call names its envs by an ``env_index`` argument (an int: one env's own
channel; a list: a batch), or by the ``env_index`` entry of its tensordict
(as every result of the pool carries it). :class:`EnvIndexer` turns either
into the batch to send and its list of indices, refusing what can never
work: an index out of range, repeated or not an integer, rows that do not
match the indices (:class:`~zmqpool.errors.BatchSizeMismatchError`), a
tensordict that names no env (:class:`~zmqpool.errors.MissingKeyError`).
Integers of any kind (numpy's, a 1-d integer tensor) are taken as Python
ints; a negative one counts from the end (``-1``: env ``N-1``) and is
replaced by that env's index, in the result's ``env_index`` too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, lazy_stack

from zmqpool.errors import BatchSizeMismatchError, MissingKeyError
from zmqpool.validation import env_index_arg

ENV_INDEX = "env_index"


def is_plain_batch(tensordict: Any) -> TypeGuard[TensorDict]:
    """A TensorDict itself (not a subclass or lazy stack) of one batch dim: the fast path."""
    return type(tensordict) is TensorDict and tensordict.batch_dims == 1


class EnvIndexer:
    """Batches and their env indices for one pool; see the module docstring.

    Args:
        env_batch_sizes: each env's own batch size.
        device: where new tensordicts are made.
        dense: ``stack="dense"``: a new batch of same-sized envs is one TensorDict.
        set_env_index: writes a batch's ``env_index`` entry.
    """

    def __init__(
        self,
        env_batch_sizes: Sequence[torch.Size],
        device: Any,
        dense: bool,
        set_env_index: Callable[[TensorDictBase, list[int]], None],
    ) -> None:
        self.env_batch_sizes = list(env_batch_sizes)
        self.num_envs = len(self.env_batch_sizes)
        self.device = device
        self.dense = dense
        self.set_env_index = set_env_index

    def batch(
        self, tensordict: TensorDictBase | None, env_index: Any, make_if_none: bool
    ) -> tuple[TensorDictBase, list[int]]:
        """The batch a send goes with, ``env_index`` set, and its checked env indices.

        ``env_index``: as :meth:`arg` returned it. A plain batch with its env
        indices (the hot path) is tagged here, at a fraction of the cost: its
        ``env_index`` is the same ``NonTensorStack``.
        """
        if type(env_index) is list:
            self.check_rows(env_index, tensordict)
            if is_plain_batch(tensordict):
                self.set_env_index(tensordict, env_index)
                return tensordict, env_index
        return self.make(tensordict, env_index, make_if_none)  # its indices are checked

    def arg(self, env_index: Any) -> int | list[int] | None:
        """An ``env_index=`` argument checked, as None, one env's int or a list of ints.

        Integers of any kind are taken (see :func:`zmqpool.validation.env_index_arg`).
        """
        return env_index_arg(env_index, self.num_envs)

    def one(self, env_index: Any) -> int:
        """An argument that names one env (a recv on its own channel), as an int."""
        index = self.arg(env_index)
        if not isinstance(index, int):
            raise TypeError(f"env_index must name one env (an int), got {env_index!r}")
        return index

    def make(
        self, tensordict: TensorDictBase | None, env_index: Any, make_if_none: bool
    ) -> tuple[TensorDictBase, list[int]]:
        """torchrl's ``_maybe_make_tensordict``: the batch to send and its env indices.

        torchrl's reads one index per element (``view(-1)``), so a pool of
        children with batch dims of their own sees every env repeated; here
        the indices are read along the env dim, and new tensordicts get the
        children's batch size.
        """
        if env_index is None:
            return self._indexed_batch(tensordict)
        env_index = self.arg(env_index)  # before anything is written into the caller's tensordict
        if isinstance(env_index, int):
            return self._one_env_batch(tensordict, env_index, make_if_none), [env_index]
        assert env_index is not None  # it was not None above
        if tensordict is None and make_if_none:
            tensordict = self._empty_batch(env_index)
        if tensordict is None:
            raise TypeError("a tensordict is needed to step envs")
        self.check_rows(env_index, tensordict)
        self.set_env_index(tensordict, env_index)
        return tensordict, env_index

    def _indexed_batch(self, tensordict: Any) -> tuple[TensorDictBase, list[int]]:
        if tensordict is None:
            raise TypeError("a tensordict with an 'env_index' entry, or env_index=, is needed")
        if ENV_INDEX not in tensordict:
            raise MissingKeyError(
                "the tensordict has no 'env_index' entry: pass env_index= or set it "
                "(results of this pool carry it)"
            )
        env_idx = self.arg(indices_along_env_dim(tensordict.get(ENV_INDEX)))
        if env_idx is None:
            raise TypeError("the tensordict's 'env_index' entry is None: it names no env")
        if isinstance(env_idx, int):  # one env's own tensordict (NonTensorData index)
            if tensordict.shape != (1, *self.env_batch_sizes[env_idx]):
                tensordict = lazy_stack([tensordict])
            return tensordict, [env_idx]
        return tensordict, env_idx

    def _one_env_batch(self, tensordict: Any, env: int, make_if_none: bool) -> TensorDictBase:
        if tensordict is None and make_if_none:
            tensordict = TensorDict(batch_size=self.env_batch_sizes[env], device=self.device)
        if tensordict is None:
            raise TypeError(f"a tensordict is needed to step env {env}")
        self.check_own_row(env, tensordict)
        tensordict.set(ENV_INDEX, NonTensorData(env, batch_size=tensordict.batch_size))
        return lazy_stack([tensordict])  # unbind(0) gives the caller's tensordict back

    def _empty_batch(self, env_index: list[int]) -> TensorDictBase:
        sizes = [self.env_batch_sizes[i] for i in env_index]
        if self.dense and len(set(sizes)) <= 1:
            lead = sizes[0] if sizes else torch.Size()
            return TensorDict(batch_size=(len(env_index), *lead), device=self.device)
        return LazyStackedTensorDict(*[TensorDict(batch_size=b, device=self.device) for b in sizes])

    def check_own_row(self, env: int, tensordict: Any) -> None:
        """Refuse, before anything is written, a tensordict sent on env ``env``'s own channel
        that is not one env's: of another batch size than the env's (the whole batch, say).

        torchrl's pool raises a ``RuntimeError`` at the send, and the env would
        raise anyway (``EnvBase.step`` checks the shape); refused here, the error
        comes at the send, not at the recv after a round trip (and, with
        ``on_env_error="restart"``, a restart).
        """
        expected = self.env_batch_sizes[env]
        batch_size = getattr(tensordict, "batch_size", None)
        if batch_size is not None and batch_size != expected:
            raise BatchSizeMismatchError(
                f"env {env}'s own channel takes that env's tensordict, of batch size "
                f"{tuple(expected)}; got one of batch size {tuple(batch_size)} (send one row of "
                "a batch, or the batch with env_index=[...])"
            )

    @staticmethod
    def check_rows(env_idx: list[int], tensordict: TensorDictBase | None) -> None:
        """Refuse a batch whose rows do not match its env indices, before anything is written."""
        if tensordict is not None and tensordict.batch_size[:1] != torch.Size([len(env_idx)]):
            raise BatchSizeMismatchError(
                f"the tensordict's batch size {tuple(tensordict.batch_size)} does not match "
                f"the {len(env_idx)} env indices {env_idx}"
            )


def indices_along_env_dim(value: Any) -> int | list[int]:
    """The env indices in an ``env_index`` entry, one per env (its first dim).

    A scalar (``NonTensorData`` or a 0-d tensor) is one env's own tensordict.
    An entry expanded over a child's batch dims holds its env's index in
    every element: the first one stands for the row.
    """
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            return int(value)
        return value.reshape(value.shape[0], -1)[:, 0].tolist()
    if isinstance(value, NonTensorData):
        return _first(value.data) if value.batch_dims else value.data
    data = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(data, list):
        return data
    return [_first(item) for item in data]


def _first(item: Any) -> Any:
    while isinstance(item, list) and item:
        item = item[0]
    return item
