"""webhook.policy.accelerators: admission, the audit and the controllers agree about every node.

Each reads a Node its own way (admission from its node cache, the audit from listed or offline
Nodes, the controllers from their informer's facts) and asks the one definition; these tests hand all
three the same Node object and compare what they decide.
"""

from __future__ import annotations

import datetime
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from webhook.audit import findings
from webhook.kube import fact_sources as node_cache
from webhook.policy import accelerators, rules
from webhook.policy.facts import ClusterFacts, node_info
from webhook.policy.health import observed, signals
from webhook.policy.model import default_policy, parse_policy
from webhook.policy.workload import locate

POLICY = default_policy()
NAME = "node-1"
NOW = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
LABELS = (
    "nvidia.com/gpu.present",
    "cloud.google.com/gke-accelerator",
    "kubernetes.io/hostname",
    "karpenter.sh/nodepool",
)
RESOURCES = ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu", "example.com/nic", "cpu", "memory")
# Quantities as the API server serves them (it refuses others); 0 included: the kubelet writes it for a
# resource whose device plugin went away.
COUNTS = ("0", "1", "8", "1k", "500m")


def raw_node(labels: dict[str, str], capacity: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NAME, "uid": "uid-1", "labels": labels},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def admission_says(raw: dict[str, Any]) -> bool:
    """The guard's view: a pod bound to the node by nodeName is bound for an accelerator node."""
    converted = node_cache.node_converter(node_cache.NodeReads.of(POLICY))(raw)
    assert converted is not None
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"nodeName": NAME}}
    workload = locate(pod, namespace="team")
    assert workload is not None
    reasons = rules.accelerator_node_reasons(workload, POLICY, ClusterFacts(nodes={NAME: converted[1]}))
    return f"nodeName {NAME}" in reasons


def audit_says(raw: dict[str, Any]) -> bool:
    """The audit's view: the accelerator nodes it checks for a taint."""
    converted = node_info(raw)
    assert converted is not None
    found = findings.node_findings(POLICY, ClusterFacts(nodes={NAME: converted[1]}))
    return [finding.subject.name for finding in found] == [NAME]


def controllers_say(raw: dict[str, Any]) -> bool:
    """The controllers' view (health.nodeSelector selects every node by default): the node is in scope,
    and its assessment says so."""
    node = observed.node_facts(raw)
    assert node is not None
    in_scope = signals.in_health_scope(node, POLICY)
    assert signals.assess(node, [], POLICY, NOW).in_scope == in_scope
    return in_scope


@given(
    labels=st.dictionaries(st.sampled_from(LABELS), st.sampled_from(("true", "a100", "pool-a"))),
    capacity=st.dictionaries(st.sampled_from(RESOURCES), st.sampled_from(COUNTS)),
)
@example(labels={}, capacity={})
@example(labels={}, capacity={"nvidia.com/gpu": "0"})
@example(labels={"nvidia.com/gpu.present": "true"}, capacity={})
@example(labels={"kubernetes.io/hostname": NAME}, capacity={"example.com/nic": "2", "cpu": "64"})
def test_admission_the_audit_and_the_controllers_agree_about_a_node(
    labels: dict[str, str], capacity: dict[str, str]
) -> None:
    raw = raw_node(labels, capacity)
    assert admission_says(raw) == audit_says(raw) == controllers_say(raw)


def test_the_examples_above_cover_both_answers() -> None:
    assert admission_says(raw_node({}, {"nvidia.com/gpu": "0"}))
    assert controllers_say(raw_node({"nvidia.com/gpu.present": "true"}, {}))
    assert not audit_says(raw_node({}, {"example.com/nic": "2"}))
    assert not controllers_say(raw_node({}, {}))


def test_a_node_known_by_its_resource_slices_alone_is_one_to_the_controllers_only() -> None:
    """What admission and the audit cannot see: they read no ResourceSlices (the definition is the
    same; the module docstring says so)."""
    raw = raw_node({}, {"cpu": "64"})
    piece = observed.slice_facts(
        {
            "metadata": {"name": "slice-1"},
            "spec": {
                "nodeName": NAME,
                "driver": "gpu.nvidia.com",
                "pool": {"name": NAME, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0"}],
            },
        }
    )
    assert piece is not None
    node = observed.node_facts(raw)
    assert node is not None
    joined = observed.with_devices(node, observed.node_devices([piece]))
    assert signals.in_health_scope(joined, POLICY)
    assert not admission_says(raw) and not audit_says(raw)


def test_health_node_selector_narrows_the_controllers_scope_not_what_an_accelerator_node_is() -> None:
    selective = parse_policy("health:\n  nodeSelector:\n    matchLabels: {team: ml}\n")
    raw = raw_node({"nvidia.com/gpu.present": "true"}, {"nvidia.com/gpu": "8"})
    node = observed.node_facts(raw)
    assert node is not None
    assert accelerators.is_accelerator_node(
        selective.accelerators, labels=node.labels, resources=node.capacity
    )
    assert not signals.in_health_scope(node, selective)
    assert admission_says(raw)


def test_a_claim_counts_by_its_device_classes_when_they_are_known() -> None:
    assert accelerators.claim_counts(POLICY.accelerators, None)
    assert accelerators.claim_counts(POLICY.accelerators, ("gpu.nvidia.com",))
    assert not accelerators.claim_counts(POLICY.accelerators, ("nic.example.com",))
    off = parse_policy("accelerators:\n  resourceClaims: false\n")
    assert not accelerators.claim_counts(off.accelerators, None)
