"""The SLURM and Kubernetes recipes in docs/cluster/ use the worker command line as it is.

Each recipe's ``python -m workers`` command is parsed by the worker's own
argument parser (nothing is started), so a recipe cannot drift from the CLI:
a renamed or removed flag fails here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from workers.cli import build_parser

RECIPES = Path(__file__).resolve().parent.parent / "docs" / "cluster"
#: What SLURM and the recipe's own exports give the script (values only need to parse).
SLURM_ENV = {
    "TRAINER": "10.0.0.5:5555",
    "KEYS": "/shared/keys",
    "SLURM_CPUS_PER_TASK": "8",
    "SLURM_PROCID": "3",
}


def expand(line: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)


def test_the_sbatch_script_runs_one_worker_per_node_with_its_own_key():
    script = (RECIPES / "workers.sbatch").read_text()
    commands = [line for line in script.splitlines() if "python -m workers" in line]
    commands = [line for line in commands if not line.lstrip().startswith("#")]
    assert len(commands) == 1, commands
    argv = shlex.split(expand(commands[0], SLURM_ENV))
    assert argv[:4] == ["exec", "python", "-m", "workers"]
    args = build_parser().parse_args(argv[4:])
    assert args.connect == "tcp://10.0.0.5:5555" and args.num_envs == 8
    assert args.client_key == "/shared/keys/workers/worker-3.key_secret"
    assert args.server_key == "/shared/keys/server.key"
    assert args.env == "my_package.envs:make_env"
    assert "srun" in script and "#SBATCH --ntasks-per-node=1" in script


def test_the_kubernetes_manifest_runs_workers_against_the_trainer_service_with_secret_keys():
    docs = list(yaml.safe_load_all((RECIPES / "workers-k8s.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "workers"]
    args = build_parser().parse_args(container["args"])
    ports = {p["port"] for p in service["spec"]["ports"]}
    assert args.connect == f"tcp://{service['metadata']['name']}:5555"
    assert ports == {5555, 5556, 5557}  # commands, results, the pool's heartbeats
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (volume,) = pod["volumes"]
    assert volume["secret"]["defaultMode"] & 0o077 == 0  # the worker refuses looser secrets
    assert args.server_key.startswith(mounts[volume["name"]])
    assert args.client_key.startswith(mounts[volume["name"]])
    assert args.num_envs == 8 and args.env == "my_package.envs:make_env"


def test_the_sbatch_script_is_valid_bash_and_checks_its_exports():
    # The worker line parsing above says nothing of the rest of the script: bash must accept
    # it all (an apostrophe in a ${VAR:?message} once made it fail before srun), and
    # without TRAINER it must stop with its own message.
    import subprocess

    script = RECIPES / "workers.sbatch"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    run = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert run.returncode != 0 and "set TRAINER=HOST:PORT" in run.stderr, run.stderr
