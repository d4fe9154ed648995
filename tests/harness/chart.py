"""Helm and the chart charts/gpuguard: Helm built from the module proxy (tests/helm/build.sh, cached), run
with its homes in a test folder so nothing is written outside it."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.harness import REPO_ROOT
from tests.harness.controlplane import without_proxies

CHART = REPO_ROOT / "charts" / "gpuguard"
RELEASE = "gpuguard"


def build_helm() -> Path:
    """The helm binary, built on first use (a few minutes), then cached."""
    build = subprocess.run(
        ["bash", str(REPO_ROOT / "tests" / "helm" / "build.sh")], check=True, capture_output=True, text=True
    )
    return Path(build.stdout.splitlines()[-1])


@dataclass(frozen=True)
class Helm:
    binary: Path
    home: Path
    kubeconfig: Path | None = None

    def env(self) -> dict[str, str]:
        homes = {f"HELM_{kind}_HOME": str(self.home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}
        return without_proxies() | homes | ({"KUBECONFIG": str(self.kubeconfig)} if self.kubeconfig else {})

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary), *args], capture_output=True, text=True, timeout=timeout, env=self.env()
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result

    def template(self, *values: str) -> list[dict[str, Any]]:
        """`helm template` of the chart with the given value flags (--set ...), parsed."""
        text = self("template", RELEASE, str(CHART), *values).stdout
        return [doc for doc in yaml.safe_load_all(text) if doc]


def canonical(objects: list[dict[str, Any]]) -> list[str]:
    """Objects as sorted JSON: equal lists mean the same objects, whatever their order in the output."""
    return sorted(json.dumps(obj, sort_keys=True) for obj in objects)
