"""The ``zmqpool`` command: help texts, keygen, the demo (real processes, bounded waits).

Every ``python`` start imports torch (a few seconds on a 2-core machine), so
the short commands are started all at once and awaited together.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from zmqpool import cli
from zmqpool.demo import DEFAULT_ENV, EnvTally

#: A short command (help, keygen) imports torch and exits; a loaded machine gets slack.
SHORT_TIMEOUT_S = 180
#: The demo builds a pool (each worker imports torchrl), steps it and closes it.
DEMO_TIMEOUT_S = 150

pytestmark = pytest.mark.timeout(2 * DEMO_TIMEOUT_S)


def console_script() -> str:
    """The installed ``zmqpool`` entry point (next to this interpreter, or on PATH)."""
    beside = Path(sys.executable).with_name("zmqpool")
    found = str(beside) if beside.exists() else shutil.which("zmqpool")
    if found is None:
        pytest.fail("the zmqpool console script is not installed: pip install -e .")
    return found


def run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


HELP_COMMANDS = {
    "zmqpool": [],
    "demo": ["demo"],
    "worker": ["worker"],
    "keygen": ["keygen"],
    "bench": ["bench"],
}


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keygen") / "keys"


@pytest.fixture(scope="module")
def rel_cwd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working directory of ``zmqpool keygen keys/ --workers 2`` (the README's command)."""
    return tmp_path_factory.mktemp("keygen-rel")


