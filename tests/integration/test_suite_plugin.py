"""The suite on a bare clone: what tests/harness/suite.py makes a run say and do, with and without the
shared corpus beside the clone. Each case is a real pytest run in a copy of the suite's own setup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO_ROOT

CORPUS_TESTS = """
import pytest
from tests.harness import corpus

@pytest.mark.corpus
@pytest.mark.parametrize("path", corpus.FILES, ids=lambda p: p.stem)
def test_corpus_file(path):
    assert path.read_text()

@pytest.mark.corpus
def test_corpus_is_not_empty():
    assert corpus.FILES

def test_of_the_project_itself():
    pass
"""


def clone(tmp_path: Path) -> Path:
    """A clone with the suite's pytest setup and one test module, and nothing beside it."""
    root = tmp_path / "gpuguard"
    (root / "tests" / "controlplane").mkdir(parents=True)
    (root / "tests" / "harness").mkdir()
    (root / "tests" / "unit").mkdir()
    shutil.copy(REPO_ROOT / "pyproject.toml", root)
    for name in ("__init__.py", "harness/__init__.py", "harness/suite.py", "harness/corpus.py"):
        shutil.copy(REPO_ROOT / "tests" / name, root / "tests" / name)
    shutil.copy(REPO_ROOT / "tests" / "controlplane" / "go.mod", root / "tests" / "controlplane")
    # In a tier's folder: pyproject.toml's testpaths name the tiers' folders, not tests/ itself.
    (root / "tests" / "unit" / "test_sample.py").write_text(CORPUS_TESTS)
    return root


def run(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "GPUGUARD_CORPUS"} | env
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=root,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_bare_clone_passes_with_its_own_tests_and_says_the_corpus_ones_were_skipped(tmp_path: Path) -> None:
    root = clone(tmp_path)
    result = run(root)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "e2e: Kubernetes v1." in result.stdout  # the header names the version, also from the root
    assert f"corpus: none at {tmp_path / 'shared' / 'corpus'}: its tests are skipped" in result.stdout
    assert "1 passed, 2 skipped" in result.stdout
    assert "corpus: 2 corpus tests skipped, no corpus at" in result.stdout


def test_with_the_corpus_beside_the_clone_its_tests_run(tmp_path: Path) -> None:
    root = clone(tmp_path)
    corpus = tmp_path / "shared" / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "a.yaml").write_text("kind: Pod\n")
    result = run(root)

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"corpus: {corpus} (1 manifests): its tests run" in result.stdout
    assert "3 passed" in result.stdout
    assert f"corpus: 2 corpus tests ran on {corpus}" in result.stdout


def test_an_empty_corpus_fails_rather_than_passing_on_nothing(tmp_path: Path) -> None:
    root = clone(tmp_path)
    (tmp_path / "shared" / "corpus").mkdir(parents=True)
    result = run(root)

    assert result.returncode == 1
    assert "FAILED tests/unit/test_sample.py::test_corpus_is_not_empty" in result.stdout


def test_a_corpus_named_in_the_environment_is_required(tmp_path: Path) -> None:
    root = clone(tmp_path)
    named = tmp_path / "elsewhere"
    result = run(root, GPUGUARD_CORPUS=str(named))

    assert result.returncode != 0
    assert f"GPUGUARD_CORPUS={named}: no such folder" in result.stdout + result.stderr
