"""Smoke test of ``scripts/bench.py --quick`` (and its threshold probe): they run and measure.

The numbers themselves are not judged (the targets are informational); this
only checks that every scenario ran zmqpool plus at least one reference row,
that no row failed, and that the JSON and PNG reports were written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench.py"
QUICK_SCENARIOS = {"cheap", "pixel", "1mib", "latency", "roundtrip"}
#: ``--quick`` is meant to finish in about a minute; a loaded 2-core machine gets slack.
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("bench")
    argv = [sys.executable, str(SCRIPT), "--quick", "--json", str(out / "r.json")]
    argv += ["--plot", str(out / "r.png")]
    proc = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    return proc, out


pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)


def results_of(out: Path) -> list[dict]:
    return json.loads((out / "r.json").read_text())["results"]


def test_exits_zero_and_prints_a_table(quick_run):
    proc, _ = quick_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "| scenario | row |" in proc.stdout


def test_every_row_it_ran_measured_steps(quick_run):
    proc, out = quick_run
    results = results_of(out)
    pairs = [(r["scenario"], r["row"]) for r in results]
    assert len(pairs) == len(set(pairs)), pairs
    failed = [(r["scenario"], r["row"], r["error"]) for r in results if r["error"]]
    assert not failed, f"{failed}\nstderr:\n{proc.stderr}"
    for r in results:
        assert r["steps"] > 0 and r["steps_per_s"] > 0, r


def test_every_scenario_has_a_zmqpool_row_and_a_reference(quick_run):
    _, out = quick_run
    rows: dict[str, set[str]] = {}
    for r in results_of(out):
        rows.setdefault(r["scenario"], set()).add(r["row"])
    assert set(rows) == QUICK_SCENARIOS
    for scenario, names in rows.items():
        assert "zmqpool" in names, scenario
        assert len(names) >= 2, (scenario, names)


def test_ratios_and_targets_are_computed(quick_run):
    _, out = quick_run
    report = json.loads((out / "r.json").read_text())
    others = {(r["scenario"], r["row"]) for r in report["results"] if r["row"] != "zmqpool"}
    ratios = {(x["scenario"], x["row"]): x["zmqpool_over_row"] for x in report["ratios"]}
    assert set(ratios) == others
    assert all(v > 0 for v in ratios.values())
    assert report["targets"], "no target was judged"
    for target in report["targets"]:
        assert target["passed"] in (True, False), target


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="CPU accounting reads /proc")
def test_cpu_per_step_counts_the_worker_processes(quick_run):
    _, out = quick_run
    for r in results_of(out):
        # (seconds from clock ticks, subtracted: equal shares may differ in the last bit)
        assert r["cpu_us_per_step"] >= r["trainer_cpu_us_per_step"] * (1 - 1e-9), r
        assert r["trainer_cpu_us_per_step"] >= 0, r
        assert r["switches_per_step"] >= 0, r
    cells = {(r["scenario"], r["row"]): r for r in results_of(out)}
    # The envs step in the workers: a pool's total is well above its trainer's share,
    # and stepping in-process leaves nothing outside the trainer.
    pool, serial = cells[("cheap", "zmqpool")], cells[("cheap", "serial")]
    assert pool["cpu_us_per_step"] > 1.5 * pool["trainer_cpu_us_per_step"], pool
    assert serial["cpu_us_per_step"] == pytest.approx(serial["trainer_cpu_us_per_step"]), serial


def test_plot_is_a_png(quick_run):
    _, out = quick_run
    png = out / "r.png"
    assert png.exists()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_threshold_probe_measures_both_layouts(tmp_path):
    argv = [sys.executable, str(SCRIPT), "--probe-threshold", "--quick"]
    argv += ["--json", str(tmp_path / "probe.json")]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "| observation |" in proc.stdout
    report = json.loads((tmp_path / "probe.json").read_text())
    cells = {(r["nbytes"], r["own_frame"]) for r in report["probe"]}
    assert cells == {(n, own) for n in (1 << 10, 64 << 10) for own in (False, True)}
    assert all(r["send_us"] > 0 and r["recv_us"] > 0 for r in report["probe"])
    assert "crossover_bytes" in report
