"""Attacks on the trainer by peers that hold an authorized key (or speak first), from outside.

The remaining trainer-side findings of the network-hardening review: what a
peer *inside* the allow-list can do to the pool (amplify its specs into
gigabytes, send huge results, speak for another worker's identity, hang a
request forever, poison a batch, set the pool's reference spec, drown its
supervisor). As in ``test_network_hardening.py``, the pool runs in its own
process (:class:`tests.hostile.Victim`) and is judged from outside: its RSS
and peak RSS (``/proc/PID/status``), its CPU time (``/proc/PID/stat``), its
log, what it answers its peers, and what its public API returns
(``stepped_envs`` and ``collected`` events). Remote workers are
:class:`~tests.hostile.ScriptedWorker`s: they register as ``python -m
workers`` does and answer (or not) with real tensordicts of the test's
choosing. Keys: workers 0 and 1 are authorized (``key_dir`` in conftest.py).
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from typing import Any

import hostile
import msgpack
import pytest
import torch
import zmq
from hostile import Peer, ScriptedWorker, Victim, client_keys, wait_until

from tests.netns import free_port_base
from zmqpool.testing import CountingEnv

HOST = "127.0.0.1"
MB = 1 << 20

#: Victims wait long for registrations, and heartbeats never run out during a test.
QUIET = {"register_timeout_s": 60.0, "close_timeout_s": 1.0, "heartbeat_liveness": 120}


def victim_on(tmp_path, key_dir, port, *, remote_envs=1, config=None, **kwargs) -> Victim:
    """A pool bound on ``port`` with CURVE, listening (P, P+1, P+2) before this returns."""
    victim = Victim(
        tmp_path / "pool.log",
        remote_envs=remote_envs,
        bind=f"tcp://{HOST}:{port}",
        curve_keys=key_dir,
        config={**QUIET, **(config or {})},
        **kwargs,
    )
    try:
        victim.wait_listening([port, port + 1, port + 2], timeout_s=90)
    except BaseException:
        victim.stop()
        failed = victim.seen("construct_failed")
        if failed is not None:  # e.g. a PoolConfig field this zmqpool does not have
            raise AssertionError(
                f"the pool refused {config}: {failed['type']}: {failed['error']}"
            ) from None
        raise
    return victim


def worker(context, victim: Victim, port: int, key_dir, key: int, name: bytes) -> ScriptedWorker:
    return ScriptedWorker(context, victim.hello, HOST, port, client_keys(key_dir, key), name)


@contextlib.contextmanager
def key_0_holding_the_slot(tmp_path, key_dir, context, name: bytes):
    """A victim pool of one remote slot, constructed with a worker of key 0 in it.

    Yields ``(victim, port, worker, env)``.
    """
    port = free_port_base(HOST)
    with victim_on(tmp_path, key_dir, port) as victim:
        peer = worker(context, victim, port, key_dir, 0, name)
        [env] = welcomed(peer, victim)
        victim.wait("constructed", timeout_s=30)
        yield victim, port, peer, env


def welcomed(w: ScriptedWorker, victim: Victim, body=None, timeout_s: float = 60.0) -> list[int]:
    """``w`` registers until welcomed; its env slots (AssertionError otherwise)."""
    reply = w.register(body, timeout_s=timeout_s, until=lambda: victim.seen("construct_failed"))
    failed = victim.seen("construct_failed")
    assert reply is not None, (
        f"{w.identity!r} was not welcomed within {timeout_s} s; refusals {w.refusals[-2:]}; "
        f"construction: {failed}"
    )
    return w.envs


def reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (``clear_refs`` 5); False if not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def log_line(victim: Victim, *needles: str) -> str | None:
    """The first log line holding every one of ``needles``, or None."""
    for line in victim.log().splitlines():
        if all(n in line for n in needles):
            return line
    return None


# ---------------------------------------------------------------- replies of a real env


def reset_td(**kwargs) -> Any:
    return CountingEnv(**kwargs).reset()


def step_next(**kwargs) -> Any:
    """What a worker sends for a STEP: ``env.step(td)["next"]`` of a CountingEnv."""
    env = CountingEnv(**kwargs)
    td = env.reset()
    td["action"] = torch.tensor([0.5])
    return env.step(td)["next"]


def answer_commands(w: ScriptedWorker, count: int, timeout_s: float, **env_kwargs) -> list[str]:
    """Answer the next ``count`` commands as a CountingEnv (``env_kwargs``) would; their names."""
    seen = []
    for _ in range(count):
        command = w.command(timeout_s)
        assert command is not None, f"{w.identity!r} got no command within {timeout_s} s"
        seen.append(command["command"])
        td = reset_td(**env_kwargs) if command["command"] == "RESET" else step_next(**env_kwargs)
        w.answer(command, td)
    return seen


# ---------------------------------------------------------------- 5: spec amplification


ELEMENTS = 2**26  # float32: 256 MiB a tensor; torchrl builds low and high at full shape


def with_leaf(spec: Any, name: str, leaf: dict[str, Any]) -> Any:
    """A copy of spec data whose leaf ``name`` (wherever it is) is ``leaf``."""
    if isinstance(spec, dict):
        return {
            k: leaf
            if k == name and isinstance(v, dict) and "shape" in v
            else with_leaf(v, name, leaf)
            for k, v in spec.items()
        }
    if isinstance(spec, list):
        return [with_leaf(item, name, leaf) for item in spec]
    return spec


def amplified(spec: Any, elements: int = ELEMENTS) -> Any:
    """The finding's spec: an observation Bounded over ``elements`` float32, bounds broadcast."""

    def bound(value: float) -> dict[str, Any]:
        data = struct.pack("<f", value)
        return {"dtype": "float32", "shape": [1], "data": data, "expand": [elements]}

    leaf = {
        "class": "BoundedContinuous",
        "shape": [elements],
        "device": "cpu",
        "dtype": "float32",
        "low": bound(0.0),
        "high": bound(1.0),
    }
    return with_leaf(spec, "observation", leaf)


