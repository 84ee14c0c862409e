"""The examples in the docstrings run, and print what they show (doctest).

Every module of ``zmqpool`` and ``workers`` whose source holds an example
(``>>>``) is run through :func:`doctest.testmod`, so an example that drifts
from the code fails here rather than misleading a reader.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modules_with_examples() -> list[str]:
    names = []
    for package in ("zmqpool", "workers"):
        for path in sorted((ROOT / package).glob("*.py")):
            if path.stem != "__main__" and ">>>" in path.read_text(encoding="utf-8"):
                stem = "" if path.stem == "__init__" else f".{path.stem}"
                names.append(f"{package}{stem}")
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    assert "zmqpool.validation" in MODULES and "workers.loop" in MODULES, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_a_modules_examples_print_what_they_show(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
