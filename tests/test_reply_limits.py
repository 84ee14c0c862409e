"""What one worker's replies can cost the trainer: memory kept for its layouts, other envs' results.

Each live test runs the pool in a process of its own (:class:`tests.hostile.Victim`),
bound with CURVE on ``tcp://127.0.0.1:P``, and plays an authorized remote
worker by hand (:class:`tests.hostile.ScriptedWorker`):

- layouts: a reply may announce a layout (id 0 again, or a new id) of 4,096
  empty leaves under 16-deep keys, some 270 KB on the wire and 4.4 MiB of
  objects in the trainer, plus an off-spec observation so the reply is only
  an ``EnvError``. The trainer must keep no more of them than its decoder
  holds, and the decoder no more than ``MAX_PEER_LAYOUT_BYTES``;
- structure: in a mixed pool (an honest local env 0, the scripted remote env),
  a remote reply missing a declared key, or of another dtype than its spec,
  must cost that env an ``EnvError`` naming the key, and the local env must
  keep its result (torch.stack of the two raised, naming no env, or promoted
  the batch to float64).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import hostile
import msgpack
import torch
from hostile import ScriptedWorker, Victim, client_keys
from tensordict import TensorDict

from tests.conformance import InfoLeafEnv
from tests.netns import free_port_base
from zmqpool import PoolConfig, ZMQAsyncEnvPool
from zmqpool.codec import Encoder, layout_of
from zmqpool.conformity import mark_misfits
from zmqpool.errors import EnvError
from zmqpool.layout import Layout
from zmqpool.limits import MAX_PEER_LAYOUT_BYTES
from zmqpool.state import Kind, Pending, Reply
from zmqpool.testing import CountingEnv
from zmqpool.wire import Command

HOST = "127.0.0.1"
MB = 1 << 20
#: Victims wait long for registrations, and heartbeats never run out during a test.
QUIET = {"register_timeout_s": 60.0, "close_timeout_s": 1.0, "heartbeat_liveness": 120}


def victim_on(tmp_path, key_dir, port: int, **kwargs: Any) -> Victim:
    """A pool bound on ``port`` with CURVE, listening (P, P+1, P+2) before this returns."""
    victim = Victim(
        tmp_path / "pool.log",
        bind=f"tcp://{HOST}:{port}",
        curve_keys=key_dir,
        config=QUIET,
        **kwargs,
    )
    try:
        victim.wait_listening([port, port + 1, port + 2], timeout_s=60)
    except BaseException:
        victim.stop()
        raise
    return victim


def remote_env(context, victim: Victim, port: int, key_dir, name: bytes) -> tuple[Any, int]:
    """An authorized scripted worker, welcomed, and its one env slot."""
    worker = ScriptedWorker(context, victim.hello, HOST, port, client_keys(key_dir, 0), name)
    reply = worker.register(timeout_s=30.0, until=lambda: victim.seen("construct_failed"))
    assert reply is not None, (worker.refusals[-2:], victim.seen("construct_failed"))
    victim.wait("constructed", timeout_s=30)
    [env] = worker.envs
    return worker, env


def step_next() -> TensorDict:
    """What an honest worker sends for a STEP: ``env.step(td)["next"]`` of a CountingEnv."""
    env = CountingEnv()
    td = env.reset()
    td["action"] = torch.tensor([0.5])
    return env.step(td)["next"]


# ---------------------------------------------------------------- layouts a peer makes us keep


def deep_layout(tag: int, leaves: int) -> dict[str, Any]:
    """A layout's wire form: ``leaves`` empty float leaves under 16-deep keys of 2-character
    names (1-character ones are shared by CPython), then an observation of shape [5]."""
    names = [f"{chr(97 + j % 26)}{chr(97 + j * 7 % 26)}" for j in range(15)]
    entries = [[[*names, f"{tag:x}_{i}"], "float32", [0], False] for i in range(leaves)]
    entries.append([["observation"], "float32", [5], False])
    return {"b": [], "t": entries, "n": []}


def announcing_reply(worker: ScriptedWorker, command: dict[str, Any], layout_id: int, data):
    """A RESULT answering ``command`` that announces ``data`` as ``layout_id`` and uses it."""
    header = worker.result_header(
        command["env"], command["seq"], [layout_id], {"L": {layout_id: data}}
    )
    return [header, *[bytes(size) for size in frame_sizes(len(data["t"]))]]


@functools.cache
def frame_sizes(leaves: int) -> tuple[int, ...]:
    """The frames of a :func:`deep_layout` of ``leaves - 1`` leaves (whatever its tag)."""
    data = msgpack.unpackb(msgpack.packb(deep_layout(0, leaves - 1)), raw=False)
    return Layout.from_data(data).frame_sizes


def bad_layout_rounds(victim, worker, env: int, count: int, layout_id, leaves: int) -> list:
    """``count`` rounds of a step of ``env``, each answered with a new deep layout
    (as ``layout_id(i)``); the errors the pool raised, and its RSS growth meanwhile."""
    victim.command(f'step-envs {{"envs": [{env}], "timeout": 30, "rounds": {count}}}')
    for i in range(count):
        command = worker.command(10)
        assert command is not None, f"no step {i} from the pool"
        worker.send_result(announcing_reply(worker, command, layout_id(i), deep_layout(i, leaves)))
    rounds = victim.wait("stepped_envs", timeout_s=60)["rounds"]
    return [error for r in rounds for error in r["errors"]]


def settled_growth(victim: Victim, before: int) -> int:
    victim.command("malloc-trim")
    victim.wait("trimmed", timeout_s=10)
    return hostile.settled_rss(victim.pid) - before


def baseline(victim: Victim, worker: ScriptedWorker, env: int) -> int:
    """The pool's RSS after one honest step of ``env`` (its first-use costs paid)."""
    victim.command(f'step-envs {{"envs": [{env}], "timeout": 10}}')
    command = worker.command(10)
    assert command is not None
    worker.answer(command, step_next())
    victim.wait("stepped_envs", timeout_s=30)
    victim.command("malloc-trim")
    victim.wait("trimmed", timeout_s=10)
    return hostile.settled_rss(victim.pid)


