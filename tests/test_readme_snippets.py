"""The README's Python examples that run on one machine, read from README.md and run as written.

The Quickstart (4 CartPole envs, 1,000 recvs), the fork server kept between
pools and the pool configured for restarts run in one fresh interpreter, one
after another, as a reader pastes them: the later two use the Quickstart's
``make_env``. The README cannot then drift from the API without a failure here.

Not run here: the remote pool's example (``curve_keys``, a bind on 0.0.0.0),
whose commands ``tests/test_readme_commands.py`` runs from the README, and the
Ray example, which needs ``my_package`` installed on a cluster's nodes
(``RayWorkers`` has ``tests/test_ray.py``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: What identifies each example run here, in the order they run.
RUN = ("def make_env", "with keep_fork_server()", 'on_env_error="restart"')
#: What identifies the examples left to other tests (see the module's docstring).
NOT_RUN = ('curve_keys="keys/"', "RayWorkers(")
#: Three pools of 4-8 CartPole envs: seconds alone, more on a loaded 2-core machine.
RUN_TIMEOUT_S = 240
DONE = "every README example ran"

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 30)


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def the_block_with(marker: str, blocks: list[str]) -> str:
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} README examples contain {marker!r}"
    return found[0]


def test_every_python_example_is_run_here_or_named_as_left_to_another_test():
    blocks = python_blocks()
    assert blocks, "no ```python block in README.md"
    for block in blocks:
        owners = [m for m in (*RUN, *NOT_RUN) if m in block]
        assert len(owners) == 1, f"an example this test does not know:\n{block}"


def test_the_local_examples_run_as_written(tmp_path: Path):
    blocks = python_blocks()
    # The restart example builds a pool and leaves it to the reader: close it here.
    script = [*(the_block_with(m, blocks) for m in RUN), "pool.close()", f"print({DONE!r})"]
    path = tmp_path / "readme_examples.py"
    path.write_text("\n".join(script))
    proc = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0 and DONE in proc.stdout, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr
