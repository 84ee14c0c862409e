"""Workers on another "machine" (a network namespace) over TCP with CURVE: refusals, rejoins.

The mixed local+remote pool also runs every test of test_pool_api.py and
test_stress.py (the ``pool`` fixture's ``mixed`` parameter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import torch
import zmq
from tensordict import TensorDict
from torchrl.envs import SerialEnv
from torchrl.envs.utils import step_mdp

from tests import warm
from tests.conftest import start_remote_worker, stop
from tests.netns import free_port_base
from zmqpool import EnvLostError, PoolConfig, RegistrationError, ZMQAsyncEnvPool
from zmqpool.arguments import public_key_of
from zmqpool.limits import remote_piece_bytes
from zmqpool.security import ClientKeys, make_client
from zmqpool.testing import CountingEnv
from zmqpool.wire import Command

BEATS = PoolConfig(
    register_timeout_s=90.0,
    close_timeout_s=2.0,
    heartbeat_interval_s=0.2,
    heartbeat_liveness=5,
    rejoin_timeout_s=30.0,
)
FAST_BEATS = ("--heartbeat-interval", "0.2")


def curve_admissions(caplog) -> list[str]:
    """The CURVE handshakes the pool's ZAP handler allowed (pyzmq's zmq.auth debug log)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("ALLOWED (CURVE)")]


def remote_pool(host, port, keys, config=BEATS, **kwargs) -> ZMQAsyncEnvPool:
    return ZMQAsyncEnvPool(
        [],
        remote_envs=kwargs.pop("remote_envs", 1),
        bind=f"tcp://{host.pool_ip}:{port}",
        curve_keys=keys,
        config=config,
        **kwargs,
    )


def kill_host(worker: warm.WarmProcess) -> None:
    """The whole host goes away: its supervisor and env processes, SIGKILLed."""
    kids = ns_children(worker)
    worker.kill()
    for pid in kids:
        os.kill(pid, signal.SIGKILL)
    worker.wait(timeout=10)


def step(pool, envs, value=0.5):
    pool.async_step_send(
        TensorDict({"action": torch.full((len(envs), 1), value)}, [len(envs)]), env_index=envs
    )


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=10)
    return [int(p) for p in out.stdout.split()]


def ns_children(worker: warm.WarmProcess) -> list[int]:
    """The env processes of a remote supervisor (the worker's process: tests/warm.py)."""
    return children(worker.pid)


@pytest.fixture(scope="module")
def guarded(remote_host, key_dir):
    """A remote-only pool with one slot, filled by an authorized worker."""
    port = free_port_base(remote_host.pool_ip)
    worker = start_remote_worker(remote_host, port, key_dir, extra=FAST_BEATS)
    pool = remote_pool(remote_host, port, key_dir)
    yield pool, port
    pool.close()
    stop(worker)


def test_tcp_without_keys_needs_an_explicit_opt_out(caplog):
    with pytest.raises(ValueError, match="insecure=True"):
        ZMQAsyncEnvPool([], remote_envs=1, bind="tcp://127.0.0.1:5999")
    with pytest.raises(ValueError, match="remote_envs needs bind"):
        ZMQAsyncEnvPool([], remote_envs=1)


def test_a_worker_whose_key_is_not_listed_cannot_connect(guarded, remote_host, key_dir):
    pool, port = guarded
    intruder = start_remote_worker(
        remote_host,
        port,
        key_dir,
        key=2,  # not in authorized/
        extra=("--single-process", "--register-timeout", "3", "--identity", "intruder"),
    )
    _, err = intruder.communicate(timeout=60)
    assert intruder.returncode == 2
    # Said as it is, in the log and in the exit line: the pool refused the key (ZAP,
    # HANDSHAKE_FAILED_AUTH 400), naming the key file; not a frame-size or protocol error.
    refusal = "refused this worker's CURVE key during the handshake (ZAP denied it, status 400)"
    assert err.count(refusal) >= 2, err
    assert str(key_dir / "workers" / "worker-2.key_secret") in err
    assert "must be in the pool's authorized/ folder (copy worker-2.key there" in err
    assert "protocol error" not in err and "no answer from the pool" not in err, err
    assert pool.runtime.roster.worker(b"intruder") is None
    assert pool.reset()["observation"].shape == (1, 4)  # the pool carries on


