"""The exception tree of zmqpool.

Every error the pool raises on purpose about its envs, workers and calls is a
:class:`ZMQPoolError`; where a builtin already names the situation for torchrl
users (``TimeoutError`` for a recv deadline, ``RuntimeError`` for a busy env)
the class also derives from it, so ``except RuntimeError`` written against
torchrl's pool keeps working. A bad argument (an env index out of range, a
``min_get`` below 1, a config of the wrong type) raises the builtin torchrl
raises for it (``IndexError``, ``ValueError``, ``TypeError``), naming the
argument::

    ZMQPoolError
    ├── ProtocolError (ValueError)       a frame or header that breaks the wire contract
    │   └── VersionMismatchError         a peer speaking another protocol version
    ├── BackendError (ValueError, NotImplementedError)
    │                                    a backend= torchrl's pool does not run either
    ├── InputError (ValueError)          a send's input that can never work, refused at the send
    │                                    (and, with strict_inputs, one off its spec)
    │   ├── MissingKeyError (KeyError)   an entry the envs need is missing (the action)
    │   └── BatchSizeMismatchError (RuntimeError, IndexError)
    │                                    rows that do not match env_index
    ├── RegistrationError (RuntimeError) a worker refused, or slots left unfilled
    ├── EnvError (RuntimeError)          an env raised in a worker; carries its traceback
    │   ├── EnvValueError (ValueError), EnvKeyError (KeyError)...
    │   │                                an env raised that builtin (ENV_ERROR_BASES)
    │   └── EnvMakerError                the env maker itself raised
    │       └── EnvMakerValueError (ValueError), EnvMakerImportError (ImportError)...
    ├── EnvLostError (RuntimeError)      an env's worker died and could not be brought back
    │   ├── CrashLoopError               restarts exceeded the configured limit
    │   └── RemoteWorkerDeadError        its launcher says a remote worker is dead for good
    ├── PoolClosedError (RuntimeError)   a recv on a closed pool, or one forked from
    ├── RecvTimeoutError (TimeoutError)  a recv's ``timeout`` passed before ``min_get`` results
    ├── EnvBusyError (RuntimeError)      a send (or a seed) to envs still processing a command
    ├── TooFewInFlightError (RuntimeError)
    │                                    a recv awaiting more results than are in flight
    └── NothingInFlightError (RuntimeError, KeyError)
                                         a recv on an env's own channel that nothing was sent on

    ChannelIndexError (IndexError, KeyError)
                                         a bad argument: a recv's env_index out of range
    ChannelIndexTypeError (TypeError, KeyError)
                                         a bad argument: a recv's env_index not an integer
"""

from __future__ import annotations

from typing import TypeVar


class ZMQPoolError(Exception):
    """Base class of every error zmqpool raises on purpose.

    Every one can be pickled (a pool may run in a multiprocessing worker): a class
    whose ``__init__`` does not take ``self.args`` back defines ``__reduce__``.
    """


class ProtocolError(ZMQPoolError, ValueError):
    """A message broke the wire contract (bad header, frame count, size, dtype...)."""


class BackendError(ZMQPoolError, ValueError, NotImplementedError):
    """A ``backend=`` torchrl's pool does not run either (``"asyncio"``, or any other name).

    torchrl's raises ``NotImplementedError`` there; a ``ValueError`` too, as
    zmqpool's was before.
    """


class VersionMismatchError(ProtocolError):
    """A peer speaks another protocol version."""


class InputError(ZMQPoolError, ValueError):
    """An input of a send that can never work, refused in the caller's stack before it is sent.

    A ``ValueError``; where torchrl's pool (or ``SerialEnv``) raises another
    builtin for the same input, the subclass is that builtin too, so that
    ``except KeyError`` written against torchrl's pool keeps working.
    """

    #: The text, even in a subclass that is also a ``KeyError`` (whose own quotes it).
    __str__ = BaseException.__str__


class MissingKeyError(InputError, KeyError):
    """An input lacks an entry the envs need: the action of a step, or the ``env_index``
    of a tensordict sent without ``env_index=``.

    torchrl's pool hands the input to the env, whose ``tensordict.get`` raises
    ``KeyError``; this is a ``KeyError`` too, raised before anything is sent.
    """


class BatchSizeMismatchError(InputError, RuntimeError, IndexError):
    """A tensordict whose rows (its leading batch dim) do not match the env indices it is
    sent to, or, on an env's own channel, that is not of the env's batch size.

    torchrl's pool raises ``RuntimeError`` (tensordict's "Received a new batch
    size"), as the pool's own sync calls do for a tensordict of another batch
    size, and ``IndexError`` for an unbatched tensordict sent with a list of
    env indices ("Incompatible dim"): this is both.
    """


class RegistrationError(ZMQPoolError, RuntimeError):
    """A worker was refused at registration, or env slots were never filled."""


class NoRoomError(RegistrationError):
    """A remote worker asked for more env slots than are free (internal: its REGISTER waits
    or is refused, see :mod:`zmqpool.admission`)."""


class EnvError(ZMQPoolError, RuntimeError):
    """An env raised inside its worker.

    Attributes:
        env_index: the pool index of the env that raised.
        reason: what went wrong, without the env's index (the text's first line
            is ``env <index>: <reason>``).
        remote_traceback: the traceback text formatted in the worker.
    """

    def __init__(self, env_index: int, message: str, remote_traceback: str = "") -> None:
        self.env_index = env_index
        self.reason = message
        self.remote_traceback = remote_traceback
        text = f"env {env_index}: {message}"
        if remote_traceback:
            text += f"\n--- worker traceback ---\n{remote_traceback.rstrip()}"
        super().__init__(text)

    #: The text, even in a subclass that is also a ``KeyError`` (whose own quotes it).
    __str__ = BaseException.__str__

    def __reduce__(self) -> tuple:
        # BaseException rebuilds an error as cls(*self.args): here the formatted text alone,
        # which __init__ does not take, so unpickling raised TypeError (a pool in a
        # ProcessPoolExecutor job showed an env's error as BrokenProcessPool).
        return type(self), (self.env_index, self.reason, self.remote_traceback), self.__dict__


#: The builtin exceptions an env's error is also an instance of, when the env raised
#: one of them (or a subclass of one): ``except ValueError`` around a step of
#: torchrl's pool, which re-raises the env's own exception, keeps working. The
#: first in an error's MRO is taken, so a subclass listed (``ConnectionResetError``)
#: wins over its base (``OSError``). Only builtins: nothing from a worker names a
#: class to import, so an env's own exception class is caught as its builtin base.
#: ``RuntimeError`` is not listed: every :class:`EnvError` is one already.
ENV_ERROR_BASES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        UnicodeError,
        TypeError,
        KeyError,
        IndexError,
        LookupError,
        AttributeError,
        NameError,
        NotImplementedError,
        RecursionError,
        AssertionError,
        ZeroDivisionError,
        OverflowError,
        FloatingPointError,
        ArithmeticError,
        StopIteration,
        EOFError,
        MemoryError,
        BufferError,
        ModuleNotFoundError,
        ImportError,
        # OSError and the subclasses its errno picks (a simulator behind a socket or a file).
        ConnectionResetError,
        ConnectionRefusedError,
        ConnectionAbortedError,
        BrokenPipeError,
        ConnectionError,
        TimeoutError,
        FileNotFoundError,
        FileExistsError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
        ProcessLookupError,
        ChildProcessError,
        BlockingIOError,
        InterruptedError,
        OSError,
    )
}


_Family = TypeVar("_Family", bound="EnvError")


def _with_builtins(family: type[_Family], who: str) -> dict[str, type[_Family]]:
    """``family`` and each builtin of :data:`ENV_ERROR_BASES`, by the builtin's name.

    ``EnvError`` gives ``EnvValueError``..., ``EnvMakerError`` ``EnvMakerValueError``...:
    module attributes (set by the caller), so that they pickle.
    """
    family_name = family.__name__
    prefix = family_name.removesuffix("Error")
    classes = {}
    for name, base in ENV_ERROR_BASES.items():
        cls = type(f"{prefix}{name}", (family, base), {"__module__": __name__})
        cls.__doc__ = f"{who} raised a ``{name}``: an :class:`{family_name}` and a ``{name}``."
        classes[name] = cls
    return classes


ENV_ERROR_CLASSES: dict[str, type[EnvError]] = _with_builtins(EnvError, "An env")
globals().update({cls.__name__: cls for cls in ENV_ERROR_CLASSES.values()})


def builtin_base(error: BaseException) -> str | None:
    """The name of the first of :data:`ENV_ERROR_BASES` that ``error`` is an instance of."""
    for cls in type(error).__mro__:
        if ENV_ERROR_BASES.get(cls.__name__) is cls:
            return cls.__name__
    return None


