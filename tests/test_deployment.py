"""The launch files a cluster user runs, checked on CPU: the linters (shellcheck, hadolint) pass,
the Slurm script run against stand-ins for srun and scontrol mounts the checkout over the image's
copy, passes the stop file and --resume auto, turns its time-limit signal into a saved stop and
requeues itself; the image installs every runtime dependency and refuses a Transformer Engine
outside megatron-core's range."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "ppo_16x8.sbatch"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    assert path.is_file(), f"{name} is missing: it comes with the test extra (pip install -e .[test])"
    return str(path)


def test_shell_scripts_and_the_dockerfile_pass_their_linters() -> None:
    scripts = [SBATCH, REPO / ".ci" / "run", *sorted((REPO / "scripts").glob("*.sh"))]
    shellcheck = subprocess.run([_tool("shellcheck"), *map(str, scripts)], capture_output=True,
                                text=True)
    assert shellcheck.returncode == 0, shellcheck.stdout
    hadolint = subprocess.run([_tool("hadolint"), str(REPO / "Dockerfile")], capture_output=True,
                              text=True)
    assert hadolint.returncode == 0, hadolint.stdout


def _stand_ins(bin_dir: Path, log: Path) -> None:
    """srun records its arguments and runs until the stop file it was given appears (a run that
    saves and exits 0); scontrol prints one host name or records a requeue."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"""#!/bin/bash
printf '%s\\n' "$@" > {log}.srun
stop=$(printf '%s\\n' "$@" | sed -n 's/^faults.stop_file=//p')
for _ in $(seq 600); do [ -e "$stop" ] && exit 0; sleep 0.1; done
exit 3
""")
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
if [ "$1" = show ]; then echo node001; else echo "$@" >> {log}.scontrol; fi
""")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)


def _submit(tmp_path: Path, restart_count: int) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "calls"
    _stand_ins(tmp_path / "bin", log)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[001-016]", "SLURM_NNODES": "16",
           "SLURM_RESTART_COUNT": str(restart_count)}
    job = subprocess.Popen(["bash", str(SBATCH), "steps=7"], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return job, log


@pytest.mark.skipif(sys.platform != "linux", reason="runs the batch script with bash")
def test_the_slurm_script_stops_on_its_signal_saves_and_requeues(tmp_path: Path) -> None:
    job, log = _submit(tmp_path, restart_count=0)
    deadline = time.monotonic() + 30
    while not Path(f"{log}.srun").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    job.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@900 before the time limit
    output, _ = job.communicate(timeout=60)
    assert job.returncode == 0, output
    args = Path(f"{log}.srun").read_text().splitlines()
    assert f"--container-mounts={tmp_path}:/workspace/megatron_rlhf" in args
    assert "--container-workdir=/workspace/megatron_rlhf" in args
    assert f"--container-image={tmp_path}/megatron_rlhf.sqsh" in args
    assert "faults.stop_file=runs/slurm/stop-42" in args and args[-1] == "steps=7"
    assert "--resume" not in args  # a first start refuses an occupied save dir
    assert "--rdzv-endpoint" in args and args[args.index("--rdzv-endpoint") + 1] == "node001:29500"
    assert Path(f"{log}.scontrol").read_text().split() == ["requeue", "42"]
    assert not (tmp_path / "runs" / "slurm" / "stop-42").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="runs the batch script with bash")
def test_a_requeued_job_resumes_automatically_and_a_finished_one_is_not_requeued(
        tmp_path: Path) -> None:
    (tmp_path / "runs" / "slurm").mkdir(parents=True)
    job, log = _submit(tmp_path, restart_count=1)
    deadline = time.monotonic() + 30
    while not Path(f"{log}.srun").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    (tmp_path / "runs" / "slurm" / "stop-42").touch()  # the run ends by itself
    output, _ = job.communicate(timeout=60)
    assert job.returncode == 0, output
    args = Path(f"{log}.srun").read_text().splitlines()
    assert args[args.index("--resume") + 1] == "auto"
    assert not Path(f"{log}.scontrol").exists()


def _install_requires() -> list[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "setup")
    requires = next(k.value for k in call.keywords if k.arg == "install_requires")
    names = []
    for item in requires.elts:
        text = item.value if isinstance(item, ast.Constant) else "megatron-core"
        names.append(re.split(r"[<>=\[ ]", text)[0])
    return names


def test_the_image_installs_every_runtime_dependency_and_smoke_tests_the_runner() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    installs = " ".join(re.findall(r"pip install[^&]*", dockerfile.replace("\\\n", " ")))
    missing = [name for name in _install_requires()
               if name != "torch" and not re.search(rf"(^|[\s\"']){re.escape(name)}([\s\"'<>=]|$)",
                                                    installs)]
    assert not missing, f"setup.py needs {missing}, which the Dockerfile does not install"
    assert "megatron_rlhf.engine.run.runner" in dockerfile and "tools/run_ppo.py --help" in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"runs", "ckpt", ".venv", ".git"} <= set(ignored)


@pytest.mark.parametrize("version, required, code", [
    ("2.10.0+8a7d1c2", 1, 0), ("2.9.0a0", 1, 0), ("2.4.0", 1, 1), ("2.12.0", 1, 1),
    ("2.4.0", 0, 0), (None, 1, 1),
])
def test_the_te_check_accepts_megatron_cores_range_only(tmp_path: Path, version: str | None,
                                                       required: int, code: int) -> None:
    if version is None and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    if version is not None:
        (tmp_path / "transformer_engine").mkdir()
        (tmp_path / "transformer_engine" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_te_version.py"), "--min", "2.9",
         "--below", "2.12", "--required", str(required)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == code, result.stderr
    if code or not required:
        assert "the range megatron-core 0.16.1 is developed against" in result.stderr