def test_a_worker_with_other_specs_is_refused_on_both_sides(guarded, remote_host, key_dir, caplog):
    pool, port = guarded
    with caplog.at_level(logging.WARNING, logger="zmqpool"):
        odd = start_remote_worker(
            remote_host,
            port,
            key_dir,
            key=1,
            kwargs={"obs_shape": [5]},
            extra=("--single-process", "--register-timeout", "30"),
        )
        # The pool answers registrations while its trainer calls it: keep calling.
        deadline = time.monotonic() + 60
        while odd.poll() is None and time.monotonic() < deadline:
            pool.reset()
            time.sleep(0.05)
        _, err = odd.communicate(timeout=10)
    assert odd.returncode == 2
    assert "spec mismatch" in err and "observation" in err
    assert "refused worker" in caplog.text and "spec mismatch" in caplog.text


def test_a_protocol_version_mismatch_is_refused_with_a_reason(guarded, remote_host, key_dir):
    pool, port = guarded
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.linger = 0
        keys = ClientKeys.from_files(
            str(key_dir / "server.key"), str(key_dir / "workers" / "worker-0.key_secret")
        )
        make_client(dealer, keys)
        dealer.connect(f"tcp://{remote_host.pool_ip}:{port}")
        dealer.send(msgpack.packb([99, int(Command.REGISTER), -1, 0, b"", [], {"reg": {}}]))
        for _ in range(100):  # the pool answers while it pumps: let it pump
            pool.reset()
            if dealer.poll(50):
                break
        reply = msgpack.unpackb(dealer.recv(), raw=False)
    finally:
        context.destroy(linger=0)
    assert reply[1] == int(Command.REFUSE)
    assert "version 99" in reply[6]["err"]


def test_construction_names_the_missing_remote_envs_and_the_endpoint(remote_host, key_dir):
    port = free_port_base(remote_host.pool_ip)
    config = PoolConfig(register_timeout_s=2.0)
    with pytest.raises(RegistrationError) as info:
        remote_pool(remote_host, port, key_dir, config=config)
    assert "[0]" in str(info.value) and f"{remote_host.pool_ip}:{port}" in str(info.value)


def test_a_remote_workers_env_maker_error_reaches_the_trainer(remote_host, key_dir, caplog):
    """The worker never registers; the trainer's error and log still say why, and whose key."""
    port = free_port_base(remote_host.pool_ip)
    worker = start_remote_worker(remote_host, port, key_dir, kwargs={"no_such_argument": 1})
    # Its host tries 5 times (about a second, started warm) and gives up; the trainer
    # waits its deadline.
    config = PoolConfig(register_timeout_s=8.0)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="zmqpool"),
            pytest.raises(RegistrationError) as info,
        ):
            remote_pool(remote_host, port, key_dir, config=config)
    finally:
        stop(worker)
    text = str(info.value)
    assert "could not start (maker)" in text and "no_such_argument" in text, text
    assert public_key_of(key_dir / "authorized" / "worker-0.key") in text, text
    assert any("no_such_argument" in record.getMessage() for record in caplog.records)


def _calls(env) -> list[TensorDict]:
    """A reset, a step and a step_and_maybe_reset, as a user writes them."""
    action = TensorDict({"action": torch.full((1, 1), 0.25)}, [1])
    reset = env.reset()
    stepped = env.step(reset.clone().update(action))
    result, root = env.step_and_maybe_reset(step_mdp(stepped).update(action))
    return [reset, stepped, result, root]


