"""The wire: how commands, results and tensordicts become ZeroMQ frames.

This docstring is the contract between the trainer and its workers: the one
description of the format, which the modules that implement it point to. This
module owns frame 0 (:class:`Header`, :class:`Command`,
:data:`PROTOCOL_VERSION`) and :func:`encode_message`, which puts a header and
its parts' frames together. The rest is split by audience:

- both sides: :mod:`zmqpool.limits` (every bound a peer is held to),
  :mod:`zmqpool.classnames` (how a tensorclass travels by name),
  :mod:`zmqpool.layout` (:class:`~zmqpool.layout.Layout`: how one tensordict
  lies in frames, and its checks), :mod:`zmqpool.codec`
  (:class:`~zmqpool.codec.Encoder`, :class:`~zmqpool.codec.Decoder`:
  tensordicts to frames and back);
- the trainer only: :mod:`zmqpool.batching` (a batch's rows packed into
  per-env parts, replies stacked straight from their frames). Workers never
  import it.

None of them knows of sockets, and nothing here ever unpickles.

A message is a list of frames::

    frame 0      header: msgpack array
                 [version, command, env, seq, token, layouts, body]
    frame 1..    the tensor frames of each tensordict part, part after part

- ``version`` (int): :data:`PROTOCOL_VERSION`; a peer with another version is
  refused with :class:`~zmqpool.errors.VersionMismatchError`.
- ``command`` (int): a :class:`Command`.
- ``env`` (int): the pool's env index the message is about (-1: the worker).
- ``seq`` (int): the per-env sequence number of the request this message is
  or answers; a reply whose seq is not the one awaited is dropped.
- ``token`` (bytes): the session token the pool gave the worker at
  registration; results must carry it (empty on commands).
- ``layouts`` (list of int): one layout id per tensordict part carried.
- ``body`` (map or nil): the rare fields: ``"L"`` new layouts ``{id: layout}``,
  ``"nt"`` non-tensor values per part, ``"err"``/``"tb"`` an error and its
  traceback, ``"reg"`` registration data, ``"seed"``, ``"kw"`` a reset's
  keywords (a map of names to plain data).

A tensordict part is described by a :class:`~zmqpool.layout.Layout`, sent in
full once (in ``body["L"]``, the first time its id is used on a connection) and
referred to by id afterwards, so per-step headers stay a few dozen bytes. A
layout is a map: ``"b"`` the batch size, ``"t"`` the tensor leaves ``[key path,
dtype, shape, own_frame]``, ``"n"`` the non-tensor key paths, and, only when
needed, ``"s"`` the nested tensordicts that have a batch size of their own or
no keys (``[key path, batch size]``) and ``"k"`` the indices of the non-tensor
keys that hold a ``NonTensorStack`` (their value is then a nested list, one
item per batch element) rather than one ``NonTensorData``, ``"z"`` the lazy
stacks and ``"c"`` the tensorclasses (both below). Leaves smaller than
:data:`~zmqpool.codec.ZERO_COPY_THRESHOLD` bytes are packed, 16-byte aligned,
in one frame (copying a few bytes is cheaper than a zero-copy frame's
bookkeeping); larger ones travel as their own frame, sent with ``copy=False``
and read with :func:`torch.frombuffer`, without a copy. The receiver recomputes
offsets itself and checks every frame's size against the layout before touching
it.

Lazy stacks. A ``LazyStackedTensorDict`` (heterogeneous envs' per-agent
entries: members with different keys or shapes) travels as its members, never
densified: ``"z"`` lists ``[key path, stack_dim, member count]`` per lazy stack
(key path ``[]``: the part itself is one), and member ``i`` of the stack at
``P`` is the nested tensordict at the synthetic path ``(*P, "#i")``, its
leaves, non-tensors and branches below it as anywhere else. Such a layout
always lists, in ``"s"``, the stack itself (batch size ``B``, unless it is the
part) and every member (batch size ``B`` without dim ``stack_dim``). The
decoder builds the members bottom up and ``LazyStackedTensorDict``-stacks them
at ``stack_dim``, so a lazy stack comes back lazy, with its stack_dim and each
member's keys, shapes, dtypes, values and non-tensors, lazy stacks inside lazy
stacks and members without keys included (a stack of zero members cannot be
built by tensordict, and is refused on encode). A ``"z"`` entry is refused
unless: ``0 < count <=`` :data:`~zmqpool.limits.MAX_LEAVES`, ``0 <= stack_dim <
len(B)`` and ``B[stack_dim] == count``; the counts add up to at most the number
of branches; every member ``#0``..``#count-1`` is listed in ``"s"`` with its
batch size; and nothing but those members lies directly under the stack (so no
key of the caller's can pose as a member). These are checked on the layout's
few entries, before any name or tensor is made. A layout without lazy stacks
has no ``"z"`` and encodes to exactly the bytes it did before ``"z"`` existed;
:data:`PROTOCOL_VERSION` was not bumped for it: a peer without ``"z"`` refuses
such a layout cleanly (a :class:`~zmqpool.errors.ProtocolError` answered as a
malformed message), and could not have encoded a heterogeneous lazy stack
anyway, while every other message reads as before.

Tensorclasses. A tensorclass (``@tensorclass``: a dataclass around a
tensordict, like torchrl's ``EnvWithTensorClass`` observation) travels as the
tensordict it wraps plus its class's *name*, never as code: ``"c"`` lists
``[key path, "module:qualname"]`` per tensorclass (key path ``[]``: the part
itself is one), each of which is also listed in ``"s"`` (its batch size), and
its fields are the keys under it as anywhere else (``str`` fields are
non-tensors; a field set to ``None`` is not sent and comes back ``None``). The
decoder looks a name up, never imports it: the module must already be in
``sys.modules`` (importing a module a peer names would run its code), the
qualname is followed through the ``__dict__`` of its module and classes only
(no ``getattr``, so no module ``__getattr__`` runs), and what it finds must be
a tensorclass type (:func:`tensordict.is_tensorclass`, not a non-tensor one)
whose fields include every key sent under it; it is then rebuilt with
``cls._from_tensordict``, bottom up, so tensorclasses inside tensorclasses,
inside lazy stacks (or wrapping one) and stacked into a batch by
:func:`~zmqpool.batching.stack_parts` come back as instances. A name that is
malformed (not ``module:qualname`` of identifiers, over
:data:`~zmqpool.limits.MAX_CLASS_NAME` characters) or names something else
(``os:system``, ``builtins:dict``) is refused with a
:class:`~zmqpool.errors.ProtocolError` when the layout is announced, before
anything is built; a class that is merely not loaded here (its module not
imported, no such attribute, defined inside a function) is not an error: its
values arrive as plain TensorDicts, with one
:class:`~zmqpool.classnames.TensorclassNotLoadedWarning` per class naming the
module to import. A ``"c"`` entry is refused unless its key is the part or one
of the layout's branches, and appears once. A layout without tensorclasses has
no ``"c"`` and encodes to the bytes it did before; as for ``"z"``,
:data:`PROTOCOL_VERSION` was not bumped: no older peer can misread a layout
with ``"c"``, it refuses it cleanly (a ``ProtocolError``, answered as a
malformed message). Only tensorclass values change: from a newer peer to an
older one they used to arrive as plain nested tensordicts, and are now refused
(upgrade both sides).

Batches. Several small messages to or from one worker may travel as one
``BATCH`` message (:func:`batch_messages`, :func:`split_batch`): frame 0 is a
header with command ``BATCH``, ``env`` -1 from the pool or one of its envs from
a worker, the worker's token on results, no layouts, and the body ``{"n":
[frames of each message], "len": [bytes of each frame]}``; frame 1 is every
frame of those messages, joined in order. Each message inside is a whole
message as above (its own header first) and is handled exactly as if it had
come alone, in order, checks and all; a ``BATCH`` inside a batch is refused.
The pool batches the commands of one call that go to one worker, if that
worker asked for batches when it registered (``batches`` in its REGISTER: it
hosts several envs). A worker that steps its envs in its main thread keeps
the replies of a batch and sends them together when it ends, or before a
command whose env took over a millisecond last time, so that no reply waits
on a slow env; a worker with env threads hands each command to its env's
thread and replies as each env is done, except that replies ready while
another thread is sending go right after it, together (at most one message
per env in a batch). Only messages of at most
:data:`~zmqpool.limits.MAX_BATCHED_MESSAGE_BYTES` are joined, into frames of at
most :data:`~zmqpool.limits.MAX_BATCH_BYTES` (under every socket's
``MAXMSGSIZE``); larger ones go alone, in their place, zero-copy frames and
all. A receiver checks the counts and sizes against the joined frame, and the
number of messages against what the peer may have in flight, before it makes
a view of it: a batch allocates nothing (the views share the joined frame).

Pieces. A remote worker's results port takes frames of a piece's size only
(WELCOME's ``piece``, :func:`~zmqpool.limits.remote_piece_bytes`: 1/128 of
the largest frame the port's replies may hold, but at least 256 KiB), since a port's frame
limit is what any peer, keyless too, can make the pool hold per connection
during the CURVE handshake. A reply with a larger frame travels as a ``BATCH``
of that one message (:func:`pieced_message`): the header as above, then its
joined frame cut into pieces of at most ``piece`` bytes (at most
:data:`~zmqpool.limits.MAX_PIECES`; a worker answers a larger reply with an
error). The pool takes pieces only from a remote worker, and one message in
them; it holds each frame listed to the largest its specs imply (WELCOME's
``max_frame``), their sizes to the pieces' bytes, and those to a header and
:data:`~zmqpool.limits.MAX_PARTS` frames of ``max_frame``
(:func:`~zmqpool.limits.max_pieced_bytes`), then joins them: one copy, made
once every claim is checked.

Rows joined. Among a worker's kept replies (a batch run inline, or replies
queued while another env thread sent), the results of envs whose parts have
the same layouts (already announced, tensors only, each of at most
:data:`~zmqpool.limits.MAX_BATCHED_MESSAGE_BYTES`) travel as one ``RESULTS``
message, alone or inside a BATCH (:func:`joined_messages`,
:func:`results_rows`): its header carries the first env, seq 0, the
worker's token, the shared layout ids and the body ``{"envs": [env, ...],
"seqs": [seq, ...]}``; frame ``i`` after it is every env's frame ``i``, back
to back in the order of ``envs``, so one frame
of ``rows`` times the layout's size. It is taken as one RESULT per env, in
that order, each matched to its own awaited seq and held to its own env's
specs. The pool refuses it whole unless every env is the sender's, none comes
twice, there are at least two and at most the sender's envs, and each frame is
exactly ``rows`` times the layout's; it then makes views, allocating nothing.

The other way, a call's commands to such a worker join the same way: those of
one command (one of :data:`JOINABLE_COMMANDS`, without a body) whose parts
have the same announced layouts travel as one ``COMMANDS`` message
(:func:`command_rows`): env the first env, seq 0, no token, the layout ids,
the body ``{"c": command, "envs": [...], "seqs": [...]}``, frames as in a
``RESULTS``. It may travel alone or inside a BATCH (a message like any
other). The worker takes it as one command per env, in order, each with its
own seq, exactly as if each had come alone; it drops it whole (counted, as a
malformed batch) unless ``c`` is joinable and the envs and seqs pass the
checks of a ``RESULTS`` (its own envs as the bound); a frame that is not
``rows`` times its layout's answers every env of it with an error (malformed
command). A row that announces a layout, or carries non-tensors, breaks the
run and goes as its own message in its place, so a layout is always
announced before a joined row uses it. The body may also hold ``"h": true``
(:func:`holds_replies`; anything else there drops the message): the pool's
last recv waited for several results, so the worker should keep this
message's replies together, sending those it kept before an env only when
that env was slow in both of its last two commands, not in its last alone
(``workers.loop``).

Limits. Every count, length and size a peer sends is held to a bound of
:mod:`zmqpool.limits` before anything is allocated. A layout is refused when it
breaks the tree a tensordict can be (a key twice, a key both a leaf and a
branch, a leaf whose shape does not start with its tensordict's batch size),
when a leaf exceeds :data:`~zmqpool.limits.MAX_LEAF_BYTES` or a frame the
decoder's ``max_frame_bytes``: so a layout claiming a 10 GB leaf is refused
when it is announced, before any frame is looked at, and allocates nothing.
What the decoder cannot stop is ZeroMQ receiving a huge frame: that is the
socket's ``MAXMSGSIZE`` (a per-frame limit, read when a socket binds or
connects), which :func:`~zmqpool.layout.max_message_bytes` derives from the
layouts a peer will use."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from zmqpool.errors import ProtocolError, VersionMismatchError
from zmqpool.limits import (
    MAX_BATCH_BYTES,
    MAX_BATCH_FRAMES,
    MAX_BATCHED_MESSAGE_BYTES,
    MAX_HEADER_BYTES,
    MAX_LAYOUT_ID,
    MAX_MESSAGE_FRAMES,
    MAX_PARTS,
    MAX_TOKEN_BYTES,
    described,
    is_int,
    max_pieced_bytes,
)

# isort: split
if TYPE_CHECKING:
    from zmqpool.codec import EncodedPart

#: Bumped whenever a peer of the previous version could misread a message.
#: 2: a spec's bounds may travel broadcast (:mod:`zmqpool.specs`' ``E``
#: tensors), which a version-1 pool would refuse as malformed specs.
#: 3: several small messages may travel as one (:data:`Command.BATCH`), which a
#: version-2 peer would refuse, losing the requests or replies inside.
#: 4: the results of several envs may travel with their rows joined
#: (:data:`Command.RESULTS`), which a version-3 pool would drop.
#: 5: the commands of several envs may travel with their rows joined
#: (:data:`Command.COMMANDS`), which a version-4 worker would drop.
#: 6: a COMMANDS may ask its worker to keep its replies together (body ``"h"``),
#: which a version-5 worker would drop.
#: 7: WELCOME says the largest frame the pool takes from the worker
#: (``max_frame``), so that a worker answers an output over it with an error
#: instead of a reply libzmq would drop, request and all; an ERROR may name the
#: builtin exception the env raised (``base``), which a version-6 pool refuses;
#: REJOIN asks a remote worker the pool set aside (a hang) to register again.
#: 8: SEED carries ``static`` and its reply the seed the env returned
#: (``next_seed``): a version-7 worker would reply with nothing, and the pool
#: seed the envs after it with None.
#: 9: a remote worker asks the pool's beacon for its PINGs (a HEARTBEAT from a
#: DEALER to a ROUTER): a version-8 worker's SUB cannot connect to it. An ERROR
#: or FAILED may name more builtins (``base``: OSError's family, ImportError...),
#: which a version-8 pool refuses, and a maker's FAILED names the one it raised.
#: 10: a remote worker's reply with a frame over its results port's limit travels
#: in pieces (WELCOME's ``piece``; a BATCH whose joined frame is cut), which a
#: version-9 pool drops; the port's limit is a piece's, not the largest reply's.
#: 11: a RESET or RESET_RAW may carry the caller's reset keywords (body ``"kw"``),
#: which a version-10 worker would leave out of the env's reset.
#: 12: REGISTER says which envs honour a reset's state (``set_state``, each env's
#: ``_supports_set_state``), which a version-11 pool refuses; a rebuilt env's
#: first RESET or RESET_RAW may carry the seed to set first (body ``"reseed"``),
#: which a version-11 worker would leave unset.
PROTOCOL_VERSION = 12


#: The key of a SEED reply's one value: the seed the env's ``set_seed`` returned.
NEXT_SEED = "next_seed"
#: The body key of a rebuilt env's first reset: the seed it is given first
#: (:func:`zmqpool.roster.restart_seed`).
RESEED = "reseed"


class Command(enum.IntEnum):
    """What a message asks for or answers."""

    # pool -> worker, on the broker's ROUTER
    STEP = 1  # env.step(td), reply: the "next" subtree
    RESET = 2  # env.reset(td, **body["kw"]), reply: the reset tensordict
    STEP_AND_MAYBE_RESET = 3  # reply: "next" subtree, then the next root
    STEP_RAW = 4  # env._step(td) (torchrl's private path), reply: its output
    RESET_RAW = 5  # env._reset(td, **body["kw"]), reply: its output
    SEED = 6  # env.set_seed(body["seed"], body["static"]), reply: {"next_seed": what it returned}
    CLOSE = 7  # shut down
    WELCOME = 8  # registration accepted: body["reg"] has token and env indices
    REFUSE = 9  # registration refused: body["err"]
    PING = 10  # the pool's heartbeat
    COMMANDS = 11  # several envs' commands, rows joined: body["c"], "envs", "seqs" (and "h")
    REJOIN = 12  # a remote worker the pool set aside (a hang): register again
    # worker -> pool, on the broker's ROUTER
    REGISTER = 20  # body["reg"]: env indices, specs, pid
    FAILED = 21  # building an env failed: body["err"], body["tb"]
    HEARTBEAT = 22
    # worker -> pool, on the results PULL
    RESULT = 30
    ERROR = 31  # the env raised: body["err"], body["tb"]
    RESULTS = 32  # several envs' results, rows joined: body["envs"], body["seqs"]
    # either way, on a command's or a result's socket
    BATCH = 40  # several messages in one: body["n"] frames each, body["len"] bytes per frame


# ---------------------------------------------------------------- headers


@dataclasses.dataclass(slots=True)
class Header:
    """Frame 0 of every message.

    Not frozen, for speed: one is made for every message received (and, on a
    worker, for every row of a COMMANDS), and a frozen dataclass's ``__init__``
    sets each field through ``object.__setattr__``. Nobody changes one after it
    is made.
    """

    command: Command
    env: int = -1
    seq: int = 0
    token: bytes = b""
    layouts: tuple[int, ...] = ()
    body: dict[str, Any] | None = None
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return _pack_header(self, list(self.layouts), self.body)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Header:
        """Parse and validate frame 0; raise :class:`ProtocolError` if it is not one."""
        size = len(data)
        if size > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            if size > PAUSE_GC_ABOVE_BYTES:
                fields = _unpack_collector_paused(data)
            else:
                fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as err:  # msgpack raises many types; all mean "not a header"
            raise ProtocolError(f"header is not msgpack: {err}") from None
        return cls._from_fields(fields)

    @classmethod
    def _from_fields(cls, fields: Any) -> Header:
        # Exact types throughout: msgpack yields plain lists, bytes and dicts (see is_int).
        if type(fields) is not list or len(fields) != 7:
            raise ProtocolError("header must be a msgpack array of 7 fields")
        version, command, env, seq, token, layouts, body = fields  # _pack_header's order
        # ``type(x) is int``: limits.is_int's exact test, inline (this runs for every
        # message received, and a call costs more than the test).
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"protocol version {described(version)} received, "
                f"this side speaks {PROTOCOL_VERSION}"
            )
        known = _COMMANDS.get(command) if type(command) is int else None
        if known is None:
            raise ProtocolError(f"unknown command {described(command)}")
        if type(env) is not int or type(seq) is not int or seq < 0:
            raise ProtocolError("header env and seq must be integers (seq >= 0)")
        if type(token) is not bytes or len(token) > MAX_TOKEN_BYTES:
            raise ProtocolError(f"header token must be at most {MAX_TOKEN_BYTES} bytes")
        if type(layouts) is not list or len(layouts) > MAX_PARTS:
            raise ProtocolError(f"header layouts must be a list of at most {MAX_PARTS} ids")
        for i in layouts:
            if type(i) is not int or not 0 <= i < MAX_LAYOUT_ID:
                raise ProtocolError("layout ids must be non-negative integers")
        if body is not None and type(body) is not dict:
            raise ProtocolError("header body must be a map or nil")
        return cls(known, env, seq, token, tuple(layouts), body)


#: Headers larger than this are unpacked with the cyclic collector paused. A header
#: is up to one container per byte: 256 KiB of empty msgpack arrays unpacked in
#: 270-370 ms with it on (the containers set off full collections, each walking
#: the ~400,000 objects torch and torchrl keep), in 22-31 ms paused (measured
#: here); 4 KiB of them in 1-1.5 ms, against 0.08 ms paused (it was 16 KiB: a
#: remote key's flood of 4 KiB ones took 200 local steps from 0.1 s to 21 s). A
#: cheap step's header, under 1 KiB, skips the pause's lock and two calls.
PAUSE_GC_ABOVE_BYTES = 1 << 10


def _unpack_collector_paused(data: bytes | memoryview) -> Any:
    with collector_paused():
        return msgpack.unpackb(data, raw=False, strict_map_key=False)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off while the block runs (nested pauses: the outer one resumes it).

    A message's objects must be gone by the end of the pause too: a collection that
    finds them alive (the header is still held when the next allocation comes)
    promotes them, and thousands of them a message set off full collections.
    """
    # One pause at a time in a process (two pools' threads may decode at once): else one
    # could read "disabled" from the other's pause and leave the collector off for good.
    with _GC_PAUSE:
        enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if enabled:
                gc.enable()


