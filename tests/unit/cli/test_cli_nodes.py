"""`gpuguard nodes`: its options on either side of a subcommand; `nodes drivers -f`, a node list read
like every other manifest input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.manifests import Gpuguard
from webhook import cli
from webhook.cli import nodes, output


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


@pytest.mark.parametrize(
    "argv",
    [
        ["nodes", "--kubeconfig=k", "--namespace=ops", "explain", "gpu-1"],
        ["nodes", "explain", "gpu-1", "--kubeconfig=k", "--namespace=ops"],
        ["nodes", "--kubeconfig=k", "explain", "gpu-1", "--namespace=ops"],
    ],
)
def test_the_device_health_options_hold_before_or_after_the_subcommand(argv: list[str]) -> None:
    args = cli.parser().parse_args(argv)
    assert (args.run, args.nodes_command, args.node) == (nodes.run_health, "explain", "gpu-1")
    assert (args.kubeconfig, args.namespace, args.policy, args.policy_configmap) == ("k", "ops", None, None)


def test_a_subcommand_keeps_what_was_given_before_it_and_bare_nodes_is_the_table() -> None:
    drivers = cli.parser().parse_args(["nodes", "--policy=p.yaml", "--kubeconfig=k", "drivers"])
    assert (drivers.run, drivers.policy, drivers.kubeconfig) == (nodes.run_drivers, "p.yaml", "k")
    reset = cli.parser().parse_args(["nodes", "--namespace=ops", "reset-breaker"])
    assert (reset.nodes_command, reset.namespace) == ("reset-breaker", "ops")
    ack = cli.parser().parse_args(["nodes", "--kubeconfig=k", "ack", "gpu-1"])
    assert (ack.run, ack.nodes_command, ack.node, ack.kubeconfig) == (nodes.run_health, "ack", "gpu-1", "k")
    table = cli.parser().parse_args(["nodes"])
    assert (table.run, table.nodes_command, table.namespace) == (nodes.run_health, None, "gpuguard")