def test_a_remote_reply_over_the_results_ports_limit_comes_in_pieces_whole(remote_host, key_dir):
    """An observation of 1.6 MB from another host, over the results port's frame limit.

    The port takes frames of a piece (512 KiB for the default 64 MiB
    ``max_remote_frame_bytes``: what any peer, keyless too, can make the pool
    hold during a handshake); the reply travels cut and is joined (wire:
    pieces). Every call gives what ``SerialEnv`` gives, value for value.
    """
    shape = [400_000]
    assert 4 * shape[0] > remote_piece_bytes(PoolConfig().max_remote_frame_bytes)
    port = free_port_base(remote_host.pool_ip)
    worker = start_remote_worker(remote_host, port, key_dir, kwargs={"obs_shape": shape})
    serial = SerialEnv(1, functools.partial(CountingEnv, obs_shape=shape))
    try:
        # A reply lost on the way is a timeout within 30 s, not a wait for ever.
        config = dataclasses.replace(BEATS, remote_step_timeout_s=30.0)
        pool = remote_pool(remote_host, port, key_dir, config=config)
        try:
            ours = _calls(pool)
        finally:
            pool.close()
        theirs = _calls(serial)
    finally:
        if not serial.is_closed:
            serial.close()
        stop(worker)
    for got, want in zip(ours, theirs, strict=True):
        keys = sorted(want.keys(True, True), key=str)
        assert sorted(got.keys(True, True), key=str) == keys
        for key in keys:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_a_killed_remote_env_process_is_restarted_by_its_host_and_rejoins(remote_host, key_dir):
    port = free_port_base(remote_host.pool_ip)
    worker = start_remote_worker(
        remote_host, port, key_dir, kwargs={"step_sleep_s": [0.5, 0.5]}, extra=FAST_BEATS
    )
    pool = remote_pool(remote_host, port, key_dir)
    try:
        pool.reset()
        step(pool, [0])
        time.sleep(0.1)  # the step is now running in the remote process
        killed_at = time.monotonic()
        for pid in ns_children(worker):
            os.kill(pid, signal.SIGKILL)
        rejoin_s = truncated_then_steps_on(pool, killed_at, timeout=60)
        print(f"\nremote kill -> rejoin -> truncation: {rejoin_s:.2f} s")
    finally:
        pool.close()
        stop(worker)


def test_a_pool_closed_normally_is_no_warning_on_its_workers_host_a_killed_env_is(
    remote_host, key_dir
):
    """At the default log level (WARNING) the supervisor says nothing when the pool closes
    (its env process, told to exit, is started again for the next pool: an INFO line);
    an env process killed is a warning, as before. The closed pool's next call starts it
    again (as SerialEnv does), and the worker's new env process joins it."""
    port = free_port_base(remote_host.pool_ip)
    worker = start_remote_worker(remote_host, port, key_dir, extra=FAST_BEATS)
    pool = None
    try:
        pool = remote_pool(remote_host, port, key_dir)
        first = new_env_processes(worker, [])
        pool.reset()
        pool.close()
        second = new_env_processes(worker, first)  # the pool's CLOSE ended the first
        assert pool.reset()["observation"].shape == (1, 4)  # bound again; the worker is back
        pool.close()
        second = new_env_processes(worker, second)
        for pid in second:
            os.kill(pid, signal.SIGKILL)
        new_env_processes(worker, second)
    finally:
        if pool is not None:
            pool.close()
        stop(worker)
    _, err = worker.communicate(timeout=10)
    lines = err.splitlines()
    assert len(lines) == 1 and "ended (-9); restarting in" in lines[0], err
    assert " worker WARNING " in lines[0], err  # the level, as the trainer's log lines say it


