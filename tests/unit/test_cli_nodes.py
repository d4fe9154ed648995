"""`gpuguard nodes drivers -f`: a node list read like every other manifest input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from webhook.cli import output

from .builders import Gpuguard


def gpu_node(name: str, driver: str) -> dict[str, Any]:
    labels = {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/cuda.driver-version.full": driver,
        "nvidia.com/cuda.driver-version.major": driver.split(".")[0],
        "nvidia.com/cuda.runtime-version.full": "12.8",
    }
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def test_a_mixed_pool_exits_1(gpuguard: Gpuguard, tmp_path: Path) -> None:
    nodes = output.as_list([gpu_node("a", "570.124.06"), gpu_node("b", "570.86.15")])
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    run = gpuguard("nodes", "drivers", "-f", "nodes.yaml")
    assert run.code == 1, run.err
    assert "570.124.06 (1), 570.86.15 (1)" in run.out and "MIXED" in run.out
    same = gpuguard(
        "nodes", "drivers", "-f", "-", stdin=yaml.safe_dump(output.as_list([gpu_node("a", "570.86.15")]))
    )
    assert same.code == 0 and "MIXED" not in same.out


def test_a_bad_node_list_names_the_file(gpuguard: Gpuguard) -> None:
    run = gpuguard("nodes", "drivers", "-f", "absent.yaml")
    assert (run.code, run.err) == (2, "gpuguard: absent.yaml: no such file\n")