_GC_PAUSE = threading.RLock()


def peek_command(data: bytes | memoryview) -> Command | None:
    """The command of a header, read without unpacking the rest (None: not a header).

    What a socket that takes only small messages from most peers reads
    first, to refuse a large one before its body becomes objects.
    """
    fields = _peek_fields(data, 2)
    command = None if fields is None else fields[1]
    return _COMMANDS.get(command) if type(command) is int else None


def peek_sender(data: bytes | memoryview) -> tuple[int, bytes] | None:
    """A header's env and token, read without unpacking its layouts and body (None: not a header).

    What the results socket reads first of a large header, to drop one that
    its env's worker did not send before its body becomes objects.
    """
    fields = _peek_fields(data, 5)
    if fields is None or type(fields[2]) is not int or type(fields[4]) is not bytes:
        return None
    return fields[2], fields[4]


def _peek_fields(data: bytes | memoryview, count: int) -> list[Any] | None:
    """A header's first ``count`` fields (the small ones), or None if it is not a header."""
    # Scalars only (ints, a token): a field that is an array or a map (of up to one
    # object per byte) raises at once instead of being built before any check.
    unpacker = msgpack.Unpacker(
        raw=False,
        max_buffer_size=len(data) or 1,
        max_array_len=0,
        max_map_len=0,
        max_ext_len=0,
        max_str_len=MAX_TOKEN_BYTES,
        max_bin_len=MAX_TOKEN_BYTES,
    )
    try:
        unpacker.feed(data)
        if unpacker.read_array_header() != 7:
            return None
        return [unpacker.unpack() for _ in range(count)]
    except Exception:  # msgpack raises many types; all mean "not a header"
        return None


