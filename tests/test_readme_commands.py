"""The README's "Workers on other machines" commands, read from README.md and run as written.

The keygen command, the files a worker machine gets, the worker command and the
pool's ``curve_keys`` are all taken from the README text, so the README cannot
drift from what works. Only the placeholders are replaced: ``TRAINER`` by
127.0.0.1, the port by a free one, ``my_package.envs:make_env`` by an env that
says who it is (``zmqpool.testing:CountingEnv``, with ``--kwargs`` giving each
of the worker's envs its own id) and ``python``/``zmqpool`` by this
interpreter's. Every wait is bounded: subprocess timeouts and the pool's
``register_timeout_s``.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import FAST, stop
from tests.netns import free_port_base
from zmqpool import ZMQAsyncEnvPool

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "Workers on other machines"
#: keygen imports zmq (and starts an interpreter): seconds, but a loaded 2-core machine is slow.
KEYGEN_TIMEOUT_S = 180
#: Ids the worker's envs write into observation[..., 0]: no local env could produce them.
REMOTE_ID_BASE = 100

pytestmark = pytest.mark.timeout(FAST.register_timeout_s + 2 * KEYGEN_TIMEOUT_S)


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a markdown text."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def shell_command(blocks: list[str], prefix: str) -> list[str]:
    """The one command of a bash block that starts with ``prefix``, split as a shell would."""
    found = [b for b in blocks if b.startswith(prefix)]
    assert len(found) == 1, f"expected one bash block starting with {prefix!r}, got {found}"
    return shlex.split(found[0].replace("\\\n", " "))


class ReadmeCommands:
    """What the README's remote-worker section says to type and copy."""

    def __init__(self, text: str) -> None:
        body = section(text, SECTION)
        bash = code_blocks(body, "bash")
        self.keygen = shell_command(bash, "zmqpool keygen")
        self.worker = shell_command(bash, "python -m workers")
        gets = re.search(r"Worker machine `N` gets\s+`([^`]+)` and\s+`([^`]+)`", body)
        assert gets, "the README no longer says which files a worker machine gets"
        self.worker_files = [gets.group(1), gets.group(2).replace("N", "0")]
        pool_blocks = [b for b in code_blocks(body, "python") if "remote_envs=" in b]
        assert len(pool_blocks) == 1, pool_blocks
        keys = re.search(r'curve_keys="([^"]+)"', pool_blocks[0])
        bind = re.search(r'bind="tcp://[^:"]+:(\d+)"', pool_blocks[0])
        assert keys and bind, pool_blocks[0]
        self.curve_keys, self.bind_port = keys.group(1), bind.group(1)

    def option(self, name: str) -> str:
        return self.worker[self.worker.index(name) + 1]


@pytest.fixture(scope="module")
def readme() -> ReadmeCommands:
    return ReadmeCommands(README.read_text())


def console_script(name: str) -> str:
    """The installed entry point ``name`` (next to this interpreter, or on PATH)."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"the {name} console script is not installed: pip install -e .")
    return found


def test_the_readme_commands_fit_together(readme):
    """The commands this file runs say what the test assumes, and agree with each other."""
    assert readme.keygen[:2] == ["zmqpool", "keygen"]
    keys_dir = readme.keygen[2]
    assert not Path(keys_dir).is_absolute(), "the README's keygen uses a relative DIR"
    assert readme.keygen[3:] == ["--workers", "2"]
    assert Path(readme.curve_keys) == Path(keys_dir), "the pool reads the keys keygen wrote"
    assert readme.worker[:3] == ["python", "-m", "workers"]
    assert readme.option("--connect") == f"tcp://TRAINER:{readme.bind_port}"
    # The worker names the files it was given, as they lie in its working directory.
    server_key, client_key = readme.worker_files
    assert readme.option("--server-key") == Path(server_key).name
    assert readme.option("--client-key") == Path(client_key).name


def worker_argv(readme: ReadmeCommands, port: int) -> tuple[list[str], int]:
    """The README's worker command with its placeholders filled in; and its --num-envs."""
    substitutions = {
        "python": sys.executable,
        f"tcp://TRAINER:{readme.bind_port}": f"tcp://127.0.0.1:{port}",
        "my_package.envs:make_env": "zmqpool.testing:CountingEnv",
    }
    missing = [old for old in substitutions if old not in readme.worker]
    assert not missing, f"placeholders no longer in the README's worker command: {missing}"
    argv = [substitutions.get(arg, arg) for arg in readme.worker]
    num_envs = int(readme.option("--num-envs"))  # kept as written: 4 forked env processes
    ids = [{"env_id": REMOTE_ID_BASE + k} for k in range(num_envs)]
    return [*argv, "--kwargs", json.dumps(ids)], num_envs


def test_readme_keygen_and_worker_commands_run_as_written(readme, tmp_path, monkeypatch):
    trainer_dir, worker_dir = tmp_path / "trainer", tmp_path / "worker-0"
    trainer_dir.mkdir()
    worker_dir.mkdir()

    # On the trainer: the keygen command as written, with its relative DIR.
    keygen = [console_script("zmqpool"), *readme.keygen[1:]]
    done = subprocess.run(
        keygen, cwd=trainer_dir, capture_output=True, text=True, timeout=KEYGEN_TIMEOUT_S
    )
    assert done.returncode == 0, f"{keygen}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    keys = trainer_dir / readme.keygen[2]
    for directory in (keys, keys / "workers", keys / "authorized"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE((keys / "server.key_secret").stat().st_mode) == 0o600

    # Worker machine 0 gets the files the README names, into its working directory.
    for name in readme.worker_files:
        shutil.copy(keys / name, worker_dir / Path(name).name)

    port = free_port_base("127.0.0.1")
    argv, num_envs = worker_argv(readme, port)
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:
        # The README: start it before or after the trainer; it waits.
        worker = subprocess.Popen(
            argv, cwd=worker_dir, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    try:
        monkeypatch.chdir(trainer_dir)
        # No local envs (the README's example has 4): every result here must come from
        # the worker, and this suite stays light on 2 cores.
        pool = ZMQAsyncEnvPool(
            [],
            remote_envs=num_envs,
            bind=f"tcp://127.0.0.1:{port}",
            curve_keys=readme.curve_keys,  # "keys/", relative to the trainer's cwd
            config=FAST,
        )
        try:
            check_remote_envs(pool, num_envs)
        finally:
            pool.close()
        assert worker.poll() is None, f"the worker exited early:\n{log_path.read_text()}"
    finally:
        stop(worker)


def check_remote_envs(pool: ZMQAsyncEnvPool, num_envs: int) -> None:
    remote_ids = {float(REMOTE_ID_BASE + k) for k in range(num_envs)}
    td = pool.reset()
    assert [int(i) for i in td["env_index"]] == list(range(num_envs))
    # Which of the worker's envs took which slot is the pool's choice; all of them did.
    ids = td["observation"][:, 0].tolist()
    assert set(ids) == remote_ids, ids
    assert td["observation"][:, 1].tolist() == [0.0] * num_envs
    for step in (1, 2):
        actions = torch.tensor([[0.1 * (i + 1) * step] for i in range(num_envs)])
        td = pool.step(TensorDict({"action": actions}, [num_envs]))
        nxt = td["next", "observation"]
        assert nxt[:, 0].tolist() == ids, "each slot stays with its remote env"
        assert nxt[:, 1].tolist() == [float(step)] * num_envs
        assert torch.allclose(nxt[:, 2], actions[:, 0])
        rewards = [env_id + step for env_id in ids]
        assert td["next", "reward"][:, 0].tolist() == rewards