def new_env_processes(worker: warm.WarmProcess, old: list[int], timeout: float = 60) -> list[int]:
    """The remote supervisor's env processes once there are some and none of ``old``."""
    deadline = time.monotonic() + timeout
    while (kids := children(worker.pid)) == [] or set(kids) & set(old):
        assert time.monotonic() < deadline, f"env processes {old} still there after {timeout} s"
        time.sleep(0.05)
    return kids


def truncated_then_steps_on(pool, since: float, timeout: float) -> float:
    """Env 0's request in flight is answered by a restart's truncation, then env 0 steps on.

    Returns the seconds from ``since`` to the truncation.
    """
    out = pool.async_step_recv(min_get=1, timeout=timeout)
    took = time.monotonic() - since
    assert pool.last_restarted_envs == [0] and out["next", "truncated"].item()
    step(pool, [0])
    assert pool.async_step_recv(min_get=1, timeout=timeout)["next", "observation"][0, 1] == 1
    return took


class _LeavesItsConnectionsOpen(CountingEnv):
    """Dies in its first step (the first process only, by ``marker``), its connections left open.

    A child forked beforehand holds copies of the process's sockets for
    ``hold_s``: the pool's side of each TCP connection stays up, as when the
    FIN of a process killed during a link drop is lost.
    """

    def __init__(self, marker: str, hold_s: float) -> None:
        super().__init__()
        self.marker, self.hold_s = marker, hold_s

    def _step(self, tensordict):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            if os.fork() == 0:
                time.sleep(self.hold_s)
                os._exit(0)
            os._exit(3)
        return super()._step(tensordict)


def test_a_restarted_env_process_rejoins_after_its_predecessors_connection_lingered(
    remote_host, key_dir, tmp_path
):
    """Chaos audit: the restarted process (same identity) connected while the pool still
    held its predecessor's connection. libzmq's ROUTER (no handover) ignores a connection
    whose identity another holds, and keeps ignoring it after that one closes: every
    REGISTER it sent went nowhere, and the env never came back. A REGISTER left
    unanswered now makes the worker connect again."""
    port = free_port_base(remote_host.pool_ip)
    kwargs = {"marker": str(tmp_path / "died"), "hold_s": 2.0}
    worker = start_remote_worker(
        remote_host,
        port,
        key_dir,
        env="tests.test_remote:_LeavesItsConnectionsOpen",
        kwargs=kwargs,
        extra=FAST_BEATS,
    )
    pool = remote_pool(remote_host, port, key_dir)
    try:
        pool.reset()
        step(pool, [0])  # the process dies in it; its host forks a new one at once
        died_at = time.monotonic()
        rejoin_s = truncated_then_steps_on(pool, died_at, timeout=30)
        print(f"\nold connection held 2 s -> rejoin -> truncation: {rejoin_s:.2f} s")
    finally:
        pool.close()
        stop(worker)


def test_a_worker_that_lost_the_pool_in_a_link_drop_gets_its_requests_again(remote_host, key_dir):
    """Chaos audit: the link drops while the trainer is idle; the worker, hearing no beats,
    registers again. The pool, not having listened, still held it live, and answered
    its REGISTER (the same process) as a duplicate: the WELCOME again, nothing more. The
    worker had forgotten the link's layouts and dropped what came before the WELCOME, so
    the next step was lost (its recv hung) or failed ("unknown layout id"). It now
    registers again as a new incarnation: a rejoin, its step answered as a truncation."""
    if remote_host.namespace is None:
        pytest.skip(f"needs a network namespace: {remote_host.why_not}")
    link = f"zp{remote_host.namespace.removeprefix('zmqp')}a"  # the pool's end (tests/netns.py)
    port = free_port_base(remote_host.pool_ip)
    worker = start_remote_worker(remote_host, port, key_dir, extra=FAST_BEATS)
    pool = remote_pool(remote_host, port, key_dir)
    try:
        pool.reset()
        step(pool, [0])
        assert pool.async_step_recv(min_get=1, timeout=30)["next", "observation"][0, 1] == 1
        subprocess.run(["ip", "link", "set", link, "down"], check=True, timeout=10)
        try:
            time.sleep(2.5)  # past the worker's 1 s without the pool's beats
        finally:
            subprocess.run(["ip", "link", "set", link, "up"], check=True, timeout=10)
        time.sleep(3.0)  # its REGISTER (maybe a few) reaches the pool, which reads it below
        step(pool, [0])
        truncated_then_steps_on(pool, time.monotonic(), timeout=30)
    finally:
        pool.close()
        stop(worker)


