"""The wire's modules split by audience: workers never load the trainer's batching.

:mod:`zmqpool.batching` (packing a batch's rows, stacking replies) is the
trainer's alone; a worker imports the shared modules (wire, limits, layout,
codec) only. Checked in a fresh interpreter, so nothing this test process
imported counts.
"""

import subprocess
import sys

_IMPORT_ALL_WORKERS = """
import importlib, pkgutil, sys
import workers
for module in pkgutil.iter_modules(workers.__path__):
    if module.name != "__main__":
        importlib.import_module("workers." + module.name)
print(" ".join(sorted(sys.modules)))
"""


def test_workers_modules_do_not_import_the_trainers_batching():
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL_WORKERS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert "workers.loop" in loaded and "zmqpool.codec" in loaded  # the scan did import them
    assert "zmqpool.batching" not in loaded
