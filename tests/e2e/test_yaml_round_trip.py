"""`gpuguard mutate -f x | kubectl apply -f -` stores every string as written: kubectl's YAML reader (Go,
YAML 1.1 booleans, Go number literals) reads gpuguard's output back unchanged, on the real API server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.harness import REPO_ROOT
from tests.harness.admission import default_priority_classes, gpu_pod, install_priority_classes
from tests.harness.controlplane import ControlPlane

# Strings YAML 1.1 or 1.2 or Go would read as something else when written bare.
TRICKY = [
    "0o17", "017", "0x1F", "0b101", "1e3", "-1e-3", "1_000", ".5", "+12", "1:30", "2001-12-14",
    "2001-12-14T21:59:43Z", ".inf", ".NaN", "~", "null", "y", "n", "yes", "No", "ON", "off", "True", "<<",
    "next\x85line", "line\u2028separator",  # line breaks a quoted YAML string would fold into a space
]  # fmt: skip
# A label value is at most 63 of [-_.A-Za-z0-9], starting and ending alphanumeric.
LABEL_VALUES = [value for value in TRICKY if re.fullmatch(r"[A-Za-z0-9]([-_.A-Za-z0-9]*[A-Za-z0-9])?", value)]


def manifests(namespace: str) -> list[dict[str, Any]]:
    pod = gpu_pod("tricky", namespace)
    pod["metadata"]["labels"] = {f"l{index}": value for index, value in enumerate(LABEL_VALUES)}
    pod["metadata"]["annotations"] = {f"example.com/a{index}": value for index, value in enumerate(TRICKY)}
    pod["spec"]["containers"][0]["env"] = [
        {"name": f"V{i}", "value": value} for i, value in enumerate(TRICKY)
    ]
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tricky", "namespace": namespace},
        "data": {f"k{index}": value for index, value in enumerate(TRICKY)},
    }
    return [pod, configmap]


def test_mutated_output_applied_with_kubectl_keeps_every_string(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    install_priority_classes(control_plane, default_priority_classes())  # the class gpuguard gives it
    source = manifests(namespace)
    path = tmp_path / "tricky.yaml"
    path.write_text(yaml.safe_dump_all(source))
    mutate = subprocess.run(
        [sys.executable, "-m", "webhook", "mutate", "-f", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=True,
    )
    assert "gpuguard.io/rules" in mutate.stdout  # the pod was mutated: this is gpuguard's output

    applied = control_plane.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=mutate.stdout)
    stored = json.loads(applied.stdout)["items"]

    pod, configmap = stored
    wanted_pod, wanted_configmap = source
    assert configmap["data"] == wanted_configmap["data"]
    assert {k: pod["metadata"]["labels"][k] for k in wanted_pod["metadata"]["labels"]} == wanted_pod[
        "metadata"
    ]["labels"]
    annotations = pod["metadata"]["annotations"]
    assert {k: annotations[k] for k in wanted_pod["metadata"]["annotations"]} == wanted_pod["metadata"][
        "annotations"
    ]
    assert pod["spec"]["containers"][0]["env"] == wanted_pod["spec"]["containers"][0]["env"]
