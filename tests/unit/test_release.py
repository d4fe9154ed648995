"""What a release promises. The version lives in one place, `webhook.__version__` (pyproject.toml reads
it from there and `gpuguard --version` prints it), and the manifests and the chart that ship name the
image of that version: a release changes the one line and the tags, runs scripts/render-install and
scripts/render-chart, and tags `v<version>` (CHANGELOG.md). docs/stability.md names every annotation,
label, condition, metric and Event reason the code uses, so a new one is never public by accident."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import yaml

from tests.harness import REPO_ROOT
from webhook import __version__
from webhook.kube.events import Reason

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
    assert images, "no gpuguard image in deploy/install.yaml"  # the webhook, controllers, audit, node agent
    assert set(images) == {f"{IMAGE}:{__version__}"}


def test_the_chart_is_versioned_with_gpuguard() -> None:
    chart = _yaml(CHART / "Chart.yaml")
    assert (chart["version"], chart["appVersion"]) == (__version__, __version__)
    assert _yaml(CHART / "values.yaml")["image"]["tag"] == __version__


def test_the_changelog_has_an_entry_for_the_version() -> None:
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.MULTILINE)


# --- docs/stability.md names everything gpuguard puts on objects and exports ------------------------

STABILITY = REPO_ROOT / "docs" / "stability.md"
PACKAGE = REPO_ROOT / "webhook"


def _named_in_stability() -> set[str]:
    return set(re.findall(r"`([^`]+)`", STABILITY.read_text()))


def _in_the_package(pattern: str) -> set[str]:
    """Every match of `pattern` in the package's source and its default policy."""
    sources = [*PACKAGE.rglob("*.py"), PACKAGE / "default-policy.yaml"]
    return {match for path in sources for match in re.findall(pattern, path.read_text())}


def test_stability_names_every_annotation_label_and_taint() -> None:
    keys = _in_the_package(r"gpuguard\.io/[A-Za-z0-9._-]*[A-Za-z0-9]")
    assert keys, "the pattern found nothing"
    assert keys - _named_in_stability() == set()


def test_stability_names_every_condition_type() -> None:
    conditions = _in_the_package(r"\"(GPUGuard[A-Za-z]+)\"")
    assert conditions == {"GPUGuardDeviceHealthy", "GPUGuardDevicesAllocatable"}
    assert conditions - _named_in_stability() == set()


def test_stability_names_every_metric() -> None:
    metrics = _in_the_package(r"\bgpuguard_[a-z_]+[a-z]")
    assert len(metrics) > 20, metrics
    assert metrics - _named_in_stability() == set()


def test_stability_names_every_event_reason() -> None:
    assert set(get_args(Reason)) - _named_in_stability() == set()


def test_observability_describes_every_metric_and_event_reason() -> None:
    """docs/observability.md is where an operator looks a series or a reason up: none may be missing."""
    page = (REPO_ROOT / "docs" / "observability.md").read_text()
    metric = r"\bgpuguard_[a-z_]+[a-z]"
    assert _in_the_package(metric) - set(re.findall(metric, page)) == set()
    assert set(get_args(Reason)) - set(re.findall(r"`([^`]+)`", page)) == set()
