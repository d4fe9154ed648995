"""The converters behind the cluster facts: a node is kept as what the rules read under the policy.

A GPU fleet's Node is ~11 KB (dozens of labels, cached images, conditions); the guard reads whether it
is an accelerator node and why, the metrics read its driver labels, and the driver check (when it can
run) reads any label. These tests pin that down, and that a policy changing what is read of a node
lists the nodes again with a converter for it, while any other policy change does not.
"""

from __future__ import annotations

import threading
from typing import Any

from kubernetes.client import ApiClient, Configuration

from webhook.kube import fact_sources
from webhook.kube.informer import Converter
from webhook.policy.facts import ClusterFacts, NodeInfo
from webhook.policy.model import default_policy, parse_policy
from webhook.policy.rules import accelerator_node_reasons
from webhook.policy.workload import locate

DEFAULT = default_policy()
NO_DRIVER_CHECK = parse_policy('rules:\n  driverCompatibility:\n    mode: "off"\n')
PRUNED = fact_sources.NodeReads.of(NO_DRIVER_CHECK)


def fleet_node(name: str, *, gpu: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    base = {f"feature.node.kubernetes.io/cpu-cpuid.X{i:02d}": "true" for i in range(30)}
    base |= {"kubernetes.io/hostname": name, "topology.kubernetes.io/zone": "us-east-1a"}
    if gpu:
        base |= {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    capacity = {"cpu": "192", "memory": "2Ti", "pods": "110"} | ({"nvidia.com/gpu": "8"} if gpu else {})
    return {
        "metadata": {"name": name, "labels": base | (labels or {})},
        "status": {
            "capacity": capacity,
            "images": [{"names": [f"nvcr.io/ml/image-{i}:1"], "sizeBytes": i} for i in range(40)],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_a_node_keeps_only_what_makes_it_an_accelerator_node_without_the_driver_check() -> None:
    convert = fact_sources.node_converter(PRUNED)
    assert convert(fleet_node("gpu-1")) == (
        "gpu-1",
        NodeInfo(
            {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            ("nvidia.com/gpu",),
        ),
    )
    assert convert(fleet_node("cpu-1", gpu=False)) == ("cpu-1", NodeInfo({}, ()))


def test_nodes_alike_share_one_value() -> None:
    convert = fact_sources.node_converter(PRUNED)
    values = [
        convert(fleet_node(f"gpu-{i}", labels={"kubernetes.io/hostname": f"gpu-{i}"})) for i in range(3)
    ]
    assert len({id(value) for _, value in (v for v in values if v is not None)}) == 1


def test_malformed_nodes_are_kept_as_plain_nodes_or_skipped() -> None:
    convert = fact_sources.node_converter(PRUNED)
    assert convert({"metadata": {"name": "odd", "labels": ["x"]}, "status": {"capacity": 7}}) == (
        "odd",
        NodeInfo({}, ()),
    )
    assert convert({"metadata": {}}) is None


def test_the_rule_says_the_same_of_a_kept_node_as_of_the_whole_one() -> None:
    pod = {"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "p"}, "spec": {"nodeName": "gpu-1"}}
    workload = locate(pod, namespace="team")
    assert workload is not None
    raw = fleet_node("gpu-1")
    whole = NodeInfo(raw["metadata"]["labels"], tuple(sorted(raw["status"]["capacity"])))
    converted = fact_sources.node_converter(PRUNED)(raw)
    assert converted is not None
    for node in (whole, converted[1]):
        assert accelerator_node_reasons(workload, NO_DRIVER_CHECK, ClusterFacts(nodes={"gpu-1": node})) == [
            "nodeName gpu-1"
        ]


def test_the_driver_check_keeps_every_label_a_workload_may_select_on() -> None:
    """It matches each workload's own node selection against every node: any label may matter."""
    assert fact_sources.NodeReads.of(DEFAULT).every_label
    namespaced = parse_policy(
        'rules:\n  driverCompatibility:\n    mode: "off"\n'
        "namespaces:\n  - names: [ml]\n    rules:\n      driverCompatibility: warn\n"
    )
    assert fact_sources.NodeReads.of(namespaced).every_label
    assert not fact_sources.NodeReads.of(parse_policy("enabled: false\n")).every_label
    raw = fleet_node("gpu-1")
    converted = fact_sources.node_converter(fact_sources.NodeReads.of(DEFAULT))(raw)
    assert converted is not None
    assert converted[1].labels == raw["metadata"]["labels"]


def test_without_the_driver_check_the_driver_labels_are_kept_for_the_metrics() -> None:
    raw = fleet_node("gpu-1", labels={"nvidia.com/cuda.driver-version.full": "570.124.06"})
    converted = fact_sources.node_converter(PRUNED)(raw)
    assert converted is not None
    assert converted[1].labels["nvidia.com/cuda.driver-version.full"] == "570.124.06"


class _Recorded(fact_sources.FactInformers):
    def __init__(self) -> None:
        publisher = fact_sources.FactsPublisher(get=ClusterFacts, put=lambda _: None)
        super().__init__(ApiClient(Configuration()), publisher, threading.Event(), NO_DRIVER_CHECK)
        self.reconverted: list[NodeInfo | None] = []
        self.nodes.reconvert = self._reconvert  # type: ignore[method-assign]

    def _reconvert(self, convert: Converter[NodeInfo]) -> bool:
        converted = convert(fleet_node("fpga-1", gpu=False, labels={"example.com/fpga": "true"}))
        self.reconverted.append(converted[1] if converted else None)
        return True


def test_only_a_policy_that_changes_what_is_read_of_nodes_lists_them_again() -> None:
    informers = _Recorded()
    off = 'rules:\n  driverCompatibility:\n    mode: "off"\n'
    informers.policy_loaded(parse_policy(off + "mode: warn\n"))
    assert informers.reconverted == []
    labels = [*DEFAULT.accelerators.nodeLabels, "example.com/fpga"]
    informers.policy_loaded(parse_policy(off + f"accelerators:\n  nodeLabels: {labels}\n"))
    assert informers.reconverted == [NodeInfo({"example.com/fpga": "true"}, ())]
    informers.policy_loaded(parse_policy(off + f"accelerators:\n  nodeLabels: {labels}\nmode: audit\n"))
    assert len(informers.reconverted) == 1
    informers.policy_loaded(parse_policy(f"accelerators:\n  nodeLabels: {labels}\n"))  # the check is on
    assert len(informers.reconverted) == 2
    assert informers.reconverted[-1] is not None
    assert "kubernetes.io/hostname" in informers.reconverted[-1].labels