#: Command by value: a dict lookup is a fraction of ``Command(value)``'s cost.
_COMMANDS: dict[int, Command] = {command.value: command for command in Command}


def _pack_header(header: Header, layouts: list[int], body: dict[str, Any] | None) -> bytes:
    """Frame 0: the header's fields in their wire order (the module docstring's)."""
    return _pack_fields(
        header.version, header.command, header.env, header.seq, header.token, layouts, body
    )


def _pack_fields(
    version: int,
    command: Command,
    env: int,
    seq: int,
    token: bytes,
    layouts: list[int],
    body: dict[str, Any] | None,
) -> bytes:
    try:
        packer = _PACKERS.packer
    except AttributeError:  # this thread's first header
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack([version, int(command), env, seq, token, layouts, body])


#: Each thread's msgpack Packer, kept: ``msgpack.packb`` builds one per call (0.7
#: against 0.3 us a header, for every message sent). Per thread, because a Packer
#: is not thread-safe (workers with env threads, the beacon); it empties its
#: buffer when a pack raises, so a failed header leaves nothing behind.
_PACKERS = threading.local()


def encode_message(header: Header, parts: Sequence[EncodedPart]) -> list[Any]:
    """Header frame + every part's frames, with layouts announced and non-tensors attached."""
    return message_frames(
        header.command, header.env, header.seq, header.token, header.body, parts, header.version
    )


