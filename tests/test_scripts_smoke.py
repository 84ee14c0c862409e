"""Every script in scripts/ runs with tiny sizes (bench and PPO have their own smoke tests)."""

import json
import subprocess
import sys


def test_restart_bench_runs_and_measures_a_restart(tmp_path):
    out = tmp_path / "restart.json"
    argv = [sys.executable, "scripts/restart_bench.py", "--kills", "2", "--window", "0.3"]
    argv += ["--no-fresh-interpreter", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = json.loads(out.read_text())["fork server"]
    assert 0 < row["restart_latency_median_s"] < 60
    assert row["healthy_steps_per_s_during_restart"] > 0
