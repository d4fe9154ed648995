"""`admission.mode` on the real API server: `gpuguard controllers`, as the controllers' ServiceAccount of
deploy/ and reading the live policy ConfigMap, keeps the compiled native admission policies in step with
it. Switching to hybrid creates them (and the API server applies them), a policy change updates what
changed and deletes what is no longer wanted, a refused policy keeps them, switching back to webhook
deletes gpuguard's own and nothing else, and a replica that does not hold the Lease writes nothing.

A control plane of its own: the objects bind every namespace, and would act on the suite's other tests.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_native import NATIVE_KINDS, wait_until_in_force
from tests.harness.admission import (
    create_namespace,
    default_priority_classes,
    install_priority_classes,
    submit,
)
from tests.harness.controllers import (
    NAMESPACE,
    SERVICE_ACCOUNT,
    Start,
    eventually,
    install_service_account,
    service_account_kubeconfig,
    start_fixture,
)
from tests.harness.controlplane import ControlPlane
from webhook.controllers import series
from webhook.controllers.nativesync import NAME
from webhook.policy.model import CONFIGMAP_KEY, parse_policy
from webhook.policy.nativesync import HASH_ANNOTATION, OWNER, OWNER_LABEL, namespace_owner, wanted

POLICY_CONFIGMAP = "gpuguard-policy"  # the one name the controllers' Role lets them read
LEASE = "gpuguard-controllers"
# No PolicyReports here (they need the audit's CRD and rights); no nodes, so health does nothing.
BASE = {"audit": {"reportIntervalSeconds": 0}}
HYBRID = {**BASE, "admission": {"mode": "hybrid"}}
# Another margin (the gracefulTermination MAP changes) and priority off (its MAP and binding go).
CHANGED = {**HYBRID, "rules": {"gracefulTermination": {"marginSeconds": 25}, "priority": {"mode": "off"}}}

Objects = dict[tuple[str, str], dict[str, Any]]


@pytest.fixture(scope="module")
def cluster(k8s_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane.start(k8s_bin, tmp_path_factory.mktemp("hybrid-plane"))
    try:
        install_service_account(plane, SERVICE_ACCOUNT)
        # The class the priority rule gives: the in-tree Priority plugin refuses pods naming a missing one.
        install_priority_classes(plane, default_priority_classes())
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def kubeconfig(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service_account_kubeconfig(cluster, tmp_path_factory.mktemp("hybrid-sa") / "sa.kubeconfig")


def remove_what_they_own(cluster: ControlPlane) -> None:
    cluster.kubectl("delete", NATIVE_KINDS, "-l", f"{OWNER_LABEL}={OWNER}", check=False)
    cluster.kubectl("delete", "lease", LEASE, "-n", NAMESPACE, "--ignore-not-found", check=False)


# Controllers on the policy ConfigMap. The Lease's defaults: no test here times a failover, and a write
# may take what is left of a 15 s lease (up to 10 s). Creating the trusted-device-software VAP (57 KB of
# CEL for the API server to check) took 1.9 s on a quiet control plane here, more than the 4 s lease of
# the failover tests leaves a write under load.
start = start_fixture(remove_what_they_own, policy_configmap=f"{NAMESPACE}/{POLICY_CONFIGMAP}", lease_args=())


def set_policy(plane: ControlPlane, text: str) -> None:
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": POLICY_CONFIGMAP, "namespace": NAMESPACE},
        "data": {CONFIGMAP_KEY: text},
    }
    submit(plane, "apply", configmap)


def owned(plane: ControlPlane) -> Objects:
    """gpuguard's own admission policies and bindings, by kind and name."""
    listed = plane.kubectl_json("get", NATIVE_KINDS, "-l", f"{OWNER_LABEL}={OWNER}", "--show-managed-fields")
    return {(o["kind"], o["metadata"]["name"]): o for o in listed["items"]}


def hashes(objects: Objects) -> dict[tuple[str, str], str]:
    return {key: obj["metadata"]["annotations"][HASH_ANNOTATION] for key, obj in objects.items()}


def wanted_hashes(plane: ControlPlane, policy: dict[str, Any]) -> dict[tuple[str, str], str]:
    uid = plane.kubectl_json("get", "namespace", NAMESPACE)["metadata"]["uid"]
    return {
        (o["kind"], o["metadata"]["name"]): o["metadata"]["annotations"][HASH_ANNOTATION]
        for o in wanted(parse_policy(yaml.safe_dump(policy)), namespace_owner(NAMESPACE, uid))
    }


def versions(objects: Objects) -> dict[tuple[str, str], str]:
    return {key: obj["metadata"]["resourceVersion"] for key, obj in objects.items()}