def message_frames(
    command: Command,
    env: int,
    seq: int,
    token: bytes,
    body: dict[str, Any] | None,
    parts: Sequence[EncodedPart],
    version: int = PROTOCOL_VERSION,
) -> list[Any]:
    """:func:`encode_message` of ``Header(command, env, seq, token, body=body)``, without
    building the Header (seven field sets, for every message sent)."""
    new_layouts = {p.layout_id: p.new_layout for p in parts if p.new_layout is not None}
    nontensor = any(p.nontensor for p in parts)
    if new_layouts or nontensor:
        body = dict(body or {})
        if new_layouts:
            body["L"] = new_layouts
        if nontensor:
            body["nt"] = [p.nontensor or [] for p in parts]
    layouts = [p.layout_id for p in parts]
    frames: list[Any] = [_pack_fields(version, command, env, seq, token, layouts, body or None)]
    if (new_layouts or nontensor) and len(frames[0]) > MAX_HEADER_BYTES:
        raise _header_too_large(len(frames[0]))
    for part in parts:
        frames.extend(part.frames)
    return frames


def check_header_room(parts: Sequence[EncodedPart], body: dict[str, Any] | None = None) -> None:
    """Raise :class:`ProtocolError` if a message of ``parts`` (and ``body``) would have a
    header a peer drops, or one msgpack cannot pack.

    Only non-tensor data, announced layouts and a body (a reset's keywords)
    make a header large; a peer drops a header over :data:`MAX_HEADER_BYTES`
    as malformed, and the request it answers with it. Packs the header once
    more, and only then.
    """
    if body is not None or any(p.nontensor or p.new_layout is not None for p in parts):
        try:
            header = message_frames(Command.RESULT, 0, 0, bytes(MAX_TOKEN_BYTES), body, parts)[0]
        except (TypeError, ValueError, OverflowError) as err:  # what msgpack cannot pack
            raise ProtocolError(f"the message's header cannot be packed ({err})") from None
        size = len(header)
        if size > MAX_HEADER_BYTES - _HEADER_SLACK:
            raise _header_too_large(size)