@pytest.fixture(scope="module")
def abs_cwd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working directory of the console-script keygen given an absolute DIR elsewhere."""
    return tmp_path_factory.mktemp("keygen-abs-cwd")


@pytest.fixture(scope="module")
def short_runs(
    keys_dir: Path, rel_cwd: Path, abs_cwd: Path
) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """Start every help command and the keygens at once; yield name -> finished process."""
    exe = console_script()
    argvs = {f"help:{k}": [exe, *v, "--help"] for k, v in HELP_COMMANDS.items()}
    argvs["keygen"] = [sys.executable, "-m", "zmqpool", "keygen", str(keys_dir), "--workers", "2"]
    # The README's command as written (a relative DIR), and the same with an absolute DIR
    # outside the working directory, both through the installed console script.
    argvs["keygen:relative"] = [exe, "keygen", "keys/", "--workers", "2"]
    argvs["keygen:absolute"] = [exe, "keygen", str(keys_dir.parent / "abs-keys"), "--workers", "2"]
    cwds = {"keygen:relative": rel_cwd, "keygen:absolute": abs_cwd}
    procs = {
        name: subprocess.Popen(
            argv,
            cwd=cwds.get(name),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in argvs.items()
    }
    try:
        yield {name: _finish(p, argvs[name]) for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def _finish(proc: subprocess.Popen, argv: list[str]) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=SHORT_TIMEOUT_S)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize("name", [f"help:{k}" for k in HELP_COMMANDS])
def test_help_exits_zero(short_runs, name):
    proc = short_runs[name]
    assert proc.returncode == 0, explain(proc)
    assert "usage:" in proc.stdout.lower()


def test_top_level_help_lists_every_subcommand(short_runs):
    for command in ("demo", "worker", "keygen", "bench"):
        assert command in short_runs["help:zmqpool"].stdout


def test_worker_help_is_the_workers_command(short_runs):
    out = short_runs["help:worker"].stdout
    assert "--connect" in out and "--env" in out


def test_bench_help_names_the_command_that_ran_it(short_runs):
    assert short_runs["help:bench"].stdout.startswith("usage: zmqpool bench ")


KEY_FILES = sorted(
    [
        "authorized",
        "authorized/worker-0.key",
        "authorized/worker-1.key",
        "server.key",
        "server.key_secret",
        "workers",
        *(f"workers/worker-{i}.{ext}" for i in (0, 1) for ext in ("key", "key_secret")),
    ]
)


def check_key_dir(keys_dir: Path) -> None:
    """The files of ``keygen DIR --workers 2``, with the README's modes, loadable."""
    assert sorted(str(p.relative_to(keys_dir)) for p in keys_dir.rglob("*")) == KEY_FILES
    for directory in (keys_dir, keys_dir / "workers", keys_dir / "authorized"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for base in ("server", "workers/worker-0", "workers/worker-1"):
        public, secret = keys_dir / f"{base}.key", keys_dir / f"{base}.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        pub_key, no_secret = zmq.auth.load_certificate(public)
        same_pub, secret_key = zmq.auth.load_certificate(secret)
        assert no_secret is None and secret_key is not None
        assert pub_key == same_pub and len(pub_key) == 40 and len(secret_key) == 40


def check_listing(stdout: str, keys_dir: Path) -> None:
    """What keygen prints: the absolute directory, one line per pair, its paths inside DIR."""
    where = keys_dir.resolve()
    expected = [
        f"wrote 3 CURVE key pairs under {where} (directories 0700, secrets 0600):",
        "  server     server.key, server.key_secret",
        "  worker-0   workers/worker-0.key, workers/worker-0.key_secret",
        "  worker-1   workers/worker-1.key, workers/worker-1.key_secret",
        "  allow-list 2 public keys in authorized/",
    ]
    assert stdout.splitlines()[: len(expected)] == expected, stdout
    # The usage names the directory absolutely, so it is right from any working directory.
    assert f'curve_keys="{where}"' in stdout, stdout
    assert f"gets {where}/server.key and {where}/workers/worker-N.key_secret" in stdout, stdout


def test_keygen_writes_private_loadable_keys(short_runs, keys_dir):
    proc = short_runs["keygen"]
    assert proc.returncode == 0, explain(proc)
    assert str(keys_dir) in proc.stdout
    check_key_dir(keys_dir)


def test_keygen_with_a_relative_dir_as_the_readme_writes_it(short_runs, rel_cwd):
    proc = short_runs["keygen:relative"]
    assert proc.returncode == 0, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    check_key_dir(rel_cwd / "keys")
    check_listing(proc.stdout, rel_cwd / "keys")
    assert sorted(p.name for p in rel_cwd.iterdir()) == ["keys"]


def test_keygen_with_an_absolute_dir_elsewhere(short_runs, keys_dir, abs_cwd):
    proc = short_runs["keygen:absolute"]
    assert proc.returncode == 0, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    check_key_dir(keys_dir.parent / "abs-keys")
    check_listing(proc.stdout, keys_dir.parent / "abs-keys")
    assert list(abs_cwd.iterdir()) == [], "nothing is written to the working directory"


def test_keygen_authorizes_exactly_the_workers(short_runs, keys_dir):
    assert short_runs["keygen"].returncode == 0
    for i in (0, 1):
        allowed, _ = zmq.auth.load_certificate(keys_dir / "authorized" / f"worker-{i}.key")
        own, _ = zmq.auth.load_certificate(keys_dir / "workers" / f"worker-{i}.key_secret")
        assert allowed == own


# ---------------------------------------------------------------- in-process, no torch start-up


def test_keygen_refuses_to_overwrite_without_force(tmp_path, capsys):
    keys = tmp_path / "k"
    assert cli.main(["keygen", str(keys), "--workers", "3"]) == 0
    before = (keys / "server.key_secret").read_text()
    assert cli.main(["keygen", str(keys)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (keys / "server.key_secret").read_text() == before
    assert cli.main(["keygen", str(keys), "--force"]) == 0
    assert (keys / "server.key_secret").read_text() != before
    # Fewer workers now: the keys of the others are no longer accepted.
    assert sorted(p.name for p in (keys / "authorized").iterdir()) == ["worker-0.key"]


def test_keygen_refuses_a_directory_others_can_read(tmp_path, capsys):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    assert cli.main(["keygen", str(open_dir)]) == 2
    assert "0755" in capsys.readouterr().err
    assert list(open_dir.iterdir()) == []


@pytest.mark.parametrize("target", ["/proc/zmqpool-keys", "a-file/keys"])
def test_keygen_where_it_cannot_write_is_a_one_line_error(tmp_path, monkeypatch, capsys, target):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a directory\n")
    assert cli.main(["keygen", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zmqpool keygen: cannot write keys into {target}: "), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("existing", ["server.key", "workers/worker-0.key", "authorized/old.key"])
def test_keygen_refuses_to_replace_a_public_key_without_force(tmp_path, capsys, existing):
    keys = tmp_path / "k"
    for directory in (keys, keys / "workers", keys / "authorized"):
        directory.mkdir(mode=0o700)
        directory.chmod(0o700)
    (keys / existing).write_text("public-key = 'kept'\n")
    assert cli.main(["keygen", str(keys)]) == 2
    assert f"already holds ['{existing}']; pass --force" in capsys.readouterr().err
    assert (keys / existing).read_text() == "public-key = 'kept'\n"
    assert not (keys / "server.key_secret").exists()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_demo_refuses_a_step_timeout_that_is_not_a_positive_duration(monkeypatch, capsys, value):
    monkeypatch.setattr(cli, "_cmd_demo", lambda args: pytest.fail("the demo ran"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--step-timeout", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --step-timeout: must be a number of seconds > 0, got {value}" in err
    assert "Traceback" not in err


def test_demo_report_counts_env_restarts_as_such():
    from zmqpool.demo import DemoOptions, DemoResult, print_report

    out = io.StringIO()
    opts = DemoOptions(num_envs=2, envs_per_worker=2, kill_one=True)
    print_report(opts, DemoResult(10, 1.0, 0.5, [EnvTally(), EnvTally()], restarts_seen=2), out)
    assert "env restarts: 2" in out.getvalue() and "worker restarts" not in out.getvalue()


def test_demo_rejects_a_bad_env_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--env", "no_such_module_xyz:make"])
    assert exit_info.value.code == 2
    assert "no_such_module_xyz" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("source", "raised"),
    [
        ("raise RuntimeError('no display here')", "RuntimeError: no display here"),
        ("import no_such_dependency_xyz", "ModuleNotFoundError: No module named 'no_such_dep"),
        ("import sys; sys.exit(3)", "SystemExit: 3"),  # was: exit 3, no message
    ],
)
def test_demo_env_whose_module_fails_to_import_is_a_one_line_error(
    monkeypatch, tmp_path, capsys, source, raised
):
    """Whatever the module raises at import: one line naming it and the exception, status 2
    (as python -m workers --env: the same check, workers.hosting.maker_from_name)."""
    (tmp_path / "broken_env_module.py").write_text(f"{source}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "_cmd_demo", lambda args: pytest.fail("the demo ran"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--env", "broken_env_module:make"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    expected = "zmqpool demo: error: --env broken_env_module:make: cannot import "
    assert err.strip().splitlines()[-1].startswith(f"{expected}'broken_env_module': {raised}"), err


@pytest.mark.parametrize("value", ["-1", str(2**64)])
def test_demo_refuses_a_seed_torch_or_torchrl_would_refuse(monkeypatch, capsys, value):
    """torch.manual_seed takes -1, but torchrl's seed chain and gymnasium refuse negative seeds
    (the envs' processes raised, a traceback), and torch.manual_seed refuses 2**64."""
    monkeypatch.setattr(cli, "_cmd_demo", lambda args: pytest.fail("the demo ran"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--seed", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"zmqpool demo: error: argument --seed: must be an integer from 0 to 2**64 - 1, got {value}"
    )
    for good in (0, 2**64 - 1):
        assert cli.build_parser().parse_args(["demo", "--seed", str(good)]).seed == good


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (["demo"], ("zmqpool.demo", "load_env_maker")),  # the env's import, before the handler
        (["worker", "--help"], ("workers.cli", "main")),  # a passthrough's own imports
    ],
    ids=["demo-env-import", "worker-passthrough"],
)
def test_ctrl_c_anywhere_in_the_command_is_status_130(monkeypatch, argv, where):
    module, name = where
    monkeypatch.setattr(f"{module}.{name}", _interrupted)
    monkeypatch.setattr(cli, "_cmd_demo", lambda args: pytest.fail("the demo ran"))
    try:
        code = cli.main(argv)
    except KeyboardInterrupt:  # a failure of this test, not a Ctrl-C of pytest's session
        pytest.fail("the KeyboardInterrupt escaped main(): a traceback, not status 130")
    assert code == 130


def test_bench_without_the_script_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "scripts" / "bench.py")
    assert cli.main(["bench", "--quick"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_cli_and_demo_agree_on_the_default_env():
    assert cli.DEFAULT_ENV == DEFAULT_ENV


def test_env_tally_counts_episodes_and_returns():
    tally = EnvTally()
    for done in (False, False, True, False, True):
        tally.record(1.0, done, truncated=False)
    assert (tally.steps, tally.episodes, tally.mean_return) == (5, 2, 2.5)
    assert tally.episode_return == 0.0


# ---------------------------------------------------------------- the demo, for real


def demo(*extra: str) -> subprocess.CompletedProcess:
    argv = [console_script(), "demo", "--num-envs", "2", "--no-progress", *extra]
    return run(argv, DEMO_TIMEOUT_S)


def per_env_steps(stdout: str) -> dict[int, int]:
    """``env steps episodes ...`` rows of the report, as env -> steps."""
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+\d+\s+\S+\s+\d+\s*$", stdout, flags=re.M)
    return {int(env): int(steps) for env, steps in rows}


def test_demo_runs_and_reports_throughput_and_per_env_lines():
    proc = demo("--steps", "200")
    assert proc.returncode == 0, explain(proc)
    rate = re.search(r"200 env-steps in [\d.]+ s: ([\d,]+) env-steps/s", proc.stdout)
    assert rate and int(rate.group(1).replace(",", "")) > 0, proc.stdout
    steps = per_env_steps(proc.stdout)
    assert set(steps) == {0, 1} and sum(steps.values()) == 200, proc.stdout


# Depends on the pool's hot restart (commit 11dc24a): a dead worker is
# restarted and its in-flight request answered with a truncation.
def test_demo_kill_one_shows_the_restart():
    proc = demo("--steps", "400", "--kill-one", "--step-timeout", "60")
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"killed worker \S+ \(pid \d+\) with SIGKILL", proc.stdout), proc.stdout
    assert re.search(r"worker \S+ restarted: pid \d+", proc.stdout), proc.stdout
    assert re.search(r"env restarts: [1-9]", proc.stdout), proc.stdout
    assert sum(per_env_steps(proc.stdout).values()) == 400, proc.stdout


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children of any of its threads: the pool forks from one)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in children.read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return [p for child in found for p in (child, *_descendants(child))]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads children from /proc")
def test_ctrl_c_of_the_demo_in_a_terminal_exits_130_without_a_traceback():
    """A terminal's Ctrl-C signals the whole process group: the trainer, the fork server and
    the workers. Only the trainer's exit says so: the fork server and the workers ignore
    SIGINT (the fork server printed its KeyboardInterrupt traceback, in os.read)."""
    argv = [console_script(), "demo", "--num-envs", "2", "--steps", "100000000", "--no-progress"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        # The fork server and its 2 workers: all of the group a Ctrl-C would reach.
        while len(_descendants(proc.pid)) < 3 and proc.poll() is None:
            assert time.monotonic() < deadline, "the demo's workers never started"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=DEMO_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in err, err
