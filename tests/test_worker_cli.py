"""``python -m workers``: bad arguments are one-line errors; a worker that failed exits non-zero.

Two kinds of test. The argument checks run in this process (``build_parser``,
``run`` on arguments that fail before anything is forked). The supervisor's
outcomes run as real processes, all started at once (each imports torch) and
awaited with a deadline: a supervised worker whose env maker cannot work, or
that cannot register, or with bad ``--slots``, must end with a non-zero status
and a one-line error, not restart its env process for ever.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from workers import cli, serving
from workers.loop import Worker
from workers.supervise import MAX_MAKER_FAILURES
from zmqpool.security import write_keys

ROOT = Path(__file__).resolve().parent.parent
#: Importing torch on a loaded 2-core machine (several processes at once), then the run itself.
RUN_TIMEOUT_S = 180

pytestmark = pytest.mark.timeout(2 * RUN_TIMEOUT_S)

MAKERS = """
def boom():
    raise RuntimeError("maker exploded")

def not_env():
    return 42

NOT_CALLABLE = 3
"""


@pytest.fixture(scope="module")
def helpers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``badmakers.py``, ``explodes.py`` (raises at import), ``exits.py``
    (``sys.exit(3)`` at import) and a key directory ``keys/`` (one worker)."""
    where = tmp_path_factory.mktemp("worker-cli")
    (where / "badmakers.py").write_text(textwrap.dedent(MAKERS))
    (where / "explodes.py").write_text("raise RuntimeError('no GPU here')\n")
    (where / "exits.py").write_text("import sys\n\nsys.exit(3)\n")
    write_keys(where / "keys", 1)
    return where


def _worker(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "workers", "--connect", f"tcp://127.0.0.1:{port}", *extra]


@pytest.fixture(scope="module")
def silent_port() -> Iterator[int]:
    """A ROUTER's port that takes connections and answers nothing: a pool that never welcomes.

    Connected, a worker whose maker failed says so at once; against a refused port
    each failure waited 2 s to be connected (``workers.loop._FAILED_CONNECT_WAIT_MS``),
    10 s of the fixture for MAX_MAKER_FAILURES failures.
    """
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        yield port
    finally:
        router.close()
        context.term()


@pytest.fixture(scope="module")
def runs(helpers: Path, silent_port: int) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """Start every supervised case at once; yield name -> finished process."""
    argvs = {
        "boom": _worker(silent_port, "--env", "badmakers:boom"),
        "not_env": _worker(silent_port, "--env", "badmakers:not_env"),
        "no_pool": _worker(
            silent_port,
            "--env",
            "zmqpool.testing:CountingEnv",
            "--num-envs",
            "2",
            "--register-timeout",
            "1",
        ),
        "slots_letters": _worker(
            silent_port,
            "--env",
            "zmqpool.testing:CountingEnv",
            "--num-envs",
            "2",
            "--slots",
            "a,b",
        ),
        "slots_count": _worker(
            silent_port, "--env", "zmqpool.testing:CountingEnv", "--slots", "1,2"
        ),
    }
    pythonpath = os.pathsep.join(p for p in (str(helpers), str(ROOT)) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    procs = {
        name: subprocess.Popen(
            argv,
            cwd=helpers,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for name, argv in argvs.items()
    }
    deadline = time.monotonic() + RUN_TIMEOUT_S  # one for all: they run at the same time
    try:
        finished = {}
        for name, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                out, err = proc.communicate(timeout=30)
                err += f"\n[still running after {RUN_TIMEOUT_S} s: killed]"
            finished[name] = subprocess.CompletedProcess(argvs[name], proc.returncode, out, err)
        yield finished
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------ the supervisor's outcomes


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("boom", "env maker raised RuntimeError('maker exploded')"),
        ("not_env", "the env maker returned int, not a torchrl EnvBase"),
    ],
)
def test_a_maker_that_never_works_ends_the_worker_with_its_error(runs, name, reason):
    proc = runs[name]
    assert proc.returncode == 1, explain(proc)
    line = last_line(proc)
    assert line.startswith("python -m workers: gave up: env process 0: its env maker failed"), line
    assert f"failed {MAX_MAKER_FAILURES} times in a row" in line and reason in line, line
    # Restarted, then not: MAX_MAKER_FAILURES starts in all.
    assert proc.stderr.count("; restarting in") == MAX_MAKER_FAILURES - 1, explain(proc)


def test_a_worker_that_cannot_register_exits_2_saying_why(runs):
    proc = runs["no_pool"]
    assert proc.returncode == 2, explain(proc)
    line = last_line(proc)
    assert line.startswith("python -m workers: gave up: env processes 0, 1: no answer from"), line
    assert "within 1.0 s" in line, line
    assert "is --server-key the pool's server.key?" in line, line  # a wrong one: no answer either
    assert "; restarting in" not in proc.stderr, explain(proc)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("slots_letters", "--slots must be comma-separated env indices, got 'a,b'"),
        ("slots_count", "--slots must name 1 env indices (--num-envs), got [1, 2]"),
    ],
)
def test_bad_slots_are_refused_before_any_env_process_starts(runs, name, message):
    proc = runs[name]
    assert proc.returncode == 2, explain(proc)
    assert last_line(proc) == f"python -m workers: error: {message}", explain(proc)
    assert "; restarting in" not in proc.stderr and "Traceback" not in proc.stderr, explain(proc)


