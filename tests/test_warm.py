"""tests/warm.py's children start as ``python SCRIPT`` would, so the tests that use them
test what a fresh interpreter would run: argv, path, directory, environment, signal
dispositions, descriptors, exit status, tracebacks, and the network namespace."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import warm

PROBE = textwrap.dedent(
    """
    import json, os, signal, sys
    report = {
        "argv": sys.argv,
        "path": sys.path[:2],
        "tests_dir": [p for p in sys.path if p.endswith("tests")],
        "main_module": sys.modules["__main__"].__dict__ is globals(),
        "cwd": os.getcwd(),
        "var": os.environ.get("WARM_PROBE"),
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": int(signal.getsignal(signal.SIGTERM)),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "main": __name__,
        "line": sys.stdin.readline().strip(),
    }
    print(json.dumps(report))  # PYTHONUNBUFFERED: out at once, no flush
    if len(sys.argv) > 1:
        raise KeyboardInterrupt  # the interpreter dies of SIGINT, after a traceback
    sys.stdin.readline()
    """
)


def test_a_child_starts_and_ends_as_a_fresh_interpreter_would(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {"WARM_PROBE": "yes", "PYTHONPATH": "/no/such/dir", "PYTHONUNBUFFERED": "1"}
    proc = warm.popen(
        [sys.executable, str(script), "x"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd="/",
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("hello\n")
    proc.stdin.flush()  # buffered, as Popen's
    report = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=30) == -signal.SIGINT
    assert report["argv"] == [str(script), "x"] and report["cwd"] == "/"
    # Its directory, then PYTHONPATH; not the launcher's tests/ (an env maker of a test
    # module imported only there), and in a __main__ of its own.
    assert report["path"] == [str(tmp_path), "/no/such/dir"] and report["tests_dir"] == []
    assert report["var"] == "yes" and report["main"] == "__main__" and report["main_module"]
    assert report["line"] == "hello"
    assert report["sigint_default"] and report["sigterm"] == int(signal.SIG_DFL)
    # 0-2, and the descriptor listdir itself opened: nothing of the launcher's.
    assert len(report["fds"]) == 4 and report["fds"][:3] == [0, 1, 2], report["fds"]


def test_unbuffered_output_is_out_before_a_kill(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {"PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, str(script)]
    proc = warm.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["line"] == "hello"  # printed, not flushed
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_its_exit_by_signal_and_its_traceback_are_its_own(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        "import sys\nprint('up', flush=True)\nsys.stdin.readline()\nraise ValueError('boom')\n"
    )
    argv = [sys.executable, str(script)]
    failing = warm.popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    killed = warm.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert killed.stdout is not None and killed.stdout.readline() == "up\n"
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL
    _, err = failing.communicate(timeout=30)
    assert failing.returncode == 1
    assert err.startswith("Traceback") and err.rstrip().endswith("ValueError: boom"), err
    assert "_Become" not in err and "During handling" not in err, err


def test_a_module_runs_as_python_m_does_in_the_given_network_namespace(remote_host, tmp_path):
    if remote_host.namespace is None:
        pytest.skip(f"no network namespace here: {remote_host.why_not}")
    (tmp_path / "nsprobe.py").write_text(
        "import json, socket, sys\n"
        "print(json.dumps([sys.argv, [name for _, name in socket.if_nameindex()]]))\n"
    )
    proc = warm.popen(
        [sys.executable, "-m", "nsprobe", "a"],
        stdout=subprocess.PIPE,
        cwd=tmp_path,
        netns=remote_host.namespace,
    )
    out, _ = proc.communicate(timeout=30)
    argv, interfaces = json.loads(out)
    assert proc.returncode == 0 and argv == [str(tmp_path / "nsprobe.py"), "a"]
    tag = remote_host.namespace.removeprefix("zmqp")
    assert sorted(interfaces) == ["lo", f"zp{tag}b"], interfaces  # the namespace's, only