def test_a_silent_worker_is_replaced_by_a_new_one_within_the_deadline(remote_host, key_dir):
    """Another key's worker registers at once, before the first is found silent (1 s): it
    waits for that verdict and takes the slot. It was refused "no room" and exited, and
    the env was lost after rejoin_timeout_s while it ran (seen once workers started warm)."""
    port = free_port_base(remote_host.pool_ip)
    first = start_remote_worker(
        remote_host, port, key_dir, kwargs={"step_sleep_s": [0.5, 0.5]}, extra=FAST_BEATS
    )
    pool = remote_pool(remote_host, port, key_dir)
    replacement = None
    try:
        pool.reset()
        step(pool, [0])
        kill_host(first)
        replacement = start_remote_worker(remote_host, port, key_dir, key=1, extra=FAST_BEATS)
        out = pool.async_step_recv(min_get=1, timeout=90)
        assert pool.last_restarted_envs == [0] and out["next", "truncated"].item()
        assert "silent" in pool.env_stats()[0]["last_restart_cause"]
    finally:
        pool.close()
        for process in (first, replacement):
            if process is not None:
                stop(process)


def test_a_host_restarted_while_the_trainer_is_away_takes_its_slot_back(
    remote_host, key_dir, caplog
):
    """The same key, a new process, registering while the trainer is busy (chaos audit).

    Its old worker was still live as far as the pool knew (nobody is judged
    silent on time the pool did not listen), so the new one was refused "no
    room", gave up, and the env was reported lost after ``rejoin_timeout_s``
    while its replacement ran. It now waits for the old one's verdict.
    """
    port = free_port_base(remote_host.pool_ip)
    slow = {"step_sleep_s": [0.5, 0.5]}  # the step is in flight when the host dies
    first = start_remote_worker(remote_host, port, key_dir, kwargs=slow, extra=FAST_BEATS)
    pool = remote_pool(remote_host, port, key_dir)
    replacement = None
    try:
        pool.reset()
        step(pool, [0])
        kill_host(first)
        # The trainer is busy until the new worker's connection is in: the pool's ZAP
        # thread admits it (and its REGISTER follows) while the trainer does not listen.
        with caplog.at_level(logging.DEBUG, logger="zmq.auth"):
            admitted = len(curve_admissions(caplog))
            replacement = start_remote_worker(remote_host, port, key_dir, key=0, extra=FAST_BEATS)
            deadline = time.monotonic() + 60
            while len(curve_admissions(caplog)) == admitted:
                assert time.monotonic() < deadline, "the new worker never connected"
                time.sleep(0.05)
        out = pool.async_step_recv(min_get=1, timeout=90)
        assert pool.last_restarted_envs == [0] and out["next", "truncated"].item()
        step(pool, [0])
        assert pool.async_step_recv(min_get=1, timeout=30)["next", "observation"][0, 1] == 1
    finally:
        pool.close()
        for process in (first, replacement):
            if process is not None:
                stop(process)