@pytest.mark.parametrize("pool_kind", ["mixed", "remote-only"])
def test_an_amplified_spec_costs_the_pool_nothing(tmp_path, key_dir, context, pool_kind):
    """Finding 5: a ~1.3 kB REGISTER declaring a 2**26-element Bounded spec (bounds broadcast).

    ``mixed``: a local env sets the reference, which the spec does not match:
    refused ("spec mismatch") before anything is built. ``remote-only`` (no ``remote_spec``):
    nothing to compare with, so ``max_remote_spec_bytes`` (256 MiB, counted as
    built: low + high + zero = 768 MiB here) must refuse it. Either way the
    peer gets a REFUSE and the pool's peak and settled RSS stay within 100 MB
    of what they were.
    """
    port = free_port_base(HOST)
    local = [{"env_id": 0}] if pool_kind == "mixed" else []
    with victim_on(tmp_path, key_dir, port, local=local) as victim:
        hello = victim.hello
        body = hello.register_body([amplified(hello.spec)])
        size = len(hello.header("REGISTER", body))
        # No wait for the local env: the remote side binds only once the local envs are in.
        before = hostile.settled_rss(victim.pid)
        peak_reset = reset_peak(victim.pid)
        peak_before = hostile.peak_rss_bytes(victim.pid)
        attacker = worker(context, victim, port, key_dir, 1, b"amplifier")
        t0 = time.monotonic()
        reply = attacker.register(body, timeout_s=60, retry_s=20, give_up_if_refused=True)
        seconds = time.monotonic() - t0
        after = hostile.settled_rss(victim.pid)
        peak = hostile.peak_rss_bytes(victim.pid)
        refusals = list(attacker.refusals)
        attacker.close()
    growth, peak_growth = after - before, peak - max(peak_before, before)
    figures = (
        f"{pool_kind} pool, REGISTER of {size} bytes declaring {ELEMENTS} float32: RSS "
        f"{before / MB:.0f} -> {after / MB:.0f} MB (+{growth / MB:.0f} MB), peak +"
        f"{peak_growth / MB:.0f} MB (VmHWM {'reset' if peak_reset else 'not reset'} first), "
        f"answered in {seconds:.1f} s: {'WELCOME' if reply else 'REFUSE ' + str(refusals)[:200]}"
    )
    print(figures)
    assert reply is None and refusals, f"the amplified spec was not refused: {figures}"
    why = "spec mismatch" if local else "would cost more than"  # which check refused it
    assert all(why in refusal for refusal in refusals), figures
    assert growth < 100 * MB and peak_growth < 100 * MB, figures


def test_registering_again_and_again_does_not_build_the_specs_again(tmp_path, key_dir, context):
    """Session 53's audit: each REGISTER with a new incarnation is a rejoin, and the pool
    built its specs (and their zero) again from ~1.2 kB: 479 of them, 18.8 s of CPU.

    A lazy pool's remote slot (nothing to compare with) is taken with an observation
    of 2**24 float32 (64 MiB zeroed per build); 150 REGISTERs with new incarnations
    follow, read while the pool steps its local env 20 times: each is welcomed, and
    the pool's CPU for all of it stays under 2 s.
    """
    port = free_port_base(HOST)
    leaf = {"class": "UnboundedContinuous", "shape": [2**24], "device": "cpu", "dtype": "float32"}
    with victim_on(tmp_path, key_dir, port, local=[{"env_id": 0}], stack="lazy") as victim:
        hello = victim.hello
        spec = with_leaf(hello.spec, "observation", leaf)
        rejoiner = worker(context, victim, port, key_dir, 1, b"rejoiner")
        assert rejoiner.register(hello.register_body([spec]), timeout_s=60) is not None
        victim.wait("constructed", timeout_s=60)
        cpu_before = hostile.cpu_seconds(victim.pid)
        for _ in range(150):  # within the per-key REGISTER burst (200)
            rejoiner.dealer.send(hello.header("REGISTER", hello.register_body([spec])))
        victim.command('step-envs {"envs": [0], "timeout": 30, "rounds": 20}')
        rounds = victim.wait("stepped_envs", timeout_s=120)["rounds"]
        cpu = hostile.cpu_seconds(victim.pid) - cpu_before
        replies = []
        while len(replies) < 150 and (frame := rejoiner.dealer.reply(10.0)) is not None:
            replies.append(hello.decode(frame)["command"])
        rejoiner.close()
    assert all("0" in r["results"] and not r["errors"] for r in rounds), rounds
    assert replies == ["WELCOME"] * 150, f"{len(replies)} replies: {sorted(set(replies))}"
    assert cpu < 2.0, f"150 REGISTERs of the same specs cost the pool {cpu:.1f} s of CPU"


_FOUR_FLOATS = {"dtype": "float32", "shape": [4]}
#: An observation leaf of another class than CountingEnv's (Unbounded): they do not stack.
BOUNDED_4 = {
    "class": "BoundedContinuous",
    "shape": [4],
    "device": "cpu",
    "dtype": "float32",
    "low": {**_FOUR_FLOATS, "data": b"\0" * 16},
    "high": {**_FOUR_FLOATS, "data": b"\0\0\x80\x3f" * 4},
}