def by_hand(plane: ControlPlane) -> dict[str, Any]:
    """What an operator applied: a ValidatingAdmissionPolicy marked managed-by gpuguard (as the output of
    `gpuguard policy compile` is), and not the controllers' own."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "team-by-hand", "labels": {"app.kubernetes.io/managed-by": "gpuguard"}},
        "spec": {
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "validations": [{"expression": "true"}],
        },
    }
    submit(plane, "apply", policy)
    return policy


def test_the_leader_keeps_the_native_policies_in_step_with_the_live_policy_configmap(
    cluster: ControlPlane, start: Start
) -> None:
    by_hand(cluster)
    set_policy(cluster, yaml.safe_dump(BASE))
    leader = start()
    # webhook mode: the leader decided (a reconcile went by) and owns nothing.
    eventually(
        lambda: leader.metric(series.RECONCILES, controller=NAME, result="success") >= 1,
        what="the native policies reconciled in webhook mode",
        processes=[leader],
    )
    assert owned(cluster) == {}

    # hybrid: every compiled object, and the API server applies them.
    set_policy(cluster, yaml.safe_dump(HYBRID))
    eventually(
        lambda: hashes(owned(cluster)) == wanted_hashes(cluster, HYBRID),
        what="the compiled objects created",
        processes=[leader],
    )
    namespace = create_namespace(cluster, "hybrid")
    wait_until_in_force(cluster, namespace)
    created = owned(cluster)
    assert leader.status()["nativePolicies"]["owned"]["MutatingAdmissionPolicy"] >= 1
    # Owned by gpuguard's Namespace: uninstalling it lets the garbage collector take them.
    own_namespace = cluster.kubectl_json("get", "namespace", NAMESPACE)["metadata"]
    for obj in created.values():
        assert [(r["kind"], r["name"], r["uid"]) for r in obj["metadata"]["ownerReferences"]] == [
            ("Namespace", NAMESPACE, own_namespace["uid"])
        ]

    # An owned object edited by hand is written back; the others are left alone.
    binding = next(k for k in created if k[0] == "ValidatingAdmissionPolicyBinding")
    cluster.kubectl(
        "patch",
        "validatingadmissionpolicybinding",
        binding[1],
        "--type=merge",
        "-p",
        json.dumps({"spec": {"validationActions": ["Audit"]}}),
    )
    eventually(
        lambda: (
            owned(cluster)[binding]["spec"]["validationActions"]
            == created[binding]["spec"]["validationActions"]
        ),
        what="the edited binding written back",
        processes=[leader],
    )
    restored = owned(cluster)
    assert {k: v for k, v in versions(restored).items() if k != binding} == {
        k: v for k, v in versions(created).items() if k != binding
    }
    created = restored

    # A policy change: what changed is updated, what is no longer wanted deleted, the rest left alone.
    set_policy(cluster, yaml.safe_dump(CHANGED))
    eventually(
        lambda: hashes(owned(cluster)) == wanted_hashes(cluster, CHANGED),
        what="the objects updated to the changed policy",
        processes=[leader],
    )
    changed = owned(cluster)
    assert ("MutatingAdmissionPolicy", "gpuguard-priority") in created
    assert ("MutatingAdmissionPolicy", "gpuguard-priority") not in changed
    graceful = ("MutatingAdmissionPolicy", "gpuguard-graceful-termination")
    assert (
        changed[graceful]["metadata"]["resourceVersion"] != created[graceful]["metadata"]["resourceVersion"]
    )
    unchanged = {
        k
        for k in changed
        if k in created and wanted_hashes(cluster, CHANGED)[k] == wanted_hashes(cluster, HYBRID)[k]
    }
    assert unchanged, "some object is the same under both policies"
    assert {k: versions(changed)[k] for k in unchanged} == {k: versions(created)[k] for k in unchanged}

    # A policy the controllers refuse: the last good one stays, and so do its objects.
    errors = leader.status()["errors"]
    set_policy(cluster, "admission: {mode: both}\n")
    eventually(
        lambda: leader.status()["errors"] > errors,
        what="the broken policy refused",
        processes=[leader],
    )
    assert versions(owned(cluster)) == versions(changed)

    # Back to webhook: gpuguard's own objects go, the operator's stays.
    set_policy(cluster, yaml.safe_dump(BASE))
    eventually(lambda: owned(cluster) == {}, what="the owned objects deleted", processes=[leader])
    assert cluster.kubectl_json("get", "validatingadmissionpolicy", "team-by-hand")["metadata"]["name"]
    cluster.kubectl("delete", "validatingadmissionpolicy", "team-by-hand")


def test_a_replica_without_the_lease_writes_nothing_until_it_leads(
    cluster: ControlPlane, start: Start
) -> None:
    # Someone else holds the Lease, renewed just now for an hour.
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": LEASE, "namespace": NAMESPACE},
        "spec": {
            "holderIdentity": "elsewhere",
            "leaseDurationSeconds": 3600,
            "acquireTime": now,
            "renewTime": now,
        },
    }
    submit(cluster, "create", lease)
    set_policy(cluster, yaml.safe_dump(HYBRID))
    standby = start(identity="b", lead=False)
    # Its caches synced and the policy loaded: the key waits in its queue, and no worker takes it.
    eventually(
        lambda: standby.metric("gpuguard_workqueue_depth", controller=NAME) == 1,
        what="the standby holding the native policies' key",
        processes=[standby],
    )
    assert standby.status()["role"] == "standby"
    assert standby.metric(series.NATIVE_POLICY_WRITES) == 0
    assert owned(cluster) == {}

    # The holder goes: the standby leads, and only then writes.
    cluster.kubectl("delete", "lease", LEASE, "-n", NAMESPACE)
    standby.wait_leading()
    eventually(
        lambda: hashes(owned(cluster)) == wanted_hashes(cluster, HYBRID),
        what="the new leader creating the objects",
        processes=[standby],
    )
    managers = {
        entry["manager"]
        for obj in owned(cluster).values()
        for entry in obj["metadata"].get("managedFields", [])
    }
    assert managers == {"gpuguard"}, json.dumps(sorted(managers))
