"""The device-failure chain of test_device_failure.py, its three tests as they are, with every gpuguard
component running as a pod installed from deploy/ (the node agent's DaemonSet included), as a user
installs it: the webhook's replicas admit the workloads, the controllers' leader taints and evicts, each
node's agent pod reads its kubelet's PodResources socket through its hostPath.

Two things differ from a user's install, written as a kustomize overlay on deploy/ (`tier_overlay`): the
policy ConfigMap holds the tier's policy (the session webhook's rules, POLICY, with the responders' health
section, responders_policy(): one ConfigMap serves both in an install), and the node agent polls at the
responders' pace instead of every 10 s with 30 s of confirmation.

The workloads go to namespaces the session's own gpuguard leaves alone (OWNER_LABEL "installed"), so the
installed webhook is the one that mutated them. The session's controllers and agents as processes
(conftest.responders) are module-scoped: stopped with their module, before this one installs, so only the
installed ones act. This module installs gpuguard's namespaces and RBAC and removes them again, so it runs
with the other installing modules, last (conftest.INSTALLING_MODULES).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.admission import OWNER_LABEL, default_priority_classes, install_priority_classes
from tests.harness.controllers import eventually
from tests.harness.install import DEPLOY, NAMESPACE, POLICY_CONFIGMAP, run_gpuguard
from tests.harness.responders import (
    AGENT_CONFIRM_SECONDS,
    AGENT_INTERVAL_SECONDS,
    PodResponder,
    Responders,
)

from . import test_device_failure as chain
from .conftest import PATIENCE, POLICY, NodeCluster, responders_policy
from .test_helm import mutated
from .test_install import (
    AGENT_NAMESPACE,
    AGENT_PODS,
    AGENT_PORT,
    CONTROLLERS_PODS,
    CONTROLLERS_PORT,
    WEBHOOK_PODS,
    awaited,
    lease_holder,
    ready_pods,
    uninstall,
)

AGENT_DAEMONSET = "gpuguard-node-agent"
POLICY_FILE = "policy.yaml"  # the ConfigMap's key, as deploy/'s generator names it

# The chain's tests and the fixture they share, as test_device_failure.py defines them: pytest collects
# them here again, with this module's `responders`, `namespace_labels` and `summary`.
holds_released = chain.holds_released
test_a_failed_device_is_tainted_evicted_and_replaced_on_the_healthy_node_without_counting = (
    chain.test_a_failed_device_is_tainted_evicted_and_replaced_on_the_healthy_node_without_counting
)
test_the_node_agent_names_the_pod_on_the_failed_device_and_only_that_pod_is_evicted = (
    chain.test_the_node_agent_names_the_pod_on_the_failed_device_and_only_that_pod_is_evicted
)
test_a_gpu_gone_after_a_plugin_restart_keeps_the_node_marked = (
    chain.test_a_gpu_gone_after_a_plugin_restart_keeps_the_node_marked
)


def tier_overlay(folder: Path) -> Path:
    """A kustomization in `folder` over deploy/ that changes the policy ConfigMap's policy to the tier's
    and adds the responders' timings to the node agent's arguments, and nothing else; the policy checked
    as `gpuguard policy check` checks it."""
    rules, health = yaml.safe_load(POLICY), responders_policy()
    assert not rules.keys() & health.keys(), f"both policies set {rules.keys() & health.keys()}"
    (folder / POLICY_FILE).write_text(yaml.safe_dump({**rules, **health}))
    checked = run_gpuguard("policy", "check", str(folder / POLICY_FILE))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    agent_args = [f"--interval={AGENT_INTERVAL_SECONDS}", f"--confirm-seconds={AGENT_CONFIRM_SECONDS}"]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY, folder)],  # kustomize refuses an absolute path
        "configMapGenerator": [
            {
                "name": POLICY_CONFIGMAP,
                "namespace": NAMESPACE,
                "behavior": "replace",
                "files": [POLICY_FILE],
                "options": {"disableNameSuffixHash": True},
            }
        ],
        "patches": [
            {
                "target": {"kind": "DaemonSet", "name": AGENT_DAEMONSET},
                "patch": json.dumps(
                    [
                        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": arg}
                        for arg in agent_args
                    ]
                ),
            }
        ],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return folder


@pytest.fixture(scope="module")
def responders(
    cluster: NodeCluster,
    gpuguard_image: str,
    device_plugin_pods: None,
    installed_namespace: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Responders]:
    """gpuguard installed with `kubectl apply -k` of the tier's overlay, read as the chain's responders
    once it is all up: every pod Ready, a controllers pod holding the Lease, and a GPU pod mutated in an
    installed namespace (the webhook configurations' caBundle filled, the Service's endpoints reached).
    Afterwards uninstalled whatever happened, and the session's PriorityClasses back (deploy/ ships them
    too, and its uninstall removes them), as test_install's `installed`."""
    plane = cluster.plane
    overlay = tier_overlay(tmp_path_factory.mktemp("overlay"))
    installed = Responders(
        PodResponder(plane, NAMESPACE, CONTROLLERS_PODS, CONTROLLERS_PORT),
        {
            name: PodResponder(plane, AGENT_NAMESPACE, AGENT_PODS, AGENT_PORT, node=name)
            for name in cluster.nodes
        },
    )

    def up(namespace: str, selector: str, count: int, what: str) -> list[dict[str, Any]]:
        return awaited(lambda: ready_pods(plane, namespace, selector, count), what=what, logs=installed.logs)

    try:
        plane.kubectl("apply", "-k", str(overlay))
        up(NAMESPACE, WEBHOOK_PODS, 2, "both webhook replicas Ready")
        controllers = {
            pod["metadata"]["name"]
            for pod in up(NAMESPACE, CONTROLLERS_PODS, 2, "both controllers replicas Ready")
        }
        up(AGENT_NAMESPACE, AGENT_PODS, len(cluster.nodes), "a Ready node agent pod on each node")
        eventually(
            lambda: lease_holder(plane) in controllers,
            what="a controllers pod holding the Lease",
            timeout=PATIENCE,
            logs=installed.logs,
        )
        eventually(
            lambda: mutated(cluster, installed_namespace),
            what="a GPU pod mutated by the installed webhook",
            timeout=PATIENCE,
        )
        yield installed
    finally:
        uninstall(plane)
        install_priority_classes(plane, default_priority_classes())


@pytest.fixture
def namespace_labels() -> dict[str, str]:
    """The chain's namespaces are the installed webhook's alone."""
    return {OWNER_LABEL: "installed"}


@pytest.fixture
def summary(summary: Callable[[str, str], None]) -> Callable[[str, str], None]:
    """The chain's lines in the session summary, told apart from those of its run with processes."""
    return lambda key, text: summary(key, f"installed as pods: {text}")