def test_a_second_worker_of_a_key_with_no_slot_left_is_refused_after_waiting(remote_host, key_dir):
    """Its key's live worker holds the only slot: it may be its replacement, so it waits,
    then, the old one still answering after two heartbeat timeouts, it is refused "no room"."""
    port = free_port_base(remote_host.pool_ip)
    first = start_remote_worker(remote_host, port, key_dir, extra=FAST_BEATS)
    pool = remote_pool(remote_host, port, key_dir)
    second = None
    try:
        pool.reset()
        second = start_remote_worker(remote_host, port, key_dir, key=0, extra=FAST_BEATS)
        deadline = time.monotonic() + 60
        while second.poll() is None:  # the pool answers registrations while it receives
            assert time.monotonic() < deadline, "the second worker was never refused"
            step(pool, [0])
            assert pool.async_step_recv(min_get=1, timeout=30)["next", "observation"][0, 0] == 0
        assert "no room" in second.stderr.read()
        assert pool.env_stats()[0]["restarts"] == 0  # the first one kept its slot throughout
    finally:
        pool.close()
        for process in (first, second):
            if process is not None:
                stop(process)


def faulty_worker(host, port, keys, kwargs, **more) -> warm.WarmProcess:
    """A remote worker of FaultyEnvs (``kwargs``: one dict, or one per env)."""
    env = "zmqpool.testing:FaultyEnv"
    return start_remote_worker(host, port, keys, env=env, kwargs=kwargs, **more)


def test_a_remote_env_that_hung_once_takes_its_slot_back_when_it_wakes(remote_host, key_dir):
    # step_timeout_s sets the worker aside (its token void) and the pool asks it to
    # register again (REJOIN): once its step ends it does, and takes its slot back.
    # It used to beat on, unheard, until rejoin_timeout_s declared its env lost.
    port = free_port_base(remote_host.pool_ip)
    hangs = {"fault": "hang", "fault_at": 2, "hang_s": 3.0, "every_episode": False}
    worker = faulty_worker(remote_host, port, key_dir, hangs, extra=FAST_BEATS)
    config = dataclasses.replace(BEATS, step_timeout_s=1.0)
    pool = remote_pool(remote_host, port, key_dir, config=config)
    try:
        pool.reset()
        for expect_truncation in (False, True, False):  # step 2 hangs 3 s
            step(pool, [0])
            out = pool.async_step_recv(min_get=1, timeout=60)
            assert out["next", "truncated"].item() == expect_truncation
            assert pool.last_restarted_envs == ([0] if expect_truncation else [])
        assert "hung" in pool.env_stats()[0]["last_restart_cause"]
    finally:
        pool.close()
        stop(worker)


def test_a_hang_on_a_remote_worker_with_env_threads_is_seen_while_its_other_env_steps(
    remote_host, key_dir, caplog
):
    """A remote worker of two envs may step them in turn, so its requests share a clock
    that its replies move on; a reply to a request sent after the hung one says
    nothing of it (session 53's review: env 1 stepped 230 times in 12 s, env 0's
    hang never seen). Its worker is set aside within two timeouts (two requests in
    flight) and slack, while env 1 steps on.
    """
    port = free_port_base(remote_host.pool_ip)
    hangs = [{"fault": "hang", "fault_at": 2, "hang_s": 60.0}, {"fault": "hang", "fault_at": 10**9}]
    in_threads = ("--single-process", "--env-threads", "--no-inline-cheap")
    worker = faulty_worker(
        remote_host, port, key_dir, hangs, num_envs=2, extra=FAST_BEATS + in_threads
    )
    config = dataclasses.replace(BEATS, step_timeout_s=1.0)
    pool = remote_pool(remote_host, port, key_dir, config=config, remote_envs=2)

    def hung() -> bool:
        return any("hung" in r.getMessage() for r in caplog.records)

    try:
        pool.reset()
        step(pool, [0])
        pool.async_step_recv(min_get=1, timeout=60)
        with caplog.at_level(logging.WARNING, logger="zmqpool"):
            step(pool, [0])  # env 0 hangs in this one
            hung_since, env1_steps = time.monotonic(), 0
            step(pool, [1])
            while not hung() and time.monotonic() - hung_since < 15.0:
                with contextlib.suppress(TimeoutError):
                    pool.async_step_recv(min_get=1, timeout=0.2)
                    env1_steps += 1
                    step(pool, [1])
            seen_after = time.monotonic() - hung_since
        assert hung(), f"env 0's hang unseen after {seen_after:.1f} s ({env1_steps} of env 1's)"
        assert env1_steps >= 2 and seen_after < 2 * config.step_timeout_s + 2.0, (
            seen_after,
            env1_steps,
        )
    finally:
        pool.close()
        stop(worker)