#: What a header's fields other than its parts may add: env and seq as larger ints.
_HEADER_SLACK = 32


def _header_too_large(size: int) -> ProtocolError:
    return ProtocolError(
        f"the message's header would be {size} bytes (its non-tensor data and layouts), over "
        f"the {MAX_HEADER_BYTES} a peer takes: it cannot cross the wire"
    )


# ---------------------------------------------------------------- batches


def batch_messages(
    messages: Sequence[list[Any]], env: int, token: bytes = b"", max_messages: int | None = None
) -> list[list[Any]]:
    """``messages`` (each its header frame, then its tensor frames) as few messages as can be.

    Runs of small messages (at most :data:`~zmqpool.limits.MAX_BATCHED_MESSAGE_BYTES`
    each) become one :data:`Command.BATCH` each, of at most
    :data:`~zmqpool.limits.MAX_BATCH_BYTES`,
    :data:`~zmqpool.limits.MAX_BATCH_FRAMES` frames and ``max_messages``
    messages (what the receiver takes in one batch; None: no count); a larger
    message goes as it is, in its place. The order is kept: a message may use
    a layout an earlier one announced. ``env`` and ``token`` go in each batch's header (a result
    batch's ``env`` is one its worker hosts, so the pool finds the worker's link by it).
    """
    out: list[list[Any]] = []
    run = _Run()
    for frames in messages:
        sizes = [memoryview(f).nbytes for f in frames]
        fits = sum(sizes) <= MAX_BATCHED_MESSAGE_BYTES
        if run.messages and (not fits or not run.takes(sizes, max_messages)):
            out.append(run.message(env, token))
            run = _Run()
        if fits:
            run.add(frames, sizes)
        else:
            out.append(frames)
    if run.messages:
        out.append(run.message(env, token))
    return out


