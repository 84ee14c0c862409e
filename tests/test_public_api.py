"""The public API is pinned: a change to it is a decision, not an accident."""

import subprocess
import sys

import zmqpool


def test_public_names_are_pinned():
    assert sorted(zmqpool.__all__) == [
        "CrashLoopError",
        "EnvError",
        "EnvLostError",
        "EnvMakerError",
        "NothingInFlightError",
        "PoolClosedError",
        "PoolConfig",
        "ProtocolError",
        "RegistrationError",
        "VersionMismatchError",
        "ZMQAsyncEnvPool",
        "ZMQPoolError",
        "__version__",
        "keep_fork_server",
    ]


def test_error_tree_keeps_torchrl_compatible_bases():
    assert issubclass(zmqpool.EnvError, RuntimeError)
    assert issubclass(zmqpool.ProtocolError, ValueError)
    assert issubclass(zmqpool.NothingInFlightError, (RuntimeError, KeyError))
    assert str(zmqpool.NothingInFlightError("env 1: nothing")) == "env 1: nothing"
    assert issubclass(zmqpool.CrashLoopError, zmqpool.EnvLostError)
    for name in zmqpool.__all__[:-1]:
        obj = getattr(zmqpool, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, zmqpool.ZMQPoolError)


def test_workers_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "--connect" in out.stdout and "--env" in out.stdout
