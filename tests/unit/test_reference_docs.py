"""The generated reference pages (docs/reference/): current in the repository, as `scripts/render-docs`
writes them, and saying what the parser and the policy model say."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT
from webhook.cli import reference


def test_the_committed_reference_pages_are_current() -> None:
    assert reference.stale(REPO_ROOT) == [], "docs/reference/ is stale: run scripts/render-docs"


def test_the_check_names_a_stale_page_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert reference.main([], root=tmp_path) == 0
    assert reference.main(["--check"], root=tmp_path) == 0
    page = tmp_path / reference.POLICY_PAGE
    page.write_text(page.read_text().replace("`1800`", "`3600`"))
    assert reference.main(["--check"], root=tmp_path) == 1
    assert capsys.readouterr().err == (
        f"render-docs: stale, run scripts/render-docs: {reference.POLICY_PAGE}\n"
    )


def test_the_script_checks_the_repository() -> None:
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "render-docs"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "GPUGUARD_VENV": sys.prefix},
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (0, "")


def test_the_cli_reference_gives_each_option_its_help_and_default() -> None:
    page = reference.cli_reference()
    assert "\n## gpuguard policy check\n" in page
    assert "| `--port PORT` | port to listen on (default: 8443) |" in page
    assert "| [`audit`](#gpuguard-audit) |" in page


def test_the_cli_reference_does_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    outside = reference.cli_reference()
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    monkeypatch.setenv("POD_NAMESPACE", "elsewhere")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert reference.cli_reference() == outside
    assert os.environ["NODE_NAME"] == "gpu-node-7"  # put back as it was


def test_the_policy_reference_has_the_models_types_the_defaults_and_the_default_files_comments() -> None:
    page = reference.policy_reference()
    assert (
        "| `rules.readinessTolerations.batchSeconds` | integer (1 to 9,223,372,036) | `1800` | Seconds for Jobs,"
        in page
    )
    assert "| `workloadKinds[].kind` | string | (required) |" in page
    assert "| `workloadKinds[].batch` | boolean | `false` |" in page
    assert "| `health.budget.maxUnhealthy` | integer (0 to 1,000,000) or string matching" in page