# ------------------------------------------------------------ in-process: refused before a fork


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-envs", "0"], "argument --num-envs: must be an integer >= 1, got 0"),
        (["--num-envs", "-2"], "argument --num-envs: must be an integer >= 1, got -2"),
        (["--heartbeat-interval", "0"], "argument --heartbeat-interval: must be a number of"),
        (["--heartbeat-interval", "nan"], "argument --heartbeat-interval: must be a number of"),
        (["--register-timeout", "-1"], "argument --register-timeout: must be a number of"),
        (["--register-timeout", "0"], "argument --register-timeout: must be a number of"),
        (["--log-level", "LOUD"], "argument --log-level: invalid choice: 'LOUD'"),
        (["--connect", "garbage"], "argument --connect: must look like tcp://HOST:PORT"),
        (["--connect", "tcp://host"], "argument --connect: must look like tcp://HOST:PORT"),
        # Each env process's connect would fail (ZMQError), restarted for ever: refused here.
        (["--connect", "tcp://*:5555"], "argument --connect: needs the pool's host name or"),
        (["--connect", "tcp://127.0.0.1:0"], "needs a port from 1 to 65535, got 0 in"),
        (["--connect", "tcp://127.0.0.1:65536"], "needs a port from 1 to 65535, got 65536 in"),
        (["--connect", "tcp://-:5555"], "needs a host name or address (a letter or digit first"),
        (["--connect", "tcp://a*b:5555"], "needs a host name or address (a letter or digit first"),
        (["--env-indices", "a"], "argument --env-indices: must be comma-separated env indices"),
        (["--env-indices", "1,1"], "argument --env-indices: must be distinct env indices >= 0"),
        (["--env", "m:f", "--maker-stdin"], "argument --maker-stdin: not allowed with argument"),
    ],
)
def test_bad_values_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["--connect", "tcp://127.0.0.1:5555", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_good_values_still_parse():
    args = cli.build_parser().parse_args(
        ["--connect", "tcp://[::1]:5555", "--log-level", "info", "--register-timeout", "0.5"]
    )
    assert (args.log_level, args.register_timeout, args.num_envs) == ("INFO", 0.5, 1)
    assert cli.build_parser().parse_args(["--connect", "ipc:///tmp/x/r"]).connect
    for endpoint in ("tcp://trainer-1.example_lab.org:1", "tcp://10.0.0.2:65535"):
        assert cli.build_parser().parse_args(["--connect", endpoint]).connect == endpoint


def run_fails(capsys, helpers: Path, monkeypatch, *argv: str) -> tuple[int, str]:
    """``run`` with ``argv`` (a worker for an unused port), which must exit before any fork."""
    monkeypatch.chdir(helpers)
    monkeypatch.syspath_prepend(str(helpers))
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked"))
    with pytest.raises(SystemExit) as info:
        cli.run(["--connect", "tcp://127.0.0.1:9", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    code = info.value.code
    if isinstance(code, str):  # SystemExit("message"): printed by the interpreter, status 1
        return 1, code
    return code, err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("no_such_module_xyz:make", "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
        ("badmakers:nosuch", "AttributeError: module 'badmakers' has no attribute 'nosuch'"),
        ("badmakers.boom", "must look like package.module:callable, got 'badmakers.boom'"),
        ("badmakers:NOT_CALLABLE", "'NOT_CALLABLE' of 'badmakers' is a int, not a callable"),
        # Any exception at import, not only ImportError: one line naming module and exception.
        ("explodes:make", "--env explodes:make: cannot import 'explodes': RuntimeError: no GPU"),
        ("exits:make", "--env exits:make: cannot import 'exits': SystemExit: 3"),
    ],
)
def test_a_bad_env_name_is_a_one_line_error(capsys, helpers, monkeypatch, env, message):
    code, line = run_fails(capsys, helpers, monkeypatch, "--env", env)
    assert code == 2 and line.startswith("python -m workers: error: --env") and message in line


def test_bad_kwargs_are_a_one_line_error(capsys, helpers, monkeypatch):
    code, line = run_fails(
        capsys, helpers, monkeypatch, "--env", "badmakers:boom", "--kwargs", "{bad"
    )
    assert code == 2 and line.startswith("python -m workers: error: --kwargs is not JSON"), line


@pytest.mark.parametrize(
    "given", [["--server-key", "keys/server.key"], ["--client-key", "keys/x.key_secret"]]
)
def test_one_key_flag_without_the_other_is_a_usage_error(capsys, helpers, monkeypatch, given):
    code, line = run_fails(capsys, helpers, monkeypatch, "--env", "badmakers:boom", *given)
    assert code == 2, line
    assert line == "python -m workers: error: give both --server-key and --client-key, or neither"


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        (b"", "nothing on stdin"),
        (b"garbage\n", "not the pool's env makers: "),
        (pickle.dumps({"indices": [0]}), "not the pool's env makers: KeyError: 'recipes'"),
    ],
    ids=["empty", "garbage", "no-recipes"],
)
def test_a_bad_maker_stdin_is_a_one_line_error(capsys, monkeypatch, stdin, message):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked"))
    with pytest.raises(SystemExit) as info:
        cli.run(["--connect", "tcp://127.0.0.1:9", "--env-indices", "0", "--maker-stdin"])
    text = info.value.code  # SystemExit("message"): status 1, the message on stderr
    assert isinstance(text, str) and "\n" not in text, text
    assert text.startswith("python -m workers: --maker-stdin: ") and message in text, text
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_while_the_env_module_imports_is_status_130(monkeypatch):
    """Outside ``serve`` too: the maker's import (torch's, seconds) is where a Ctrl-C lands."""

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(serving, "maker_from_name", interrupted)
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked"))
    try:
        code = cli.main(["--connect", "tcp://127.0.0.1:9", "--env", "zmqpool.testing:X"])
    except KeyboardInterrupt:  # a failure of this test, not a Ctrl-C of pytest's session
        pytest.fail("the KeyboardInterrupt escaped main(): a traceback, not status 130")
    assert code == 130