@dataclasses.dataclass
class _Run:
    """Consecutive small messages on their way into one batch, their frame sizes measured once."""

    messages: list[list[Any]] = dataclasses.field(default_factory=list)
    sizes: list[int] = dataclasses.field(default_factory=list)
    nbytes: int = 0

    def takes(self, sizes: list[int], max_messages: int | None) -> bool:
        if max_messages is not None and len(self.messages) >= max_messages:
            return False
        fits_bytes = self.nbytes + sum(sizes) <= MAX_BATCH_BYTES
        return fits_bytes and len(self.sizes) + len(sizes) <= MAX_BATCH_FRAMES

    def add(self, frames: list[Any], sizes: list[int]) -> None:
        self.messages.append(frames)
        self.sizes += sizes
        self.nbytes += sum(sizes)

    def message(self, env: int, token: bytes) -> list[Any]:
        """A BATCH header, then the frames joined (a run of one: that message as it is)."""
        if len(self.messages) == 1:
            return self.messages[0]
        body = {"n": [len(frames) for frames in self.messages], "len": self.sizes}
        joined = b"".join(frame for frames in self.messages for frame in frames)
        return [Header(Command.BATCH, env, 0, token, body=body).encode(), joined]


@dataclasses.dataclass(slots=True)
class Row:
    """One env's command or result on its way out, still as encoded parts.

    The pool keeps these while it sends a call's commands to a batching
    worker, and such a worker keeps its results while a batch runs inline (or
    while another env thread sends), so that :func:`joined_messages` can join
    the rows of envs whose parts share their layouts. ``command`` is the
    message a row alone is: a command (``STEP``, ...) or ``RESULT``.

    Not frozen, for speed (a row is made for every env-step); nobody changes
    one after it is made.
    """

    command: Command
    env: int
    seq: int
    parts: list[EncodedPart]

    def joinable_nbytes(self) -> int | None:
        """This row's bytes, if it may be joined with others (nothing announced, tensors only,
        at most :data:`~zmqpool.limits.MAX_BATCHED_MESSAGE_BYTES`); else None."""
        nbytes = 0
        for part in self.parts:  # a loop, not a generator: this runs for every env-step
            if part.new_layout is not None or part.nontensor:
                return None
            nbytes += part.layout.frames_nbytes  # the sizes of the frames it laid out
        return nbytes if nbytes <= MAX_BATCHED_MESSAGE_BYTES else None

    def join_key(self) -> tuple[Command | int, ...]:
        """What rows that may travel in one message share: one command, and their parts'
        layout ids, in order."""
        parts = self.parts
        if len(parts) == 1:  # most rows: no list to build
            return self.command, parts[0].layout_id
        return (self.command, *[part.layout_id for part in parts])

    def message(self, token: bytes) -> list[Any]:
        """This row alone: a message of its command."""
        return message_frames(self.command, self.env, self.seq, token, None, self.parts)


#: The commands whose rows may travel joined (:data:`Command.COMMANDS`): those
#: that carry a tensordict, or nothing, to one env and need no body.
JOINABLE_COMMANDS = frozenset(
    (
        Command.STEP,
        Command.STEP_RAW,
        Command.STEP_AND_MAYBE_RESET,
        Command.RESET,
        Command.RESET_RAW,
    )
)


def joined_messages(
    outbox: Sequence[Row | list[Any]], token: bytes, hold: bool = False
) -> list[list[Any]]:
    """Kept commands or replies as messages: runs of rows of one command and layouts joined.

    Consecutive joinable :class:`Row` s of one :meth:`Row.join_key` become one
    :data:`Command.RESULTS` or :data:`Command.COMMANDS` (:func:`pack_rows`), of
    at most :data:`~zmqpool.limits.MAX_BATCH_BYTES`, each env in it once (a
    second row of an env begins the next run); any other row becomes its own
    message, and a message (an error reply, a command with a body) stays as it
    is. The order is kept: a row may use a layout an earlier message announced.
    ``hold``: each COMMANDS asks its worker to keep its replies together (:func:`holds_replies`).
    """
    if len(outbox) > 1 and _one_run(outbox):  # the usual outbox: one worker's rows of one step
        return [pack_rows(outbox, token, hold)]  # type: ignore[arg-type]  # all Rows: _one_run says
    out: list[list[Any]] = []
    run: list[Row] = []
    key: tuple[Command | int, ...] | None = None  # the run's (Row.join_key)
    envs: set[int] = set()  # the run's: a peer takes each env once a message
    nbytes = 0
    for entry in outbox:
        if not isinstance(entry, Row):
            if run:
                out.append(pack_rows(run, token, hold))
                run, envs, nbytes = [], set(), 0
            out.append(entry)
            continue
        row_nbytes = entry.joinable_nbytes()
        if row_nbytes is None:  # announces, carries non-tensors, or is large: alone
            if run:
                out.append(pack_rows(run, token, hold))
                run, envs, nbytes = [], set(), 0
            out.append(entry.message(token))
            continue
        row_key = entry.join_key()
        joins = row_key == key and entry.env not in envs
        if run and not (joins and nbytes + row_nbytes <= MAX_BATCH_BYTES):
            out.append(pack_rows(run, token, hold))
            run, envs, nbytes = [], set(), 0
        if run or _may_join(entry.command):
            run.append(entry)  # a row that joins the run's first has its command
            key = row_key
            envs.add(entry.env)
            nbytes += row_nbytes
        else:
            out.append(entry.message(token))
    if run:
        out.append(pack_rows(run, token, hold))
    return out