def test_remote_specs_that_do_not_stack_are_refused_not_the_pool(tmp_path, key_dir, context):
    """Session 53's audit: with ``stack="lazy"`` nothing held a remote worker's specs to the
    others', and once one with an observation of another class took the slot, stacking
    the pool's specs failed its whole construction. That peer is now refused, and an
    honest worker takes the slot.
    """
    port = free_port_base(HOST)
    leaf = BOUNDED_4
    with victim_on(tmp_path, key_dir, port, local=[{"env_id": 0}], stack="lazy") as victim:
        hello = victim.hello
        odd = worker(context, victim, port, key_dir, 1, b"odd-one")
        body = hello.register_body([with_leaf(hello.spec, "observation", leaf)])
        welcome = odd.register(body, timeout_s=60, give_up_if_refused=True)
        refusals = list(odd.refusals)
        odd.close()
        honest = worker(context, victim, port, key_dir, 0, b"honest")
        assert honest.register(timeout_s=60) is not None, (refusals, honest.refusals[-2:])
        built = victim.wait("constructed", "construct_failed", timeout_s=60)
        honest.close()
    assert welcome is None and "do not stack with env 0" in refusals[-1], refusals
    assert built["event"] == "constructed", built


def test_a_first_remote_workers_own_envs_must_stack_too(tmp_path, key_dir, context):
    """A remote-only lazy pool: the first worker has no other env to be held to, so its
    own envs' specs are stacked with each other: two that do not stack are refused."""
    port = free_port_base(HOST)
    with victim_on(tmp_path, key_dir, port, remote_envs=2, stack="lazy") as victim:
        hello = victim.hello
        odd = worker(context, victim, port, key_dir, 1, b"odd-pair")
        body = hello.register_body([hello.spec, with_leaf(hello.spec, "observation", BOUNDED_4)])
        welcome = odd.register(body, timeout_s=60, give_up_if_refused=True)
        refusals = list(odd.refusals)
        odd.close()
        honest = worker(context, victim, port, key_dir, 0, b"honest-pair")
        assert honest.register(hello.register_body([hello.spec] * 2), timeout_s=60) is not None
        built = victim.wait("constructed", "construct_failed", timeout_s=60)
        honest.close()
    assert welcome is None and "do not stack with its env" in refusals[-1], refusals
    assert built["event"] == "constructed", built


# ---------------------------------------------------------------- 6: large results frames


