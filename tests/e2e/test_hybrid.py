"""`admission.mode` on the real API server: `gpuguard controllers`, as the controllers' ServiceAccount of
deploy/ and reading the live policy ConfigMap, keeps the compiled native admission policies in step with
it. Switching to hybrid creates them (and the API server applies them), a policy change updates what
changed and deletes what is no longer wanted, a refused policy keeps them, switching back to webhook
deletes gpuguard's own and nothing else, and a replica that does not hold the Lease writes nothing.
With gpuguard's webhook registered too: in hybrid its webhooks are narrowed to what the native policies
cannot decide (a plain GPU pod never reaches it, a pod naming a node or holding a DRA claim does, and the
native policies stand aside for the claim), in native to nothing; a namespace whose mutating rules are in
warn or audit mode (by name or by label) gets an entry of its own that sends it every request, and the
leader narrows the configurations again when someone else rewrites them.

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

from tests.e2e.test_native import NATIVE_KINDS, stored_object, wait_until_in_force
from tests.harness.admission import (
    WebhookProcess,
    cpu_pod,
    create_namespace,
    default_priority_classes,
    dry_run,
    gpu_pod,
    install_priority_classes,
    kubectl_warnings,
    metric_samples,
    policy_hash,
    register,
    submit,
    unregister,
    wait_until_called,
    webhook_configurations,
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
from webhook.policy.engine import POLICY_ANNOTATION, RULES_ANNOTATION
from webhook.policy.model import CONFIGMAP_KEY, parse_policy
from webhook.policy.nativenarrow import CONDITION_NAME
from webhook.policy.nativesync import (
    FOLLOWS,
    HASH_ANNOTATION,
    OWNER,
    OWNER_LABEL,
    failing_closed,
    namespace_owner,
    wanted,
)

POLICY_CONFIGMAP = "gpuguard-policy"  # the one name the controllers' Role lets them read
LEASE = "gpuguard-controllers"
# No PolicyReports here (they need the audit's CRD and rights); no nodes, so health does nothing.
BASE = {"audit": {"reportIntervalSeconds": 0}}
HYBRID = {**BASE, "admission": {"mode": "hybrid"}}
# Another margin (the mutating rules' MAP changes) and trustedDeviceSoftware off (its VAP and bindings go).
NATIVE = {**BASE, "admission": {"mode": "native"}}
WEBHOOK_CONFIG = "gpuguard"  # the name `gpuguard controllers` narrows by default
GPU_NODE = "hybrid-gpu-node"
# Every native object written, then 5 s of settling: the 57 KB trusted-device-software VAP alone took over
# 30 s to update on a machine at load 6 on 2 cores (each attempt timed out at 10 s and was sent again).
NARROWED_TIMEOUT = 120.0
NIC_CLASS = "nic.hybrid.example.com"  # a DRA device class the default policy's deviceClasses do not match
CHANGED = {
    **HYBRID,
    "rules": {"gracefulTermination": {"marginSeconds": 25}, "trustedDeviceSoftware": {"mode": "off"}},
}

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


def registered(plane: ControlPlane, kind: str) -> dict[str, Any] | None:
    """The webhook configuration `gpuguard` of `kind` as stored, if registered."""
    found = plane.kubectl("get", kind, WEBHOOK_CONFIG, "-o", "json", "--ignore-not-found").stdout
    return json.loads(found) if found.strip() else None


def wanted_hashes(plane: ControlPlane, policy: dict[str, Any]) -> dict[tuple[str, str], str]:
    """The hash of each object the leader should write for `policy`, failing as the webhook
    configurations `gpuguard` (when registered) make it."""
    uid = plane.kubectl_json("get", "namespace", NAMESPACE)["metadata"]["uid"]
    closed = failing_closed({kind: registered(plane, kind) for kind in FOLLOWS.values()})
    return {
        (o["kind"], o["metadata"]["name"]): o["metadata"]["annotations"][HASH_ANNOTATION]
        for o in wanted(parse_policy(yaml.safe_dump(policy)), namespace_owner(NAMESPACE, uid), closed=closed)
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
    assert ("ValidatingAdmissionPolicy", "gpuguard-trusted-device-software") in created
    assert ("ValidatingAdmissionPolicy", "gpuguard-trusted-device-software") not in changed
    graceful = ("MutatingAdmissionPolicy", "gpuguard-mutations")
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


@pytest.fixture
def webhook(cluster: ControlPlane, tmp_path: Path) -> Iterator[WebhookProcess]:
    """gpuguard's webhook on the same policy ConfigMap as the controllers, with cluster facts (nodes),
    registered as `gpuguard` for every namespace but the control plane's; and a GPU node to name."""
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": GPU_NODE},
        "status": {"capacity": {"cpu": "8", "nvidia.com/gpu": "4"}},
    }
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": NIC_CLASS},
    }
    submit(cluster, "apply", {"apiVersion": "v1", "kind": "List", "items": [node, device_class]})
    workdir = tmp_path / "webhook"
    workdir.mkdir()
    process = WebhookProcess(
        workdir,
        extra_args=(
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--policy-configmap",
            f"{NAMESPACE}/{POLICY_CONFIGMAP}",
        ),
    )
    set_policy(cluster, yaml.safe_dump(BASE))
    process.start()
    register(cluster, process, "Fail", name=WEBHOOK_CONFIG)
    try:
        wait_until_called(cluster)
        yield process
    finally:
        unregister(cluster, WEBHOOK_CONFIG)
        process.stop()
        cluster.kubectl("delete", "node", GPU_NODE, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "deviceclass", NIC_CLASS, "--ignore-not-found", check=False)