def _one_run(outbox: Sequence[Row | list[Any]]) -> bool:
    """Whether ``outbox`` is rows that all join into one message (what :func:`joined_messages`
    would make of them), told in one pass: one command that may join, one part each, of one
    layout id announced before, tensors only, each env once, within the size limits."""
    first = outbox[0]
    if type(first) is not Row or len(first.parts) != 1 or not _may_join(first.command):
        return False
    command, layout_id = first.command, first.parts[0].layout_id
    envs: set[int] = set()
    nbytes = 0
    for row in outbox:
        if type(row) is not Row or row.command != command or len(row.parts) != 1:
            return False
        part = row.parts[0]
        if part.layout_id != layout_id or part.new_layout is not None or part.nontensor:
            return False
        size = part.layout.frames_nbytes
        if size > MAX_BATCHED_MESSAGE_BYTES:
            return False
        nbytes += size
        envs.add(row.env)
    return len(envs) == len(outbox) and nbytes <= MAX_BATCH_BYTES


def _may_join(command: Command) -> bool:
    return command == Command.RESULT or command in JOINABLE_COMMANDS


def pack_rows(rows: Sequence[Row], token: bytes, hold: bool = False) -> list[Any]:
    """One RESULTS or COMMANDS message for ``rows`` (which join); a single row: its message.

    Frame ``i`` after the header is every row's frame ``i``, back to back in
    the order of ``envs``: what the pool stacks anyway
    (:func:`zmqpool.batching.stack_parts`), and what a worker takes apart with
    :meth:`~zmqpool.codec.Decoder.decode_rows`.
    """
    if len(rows) == 1:
        return rows[0].message(token)
    first = rows[0]
    envs, seqs = [r.env for r in rows], [r.seq for r in rows]
    layouts = [p.layout_id for p in first.parts]
    header = _joined_header(first.command, envs, seqs, layouts, token, hold)
    if len(first.parts) == 1 and len(first.parts[0].frames) == 1:  # rows share layouts
        return [header, b"".join([r.parts[0].frames[0] for r in rows])]  # most: one frame each
    return [header, *_columns([[f for p in r.parts for f in p.frames] for r in rows])]


def packed_rows_message(
    command: Command,
    rows: Sequence[tuple[Command, int, int, Any]],
    layout_id: int,
    hold: bool = False,
) -> list[Any]:
    """The COMMANDS :func:`pack_rows` makes of two or more rows ``(command, env, seq, part)``
    that join, each one part of layout ``layout_id`` (its frames: ``part.buffers``),
    without encoding each row on its own."""
    envs, seqs = [row[1] for row in rows], [row[2] for row in rows]
    header = _joined_header(command, envs, seqs, [layout_id], b"", hold)
    buffers = [row[3].buffers for row in rows]
    if len(buffers[0]) == 1:
        return [header, b"".join([frames[0] for frames in buffers])]
    return [header, *_columns(buffers)]


def _joined_header(
    command: Command,
    envs: list[int],
    seqs: list[int],
    layouts: list[int],
    token: bytes,
    hold: bool = False,
) -> bytes:
    """The header frame of rows ``command`` joined: RESULTS for results, else COMMANDS
    (``hold``: with ``"h": true``, see :func:`holds_replies`).

    The first env is the header's own (the one its sender is found by).
    """
    body: dict[str, Any] = {"envs": envs, "seqs": seqs}
    if command == Command.RESULT:
        header = Header(Command.RESULTS, envs[0], 0, token)
    else:
        header = Header(Command.COMMANDS, envs[0], 0, token)
        body["c"] = int(command)
        if hold:
            body["h"] = True
    return _pack_header(header, layouts, body)


def _columns(rows_frames: list[list[Any]]) -> list[bytes]:
    """Frame ``i`` of every row, joined in row order, for each ``i``."""
    return [b"".join(column) for column in zip(*rows_frames, strict=True)]


def results_rows(header: Header, max_rows: int) -> tuple[list[int], list[int]]:
    """A RESULTS header's envs and seqs, checked: exact ints, as many of each, no env twice.

    At least two rows and at most ``max_rows`` (the sender's envs); the first
    env is the header's own (the one its sender is found by). Raises
    :class:`ProtocolError`. Whether the envs are the sender's is the pool's check.
    """
    body = header.body
    if body is None or body.keys() != {"envs", "seqs"}:
        raise ProtocolError('a RESULTS body must hold exactly "envs" and "seqs"')
    return _rows_of(header, body, max_rows, "RESULTS")


def command_rows(header: Header, max_rows: int) -> tuple[Command, list[int], list[int]]:
    """A COMMANDS header's command, envs and seqs, checked as :func:`results_rows` checks.

    The command must be one of :data:`JOINABLE_COMMANDS`. Raises
    :class:`ProtocolError`. Whether the envs are the worker's is the worker's
    business (a command for an env it does not host is answered with an error).
    """
    body = header.body
    if body is None or not _COMMANDS_KEYS <= body.keys() <= _COMMANDS_KEYS_HELD:
        raise ProtocolError('a COMMANDS body must hold exactly "c", "envs" and "seqs" (and "h")')
    if body.get("h", True) is not True:
        raise ProtocolError(f'a COMMANDS body\'s "h" must be true, not {described(body["h"])}')
    command = _COMMANDS.get(body["c"]) if is_int(body["c"]) else None
    if command not in JOINABLE_COMMANDS:
        raise ProtocolError(f"COMMANDS of {described(body['c'])}, not a command that may be joined")
    envs, seqs = _rows_of(header, body, max_rows, "COMMANDS")
    return command, envs, seqs


