"""Workers run our code, and a trainer and worker of different versions part at once, saying why.

- A user's project may have its own ``workers`` package (a common name) in the
  trainer's folder; ``python -m workers`` would import it. Local workers and
  the fork server pin ours.
- A peer of another protocol version cannot read our REFUSE (it stops at the
  version field), so each side decides from the version it sees: the pool
  raises at construction for its own local worker, and a worker facing a pool
  of another version exits at once instead of retrying until its timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from tests.conftest import FAST
from zmqpool import RegistrationError, VersionMismatchError, ZMQAsyncEnvPool, wire
from zmqpool.testing import CountingEnv
from zmqpool.wire import PROTOCOL_VERSION, Command, Header

ROOT = Path(__file__).resolve().parent.parent

TRAINER = textwrap.dedent(
    """
    import sys
    from zmqpool import PoolConfig, ZMQAsyncEnvPool
    from zmqpool.testing import CountingEnv
    config = PoolConfig(fork_server=sys.argv[1] == "fork")
    pool = ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}], config=config)
    print(pool.reset()["observation"][:, 0].tolist(), flush=True)
    pool.close()
    """
)


@pytest.mark.parametrize("start", ["fork", "fresh"])
def test_a_users_own_workers_package_beside_the_trainer_is_not_ours(tmp_path, start):
    shadow = tmp_path / "workers"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise SystemExit('the user workers package ran')\n")
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    done = subprocess.run(
        [sys.executable, str(script), start],
        cwd=tmp_path,  # both the script's folder and the working directory hold it
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0.0]"
    assert "the user workers package ran" not in done.stderr


PRINTING = textwrap.dedent(
    """
    import sys
    from zmqpool import PoolConfig, ZMQAsyncEnvPool
    from zmqpool.testing import CountingEnv

    class Printing(CountingEnv):
        def _step(self, tensordict):
            print(f"env {self.env_id} stepped", flush=True)
            return super()._step(tensordict)

    config = PoolConfig(fork_server=sys.argv[1] == "fork")
    pool = ZMQAsyncEnvPool([lambda: Printing(env_id=0), lambda: Printing(env_id=1)], config=config)
    pool.rand_step(pool.reset())
    pool.close()
    print("trainer done", flush=True)
    """
)


@pytest.mark.parametrize("start", ["fork", "fresh"])
def test_an_envs_print_goes_to_the_trainers_stdout_as_in_process(tmp_path, start):
    # SerialEnv's envs print to the trainer's stdout; workers forked by the fork server
    # printed to its stderr (the zygote's stdout carried its reports), fresh ones to stdout.
    script = tmp_path / "train.py"
    script.write_text(PRINTING)
    done = subprocess.run(
        [sys.executable, str(script), start], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # Two workers write to one pipe at once: a line and its newline may interleave with
    # the other's (CI saw "env 0 steppedenv 1 stepped"), so each is counted, not split.
    assert done.stdout.count("env 0 stepped") == done.stdout.count("env 1 stepped") == 1
    assert done.stdout.rstrip().endswith("trainer done")
    assert "stepped" not in done.stderr


def test_a_local_worker_of_another_version_fails_construction(monkeypatch):
    # This trainer now reads only version 99; its workers (fresh processes) speak ours.
    monkeypatch.setattr(wire, "PROTOCOL_VERSION", 99)
    start = time.monotonic()
    with pytest.raises(VersionMismatchError) as info:
        ZMQAsyncEnvPool(CountingEnv, create_env_kwargs=[{"env_id": 0}], config=FAST)
    assert "the worker of envs [0] runs another zmqpool" in str(info.value)
    assert f"protocol version {PROTOCOL_VERSION} received, this side speaks 99" in str(info.value)
    assert time.monotonic() - start < FAST.register_timeout_s / 2  # at once, not at the timeout


def test_a_worker_facing_a_pool_of_another_version_exits_at_once():
    with zmq.Context() as context, context.socket(zmq.ROUTER) as router:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        argv = [sys.executable, "-m", "workers", "--connect", f"tcp://127.0.0.1:{port}"]
        argv += ["--env", "zmqpool.testing:CountingEnv", "--single-process"]
        argv += ["--register-timeout", "60"]
        worker = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        try:
            assert router.poll(60_000), "the worker never sent its REGISTER"
            identity, message = router.recv_multipart()
            assert Header.decode(message).command == Command.REGISTER
            refusal = Header(Command.REFUSE, body={"err": "?"}, version=PROTOCOL_VERSION + 1)
            router.send_multipart([identity, refusal.encode()])
            _, stderr = worker.communicate(timeout=30)  # well before its 60 s timeout
        finally:
            worker.kill()
            worker.wait(10)
    assert worker.returncode == 2, stderr
    assert "speaks another protocol version" in stderr
    assert f"protocol version {PROTOCOL_VERSION + 1} received" in stderr


def test_a_local_worker_refused_at_registration_fails_construction_saying_why():
    """A dense pool of envs whose specs differ (observation shapes): the pool refuses env 1.

    The worker exits when refused; construction used to say only that it
    "exited with status 2 before registering", the reason in its stderr.
    """
    makers = [CountingEnv, CountingEnv]
    kwargs = [{"env_id": 0}, {"env_id": 1, "obs_shape": (5,)}]
    with pytest.raises(RegistrationError, match=r"envs \[[01]\] was refused: spec mismatch"):
        ZMQAsyncEnvPool(makers, create_env_kwargs=kwargs, config=FAST)