def set_both_policies(plane: ControlPlane, webhook: WebhookProcess, policy: dict[str, Any]) -> None:
    """`policy` into the ConfigMap, and until the webhook runs it (the controllers are waited on by what
    they write)."""
    text = yaml.safe_dump(policy)
    set_policy(plane, text)
    webhook.wait(
        lambda: webhook.request_json("GET", "/policy")["hash"] == policy_hash(text), what="the policy"
    )


def webhook_requests(webhook: WebhookProcess) -> float:
    """How many AdmissionReviews gpuguard has answered, on either endpoint."""
    return sum(value for _, value in metric_samples(webhook.metrics(), "gpuguard_admission_requests_total"))


CONFIGURATIONS = ("mutatingwebhookconfiguration", "validatingwebhookconfiguration")


def registered_webhooks(plane: ControlPlane) -> list[list[dict[str, Any]]]:
    """The webhooks of both configurations, as stored."""
    return [plane.kubectl_json("get", kind, WEBHOOK_CONFIG)["webhooks"] for kind in CONFIGURATIONS]


def narrowing_conditions(plane: ControlPlane) -> list[list[str | None]]:
    """gpuguard's own match condition in each webhook of each configuration (None: it has none)."""
    return [
        [
            next((c["expression"] for c in w.get("matchConditions", []) if c["name"] == CONDITION_NAME), None)
            for w in webhooks
        ]
        for webhooks in registered_webhooks(plane)
    ]


def narrowed(plane: ControlPlane) -> bool:
    """Narrowed where the native policies bind: the session's webhooks leave out kube-system alone, so
    each gets an entry more for gpuguard's namespace and kube-node-lease, sending what it does not."""
    return all(
        len(conditions) == 2
        and conditions[0] not in (None, "false")
        and conditions[1] == f"!({conditions[0]})"
        for conditions in narrowing_conditions(plane)
    )


def without_policy_hash(stored: dict[str, Any]) -> dict[str, Any]:
    """The stored object but for the policy hash it carries: the mode is part of the policy's text."""
    stored["metadata"].get("annotations", {}).pop(POLICY_ANNOTATION, None)
    return stored


def mutate_requests(webhook: WebhookProcess) -> float:
    """How many AdmissionReviews gpuguard has answered on /mutate."""
    samples = metric_samples(webhook.metrics(), "gpuguard_admission_requests_total")
    return sum(value for labels, value in samples if labels.get("endpoint") == "mutate")


def answered(
    webhook: WebhookProcess, plane: ControlPlane, obj: dict[str, Any]
) -> tuple[Any, list[str], bool]:
    """`obj` dry-run: the outcome (stored object, or the denial's text), the warnings and whether
    gpuguard saw it."""
    before = webhook_requests(webhook)
    result = dry_run(plane, obj)
    outcome = without_policy_hash(stored_object(result)) if result.returncode == 0 else result.stderr.strip()
    return outcome, kubectl_warnings(result), webhook_requests(webhook) > before


def admitted_by(webhook: WebhookProcess, plane: ControlPlane, obj: dict[str, Any]) -> tuple[Any, bool]:
    """`obj` dry-run: the outcome and whether gpuguard saw it."""
    outcome, _, seen = answered(webhook, plane, obj)
    return outcome, seen