def env_error(env_index: int, message: str, remote_traceback: str, base: str | None) -> EnvError:
    """The :class:`EnvError` for an env that raised; also a ``base`` (a builtin's name) if given."""
    return ENV_ERROR_CLASSES.get(base or "", EnvError)(env_index, message, remote_traceback)


class EnvMakerError(EnvError):
    """The env maker raised while building an env in its worker.

    When the maker raised a builtin (:data:`ENV_ERROR_BASES`), the error is also
    an instance of it (``EnvMakerImportError``...), as torchrl's pool and
    ``SerialEnv`` raise the maker's own: ``except ImportError`` around a pool
    built on an optional dependency keeps working.
    """


ENV_MAKER_ERROR_CLASSES: dict[str, type[EnvMakerError]] = _with_builtins(
    EnvMakerError, "An env maker"
)
globals().update({cls.__name__: cls for cls in ENV_MAKER_ERROR_CLASSES.values()})


def env_maker_error(
    env_index: int, message: str, remote_traceback: str, base: str | None
) -> EnvMakerError:
    """The :class:`EnvMakerError` for a maker that raised; also a ``base`` (a builtin's name)."""
    cls = ENV_MAKER_ERROR_CLASSES.get(base or "", EnvMakerError)
    return cls(env_index, message, remote_traceback)


class EnvLostError(ZMQPoolError, RuntimeError):
    """An env's worker died or went silent and the env could not be recovered.

    Attributes:
        env_indices: the pool indices of the envs that are lost.
    """

    def __init__(self, env_indices: list[int], message: str) -> None:
        self.env_indices = list(env_indices)
        self._message = message
        super().__init__(f"envs {self.env_indices}: {message}")

    def __reduce__(self) -> tuple:
        # The constructor's arguments, not self.args (the formatted text): see EnvError.
        return type(self), (self.env_indices, self._message), self.__dict__


class CrashLoopError(EnvLostError):
    """An env restarted more than ``max_restarts`` times within ``restart_window_s``."""


class RemoteWorkerDeadError(EnvLostError):
    """A launched remote worker is dead for good, as its launcher reports (``poll_lost``).

    For :class:`~zmqpool.ray_workers.RayWorkers`: a Ray actor Ray will not
    restart (ended by ``ray.kill``, past its ``max_restarts``, or its env maker
    raised when Ray restarted it). The message names the actor and Ray's reason.
    """


class PoolClosedError(ZMQPoolError, RuntimeError):
    """A recv after ``close()`` (nothing is in flight), a call cut short by ``close()``
    in another thread, or any call in a process forked from the pool's.

    A step, reset, send or ``set_seed`` after ``close()`` starts the pool again, as
    ``SerialEnv``'s.
    """


class RecvTimeoutError(ZMQPoolError, TimeoutError):
    """A recv's ``timeout`` passed with fewer than ``min_get`` results in.

    The results that did come in remain available to the next recv.
    """


class EnvBusyError(ZMQPoolError, RuntimeError):
    """A send, a sync call or a seed addressed envs still processing a command.

    torchrl's pool raises ``RuntimeError("Some envs are still processing a
    step.")``; this is one, with that text (and, for an async send, the busy envs).
    """


class TooFewInFlightError(ZMQPoolError, RuntimeError):
    """A recv asked for more results (``min_get``) than are in flight on its channel.

    It would wait for ever: at the call (torchrl's pool raises ``RuntimeError``
    there too), or while it waited, when another thread took the results.
    """


class ChannelIndexError(IndexError, KeyError):
    """A recv on an env's own channel whose ``env_index`` is out of range: a bad argument.

    An ``IndexError``, as every env index out of range is; and a ``KeyError``,
    which torchrl's pool raises there (it looks the env's future up).
    """

    __str__ = BaseException.__str__


class ChannelIndexTypeError(TypeError, KeyError):
    """A recv on an env's own channel whose ``env_index`` is not an integer: a bad argument.

    A ``TypeError``, as every env index that is not an integer is; and a
    ``KeyError``, which torchrl's pool raises there (no env's future has that key).
    """

    __str__ = BaseException.__str__


class NothingInFlightError(ZMQPoolError, RuntimeError, KeyError):
    """A recv on an env's own channel (``env_index=i``) that nothing was sent on.

    It would wait for ever. torchrl's pool raises ``KeyError`` (it looks the
    env's future up), so this is a ``KeyError`` too, for code written
    against it; its text is the message, not ``KeyError``'s quoted repr.
    """

    __str__ = BaseException.__str__
