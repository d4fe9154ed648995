"""`gpuguard` through its installed console script, where the process is what is tested: the exit codes
0, 1 and 2 as a shell sees them, stdin as a pipe, `serve` (a server if its checks ever let it start), and
`pip install .` giving a command that runs. Everything else about the command line is tested in-process,
in tests/unit/cli/."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

import webhook
from tests.harness import REPO_ROOT
from tests.harness.manifests import EXAMPLES, Gpuguard

JOB = EXAMPLES / "gpu-training-job.yaml"
CPU_ON_GPU_NODE = EXAMPLES / "cpu-pod-on-gpu-node.yaml"


def kinds(text: str) -> list[str]:
    return [document["kind"] for document in yaml.safe_load_all(text)]


def test_version_is_the_package_version(gpuguard: Gpuguard) -> None:
    run = gpuguard("--version")
    assert (run.code, run.out) == (0, f"gpuguard {webhook.__version__}\n")
    assert importlib.metadata.version("gpuguard") == webhook.__version__


def test_usage_errors_exit_2_naming_what_is_wrong(gpuguard: Gpuguard) -> None:
    assert gpuguard().code == 2
    unknown = gpuguard("mutat")
    assert unknown.code == 2 and "invalid choice: 'mutat'" in unknown.err


def test_validate_denies_the_cpu_pod_on_a_gpu_node(gpuguard: Gpuguard) -> None:
    run = gpuguard("validate", "-f", str(CPU_ON_GPU_NODE))
    assert run.code == 1
    header, row, summary = run.out.splitlines()
    assert header.split() == ["NAMESPACE", "OBJECT", "RULE", "MODE", "RESULT", "MESSAGE"]
    assert row.split()[:6] == [
        "default",
        "Pod/log-shipper",
        "acceleratorNodeGuard",
        "enforce",
        "denied",
        "priority",
    ]
    # Columns line up under their headers, kubectl-style.
    assert header.index("RESULT") == row.index("denied")
    assert "nodeSelector cloud.google.com/gke-accelerator" in row
    assert summary == "1 object: 0 passed, 0 warned, 1 denied"


def test_stdin_and_files_together(gpuguard: Gpuguard) -> None:
    run = gpuguard("mutate", "-f", str(JOB), "-f", "-", stdin=CPU_ON_GPU_NODE.read_text())
    assert kinds(run.out) == ["Job", "Pod"]
    twice = gpuguard("mutate", "-f", "-", "-f", "-")
    assert twice.code == 2 and "only once" in twice.err


def test_serve_refuses_a_bad_san_before_it_listens(gpuguard: Gpuguard, tmp_path: Path) -> None:
    """The names refused are tested in-process with `certs generate` (tests/unit/cli/test_cli_certs.py);
    `serve` takes the same type, and runs here, where a regression would start a server in its own
    process, not in the test's."""
    run = gpuguard("serve", "--host", "127.0.0.1", "--port", "1", "--san=two words")
    assert run.code == 2
    assert "argument --san: 'two words' is neither an IP address nor a DNS name" in run.err
    assert not (tmp_path / "certs").exists()


def test_pip_install_gives_a_working_command(tmp_path: Path) -> None:
    """`pip install .` as the README says, into a fresh folder: the console script runs, with its data."""
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT / "webhook", source / "webhook", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    target = tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # No index and no build isolation: the build backend and the dependencies are this virtualenv's.
    subprocess.run(
        [*pip, "--no-deps", "--no-index", "--no-build-isolation", "--target", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    script = target / "bin" / "gpuguard"
    env = {**os.environ, "PYTHONPATH": str(target)}
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, env=env, check=True)
    assert version.stdout == f"gpuguard {webhook.__version__}\n"
    default = subprocess.run([str(script), "policy", "default"], capture_output=True, text=True, env=env)
    assert default.stdout == (REPO_ROOT / "webhook" / "default-policy.yaml").read_text()