def test_envs_are_reported_lost_when_nobody_rejoins_in_time(remote_host, key_dir):
    port = free_port_base(remote_host.pool_ip)
    worker = start_remote_worker(
        remote_host, port, key_dir, kwargs={"step_sleep_s": [0.5, 0.5]}, extra=FAST_BEATS
    )
    config = PoolConfig(
        register_timeout_s=90.0,
        heartbeat_interval_s=0.2,
        heartbeat_liveness=5,
        rejoin_timeout_s=1.0,
    )
    pool = remote_pool(remote_host, port, key_dir, config=config)
    try:
        pool.reset()
        step(pool, [0])
        for pid in ns_children(worker):
            os.kill(pid, signal.SIGKILL)
        worker.kill()
        worker.wait(timeout=10)
        with pytest.raises(EnvLostError) as info:
            pool.async_step_recv(min_get=1, timeout=60)
        assert info.value.env_indices == [0] and "rejoined" in str(info.value)
        with pytest.raises(EnvLostError):
            step(pool, [0])
    finally:
        pool.close()
        stop(worker)


TRAINER = textwrap.dedent(
    """
    import sys, time
    from zmqpool import ZMQAsyncEnvPool, PoolConfig
    config = PoolConfig(heartbeat_interval_s=0.2, heartbeat_liveness=5, register_timeout_s=90)
    pool = ZMQAsyncEnvPool([], remote_envs=1, bind=sys.argv[1], curve_keys=sys.argv[2],
                           config=config)
    pool.reset()
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("gap_s", [0.0, 0.8])
def test_a_restarted_trainer_picks_its_waiting_workers_up_again(
    remote_host, key_dir, tmp_path, gap_s
):
    """The new trainer starts at once, or 0.8 s after the old one's death: just within the
    1 s its workers wait for a beat (0.2 s x 5). Then the worker noticed the new pool, and
    registered, before its timeout; judged after the WELCOME from the old pool's last
    beat, it was lost again at once, and again after each WELCOME: every step of 3 s was
    a restart truncation (session 54's review). Once registered, it stays."""
    port = free_port_base(remote_host.pool_ip)
    bind = f"tcp://{remote_host.pool_ip}:{port}"
    worker = start_remote_worker(remote_host, port, key_dir, extra=FAST_BEATS)
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = warm.popen([sys.executable, str(script), bind, str(key_dir)], stdout=subprocess.PIPE)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "ready"
        trainer.kill()  # the trainer dies without closing anything
        trainer.wait(timeout=10)
        time.sleep(gap_s)
        restarted_at = time.monotonic()
        pool = remote_pool(remote_host, port, key_dir)  # a new trainer on the same address
        rejoin_s = time.monotonic() - restarted_at
        truncated, steps, until = 0, 0, time.monotonic() + 3.0
        while time.monotonic() < until:
            step(pool, [0])
            out = pool.async_step_recv(min_get=1, timeout=60)
            truncated += bool(pool.last_restarted_envs)
            steps += 1
        assert out["next", "observation"][0, 0] == 0  # the same remote env, stepping again
        restarts = pool.env_stats()[0]["restarts"]
        pool.close()
        print(f"\ntrainer restart -> remote worker registered again: {rejoin_s:.2f} s")
        assert truncated == restarts == 0, f"{truncated} of {steps} steps truncated"
        assert steps > 10, steps
    finally:
        trainer.kill()
        stop(worker)
