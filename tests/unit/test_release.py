"""The version lives in one place, `webhook.__version__` (pyproject.toml reads it from there and
`gpuguard --version` prints it); the manifests and the chart that ship name the image of that version,
so a release changes the one line, runs scripts/render-install and scripts/render-chart, and tags
`v<version>` (CHANGELOG.md, docs/stability.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from webhook import __version__

from .builders import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
CHART = REPO_ROOT / "charts" / "gpuguard"
IMAGE = "gpuguard"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_the_version_is_a_release_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__), __version__


def test_every_kustomization_tags_gpuguards_image_with_the_version() -> None:
    tags = {
        path.relative_to(REPO_ROOT).as_posix(): image.get("newTag")
        for path in sorted(DEPLOY.rglob("kustomization.yaml"))
        for image in _yaml(path).get("images", [])
        if image["name"] == IMAGE
    }
    assert tags == {
        "deploy/base/kustomization.yaml": __version__,
        "deploy/node-agent/kustomization.yaml": __version__,
    }


def test_the_install_manifest_runs_the_versions_image() -> None:
    images = re.findall(r"^\s+image: (gpuguard\S*)$", (DEPLOY / "install.yaml").read_text(), re.MULTILINE)
    # The webhook, the controllers, the audit CronJob and the node agent.
    assert images == [f"{IMAGE}:{__version__}"] * 4


def test_the_chart_is_versioned_with_gpuguard() -> None:
    chart = _yaml(CHART / "Chart.yaml")
    assert (chart["version"], chart["appVersion"]) == (__version__, __version__)
    assert _yaml(CHART / "values.yaml")["image"]["tag"] == __version__


def test_the_changelog_has_an_entry_for_the_version() -> None:
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.MULTILINE)