def _keys(helpers: Path, server: str, client: str) -> list[str]:
    return ["--env", "badmakers:boom", "--server-key", server, "--client-key", client]


def test_key_file_errors_are_one_line(capsys, helpers, monkeypatch):
    good_server, good_client = "keys/server.key", "keys/workers/worker-0.key_secret"
    corrupt = helpers / "corrupt.key_secret"
    corrupt.write_text("not a key\n")
    corrupt.chmod(0o600)
    for public_mode in (0o644, 0o600):  # the public key where the secret one goes, either mode
        public = helpers / f"public{public_mode:o}.key"
        public.write_bytes((helpers / "keys" / "workers" / "worker-0.key").read_bytes())
        public.chmod(public_mode)
        code, line = run_fails(
            capsys, helpers, monkeypatch, *_keys(helpers, good_server, public.name)
        )
        assert code == 1 and "holds no secret key: give the .key_secret file" in line, line
        assert "chmod" not in line
    cases = {
        ("nope.key", good_client): "--server-key nope.key: no such file",
        ("keys", good_client): "--server-key keys: not a file",
        (good_server, "nope.key_secret"): "--client-key nope.key_secret: no such file",
        (good_server, corrupt.name): f"No public key found in {corrupt.name}",
    }
    for (server, client), message in cases.items():
        code, line = run_fails(capsys, helpers, monkeypatch, *_keys(helpers, server, client))
        assert code == 1 and line == f"python -m workers: {message}", line
    # The keys themselves are fine: the maker is what fails (in a fork, not reached here).
    public, secret = zmq.auth.load_certificate(helpers / good_client)
    assert secret is not None and public


def test_help_and_a_bad_flag_answer_before_torch_is_imported():
    """``--help`` took 3.3 s here, all of it importing what hosts envs; now a fraction of a second.

    In a fresh interpreter: this one has torch already. Both commands, ``python -m
    workers`` and ``zmqpool worker``.
    """
    code = textwrap.dedent(
        """
        import sys
        from workers import cli
        from zmqpool import cli as zmqpool_cli
        calls = [
            lambda: cli.main(["--help"]),
            lambda: cli.main(["--connect", "tcp://*:1", "--env", "x:y"]),  # refused by argparse
            lambda: zmqpool_cli.main(["worker", "--help"]),
        ]
        for call in calls:
            try:
                call()
            except SystemExit as done:
                print("status", done.code)
        print("heavy", sorted(m for m in ("torch", "tensordict", "torchrl") if m in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    said = [line for line in out.stdout.splitlines() if line.startswith(("status ", "heavy "))]
    assert said == ["status 0", "status 2", "status 0", "heavy []"], (
        out.stdout[-500:],
        out.stderr[-2000:],
    )


def test_the_zmqpool_worker_command_names_itself(capsys):
    from zmqpool import cli as zmqpool_cli

    with pytest.raises(SystemExit):
        zmqpool_cli.main(["worker", "--help"])
    assert capsys.readouterr().out.startswith("usage: zmqpool worker ")


def test_ctrl_c_of_a_single_process_worker_is_status_130_without_a_traceback(monkeypatch):
    closed = []
    close = Worker.close

    def interrupted(self):
        raise KeyboardInterrupt

    def closing(self):  # really closed: a leaked worker's context blocks a later GC in term()
        closed.append(self)
        close(self)

    monkeypatch.setattr(Worker, "register", interrupted)
    monkeypatch.setattr(Worker, "close", closing)
    argv = ["--connect", "tcp://127.0.0.1:9", "--env", "zmqpool.testing:CountingEnv"]
    assert cli.run([*argv, "--single-process"]) == 130
    assert len(closed) == 1