def test_large_results_frames_from_an_authorized_key(tmp_path, key_dir, context):
    """Finding 6: a 400 MiB single-frame result, then 400 MiB in frames of a piece (bad tokens).

    A remote-only pool without ``remote_spec``: its results port takes frames of
    a piece (512 KiB: 1/128 of ``max_remote_frame_bytes``; larger ones come cut,
    wire: pieces), so libzmq refuses the 400 MiB frame before allocating it: the
    peak RSS must stay within 100 MB. The 800 frames of 512 KiB are each within
    the port's limit: libzmq holds the whole message before the
    pool can read it (the transient is reported), but once it is dropped
    nothing may hold it: the RSS, once glibc is asked to hand back what it
    keeps for reuse (``malloc_trim``), must come back within 100 MB of the
    baseline. (Untrimmed, glibc keeps ~250-360 MB of the I/O thread's freed
    buffers for reuse, measured: reported, bounded, not the pool's.) Each message
    goes out while a step is in flight; the worker's honest reply comes after
    it on the same connection, so once the step is back the pool has dealt
    with the message.
    """
    port = free_port_base(HOST)
    figures: dict[str, str] = {}
    with victim_on(tmp_path, key_dir, port) as victim:
        sender = worker(context, victim, port, key_dir, 0, b"heavy")
        [env] = welcomed(sender, victim)
        victim.wait("constructed", timeout_s=30)
        answers: dict[str, Any] = {}
        growth: dict[str, tuple[int, int]] = {}
        for name in ("400 MiB x 1", "512 KiB x 800"):
            before = hostile.settled_rss(victim.pid)
            reset_peak(victim.pid)
            peak_before = hostile.peak_rss_bytes(victim.pid)
            victim.command(f'step-envs {{"envs": [{env}], "timeout": 60}}')
            command = sender.command(30)
            assert command is not None and command["command"] == "STEP", command
            bad = sender.result_header(env, command["seq"], token=b"not-the-token")
            if name == "400 MiB x 1":
                frames = [bad, bytearray(400 * MB)]
            else:
                frames = [bad, *(bytearray(MB // 2) for _ in range(800))]
            t0 = time.monotonic()
            sender.send_result(frames, copy=False)
            del frames
            sender.answer(command, step_next())
            answers[name] = victim.wait("stepped_envs", timeout_s=60)["rounds"][0]
            seconds = time.monotonic() - t0
            after = hostile.settled_rss(victim.pid, timeout_s=5)
            peak = hostile.peak_rss_bytes(victim.pid)
            victim.command("malloc-trim")
            victim.wait("trimmed", timeout_s=10)
            trimmed = hostile.settled_rss(victim.pid)
            growth[name] = (trimmed - before, peak - max(peak_before, before))
            figures[name] = (
                f"{name}: settled +{(after - before) / MB:.0f} MB (+{(trimmed - before) / MB:.0f} "
                f"MB after malloc_trim), peak +{(peak - max(peak_before, before)) / MB:.0f} MB, "
                f"step back in {seconds:.1f} s"
            )
        sender.close()
    note = "; ".join(figures.values())
    print(note)
    for name, rounds in answers.items():
        assert str(env) in rounds["results"], f"{name}: the honest reply was lost: {rounds}"
    settled, peak = growth["400 MiB x 1"]
    assert peak < 100 * MB and settled < 100 * MB, f"one 400 MiB frame was taken in: {note}"
    assert growth["512 KiB x 800"][0] < 100 * MB, f"the pool kept 800 frames of 512 KiB: {note}"


# ---------------------------------------------------------------- 7: identities and keys


def test_another_keys_heartbeats_do_not_keep_a_silent_worker_alive(tmp_path, key_dir, context):
    """Finding 7a: heartbeats from ``<id>!hb`` count only with ``<id>``'s own key.

    Worker A (key 0) registers and goes silent; peer B (key 1) sends a
    HEARTBEAT every 0.2 s from a DEALER named ``A!hb``, as A's heartbeat
    thread would. A step is in flight on A's env. A must still be set aside
    after the heartbeat timeout (2 s): an honest replacement (key 0) then gets
    the slot (WELCOME) and answers the step, which comes back as a restart.
    """
    port = free_port_base(HOST)
    config = {"heartbeat_interval_s": 0.5, "heartbeat_liveness": 4}
    with victim_on(tmp_path, key_dir, port, config=config) as victim:
        silent = worker(context, victim, port, key_dir, 0, b"quiet-worker")
        [env] = welcomed(silent, victim)
        victim.wait("constructed", timeout_s=30)
        spoofer = Peer(
            context,
            f"tcp://{HOST}:{port}",
            curve=client_keys(key_dir, 1),
            identity=b"quiet-worker!hb",
        )
        replacement = worker(context, victim, port, key_dir, 0, b"replacement")
        victim.command(f'step-envs {{"envs": [{env}], "timeout": 20}}')
        t0 = time.monotonic()
        assert silent.command(10) is not None  # the step reached A, which never answers
        body = victim.hello.register_body()
        spoofs, took_over = 0, None
        while time.monotonic() - t0 < 12.0:
            spoofer.send(victim.hello.header("HEARTBEAT"))
            spoofs += 1
            if replacement.register(body, timeout_s=0.2, retry_s=0.2) is not None:
                took_over = time.monotonic() - t0
                break
        vacated = log_line(victim, "quiet-worker", "silent")  # while the spoofing went on
        if took_over is not None:
            answer_commands(replacement, 1, 10)
        rounds = victim.wait("stepped_envs", timeout_s=30)["rounds"][0]
        for peer in (silent, replacement):
            peer.close()
        spoofer.close()
    print(f"7a: slot taken over after {took_over} s, {spoofs} spoofed heartbeats; log: {vacated}")
    assert took_over is not None and took_over < 2.0 + 3.0, (
        f"with key 1 sending {spoofs} heartbeats as 'quiet-worker!hb', the silent worker's slot "
        f"was {f'taken after {took_over:.1f} s' if took_over else 'still held after 12 s'} "
        f"(heartbeat timeout 2 s); the pool had logged: {vacated}"
    )
    result = rounds["results"].get(str(env))
    assert result is not None and result["restarted"], rounds


def test_one_key_cannot_take_every_slot(tmp_path, key_dir, context):
    """Finding 7b: ``max_slots_per_key=1``, two remote slots; one key registers twice.

    The second identity of key 0 gets no slot: over the quota while its key's first
    worker is live, it is taken for that worker's replacement and gets no answer (it
    would be refused after two heartbeat timeouts); key 1 takes the other slot.
    """
    port = free_port_base(HOST)
    config = {"max_slots_per_key": 1}
    with victim_on(tmp_path, key_dir, port, remote_envs=2, config=config) as victim:
        first = worker(context, victim, port, key_dir, 0, b"greedy-1")
        second = worker(context, victim, port, key_dir, 0, b"greedy-2")
        other = worker(context, victim, port, key_dir, 1, b"other-key")
        got_first = first.register(timeout_s=60, until=lambda: victim.seen("construct_failed"))
        got_second = second.register(timeout_s=5, retry_s=1, give_up_if_refused=True)
        got_other = other.register(timeout_s=30, until=lambda: victim.seen("construct_failed"))
        built = victim.wait("constructed", "construct_failed", timeout_s=30)
        for peer in (first, second, other):
            peer.close()
    print(
        f"7b: second identity {'welcomed ' + str(second.envs) if got_second else 'refused'}:"
        f" {second.refusals[:1]}; construction {built['event']}"
    )
    assert got_first is not None, f"the first identity of key 0 was not welcomed: {built}"
    assert got_second is None and not second.envs, (
        f"a second identity of the same key took a second slot (envs {second.envs}); "
        f"max_slots_per_key=1; construction: {built}"
    )
    assert got_other is not None and built["event"] == "constructed", built


def test_a_revoked_key_is_dropped_and_refused(tmp_path, key_dir, context):
    """Finding 7c: ``pool.revoke_worker_key(path)`` vacates the key's slots, drops its results.

    A (key 0) holds the slot; a step is in flight on it; the key is revoked,
    then A answers the step with its own token: that reply must not come back.
    A's REGISTER on its open connection is refused, and a new connection with
    key 0 gets no WELCOME. Key 1 then takes the slot; the step comes back as a
    restart, answered by key 1's worker.
    """
    key_file = key_dir / "authorized" / "worker-0.key"
    with key_0_holding_the_slot(tmp_path, key_dir, context, b"to-revoke") as held:
        victim, port, revoked, env = held
        victim.command(f'send-envs {{"envs": [{env}]}}')
        victim.wait("sent", "send_failed", timeout_s=10)
        command = revoked.command(10)
        assert command is not None and command["command"] == "STEP", command
        assert revoked.results_connected(10), "the results PUSH never finished its handshake"
        victim.command(f"revoke {key_file}")
        verdict = victim.wait("revoked", "revoke_failed", timeout_s=10)
        assert verdict["event"] == "revoked" and verdict["envs"] == [env], verdict
        revoked.answer(command, step_next())  # with its (now void) token
        revoked.dealer.send(victim.hello.header("REGISTER", victim.hello.register_body()))
        fresh = worker(context, victim, port, key_dir, 0, b"to-revoke-again")
        fresh.dealer.send(victim.hello.header("REGISTER", victim.hello.register_body()))
        victim.command(f'collect-envs {{"envs": [{env}], "timeout": 3, "fresh": true}}')
        late = victim.wait("collected", timeout_s=20)
        old_answers = [victim.hello.decode(f)["command"] for f in revoked.dealer.replies()]
        new_answers = [victim.hello.decode(f)["command"] for f in fresh.dealer.replies()]
        honest = worker(context, victim, port, key_dir, 1, b"after-revoke")
        victim.command(f'collect-envs {{"envs": [{env}], "timeout": 20, "fresh": true}}')
        welcome = honest.register(timeout_s=15)
        if welcome is not None:
            answer_commands(honest, 1, 10)
        rescued = victim.wait("collected", timeout_s=30)
        for peer in (revoked, fresh, honest):
            peer.close()
    print(
        f"7c: {verdict}; after revoking: {late}; old connection {old_answers}, new {new_answers}"
        f"; key 1 then: {rescued}"
    )
    assert not late["results"], f"a reply from the revoked key was delivered: {late}"
    assert "REFUSE" in old_answers and "WELCOME" not in old_answers, old_answers
    assert "WELCOME" not in new_answers, f"a new connection with the revoked key: {new_answers}"
    result = rescued["results"].get(str(env))
    assert welcome is not None and result is not None and result["restarted"], rescued


def test_a_revoked_key_stays_refused_when_the_pool_starts_again(tmp_path, key_dir, context):
    """A key revoked, then ``close()`` and a start again (a Collector's close and the next
    call): the key is refused still, though ``authorized/`` lists it (remote audit: the
    revocation lived in the closed runtime, and the revoked worker was taken back).
    """
    key_file = key_dir / "authorized" / "worker-0.key"
    with key_0_holding_the_slot(tmp_path, key_dir, context, b"before") as held:
        victim, port, first, env = held
        victim.command(f"revoke {key_file}")
        assert victim.wait("revoked", "revoke_failed", timeout_s=10)["event"] == "revoked"
        first.close()
        victim.command("close-pool")
        victim.wait("pool_closed", timeout_s=30)
        victim.command(f'send-envs {{"envs": [{env}]}}')  # starts it again: waits for a worker
        victim.wait_listening([port, port + 1, port + 2], timeout_s=60)
        revoked = worker(context, victim, port, key_dir, 0, b"revoked-again")
        try:
            welcome = revoked.register(timeout_s=10, give_up_if_refused=True)
        except zmq.Again:  # no connection in 5 s: the ZAP handler refused its handshake
            welcome = None
        revoked.close()
        assert welcome is None, f"the revoked key was welcomed back: {welcome}"
        honest = worker(context, victim, port, key_dir, 1, b"honest")
        assert welcomed(honest, victim) == [env]
        sent = victim.wait("sent", "send_failed", timeout_s=30)
        honest.close()
    assert sent["event"] == "sent", sent


# ---------------------------------------------------------------- 8: remote step deadlines


@pytest.mark.parametrize("timeout_field", ["step_timeout_s", "remote_step_timeout_s"])
def test_a_remote_worker_that_never_answers_is_given_up_on(
    tmp_path, key_dir, context, timeout_field
):
    """Finding 8: ``step_timeout_s`` holds remote workers too, and without it
    ``remote_step_timeout_s`` (by default 300 s: session 53's audit found a mute
    remote worker held a sync step for ever with no step_timeout_s).

    Two remote slots, each held by a worker that takes its step and never
    answers (a timeout of 1 s, ``rejoin_timeout_s=2``). Env A: nobody
    comes; its recv must raise ``EnvLostError`` within 6 s. Env B: an honest
    worker registers for it (``slots=[B]``) once it is free; its step must
    come back as a restart (a reset-based truncation).
    """
    port = free_port_base(HOST)
    config = {timeout_field: 1.0, "rejoin_timeout_s": 2.0, "heartbeat_interval_s": 0.25}
    config["heartbeat_liveness"] = 400
    with victim_on(tmp_path, key_dir, port, remote_envs=2, config=config) as victim:
        mute_a = worker(context, victim, port, key_dir, 0, b"mute-a")
        mute_b = worker(context, victim, port, key_dir, 1, b"mute-b")
        [env_a] = welcomed(mute_a, victim)
        [env_b] = welcomed(mute_b, victim)
        victim.wait("constructed", timeout_s=30)
        victim.command(f'step-envs {{"envs": [{env_a}, {env_b}], "timeout": 12}}')
        t0 = time.monotonic()
        assert mute_a.command(10) is not None and mute_b.command(10) is not None
        rescuer = worker(context, victim, port, key_dir, 0, b"rescuer")
        body = victim.hello.register_body(slots=[env_b])
        rescued = rescuer.register(body, timeout_s=10, retry_s=0.2)
        joined = time.monotonic() - t0
        if rescued is not None:
            answer_commands(rescuer, 1, 10)
        rounds = victim.wait("stepped_envs", timeout_s=30)["rounds"][0]
        for peer in (mute_a, mute_b, rescuer):
            peer.close()
    lost = [e for e in rounds["errors"] if env_a in (e["envs"] or [])]
    print(f"8: {rounds}; rescuer welcomed after {joined:.1f} s: {rescued is not None}")
    assert lost and lost[0]["type"] == "EnvLostError" and lost[0]["seconds"] < 6.0, (
        f"env {env_a}, whose remote worker never answered (step_timeout_s=1, "
        f"rejoin_timeout_s=2): {lost or 'no error'} after {rounds['seconds']} s; "
        f"all errors {rounds['errors']}"
    )
    result = rounds["results"].get(str(env_b))
    joining = f"welcomed after {joined:.1f} s" if rescued else f"refused: {rescuer.refusals[-1:]}"
    assert rescued is not None and result is not None and result["restarted"], (
        f"env {env_b}: a worker registering for it after the deadline was {joining}"
        f"; its step: {result}; errors {rounds['errors']}"
    )


# ---------------------------------------------------------------- 9: one bad reply


def test_one_bad_reply_costs_only_its_own_env(tmp_path, key_dir, context):
    """Finding 9: a remote reply of shape [5] (spec: [4]) beside an honest local env.

    Five rounds of step and recv (one result at a time) on a mixed pool: every
    round, the local env's result comes back and the remote env's is an
    ``EnvError`` naming it. Then one reply whose header carries a stacked
    non-tensor of 100,000 items: the pool must spend under 0.3 s of CPU on it.
    """
    port = free_port_base(HOST)
    rounds_count, items = 5, 100_000
    with victim_on(tmp_path, key_dir, port, local=[{"env_id": 0}]) as victim:
        bad = worker(context, victim, port, key_dir, 0, b"wrong-shape")
        [env] = welcomed(bad, victim)
        victim.wait("constructed", timeout_s=30)
        victim.command(f'step-envs {{"envs": [0, {env}], "timeout": 8, "rounds": {rounds_count}}}')
        served = 0
        for _ in range(rounds_count):
            command = bad.command(10)
            if command is None:
                break
            bad.answer(command, step_next(obs_shape=(5,)))
            served += 1
        rounds = victim.wait("stepped_envs", timeout_s=60)["rounds"]
        # One message of 100k non-tensor items, answering a real step.
        victim.command(f'step-envs {{"envs": [{env}], "timeout": 10}}')
        command = bad.command(10)
        assert command is not None
        frames = bloated_nontensor(bad, command, items)
        cpu0 = hostile.cpu_seconds(victim.pid)
        bad.send_result(frames)
        heavy = victim.wait("stepped_envs", timeout_s=60)["rounds"][0]
        cpu = hostile.cpu_seconds(victim.pid) - cpu0
        bad.close()
    summary = [
        f"round {i}: local {'ok' if '0' in r['results'] else 'LOST'}, remote "
        + (
            ", ".join(f"{e['type']}(envs={e['envs']})" for e in r["errors"])
            or str(r["results"].get(str(env)))
        )
        + (f", send: {r['send_error']}" if "send_error" in r else "")
        for i, r in enumerate(rounds)
    ]
    good = [
        "0" in r["results"]
        and any(e["type"] == "EnvError" and e["envs"] == [env] for e in r["errors"])
        for r in rounds
    ]
    print("9: " + "; ".join(summary))
    print(f"9: {items} stacked non-tensor items: {cpu:.2f} s of the pool's CPU; {heavy}")
    problems = []
    if len(rounds) != rounds_count or not all(good):
        problems.append(
            f"{sum(good)} of {rounds_count} rounds kept the local env's result and named env "
            f"{env} alone ({served} bad replies sent): " + "; ".join(summary)
        )
    if cpu >= 0.3:
        problems.append(
            f"one reply carrying {items} stacked non-tensor items cost the pool {cpu:.2f} s "
            f"of CPU (bound 0.3 s); its step: {heavy}"
        )
    assert not problems, "\n".join(problems)


def bloated_nontensor(w: ScriptedWorker, command: dict[str, Any], items: int) -> list[Any]:
    """A reply to ``command`` whose ``extra/x`` is a NonTensorStack of ``items`` small ints.

    Encoded small (3 items) by the zmqpool this process imported, then the
    header is rewritten: the ``extra`` branch's batch size and the values
    grow to ``items``; the tensor frames stay as they are.
    """
    import msgpack
    from tensordict import NonTensorStack, TensorDict

    td = step_next()
    extra = TensorDict({}, [3])
    extra["x"] = NonTensorStack(0, 0, 0)
    td["extra"] = extra
    from zmqpool.wire import Command, Header, encode_message

    frames = encode_message(
        Header(Command.RESULT, command["env"], command["seq"], w.token),
        [hostile._encoder().encode(td)],
    )
    fields = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    body = fields[6]
    for layout in body["L"].values():
        layout["s"] = [
            [key, [items] if list(batch) == [3] else batch] for key, batch in layout["s"]
        ]
    body["nt"] = [[[0] * items]]
    frames[0] = msgpack.packb(fields, use_bin_type=True)
    w.encoder = None  # the layout it announced is not the one the pool saw
    return frames


# ---------------------------------------------------------------- batches


def obs_head(td: Any) -> list[float]:
    return td["observation"][:2].tolist()


def test_a_workers_commands_share_a_message_and_a_bad_batch_costs_only_itself(
    tmp_path, key_dir, context
):
    """One message per worker each way, on the wire, and what a worker's bad batches cost.

    A scripted worker hosting both remote envs gets one BATCH for a step of
    both (not two messages) and answers with one BATCH: both results arrive.
    Once the action's layout is announced, a step of both is one COMMANDS
    (rows joined).
    Then, for one step of both: a batch whose sizes do not add up, one with
    another token, one nesting a batch, and one with a good result for the
    first env beside a truncated header for the second. Only the good one
    counts: the first env's result is the honest one, the second env's is the
    one sent alone afterwards (a forged one would show its observation, 666).
    Then rows joined: one RESULTS answers both envs, and one whose joined frame
    is a byte short answers both requests with the error, each naming its env.
    """
    port = free_port_base(HOST)
    with victim_on(tmp_path, key_dir, port, remote_envs=2) as victim:
        w = worker(context, victim, port, key_dir, 0, b"batcher")
        body = w.hello.register_body([w.hello.spec, w.hello.spec], batches=True)
        a, b = welcomed(w, victim, body)
        victim.wait("constructed", timeout_s=30)

        victim.command(f'send-envs {{"envs": [{a}, {b}]}}')
        commands = [w.command(10), w.command(10)]
        assert None not in commands, "the pool's commands did not arrive"
        # The first step announces the action's layout: its rows cannot join yet.
        assert w.batches == [("BATCH", [a, b])], f"not one message for both envs: {w.batches}"
        honest = [w.answer_frames(c, step_next(env_id=c["env"])) for c in commands]
        w.send_result(w.batch_frames(honest, env=a))
        victim.command(f'collect-envs {{"envs": [{a}, {b}], "timeout": 10}}')
        first = victim.wait("collected", timeout_s=30)
        assert sorted(first["results"]) == sorted([str(a), str(b)]), first
        assert first["results"][str(b)]["head"] == [float(b), 1.0], first

        victim.command(f'send-envs {{"envs": [{a}, {b}]}}')
        commands = [w.command(10), w.command(10)]
        # The layout announced, the rows of one command join: one COMMANDS.
        assert None not in commands and w.batches[-1] == ("COMMANDS", [a, b]), w.batches
        forged = [w.answer_frames(c, step_next(env_id=666)) for c in commands]
        joined = w.batch_frames(forged, env=a)
        body = msgpack.unpackb(joined[0], raw=False)[6]
        bad_sizes = msgpack.unpackb(joined[0], raw=False)
        bad_sizes[6] = {**body, "len": [*body["len"][:-1], body["len"][-1] + 1]}
        w.send_result([msgpack.packb(bad_sizes, use_bin_type=True), joined[1]])
        w.send_result(w.batch_frames(forged, env=a, token=b"\0" * 16))
        w.send_result(w.batch_frames([w.batch_frames(forged, env=a)], env=a))
        good_a = w.answer_frames(commands[0], step_next(env_id=a))
        truncated_b = [forged[1][0][:5], *forged[1][1:]]
        w.send_result(w.batch_frames([good_a, truncated_b], env=a))
        w.answer(commands[1], step_next(env_id=b))
        victim.command(f'collect-envs {{"envs": [{a}, {b}], "timeout": 10}}')
        second = victim.wait("collected", timeout_s=30)

        # Rows joined: one RESULTS answers both; then one whose joined frame is a byte
        # short answers both requests with the error, naming each env.
        victim.command(f'send-envs {{"envs": [{a}, {b}]}}')
        commands = [w.command(10), w.command(10)]
        assert None not in commands and w.batches[-1] == ("COMMANDS", [a, b]), w.batches
        w.send_result(w.results_frames(commands, [step_next(env_id=e) for e in (a, b)]))
        victim.command(f'collect-envs {{"envs": [{a}, {b}], "timeout": 10}}')
        joined = victim.wait("collected", timeout_s=30)
        victim.command(f'send-envs {{"envs": [{a}, {b}]}}')
        commands = [w.command(10), w.command(10)]
        assert None not in commands
        frames = w.results_frames(commands, [step_next(env_id=e) for e in (a, b)])
        w.send_result([frames[0], frames[1][:-1], *frames[2:]])
        victim.command(f'collect-envs {{"envs": [{a}, {b}], "timeout": 10}}')
        broken = victim.wait("collected", timeout_s=30)
        w.close()
    heads = {env: r["head"] for env, r in second["results"].items()}
    assert heads == {str(a): [float(a), 1.0], str(b): [float(b), 1.0]}, second
    heads = {env: r["head"] for env, r in joined["results"].items()}
    assert heads == {str(a): [float(a), 1.0], str(b): [float(b), 1.0]}, joined
    assert not broken["results"], broken
    named = sorted(e for err in broken["errors"] for e in err["envs"])
    assert named == [a, b] and all("malformed reply" in e["error"] for e in broken["errors"])


# ---------------------------------------------------------------- 10: the reference spec


def test_a_peer_registering_first_does_not_set_the_reference_spec(tmp_path, key_dir, context):
    """Finding 10: a hostile authorized peer REGISTERs (another spec) from before the pool starts.

    It keeps retrying every 50 ms from a thread. Construction must still
    succeed: the hostile peer refused, never welcomed; the local env in (it
    steps); the honest remote worker welcomed.
    """
    port = free_port_base(HOST)
    stop = threading.Event()
    answers: list[str] = []
    hostile_ctx = zmq.Context()

    def early_bird(hello) -> None:
        peer = Peer(
            hostile_ctx,
            f"tcp://{HOST}:{port}",
            curve=client_keys(key_dir, 1),
            identity=b"early-bird",
            reconnect_ivl_ms=50,
        )
        body = hello.register_body([hostile.with_observation_shape(hello.spec, [7])])
        frame = hello.header("REGISTER", body)
        try:
            while not stop.is_set():
                with contextlib.suppress(zmq.Again):  # not connected: the pool has not bound
                    peer.sock.send(frame, zmq.NOBLOCK)
                while peer.sock.poll(50):
                    answers.append(hello.decode(peer.sock.recv_multipart()[0])["command"])
        finally:
            peer.close()

    # The hostile peer needs the victim's protocol before the victim exists: the
    # test process's zmqpool is the victim's (same PYTHONPATH).
    thread = threading.Thread(target=early_bird, args=(local_hello(),), daemon=True)
    thread.start()
    try:
        with Victim(
            tmp_path / "pool.log",
            local=[{"env_id": 0}],
            remote_envs=1,
            bind=f"tcp://{HOST}:{port}",
            curve_keys=key_dir,
            config=QUIET,
        ) as victim:
            wait_until(
                lambda: victim.seen("construct_failed") or len(answers) >= 1,
                90,
                "the pool to answer the early peer (or to fail)",
            )
            honest = worker(context, victim, port, key_dir, 0, b"honest-remote")
            got = honest.register(timeout_s=60, until=lambda: victim.seen("construct_failed"))
            result = victim.wait("constructed", "construct_failed", timeout_s=30)
            stepped = None
            if result["event"] == "constructed":
                victim.command(f'step-envs {{"envs": [0, {honest.envs[0]}], "timeout": 10}}')
                answer_commands(honest, 1, 10)
                stepped = victim.wait("stepped_envs", timeout_s=30)["rounds"][0]
            honest.close()
    finally:
        stop.set()
        thread.join(timeout=5)
        hostile_ctx.destroy(linger=0)
    print(f"10: {result['event']}, hostile peer answered {sorted(set(answers))}; step {stepped}")
    assert result["event"] == "constructed", (
        f"with a hostile peer registering another spec from before the pool started, "
        f"construction raised {result.get('type')}: {result.get('error', '')[:300]} "
        f"(the hostile peer was answered {sorted(set(answers))})"
    )
    assert "WELCOME" not in answers and "REFUSE" in answers, answers
    assert got is not None and stepped is not None, stepped
    assert stepped["results"].get("0", {}).get("head") == [0.0, 1.0], stepped


def local_hello() -> hostile.Hello:
    """What a victim would say of its zmqpool, from this process's zmqpool."""
    import base64

    import msgpack

    from zmqpool.specs import spec_to_data
    from zmqpool.wire import PROTOCOL_VERSION, Command

    spec = base64.b64encode(msgpack.packb(spec_to_data(CountingEnv().specs), use_bin_type=True))
    commands = {c.name: int(c) for c in Command}
    event = {"version": PROTOCOL_VERSION, "commands": commands, "spec": spec.decode()}
    return hostile.Hello.from_event(event)


# ---------------------------------------------------------------- 14: liveness under a flood


def test_a_flood_of_control_messages_does_not_switch_off_hang_detection(tmp_path, key_dir, context):
    """Finding 14: > 256 control messages queued per poll must not stop the supervisor.

    A local env hangs in its first step (``FaultyEnv``, ``step_timeout_s=1``)
    while an authorized peer floods the remote ROUTER with junk HEARTBEATs
    from threads, as fast as it can (each poll then finds more than 256
    queued). The hang must still be seen: the step comes back as a restart
    within 10 s.
    """
    port = free_port_base(HOST)
    config = {"step_timeout_s": 1.0}
    local = [{"env_id": 0, "fault": "hang", "fault_at": 1}]
    with victim_on(
        tmp_path,
        key_dir,
        port,
        remote_envs=0,
        local=local,
        env="zmqpool.testing:FaultyEnv",
        config=config,
    ) as victim:
        victim.wait("constructed", timeout_s=60)
        stop = threading.Event()
        sent = [0, 0]

        def flood(slot: int) -> None:
            peer = Peer(
                context,
                f"tcp://{HOST}:{port}",
                curve=client_keys(key_dir, slot),
                identity=f"flooder-{slot}".encode(),
            )
            junk = victim.hello.header("HEARTBEAT")
            try:
                while not stop.is_set():
                    try:
                        peer.sock.send(junk, zmq.NOBLOCK)
                        sent[slot] += 1
                    except zmq.Again:
                        time.sleep(0.0005)
            finally:
                peer.close()

        floods = [threading.Thread(target=flood, args=(i,), daemon=True) for i in (0, 1)]
        for thread in floods:
            thread.start()
        try:
            wait_until(lambda: sum(sent) > 5000, 20, "the flood to start")
            t0 = time.monotonic()
            victim.command('step-envs {"envs": [0], "timeout": 15}')
            rounds = victim.wait("stepped_envs", timeout_s=40)["rounds"][0]
            seconds = time.monotonic() - t0
            flooded = sum(sent)
        finally:
            stop.set()
            for thread in floods:
                thread.join(timeout=5)
    result = rounds["results"].get("0")
    rate = flooded / max(seconds, 1e-3)
    print(f"14: {flooded} junk messages ({rate:.0f}/s); step {rounds} after {seconds:.1f} s")
    assert result is not None and result["restarted"] and result["seconds"] < 10.0, (
        f"a local env hung (step_timeout_s=1) under a flood of {flooded} junk control "
        f"messages ({rate:.0f}/s): after {seconds:.1f} s its step gave {result or rounds}"
    )