def test_layouts_a_peer_replaces_are_not_kept(tmp_path, key_dir, context):
    """30 replies, each announcing layout id 0 again as 2,048 deep-keyed leaves (~2.2 MiB
    kept each): each is its env's EnvError, and the pool's RSS grows by under 32 MB
    (each replaced layout was kept by the env's verdict cache and the intern table:
    +66 MB, and 4.4 MiB more for each further reply of 4,096 leaves, to gigabytes)."""
    port = free_port_base(HOST)
    count = 30
    with victim_on(tmp_path, key_dir, port, remote_envs=1) as victim:
        worker, env = remote_env(context, victim, port, key_dir, b"layout-replacer")
        before = baseline(victim, worker, env)
        errors = bad_layout_rounds(victim, worker, env, count, lambda i: 0, leaves=2048)
        growth = settled_growth(victim, before)
        worker.close()
    print(f"{count} layouts replaced: the pool grew by {growth / MB:.1f} MB")
    assert len(errors) == count and all(e["envs"] == [env] for e in errors), errors[:2]
    assert "observation of shape [5]" in errors[-1]["error"], errors[-1]
    assert growth < 32 * MB, f"{count} replaced layouts grew the pool by {growth / MB:.0f} MB"


def test_a_peer_holds_at_most_its_layout_budget(tmp_path, key_dir, context):
    """12 replies, each announcing a new id (4,096 deep-keyed leaves, ~4.4 MiB kept each,
    53 MiB together): the decoder refuses those past MAX_PEER_LAYOUT_BYTES (the env's
    error names the budget), and the pool's RSS grows by less than the budget and 16 MB."""
    port = free_port_base(HOST)
    count = 12
    with victim_on(tmp_path, key_dir, port, remote_envs=1) as victim:
        worker, env = remote_env(context, victim, port, key_dir, b"layout-hoarder")
        before = baseline(victim, worker, env)
        errors = bad_layout_rounds(victim, worker, env, count, lambda i: i + 1, leaves=4095)
        growth = settled_growth(victim, before)
        worker.close()
    print(f"{count} layouts announced: the pool grew by {growth / MB:.1f} MB")
    assert len(errors) == count and all(e["envs"] == [env] for e in errors), errors[:2]
    refused = [e for e in errors if f"at most {MAX_PEER_LAYOUT_BYTES} are kept" in e["error"]]
    assert refused and refused[0] is not errors[0], [e["error"][:120] for e in errors]
    assert growth < MAX_PEER_LAYOUT_BYTES + 16 * MB, f"the pool grew by {growth / MB:.0f} MB"


# ---------------------------------------------------------------- one off-structure reply


def mixed_rounds(tmp_path, key_dir, context, bad_next, rounds_count: int = 3) -> tuple[int, list]:
    """A local env 0 and a scripted remote env answering each step with ``bad_next()``:
    ``rounds_count`` rounds of a step of both, each env's result or error."""
    port = free_port_base(HOST)
    with victim_on(tmp_path, key_dir, port, remote_envs=1, local=[{"env_id": 0}]) as victim:
        worker, env = remote_env(context, victim, port, key_dir, b"off-structure")
        order = {"envs": [0, env], "timeout": 8, "rounds": rounds_count}
        victim.command(f"step-envs {json.dumps(order)}")
        for i in range(rounds_count):
            command = worker.command(10)
            assert command is not None, f"no step {i} from the pool"
            worker.answer(command, bad_next())
        rounds = victim.wait("stepped_envs", timeout_s=60)["rounds"]
        worker.close()
    return env, rounds


def only_env_lost(rounds: list, env: int, words: tuple[str, ...]) -> list[str]:
    """What is wrong with ``rounds``: each must keep env 0's result and raise one EnvError
    for ``env`` alone, naming ``words``."""
    problems = []
    for i, r in enumerate(rounds):
        named = [e for e in r["errors"] if e["type"] == "EnvError" and e["envs"] == [env]]
        if "0" not in r["results"]:
            problems.append(f"round {i}: the local env lost its result: {r}")
        if len(named) != 1 or not all(word in named[0]["error"] for word in words):
            problems.append(f"round {i}: no EnvError for env {env} naming {words}: {r}")
    return problems


