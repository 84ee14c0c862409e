"""Every script in scripts/ runs with tiny sizes (bench and PPO have their own smoke tests)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest


def test_restart_bench_runs_and_measures_a_restart(tmp_path):
    out = tmp_path / "restart.json"
    argv = [sys.executable, "scripts/restart_bench.py", "--kills", "2", "--window", "0.3"]
    argv += ["--no-fresh-interpreter", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = json.loads(out.read_text())["fork server"]
    assert 0 < row["restart_latency_median_s"] < 60
    assert row["healthy_steps_per_s_during_restart"] > 0


def test_count_instructions_runs_its_workload_without_valgrind():
    argv = [sys.executable, "scripts/count_instructions.py", "--dry-run", "--num-envs", "2"]
    argv += ["--envs-per-worker", "2", "--rounds", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "done: 3 rounds of 2 env-steps" in done.stdout


@pytest.mark.parametrize("command", ["STEP", "STEP_AND_MAYBE_RESET"])
def test_count_instructions_runs_a_workers_workload_without_valgrind(command):
    argv = [sys.executable, "scripts/count_instructions.py", "--dry-run", "--worker", command]
    argv += ["--rounds", "5"]
    # Its own temporary folder, short: an ipc path is at most 107 bytes.
    tmp = tempfile.mkdtemp(prefix="zc-", dir="/tmp")
    try:
        env = {**os.environ, "TMPDIR": tmp}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        assert f"done: 5 {command} commands" in done.stdout
        assert os.listdir(tmp) == []  # its sockets' folder is removed (it was left)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_count_instructions_reads_callgrinds_count_and_refuses_a_log_without_one():
    sys.path.insert(0, "scripts")
    try:
        import count_instructions
    finally:
        sys.path.remove("scripts")
    log = "==7== Events    : Ir\n==7== Collected : 305567029\n==7== I   refs:      305,567,029\n"
    assert count_instructions.parse_collected(log) == 305567029
    counted = count_instructions.Count(
        "x", num_envs=64, envs_per_worker=16, rounds=20, instructions=305567029
    )
    assert round(counted.per_env_step) == 238724
    with pytest.raises(RuntimeError, match="no count"):
        count_instructions.parse_collected("==7== valgrind: fatal error\n")


def test_judge_bar_steps_two_computing_envs_each_way(capsys):
    # In this process: its pools share the fork server the other tests' pools use.
    sys.path.insert(0, "scripts")
    try:
        import judge_bar
    finally:
        sys.path.remove("scripts")
    judge_bar.main(["--sizes", "32x1", "--repeats", "1", "--rounds", "3"])
    shown = capsys.readouterr().out
    assert shown.startswith("32x1, ") and shown.count(" steps/s") == 1
    for config in ("threads", "judged", "inline"):
        assert f" {config} " in shown


def test_trainer_phases_splits_the_loops_cpu_and_puts_the_pool_back(capsys):
    sys.path.insert(0, "scripts")
    try:
        import trainer_phases
    finally:
        sys.path.remove("scripts")
    from zmqpool import intake

    original = intake.Intake.on_result
    sizes = ["--num-envs", "2", "--envs-per-worker", "2", "--min-get", "2"]
    trainer_phases.main([*sizes, "--seconds", "0.5", "--warmup", "0.2"])
    assert intake.Intake.on_result is original  # every wrapper taken off again
    shown = capsys.readouterr().out
    figures = {}
    for line in shown.splitlines()[3:]:
        label, _, figure = line.rpartition(" ")
        figures[label.strip()] = float(figure)
    assert shown.startswith("batch32: 2 envs, 2 a worker, min_get=2, env threads on\n")
    assert "the main thread, all of it" in shown.splitlines()[2]
    for phase in trainer_phases.PHASES:  # each was called and timed
        assert figures[phase.label] > 0, phase.label
    assert figures["async_step_recv"] >= figures["Runtime.collect"] >= figures["Broker.poll"]
