"""One call's commands, per worker, held until the call has recorded them all, then joined.

:meth:`Runtime.send_all <zmqpool.runtime.Runtime.send_all>` records every
request of a call first and sends afterwards, so that a batching worker gets
its envs' commands in one message (wire: rows joined). This module holds
them in between and makes the messages.

Most of a call's commands are rows the pool packed from the caller's batch
(:class:`~zmqpool.codec.DecodedPart`, frames already), all of one layout.
They are kept as they are and encoded at the end, once per worker: when
every row of a worker shares one command and one layout its connection
knows already, its message is built straight from the rows' frames (what
:func:`~zmqpool.wire.joined_messages` makes of them, without a
:class:`~zmqpool.wire.Row` and an encoded part for each). Anything else is
encoded row by row, in order, and joined the long way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from zmqpool.codec import DecodedPart
from zmqpool.limits import MAX_BATCH_BYTES, MAX_BATCHED_MESSAGE_BYTES
from zmqpool.roster import Link
from zmqpool.wire import Command, Row, joined_messages, packed_rows_message

#: A packed row kept as it is until the end: ``(command, env, seq, part)``.
#: A plain tuple: one is made for every env-step of a batched call.
KeptRow = tuple[Command, int, int, DecodedPart]


class Outbox:
    """A call's messages per worker connection, in the order they were added."""

    def __init__(self) -> None:
        # (identity, remote) -> the link and what it is sent: kept rows, Rows, whole messages.
        self._queues: dict[tuple[bytes, bool], tuple[Link, list[KeptRow | Row | list[Any]]]] = {}

    def add(self, link: Link, entry: KeptRow | Row | list[Any]) -> None:
        """Queue ``entry`` for ``link``'s worker: a kept row, an encoded Row or a message."""
        key = (link.identity, link.remote)
        queued = self._queues.get(key)
        if queued is None:  # not setdefault: that builds a tuple and a list for every row
            self._queues[key] = (link, [entry])
        else:
            queued[1].append(entry)

    def messages(self, hold: bool = False) -> Iterator[tuple[Link, list[list[Any]]]]:
        """Each worker's link and its messages, rows joined where they may be; ``hold``:
        each COMMANDS asks its worker to keep its replies together
        (:func:`~zmqpool.wire.holds_replies`)."""
        for link, entries in self._queues.values():
            yield link, _messages(link, entries, hold)


def _messages(link: Link, entries: list[KeptRow | Row | list[Any]], hold: bool) -> list[list[Any]]:
    rows = list(entries)
    if len(entries) > 1 and type(entries[0]) is tuple:
        command, env, seq, part = entries[0]  # type: ignore[misc]  # a tuple: a KeptRow
        if _one_layout(entries, command, part):
            first = link.encoder.encode(part)  # announces the layout if the worker lacks it
            if first.new_layout is None:
                return [packed_rows_message(command, entries, first.layout_id, hold)]  # type: ignore[arg-type]
            # This first row carries the announcement: it goes alone, the rest joined after it.
            rows[0] = Row(command, env, seq, [first])
    return joined_messages([_encoded(link, entry) for entry in rows], b"", hold)


def _encoded(link: Link, entry: KeptRow | Row | list[Any]) -> Row | list[Any]:
    if type(entry) is not tuple:
        return entry  # type: ignore[return-value]  # a Row or a message, encoded already
    command, env, seq, part = entry
    return Row(command, env, seq, [link.encoder.encode(part)])


def _one_layout(entries: list[Any], command: Command, first: DecodedPart) -> bool:
    """Whether ``entries`` are kept rows that join into one message: ``command`` and
    ``first``'s layout each, tensors only, each env once, within the size limits
    (what :func:`~zmqpool.wire.joined_messages` would join)."""
    layout = first.layout
    size = layout.frames_nbytes
    if size > MAX_BATCHED_MESSAGE_BYTES or len(entries) * size > MAX_BATCH_BYTES:
        return False
    envs = set()
    for entry in entries:  # a loop: this runs for every env-step of a batched call
        if type(entry) is not tuple:
            return False
        row_command, env, _, part = entry
        if row_command is not command or part.layout is not layout or part.nontensor:
            return False
        envs.add(env)
    return len(envs) == len(entries)
