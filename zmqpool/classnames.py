"""Tensorclass names: how a tensorclass travels as its name, and is found again.

A tensorclass crosses the wire (a layout's ``"c"``, :mod:`zmqpool.wire`) and
specs (``Composite.data_cls``, :mod:`zmqpool.specs`) as ``"module:qualname"``,
never as code. This module owns that name: making it
(:func:`tensorclass_name`), checking it (:func:`parse_class_name`) and looking
it up among the modules already loaded, importing nothing and running no
attribute hook (:func:`resolve_tensorclass`), with one
:class:`TensorclassNotLoadedWarning` per class that is not loaded here.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import warnings
from collections.abc import Mapping
from typing import Any, cast

from tensordict import is_tensorclass

from zmqpool.errors import ProtocolError
from zmqpool.limits import MAX_CLASS_NAME


class TensorclassNotLoadedWarning(UserWarning):
    """A peer sent a tensorclass whose class this process has not loaded.

    Its values arrive as plain TensorDicts (its specs with ``data_cls=None``);
    importing the module the warning names, before the pool receives them,
    makes them instances again. Warned once per class.
    """


@functools.lru_cache(maxsize=1024)
def tensorclass_name(cls: type) -> str:
    """The name tensorclass ``cls`` travels as: ``"module:qualname"``.

    Raises:
        ProtocolError: ``cls`` is not a tensorclass, or its name is not one a
            peer would accept (:func:`parse_class_name`).
    """
    if not isinstance(cls, type) or not is_tensorclass(cls) or is_non_tensor_class(cls):
        raise ProtocolError(f"{cls!r} is not a tensorclass; it cannot cross the wire")
    name = f"{cls.__module__}:{cls.__qualname__}"
    parse_class_name(name)
    return name


def parse_class_name(name: Any) -> tuple[str, tuple[str, ...]]:
    """A tensorclass's wire name split into its module and qualname parts.

    Raises:
        ProtocolError: ``name`` is not ``"module:qualname"`` (at most
            :data:`MAX_CLASS_NAME` characters, a dotted module of identifiers, a
            dotted qualname of identifiers and ``<locals>``), so cannot name a class.
    """
    if not isinstance(name, str) or not 0 < len(name) <= MAX_CLASS_NAME:
        raise ProtocolError(
            f"a tensorclass name is a 'module:qualname' string of at most {MAX_CLASS_NAME} "
            f"characters, not {clipped(name)}"
        )
    module, _, qualname = name.partition(":")
    parts = tuple(qualname.split("."))
    if not (
        all(part.isidentifier() for part in module.split("."))
        and parts[0].isidentifier()
        and parts[-1].isidentifier()
        and all(part.isidentifier() or part == "<locals>" for part in parts)
    ):
        raise ProtocolError(f"{clipped(name)} is not a 'module:qualname' tensorclass name")
    return module, parts


def resolve_tensorclass(name: Any) -> type | None:
    """The tensorclass called ``name``, looked up among the modules already loaded.

    Nothing is imported (a module named by a peer would run its code) and no
    attribute is read with ``getattr``: the qualname is followed through the
    ``__dict__`` of the module in :data:`sys.modules` and of the classes on
    its path, so no module ``__getattr__``, property or lazy loader runs.

    Returns:
        The class; or None, with a :class:`TensorclassNotLoadedWarning` (once per
        name), when it is not loaded here: its module is not imported, has no
        such attribute, or defines it inside a function.

    Raises:
        ProtocolError: ``name`` is malformed (:func:`parse_class_name`), or names
            something that is not a tensorclass type (``os:system``,
            ``builtins:dict``, ``tensordict:NonTensorData``).
    """
    module_name, parts = parse_class_name(name)
    module = sys.modules.get(module_name)
    if module is None or not issubclass(type(module), types.ModuleType):
        _not_loaded(
            name,
            f"module {module_name} is not imported",
            f"import {module_name} in this process before the pool receives them",
        )
        return None
    found: Any = module
    namespace: Mapping[str, Any] | None = _MODULE_DICT.__get__(module)
    for depth, part in enumerate(parts):
        if part == "<locals>":
            _not_loaded(
                name,
                "it is defined inside a function, where no name reaches it",
                f"define it at the top level of {module_name}, and import that here",
            )
            return None
        if namespace is None:
            raise ProtocolError(
                f"tensorclass name {name} is refused: {'.'.join(parts[:depth])} is a "
                f"{type(found).__name__}, not a class"
            )
        found = namespace.get(part, _MISSING)
        if found is _MISSING:
            where = ".".join(parts[: depth + 1])
            _not_loaded(
                name,
                f"module {module_name} is imported but has no {where}",
                f"import the {module_name} that defines it (the peer's version of it)",
            )
            return None
        namespace = _TYPE_DICT.__get__(found, type(found)) if _is_type(found) else None
    if not _declares_tensorclass(found) or not is_tensorclass(found):
        raise ProtocolError(
            f"tensorclass name {name} is refused: it names a {type(found).__name__}, "
            "not a tensorclass"
        )
    return found


# The descriptors themselves: reading through them runs no class's or metaclass's code.
_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
_TYPE_DICT: Any = vars(type)["__dict__"]
_TYPE_MRO: Any = vars(type)["__mro__"]
_FLAGS = ("_is_tensorclass", "_is_non_tensor")
_MISSING = object()
#: Names warned about already (bounded: past it, a peer's new names are not warned about).
_WARNED: set[str] = set()
_MAX_WARNED = 256
_WARNED_LOCK = threading.Lock()


def is_non_tensor_class(cls: type) -> bool:
    """Whether ``cls`` is a non-tensor class (``NonTensorData``...): a tensorclass
    to tensordict, but the wire carries non-tensors as plain data."""
    return bool(getattr(cls, "_is_non_tensor", False))


def _declares_tensorclass(found: Any) -> bool:
    """Whether ``found`` is a tensorclass type (not a non-tensor one), read from class dicts.

    The flags ``@tensorclass`` sets are looked for in the ``__dict__`` of each
    class of the MRO, so no metaclass ``__getattr__`` or descriptor runs; only
    then does :func:`tensordict.is_tensorclass` confirm (finding it there).
    """
    if not _is_type(found):
        return False
    flags: dict[str, Any] = {}
    for klass in reversed(_TYPE_MRO.__get__(found, type(found))):
        namespace = _TYPE_DICT.__get__(klass, type(klass))
        flags.update({key: namespace[key] for key in _FLAGS if key in namespace})
    return flags.get("_is_tensorclass") is True and not flags.get("_is_non_tensor", False)


def _is_type(found: Any) -> bool:
    # Not isinstance(found, type): for an object that is not, it reads found.__class__,
    # which that object's class may compute.
    return issubclass(type(found), type)


def tensorclass_fields(cls: type) -> frozenset[str]:
    """The field names of tensorclass ``cls``: what may lie directly under an instance."""
    return frozenset(cast(Any, cls).__expected_keys__)


def _not_loaded(name: str, why: str, fix: str) -> None:
    """Warn, once per name (and for at most ``_MAX_WARNED`` names), that ``name`` arrives plain."""
    with _WARNED_LOCK:
        if name in _WARNED or len(_WARNED) >= _MAX_WARNED:
            return
        _WARNED.add(name)
    warnings.warn(
        f"tensorclass {name} is not loaded in this process ({why}): its values arrive as "
        f"plain TensorDicts, and its specs with data_cls=None. To get instances of it, {fix}.",
        TensorclassNotLoadedWarning,
        stacklevel=3,
    )


def clipped(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a peer's value quoted in an error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