def test_the_webhooks_see_only_what_the_native_policies_cannot_decide(
    cluster: ControlPlane, start: Start, webhook: WebhookProcess
) -> None:
    leader = start()
    namespace = create_namespace(cluster, "narrowed")
    plain, on_gpu_node = gpu_pod("plain", namespace), cpu_pod("named", namespace)
    on_gpu_node["spec"]["nodeName"] = GPU_NODE
    # A CPU pod with a NIC claim: no accelerator workload for the webhook, which knows the claim's class.
    nic = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "nic", "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "nic", "exactly": {"deviceClassName": NIC_CLASS}}]}},
    }
    submit(cluster, "create", nic)
    with_nic = cpu_pod("nic", namespace)
    with_nic["spec"]["resourceClaims"] = [{"name": "nic", "resourceClaimName": "nic"}]
    with_nic["spec"]["containers"][0]["resources"]["claims"] = [{"name": "nic"}]

    # webhook mode: gpuguard decides both, and its webhooks stay as registered.
    eventually(
        lambda: leader.metric(series.RECONCILES, controller=NAME, result="success") >= 1,
        what="the native policies reconciled in webhook mode",
        processes=[leader],
    )
    by_webhook, seen = admitted_by(webhook, cluster, plain)
    assert seen and by_webhook["metadata"]["annotations"]
    denied, seen = admitted_by(webhook, cluster, on_gpu_node)
    assert seen and f"nodeName {GPU_NODE}" in denied, denied
    nic_by_webhook, seen = admitted_by(webhook, cluster, with_nic)
    assert seen and isinstance(nic_by_webhook, dict) and "annotations" not in nic_by_webhook["metadata"]
    assert narrowing_conditions(cluster) == [[None], [None]]

    # hybrid: narrowed once the native objects are in force; the plain GPU pod is the MAPs' alone and
    # stored as the webhook stores it; the pod naming a node still reaches gpuguard, denied as before.
    set_both_policies(cluster, webhook, HYBRID)
    eventually(
        lambda: narrowed(cluster), what="the webhooks narrowed", timeout=NARROWED_TIMEOUT, processes=[leader]
    )
    assert hashes(owned(cluster)) == wanted_hashes(cluster, HYBRID)
    # Registered with failurePolicy Fail: the native policies standing in for them fail closed too.
    assert {obj["spec"]["failurePolicy"] for (kind, _), obj in owned(cluster).items() if kind in FOLLOWS} == {
        "Fail"
    }
    assert leader.status()["nativePolicies"]["narrowed"] == {
        "MutatingWebhookConfiguration": True,
        "ValidatingWebhookConfiguration": True,
    }
    by_native, seen = admitted_by(webhook, cluster, plain)
    assert not seen, "the plain GPU pod reached the webhook"
    assert by_native == by_webhook
    assert admitted_by(webhook, cluster, on_gpu_node) == (denied, True)
    # The native policies, which count every claim, stand aside for it: the webhook decides, as before.
    assert admitted_by(webhook, cluster, with_nic) == (nic_by_webhook, True)

    # native: no webhook is called at all, and a pod naming a node is what native mode loses.
    set_both_policies(cluster, webhook, NATIVE)
    eventually(
        lambda: narrowing_conditions(cluster) == [["false"], ["false"]],
        what="the webhooks narrowed to nothing",
        timeout=NARROWED_TIMEOUT,
        processes=[leader],
    )
    assert admitted_by(webhook, cluster, plain) == (by_webhook, False)
    admitted, seen = admitted_by(webhook, cluster, on_gpu_node)
    assert not seen and isinstance(admitted, dict)
    # and a claim counts whatever its class: the NIC pod is mutated as an accelerator workload.
    as_accelerator, seen = admitted_by(webhook, cluster, with_nic)
    assert not seen and "gracefulTermination" in as_accelerator["metadata"]["annotations"][RULES_ANNOTATION]

    # Back to webhook: the webhooks un-narrowed, then gpuguard's own objects deleted.
    set_both_policies(cluster, webhook, BASE)
    eventually(lambda: owned(cluster) == {}, what="the owned objects deleted", processes=[leader])
    assert narrowing_conditions(cluster) == [[None], [None]]
    assert admitted_by(webhook, cluster, on_gpu_node) == (denied, True)


TIER_LABEL = "hybrid.gpuguard.io/tier"