#: What a COMMANDS body holds, and may hold besides (:func:`holds_replies`).
_COMMANDS_KEYS = frozenset(("c", "envs", "seqs"))
_COMMANDS_KEYS_HELD = _COMMANDS_KEYS | {"h"}


def holds_replies(header: Header) -> bool:
    """Whether ``header`` is a COMMANDS (checked by :func:`command_rows`) that asks its
    worker to keep its replies together: the pool's last recv waited for several
    results, so one message of them is worth more to it than the first a little sooner."""
    body = header.body
    return header.command is Command.COMMANDS and body is not None and body.get("h") is True


def _rows_of(
    header: Header, body: dict[str, Any], max_rows: int, what: str
) -> tuple[list[int], list[int]]:
    envs, seqs = body["envs"], body["seqs"]
    if type(envs) is not list or type(seqs) is not list or len(envs) != len(seqs):
        raise ProtocolError(f"{what} envs and seqs must be lists of one length")
    if not 2 <= len(envs) <= max_rows:
        raise ProtocolError(f"{what} of {len(envs)} rows, where 2 to {max_rows} fit")
    if any(not is_int(e) for e in envs) or any(not is_int(s) or s < 0 for s in seqs):
        raise ProtocolError(f"{what} envs and seqs must be integers (seqs >= 0)")
    if envs[0] != header.env or len(set(envs)) != len(envs):
        raise ProtocolError(f"{what} envs must start with the header's env, each once")
    return envs, seqs


def pieced_message(frames: Sequence[Any], env: int, token: bytes, piece: int) -> list[Any]:
    """``frames`` as a BATCH of one message whose joined frame travels in pieces of ``piece`` bytes.

    For a remote worker's reply with a frame over its results port's limit
    (:func:`~zmqpool.limits.remote_piece_bytes`): the header lists the
    message's frame sizes, as any batch's; the pieces follow it.
    """
    sizes = [memoryview(f).nbytes for f in frames]
    joined = memoryview(b"".join(frames))
    pieces = [joined[at : at + piece] for at in range(0, joined.nbytes, piece)]
    body = {"n": [len(sizes)], "len": sizes}
    return [Header(Command.BATCH, env, 0, token, body=body).encode(), *pieces]


def split_batch(
    header: Header, frames: Sequence[Any], max_messages: int, max_frame: int | None = None
) -> list[list[memoryview]]:
    """A BATCH's messages, each its frames (views on the joined frame, nothing copied).

    Everything the header claims is checked before any view is made: at most
    ``max_messages`` messages (what the peer may have in flight: its envs), of
    at most :data:`~zmqpool.limits.MAX_MESSAGE_FRAMES` frames each and
    :data:`~zmqpool.limits.MAX_BATCH_FRAMES` in all, whose sizes add up to
    the one joined frame's. With ``max_frame`` (what the peer's frames are
    held to), the joined frame of one message may come in pieces
    (:func:`pieced_message`): each frame listed is held to ``max_frame``, the
    sizes to the pieces' bytes and those to
    :func:`~zmqpool.limits.max_pieced_bytes` before the pieces are joined, the
    one copy made. Raises :class:`ProtocolError`.
    """
    counts, sizes = _batch_fields(header.body)
    if not 0 < len(counts) <= max_messages:
        raise ProtocolError(f"a batch of {len(counts)} messages, where at most {max_messages} fit")
    if any(not is_int(n) or not 0 < n <= MAX_MESSAGE_FRAMES for n in counts):
        raise ProtocolError("a batch's frame counts must be positive integers")
    if sum(counts) != len(sizes) or any(not is_int(n) or n < 0 for n in sizes):
        raise ProtocolError("a batch's frame sizes must be one non-negative integer per frame")
    if len(frames) != 1 and len(counts) != 1:
        raise ProtocolError(f"a batch in pieces must carry one message, not {len(counts)}")
    joined = _joined_frame(frames, sizes, max_frame)
    views, at = [], 0
    for size in sizes:
        views.append(joined[at : at + size])
        at += size
    messages, start = [], 0
    for n in counts:
        messages.append(views[start : start + n])
        start += n
    return messages


def _joined_frame(frames: Sequence[Any], sizes: list[int], max_frame: int | None) -> memoryview:
    """A batch's one joined frame, or its pieces joined once every claim is checked."""
    if len(frames) != 1 and (max_frame is None or not frames):
        raise ProtocolError(f"a batch must carry one joined frame, not {len(frames)}")
    views = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    nbytes = sum(view.nbytes for view in views)
    if sum(sizes) != nbytes:
        raise ProtocolError(f"a batch's frame sizes add up to {sum(sizes)}, not {nbytes}")
    if len(views) == 1:
        return views[0]
    assert max_frame is not None
    if max(sizes) > max_frame:
        raise ProtocolError(
            f"a batch in pieces lists a frame of {max(sizes)} bytes; its sender's frames are "
            f"at most {max_frame}"
        )
    if nbytes > max_pieced_bytes(max_frame):
        raise ProtocolError(
            f"a reply in pieces of {nbytes} bytes; its sender's replies join to at most "
            f"{max_pieced_bytes(max_frame)}"
        )
    return memoryview(bytearray().join(views))


def _batch_fields(body: dict[str, Any] | None) -> tuple[list[Any], list[Any]]:
    counts = None if body is None else body.get("n")
    sizes = None if body is None else body.get("len")
    if type(counts) is not list or type(sizes) is not list or len(sizes) > MAX_BATCH_FRAMES:
        raise ProtocolError(f"a batch must list frame counts and at most {MAX_BATCH_FRAMES} sizes")
    return counts, sizes