def test_a_reply_missing_a_declared_key_costs_only_its_env(tmp_path, key_dir, context):
    def without_reward():
        td = step_next()
        del td["reward"]
        return td

    env, rounds = mixed_rounds(tmp_path, key_dir, context, without_reward)
    problems = only_env_lost(rounds, env, ("without reward", "spec declares"))
    assert not problems, "\n".join(problems)


def test_a_reply_of_another_dtype_than_its_spec_costs_only_its_env(tmp_path, key_dir, context):
    """A float64 observation (spec: float32) was stacked with the local env's, promoting
    the whole batch to float64 without a word."""

    def float64_observation():
        td = step_next()
        td["observation"] = td["observation"].double()
        return td

    env, rounds = mixed_rounds(tmp_path, key_dir, context, float64_observation)
    problems = only_env_lost(rounds, env, ("observation of dtype float64", "spec says float32"))
    assert not problems, "\n".join(problems)


def test_a_reply_with_a_key_the_others_lack_costs_only_its_env(tmp_path, key_dir, context):
    """An undeclared extra key is allowed (envs return more than they declare), but a dense
    stack of it with the local env's reply raised, naming no env, and lost both results."""

    def with_extra():
        td = step_next()
        td["extra"] = torch.zeros(3)
        return td

    env, rounds = mixed_rounds(tmp_path, key_dir, context, with_extra)
    problems = only_env_lost(rounds, env, ("extra", "other envs"))
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the batch's structure, judged


def reply_of(env: int, td: TensorDict, encoder: Encoder) -> Reply:
    """``td`` as the trainer holds an env's STEP reply: a part decoded from its frames."""
    from zmqpool.codec import Decoder
    from zmqpool.wire import Header, encode_message

    frames = encode_message(Header(Command.STEP, env, 1, b"t"), [encoder.encode(td)])
    header = Header.decode(frames[0])
    parts = Decoder().decode(header, [bytes(memoryview(f).cast("B")) for f in frames[1:]])
    pending = Pending(1, Command.STEP, ("step", None), None, None, None, 0.0)  # type: ignore[arg-type]
    return Reply(env, pending, parts)


def test_mark_misfits_keeps_the_batchs_structure_and_names_the_key_of_the_others():
    """Three envs reply alike, one with an extra key, one without a key: the two odd ones
    become their envs' errors naming the key; the usual batch (one layout) is untouched."""
    extra, missing = step_next(), step_next()
    extra["extra"] = torch.zeros(3)
    del missing["terminated"]
    replies = [reply_of(e, step_next(), Encoder()) for e in range(3)]
    replies += [reply_of(3, extra, Encoder()), reply_of(4, missing, Encoder())]
    assert replies[0].parts[0].layout is replies[1].parts[0].layout  # interned
    mark_misfits(replies[:3])
    assert all(r.error is None for r in replies[:3])
    mark_misfits(replies)
    assert [r.error is None for r in replies] == [True, True, True, False, False]
    assert isinstance(replies[3].error, EnvError) and replies[3].error.env_index == 3
    assert str(replies[3].error).startswith("env 3: replied with extra") and not replies[3].parts
    assert str(replies[4].error).startswith("env 4: replied without terminated")  # named once


def test_a_tie_keeps_the_structure_with_fewer_entries():
    extra = step_next()
    extra["extra"] = torch.zeros(3)
    replies = [reply_of(0, extra, Encoder()), reply_of(1, step_next(), Encoder())]
    mark_misfits(replies)
    assert replies[1].error is None and "replied with extra" in str(replies[0].error)
    assert layout_of(step_next()) == replies[1].parts[0].layout


def test_replies_of_unlike_structures_are_judged_with_those_they_are_stacked_with():
    """With max_get=1 a recv stacks one reply, which always stacks: env 0's step with an
    undeclared leaf is returned, as torchrl's pool returns it, even when the other envs'
    replies are ready beside it (they were once judged all together, and env 0 failed)."""
    makers = [functools.partial(InfoLeafEnv, info=env == 0) for env in range(3)]
    pool = ZMQAsyncEnvPool(makers, config=PoolConfig(register_timeout_s=90.0))
    try:
        td = pool.reset().exclude("env_index")
        td["action"] = torch.ones(3, 1)
        pool.async_step_send(td, env_index=[0, 1, 2])
        channel = (Kind.STEP, None)
        deadline = time.monotonic() + 30
        while pool.runtime.ledger.count_ready(channel) < 3 and time.monotonic() < deadline:
            pool.runtime.pump(0.05)  # every reply in before the first recv
        assert pool.runtime.ledger.count_ready(channel) == 3
        got = [pool.async_step_recv(min_get=1, max_get=1, timeout=10) for _ in range(3)]
        assert sorted(int(r["env_index"][0]) for r in got) == [0, 1, 2]
        assert [("next", "info") in r.keys(True) for r in got if int(r["env_index"][0]) == 0] == [
            True
        ]
    finally:
        pool.close()
