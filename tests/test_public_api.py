"""The public API is pinned: a change to it is a decision, not an accident."""

import subprocess
import sys

import zmqpool


def test_public_names_are_pinned():
    assert sorted(zmqpool.__all__) == [
        "BatchSizeMismatchError",
        "CrashLoopError",
        "EnvBusyError",
        "EnvError",
        "EnvLostError",
        "EnvMakerError",
        "InputError",
        "MissingKeyError",
        "NothingInFlightError",
        "PoolClosedError",
        "PoolConfig",
        "ProtocolError",
        "RecvTimeoutError",
        "RegistrationError",
        "RemoteWorkerDeadError",
        "TooFewInFlightError",
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
    # Refused inputs: ValueError, and the builtin torchrl's pool raises for the same input.
    for base in (zmqpool.InputError, ValueError, KeyError):
        assert issubclass(zmqpool.MissingKeyError, base)
    assert str(zmqpool.MissingKeyError("no action 'action'")) == "no action 'action'"
    for base in (zmqpool.InputError, ValueError, RuntimeError):
        assert issubclass(zmqpool.BatchSizeMismatchError, base)
    assert issubclass(zmqpool.CrashLoopError, zmqpool.EnvLostError)
    assert issubclass(zmqpool.RemoteWorkerDeadError, zmqpool.EnvLostError)
    assert issubclass(zmqpool.RecvTimeoutError, TimeoutError)
    assert issubclass(zmqpool.EnvBusyError, RuntimeError)
    assert issubclass(zmqpool.TooFewInFlightError, RuntimeError)
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


def test_every_public_error_survives_pickling():
    """A pool in a ProcessPoolExecutor job, or any multiprocessing worker, sends its errors
    back pickled: one that cannot be rebuilt shows up as BrokenProcessPool instead."""
    import pickle

    examples = {
        zmqpool.EnvError: zmqpool.EnvError(3, "boom", "Traceback...\nValueError: boom\n"),
        zmqpool.EnvMakerError: zmqpool.EnvMakerError(1, "maker failed"),
        zmqpool.EnvLostError: zmqpool.EnvLostError([2, 5], "worker died"),
        zmqpool.CrashLoopError: zmqpool.CrashLoopError((4,), "restarted 3 times in 60 s"),
        zmqpool.NothingInFlightError: zmqpool.NothingInFlightError("env 1: nothing in flight"),
        zmqpool.RemoteWorkerDeadError: zmqpool.RemoteWorkerDeadError([3], "actor killed"),
    }
    classes = [getattr(zmqpool, name) for name in zmqpool.__all__]
    classes = [c for c in classes if isinstance(c, type) and issubclass(c, BaseException)]
    assert set(examples) <= set(classes)
    attributes = ("env_index", "reason", "remote_traceback", "env_indices")
    for cls in classes:
        error = examples.get(cls) or cls(f"a {cls.__name__}")
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is cls
        assert str(copy) == str(error) and copy.args == error.args
        for name in attributes:
            assert getattr(copy, name, None) == getattr(error, name, None), (cls, name)


def test_errors_of_an_env_or_maker_are_their_builtin_and_survive_pickling():
    """``except OSError`` (or any builtin listed) around a step or a construction catches
    what an env or its maker raised, as torchrl's pool re-raises it; and pickles."""
    import pickle

    from zmqpool.errors import (
        ENV_ERROR_BASES,
        ENV_ERROR_CLASSES,
        ENV_MAKER_ERROR_CLASSES,
        builtin_base,
    )

    assert set(ENV_ERROR_CLASSES) == set(ENV_MAKER_ERROR_CLASSES) == set(ENV_ERROR_BASES)
    for name, base in ENV_ERROR_BASES.items():
        for cls, family in (
            (ENV_ERROR_CLASSES[name], zmqpool.EnvError),
            (ENV_MAKER_ERROR_CLASSES[name], zmqpool.EnvMakerError),
        ):
            error = cls(2, f"raised {name}", "Traceback...")
            assert isinstance(error, base) and isinstance(error, family), cls
            copy = pickle.loads(pickle.dumps(error))
            assert type(copy) is cls and str(copy) == str(error), cls
    # The most specific builtin in an error's MRO is the one named.
    assert builtin_base(ConnectionResetError()) == "ConnectionResetError"
    assert builtin_base(type("SimulatorDown", (ConnectionError,), {})()) == "ConnectionError"
    assert builtin_base(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")) == "UnicodeError"
    assert builtin_base(RuntimeError()) is None  # every EnvError is one already