def test_namespaces_in_warn_or_audit_mode_get_every_request_and_the_leader_undoes_a_rewrite(
    cluster: ControlPlane, start: Start, webhook: WebhookProcess
) -> None:
    leader = start()
    warned = create_namespace(cluster, "warned")
    audited = create_namespace(cluster, "audited", {TIER_LABEL: "audit"})
    enforced = create_namespace(cluster, "enforced")
    # A mutating rule in warn mode by name, every rule in audit mode by label: no MAP can do either.
    regions = {
        "namespaces": [
            {"names": [warned], "rules": {"gracefulTermination": "warn"}},
            {"selector": {"matchLabels": {TIER_LABEL: "audit"}}, "mode": "audit"},
        ]
    }
    registered = registered_webhooks(cluster)
    set_both_policies(cluster, webhook, {**BASE, **regions})
    eventually(
        lambda: leader.metric(series.RECONCILES, controller=NAME, result="success") >= 1,
        what="the native policies reconciled in webhook mode",
        processes=[leader],
    )
    by_webhook = {ns: answered(webhook, cluster, gpu_pod("plain", ns)) for ns in (warned, audited, enforced)}
    assert all(seen for _, _, seen in by_webhook.values())
    assert by_webhook[warned][1], "the warn namespace's pod got no warning"
    assert by_webhook[audited][0] != by_webhook[enforced][0], "the audit namespace's pod was mutated"

    # hybrid: the mutating webhook narrowed, its selector as registered, with an entry more for each of
    # the warn and audit namespaces (and gpuguard's own) sending them what it does not; the validating
    # one as before. The pods of the warn and audit namespaces reach gpuguard and come out as they did,
    # warnings included; the enforce namespace's is the MAPs' alone and comes out as it did too.
    set_both_policies(cluster, webhook, {**HYBRID, **regions})
    eventually(
        lambda: len(narrowing_conditions(cluster)[0]) > 2 and narrowing_conditions(cluster)[1][0] is not None,
        what="the mutating webhook split",
        timeout=NARROWED_TIMEOUT,
        processes=[leader],
    )
    split = registered_webhooks(cluster)
    mutating = split[0]
    assert {k: v for k, v in mutating[0].items() if k != "matchConditions"} == {
        k: v for k, v in registered[0][0].items() if k != "matchConditions"
    }
    assert [w["name"] for w in mutating[1:]] == [
        f"region-{i}.{registered[0][0]['name']}" for i in range(1, len(mutating))
    ]
    for namespace, reaches in ((warned, True), (audited, True), (enforced, False)):
        mutations = mutate_requests(webhook)
        outcome, warnings, seen = answered(webhook, cluster, gpu_pod("plain", namespace))
        assert seen == reaches, namespace
        # Through one entry of the mutating webhook, never both: the added one sends what the other does not.
        assert mutate_requests(webhook) - mutations == (1 if reaches else 0), namespace
        assert (outcome, warnings) == by_webhook[namespace][:2], namespace

    # `kubectl apply` of the registration, unchanged: its last-applied configuration is the same, so it
    # writes nothing over the split.
    stored = [cluster.kubectl_json("get", kind, WEBHOOK_CONFIG)["metadata"] for kind in CONFIGURATIONS]
    register(cluster, webhook, "Fail", name=WEBHOOK_CONFIG)
    assert [
        cluster.kubectl_json("get", kind, WEBHOOK_CONFIG)["metadata"] for kind in CONFIGURATIONS
    ] == stored

    # Someone else rewrites the configurations as registered (`kubectl replace`, a GitOps tool): the
    # leader sees it and splits them again, with the native objects unchanged.
    objects = versions(owned(cluster))
    submit(cluster, "replace", webhook_configurations(webhook, "Fail", name=WEBHOOK_CONFIG))
    eventually(
        lambda: registered_webhooks(cluster) == split,
        what="the configurations narrowed again",
        timeout=NARROWED_TIMEOUT,
        processes=[leader],
    )
    assert versions(owned(cluster)) == objects
    # `kubectl apply` after it, which writes its last-applied configuration back: the split stays.
    register(cluster, webhook, "Fail", name=WEBHOOK_CONFIG)
    eventually(
        lambda: registered_webhooks(cluster) == split,
        what="the configurations narrowed after kubectl apply",
        timeout=NARROWED_TIMEOUT,
        processes=[leader],
    )
    # An event that changes nothing of the split is answered by no write: the leader never fights.
    reconciles = leader.metric(series.RECONCILES, controller=NAME, result="success")
    cluster.kubectl("label", "mutatingwebhookconfiguration", WEBHOOK_CONFIG, "hybrid.gpuguard.io/seen=yes")
    labelled = cluster.kubectl_json("get", "mutatingwebhookconfiguration", WEBHOOK_CONFIG)["metadata"]
    eventually(
        lambda: leader.metric(series.RECONCILES, controller=NAME, result="success") > reconciles,
        what="the leader reconciling on the label",
        processes=[leader],
    )
    assert registered_webhooks(cluster) == split
    again = cluster.kubectl_json("get", "mutatingwebhookconfiguration", WEBHOOK_CONFIG)["metadata"]
    assert again["resourceVersion"] == labelled["resourceVersion"]

    # Back to webhook: the configurations are as registered again, entries and selectors.
    set_both_policies(cluster, webhook, {**BASE, **regions})
    eventually(lambda: owned(cluster) == {}, what="the owned objects deleted", processes=[leader])
    assert registered_webhooks(cluster) == registered
