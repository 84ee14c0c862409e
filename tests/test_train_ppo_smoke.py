"""Smoke test of ``scripts/train_ppo.py --quick``: a tiny PPO run over the pool completes.

Learning itself is not judged here (the quick run is far too short); this
checks that the script exits cleanly, printed a progress line per batch and
ended with a ``first_return=... last_return=...`` summary of finite numbers.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_ppo.py"
#: ``--quick`` finishes in well under a minute; a loaded 2-core machine gets slack.
RUN_TIMEOUT_S = 240
SUMMARY = re.compile(r"^first_return=(\S+) last_return=(\S+)$", re.MULTILINE)
PROGRESS = re.compile(r"^iter=\s*\d+ frames=\s*\d+ .*loss=", re.MULTILINE)

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def quick_run() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def test_exits_zero(quick_run: subprocess.CompletedProcess) -> None:
    assert quick_run.returncode == 0, f"stdout:\n{quick_run.stdout}\nstderr:\n{quick_run.stderr}"


def test_prints_a_progress_line_per_batch(quick_run: subprocess.CompletedProcess) -> None:
    assert len(PROGRESS.findall(quick_run.stdout)) >= 2, quick_run.stdout


def test_prints_a_finite_summary(quick_run: subprocess.CompletedProcess) -> None:
    match = SUMMARY.search(quick_run.stdout)
    assert match, f"no summary line in:\n{quick_run.stdout}"
    first, last = (float(value) for value in match.groups())
    assert math.isfinite(first) and math.isfinite(last), match.group(0)
    assert first > 0 and last > 0, match.group(0)
