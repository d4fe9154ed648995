"""Cluster-aware decisions: a gpuguard with cluster access reads PriorityClasses, namespace labels, nodes
and DRA claims from its watch caches, never from an API call per request, and says when it cannot.

The module's gpuguard runs with `--kubeconfig --policy-configmap` and answers only for namespaces
labelled for it (OWNER_LABEL); the session's gpuguard leaves those alone. The cluster-scoped objects the
tests read (PriorityClasses, Nodes, DeviceClasses) exist before it starts; namespaced ones are created by
each test, and where a decision depends on gpuguard having seen them, the test polls (bounded) for it.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness.admission import (
    API_SERVER_DEFAULT_SECONDS,
    IMAGE,
    PRE_STOP,
    READINESS_KEYS,
    RULES_ANNOTATION,
    SERVING_SECONDS,
    LiveWebhook,
    WebhookProcess,
    cpu_pod,
    dry_run,
    dry_run_until,
    gpu_pod,
    gpuguard_annotations,
    gpuguard_decisions,
    kubectl_warnings,
    metric_samples,
    pinned_to_gpu_nodes,
    read_back,
    readiness_tolerations,
    submit,
)
from tests.harness.controlplane import ControlPlane, free_ports, http_get
from tests.harness.manifests import admission_review_json, patch_of
from webhook.policy import engine
from webhook.policy.model import parse_policy

WEBHOOK_NAME = "gpuguard-e2e-facts"
VALIDATING = f"validate.{WEBHOOK_NAME}.gpuguard.io"
TEAM_LABEL = "gpuguard-e2e/team"
EXEMPT_LABEL = "gpuguard-e2e/guard-exempt"
GPU_NODE_LABEL = "nvidia.com/gpu.present"
MIN_PRIORITY = 1000  # the default policy's acceleratorNodeGuard.minPriority
CLASS_VALUE = 5000
LOW_VALUE = 10
GPU_DEVICE_CLASS = "gpu.example.com"  # matches the default policy's deviceClasses ("*gpu*")
NIC_DEVICE_CLASS = "nic.example.com"  # matches none of them
CACHE_SECONDS = 10.0  # how long a watch may take to bring a new object into gpuguard's caches
# What gpuguard watches; an admission request must never read any of them from the API server.
CACHED_RESOURCES = frozenset(
    {"priorityclasses", "namespaces", "nodes", "resourceclaims", "resourceclaimtemplates", "deviceclasses"}
)
LOOKUPS = ["claim_templates", "claims", "namespace_labels", "nodes", "priority_classes"]


@dataclass(frozen=True)
class Cluster:
    """Names of the cluster-scoped objects the module creates before its gpuguard starts."""

    never: str  # value CLASS_VALUE, preemptionPolicy Never: the policy's rules.priority.className
    high: str  # value CLASS_VALUE (>= minPriority), not in the policy's priorityClasses table
    low: str  # value LOW_VALUE (< minPriority), not in the table either
    gpu_node: str  # labelled nvidia.com/gpu.present
    capacity_node: str  # no label, but nvidia.com/gpu in its capacity
    cpu_node: str  # neither

    def objects(self) -> list[dict[str, Any]]:
        def priority_class(name: str, value: int, **extra: Any) -> dict[str, Any]:
            return {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": name},
                "value": value,
                **extra,
            }

        def node(name: str, labels: dict[str, str], capacity: dict[str, str]) -> dict[str, Any]:
            # A Node's status may be set on create; no kubelet ever reports here.
            metadata = {"name": name, "labels": labels}
            return {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": metadata,
                "status": {"capacity": capacity},
            }

        def device_class(name: str) -> dict[str, Any]:
            return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}}

        return [
            priority_class(self.never, CLASS_VALUE, preemptionPolicy="Never"),
            priority_class(self.high, CLASS_VALUE),
            priority_class(self.low, LOW_VALUE),
            node(self.gpu_node, {GPU_NODE_LABEL: "true"}, {"cpu": "8"}),
            node(self.capacity_node, {}, {"cpu": "8", "nvidia.com/gpu": "4"}),
            node(self.cpu_node, {}, {"cpu": "8"}),
            device_class(GPU_DEVICE_CLASS),
            device_class(NIC_DEVICE_CLASS),
        ]


def facts_policy(class_name: str) -> str:
    return f"""\
rules:
  priority:
    className: {class_name}
namespaces:
  - names: [kube-system, kube-node-lease]
    mode: "off"
  - selector:
      matchLabels:
        {TEAM_LABEL}: research
    mode: audit
  - selector:
      matchExpressions:
        - key: {EXEMPT_LABEL}
          operator: Exists
    rules:
      acceleratorNodeGuard: "off"
"""


def as_list(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": items}


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> Iterator[Cluster]:
    token = secrets.token_hex(3)
    made = Cluster(
        never=f"e2e-facts-never-{token}",
        high=f"e2e-facts-high-{token}",
        low=f"e2e-facts-low-{token}",
        gpu_node=f"e2e-gpu-node-{token}",
        capacity_node=f"e2e-gpu-capacity-node-{token}",
        cpu_node=f"e2e-cpu-node-{token}",
    )
    submit(control_plane, "apply", as_list(made.objects()))
    yield made
    if control_plane.running:
        submit(control_plane, "delete", as_list(made.objects()), "--ignore-not-found", "--wait=false")


@pytest.fixture(scope="module")
def live_webhook(
    control_plane: ControlPlane, cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveWebhook]:
    webhook = LiveWebhook(control_plane, tmp_path_factory.mktemp("live-facts"), WEBHOOK_NAME)
    try:
        webhook.start(facts_policy(cluster.never))
        yield webhook
    finally:
        webhook.stop()


@pytest.fixture
def live(live_webhook: LiveWebhook, cluster: Cluster) -> LiveWebhook:
    """The module's gpuguard, with the module's policy active (a test may have changed it)."""
    live_webhook.set_policy(facts_policy(cluster.never))
    return live_webhook


@pytest.fixture
def live_ns(live: LiveWebhook, request: pytest.FixtureRequest) -> str:
    return live.namespace(request.node.originalname.removeprefix("test_")[:40].rstrip("_").replace("_", "-"))


def mutated(answer: subprocess.CompletedProcess[str]) -> bool:
    return answer.returncode == 0 and bool(gpuguard_annotations(json.loads(answer.stdout)))


def admitted_unmutated(answer: subprocess.CompletedProcess[str]) -> bool:
    return answer.returncode == 0 and not gpuguard_annotations(json.loads(answer.stdout))


def priority_fields(pod: dict[str, Any]) -> tuple[Any, Any, Any]:
    spec = pod["spec"]
    return spec.get("priorityClassName"), spec.get("priority"), spec.get("preemptionPolicy")


def pinned_deployment(name: str, namespace: str, priority_class: str) -> dict[str, Any]:
    """A Deployment whose pods (no GPU request) select GPU nodes and name `priority_class`."""
    template_spec = cpu_pod(name, namespace)["spec"]
    template_spec["nodeSelector"] = {GPU_NODE_LABEL: "true"}
    template_spec["priorityClassName"] = priority_class
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": template_spec},
        },
    }


def on_node(name: str, namespace: str, node: str) -> dict[str, Any]:
    """A CPU pod (no class, priority 0) already bound to `node`: no scheduler involved."""
    pod = cpu_pod(name, namespace)
    pod["spec"]["nodeName"] = node
    return pod


def claim_pod(
    name: str, namespace: str, *, template: str | None = None, claim: str | None = None
) -> dict[str, Any]:
    """A pod without extended resources whose container uses one DRA claim (from a template or named)."""
    source = {"resourceClaimTemplateName": template} if template else {"resourceClaimName": claim}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "resourceClaims": [{"name": "device", **source}],
            "containers": [{"name": "main", "image": IMAGE, "resources": {"claims": [{"name": "device"}]}}],
        },
    }


def claim_source(kind: str, name: str, namespace: str, device_class: str) -> dict[str, Any]:
    """A ResourceClaim or ResourceClaimTemplate asking for one device of `device_class`."""
    claim_spec = {"devices": {"requests": [{"name": "device", "exactly": {"deviceClassName": device_class}}]}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": claim_spec} if kind == "ResourceClaimTemplate" else claim_spec,
    }


# --- PriorityClasses ------------------------------------------------------------------------------------


def test_bare_pod_gets_class_priority_and_preemption_policy_of_the_cluster_class(
    control_plane: ControlPlane, cluster: Cluster, live: LiveWebhook, live_ns: str
) -> None:
    manifest = gpu_pod("gpu", live_ns)

    submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert priority_fields(pod) == (cluster.never, CLASS_VALUE, "Never")
    assert "priority" in gpuguard_annotations(pod)[RULES_ANNOTATION].split(",")
    # gpuguard itself sends the three together (the Priority plugin would refuse a disagreeing pair).
    operations = patch_of(answer(live.process, "/mutate", as_admitted(gpu_pod("gpu", live_ns))))
    wanted = {
        "/spec/priorityClassName": cluster.never,
        "/spec/priority": CLASS_VALUE,
        "/spec/preemptionPolicy": "Never",
    }
    assert {op["path"]: op.get("value") for op in operations if op["path"] in wanted} == wanted
    # A class the user chose is kept, with what the cluster says about it.
    chosen = gpu_pod("chosen", live_ns)
    chosen["spec"]["priorityClassName"] = cluster.high
    submit(control_plane, "apply", chosen)
    assert priority_fields(read_back(control_plane, chosen)) == (
        cluster.high,
        CLASS_VALUE,
        "PreemptLowerPriority",
    )


@pytest.mark.parametrize("which", ["high", "low"])
def test_template_class_is_judged_by_its_value_in_the_cluster(
    control_plane: ControlPlane, cluster: Cluster, live_ns: str, which: str
) -> None:
    class_name = cluster.high if which == "high" else cluster.low
    assert class_name not in parse_policy(facts_policy(cluster.never)).priorityClasses
    manifest = pinned_deployment("pinned", live_ns, class_name)

    result = submit(control_plane, "apply", manifest, check=False)

    if which == "high":
        assert result.returncode == 0, result.stderr
        assert not any("cannot check" in w for w in kubectl_warnings(result)), result.stderr
        stored = read_back(control_plane, manifest)
        assert stored["spec"]["template"]["spec"]["priorityClassName"] == class_name
    else:
        assert result.returncode != 0
        assert f'admission webhook "{VALIDATING}" denied the request' in result.stderr
        assert f"priority {LOW_VALUE} (class {class_name}) < {MIN_PRIORITY}" in result.stderr
        assert control_plane.kubectl("get", "deployment", "pinned", "-n", live_ns, check=False).returncode


def test_policy_class_missing_from_the_cluster_is_never_injected(
    control_plane: ControlPlane, live: LiveWebhook, live_ns: str
) -> None:
    missing = f"e2e-missing-{secrets.token_hex(3)}"
    policy = facts_policy(missing)
    live.set_policy(policy)
    manifest = gpu_pod("gpu", live_ns)

    # Offline, gpuguard would inject the class, and the API server would refuse a pod naming it.
    assert engine.mutate(manifest, parse_policy(policy)).obj["spec"]["priorityClassName"] == missing
    naming_it = gpu_pod("naming-it", live_ns)
    naming_it["spec"]["priorityClassName"] = missing
    refusal = dry_run(control_plane, naming_it)
    assert refusal.returncode != 0
    assert f"no PriorityClass with name {missing} was found" in refusal.stderr
    # The live gpuguard says so when it loads the policy...
    live.process.wait(
        lambda: any(missing in e["message"] for e in live.events("PriorityClassMissing")),
        what="PriorityClassMissing Event",
    )

    result = submit(control_plane, "apply", manifest, check=False)

    # ...and on every pod it would have given the class to. Left without a class, the GPU pod has
    # priority 0 and the guard turns it away, suggesting no class that does not exist.
    assert f"gpuguard: priority class {missing} does not exist in the cluster: not set" in kubectl_warnings(
        result
    )
    assert result.returncode != 0
    assert f'admission webhook "{VALIDATING}" denied the request' in result.stderr
    assert f"set a priorityClassName with value >= {MIN_PRIORITY}" in result.stderr
    assert missing not in result.stderr.split("denied the request", 1)[1]


def test_global_default_class_counts_as_no_class(
    control_plane: ControlPlane, cluster: Cluster, live_ns: str
) -> None:
    default = f"e2e-facts-default-{secrets.token_hex(3)}"
    default_class = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": default},
        "value": 100,
        "globalDefault": True,
    }
    submit(control_plane, "create", default_class)
    try:
        # The Priority plugin gives the global default to every pod without a class (a CPU pod shows it);
        # once gpuguard has seen the class too, a GPU pod carrying it gets the policy's class instead.
        dry_run_until(
            control_plane,
            cpu_pod("cpu", live_ns),
            lambda a: a.returncode == 0 and json.loads(a.stdout)["spec"].get("priorityClassName") == default,
            what="the global default class set by the Priority plugin",
            timeout=CACHE_SECONDS,
        )
        dry_run_until(
            control_plane,
            gpu_pod("gpu", live_ns),
            lambda a: mutated(a) and json.loads(a.stdout)["spec"].get("priorityClassName") == cluster.never,
            what="the policy's class replacing the global default",
            timeout=CACHE_SECONDS,
        )

        gpu, cpu = gpu_pod("gpu", live_ns), cpu_pod("cpu", live_ns)
        submit(control_plane, "apply", as_list([gpu, cpu]))

        assert priority_fields(read_back(control_plane, gpu)) == (cluster.never, CLASS_VALUE, "Never")
        assert priority_fields(read_back(control_plane, cpu)) == (default, 100, "PreemptLowerPriority")
    finally:
        control_plane.kubectl("delete", "priorityclass", default, "--ignore-not-found")


# --- namespace labels -----------------------------------------------------------------------------------


def test_namespace_label_selector_sets_the_mode(
    control_plane: ControlPlane, live: LiveWebhook, live_ns: str
) -> None:
    before_label = gpu_pod("before", live_ns)
    submit(control_plane, "apply", before_label)
    assert gpuguard_annotations(read_back(control_plane, before_label))

    control_plane.kubectl("label", "namespace", live_ns, f"{TEAM_LABEL}=research")
    _, answers = dry_run_until(
        control_plane,
        gpu_pod("probe", live_ns),
        admitted_unmutated,
        what="audit mode for the labelled namespace",
        timeout=CACHE_SECONDS,
    )
    assert [a.stderr for a in answers if a.returncode != 0] == []
    audit_before = gpuguard_decisions(live.process, mode="audit", outcome="would-apply")

    after_label = gpu_pod("after", live_ns)
    submit(control_plane, "apply", after_label)
    pod = read_back(control_plane, after_label)

    assert not gpuguard_annotations(pod)
    assert readiness_tolerations(pod["spec"]) == {key: [API_SERVER_DEFAULT_SECONDS] for key in READINESS_KEYS}
    assert "priorityClassName" not in pod["spec"]
    assert gpuguard_decisions(live.process, mode="audit", outcome="would-apply") > audit_before


def test_namespace_label_selector_exempts_from_a_rule(control_plane: ControlPlane, live: LiveWebhook) -> None:
    plain = live.namespace("guarded")
    exempt = live.namespace("guard-exempt", {EXEMPT_LABEL: "true"})

    denied = submit(control_plane, "apply", pinned_to_gpu_nodes("crowder", plain), check=False)
    assert denied.returncode != 0
    assert f'admission webhook "{VALIDATING}" denied the request' in denied.stderr

    manifest = pinned_to_gpu_nodes("crowder", exempt)
    dry_run_until(
        control_plane, manifest, lambda a: a.returncode == 0, what="guard off by label", timeout=CACHE_SECONDS
    )
    submit(control_plane, "apply", manifest)
    assert read_back(control_plane, manifest)["spec"]["priority"] == 0


# --- nodes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("by", ["label", "capacity"])
def test_pod_bound_to_an_accelerator_node_by_name_is_guarded(
    control_plane: ControlPlane, cluster: Cluster, live_ns: str, by: str
) -> None:
    gpu_node = cluster.gpu_node if by == "label" else cluster.capacity_node
    on_gpu = submit(control_plane, "apply", on_node("on-gpu", live_ns, gpu_node), check=False)

    assert on_gpu.returncode != 0
    assert f'admission webhook "{VALIDATING}" denied the request' in on_gpu.stderr
    assert f"nodeName {gpu_node}" in on_gpu.stderr

    on_cpu = on_node("on-cpu", live_ns, cluster.cpu_node)
    submit(control_plane, "apply", on_cpu)
    pod = read_back(control_plane, on_cpu)
    assert (pod["spec"]["nodeName"], pod["spec"]["priority"]) == (cluster.cpu_node, 0)


def denied_by_guard(answer: subprocess.CompletedProcess[str]) -> bool:
    return answer.returncode != 0 and f'admission webhook "{VALIDATING}" denied the request' in answer.stderr


def test_a_relabelled_node_is_guarded_without_a_restart(
    control_plane: ControlPlane, live_ns: str, cluster: Cluster
) -> None:
    node = f"e2e-relabelled-node-{secrets.token_hex(3)}"
    submit(control_plane, "create", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    try:
        pod = on_node("on-relabelled", live_ns, node)
        dry_run_until(control_plane, pod, admitted_unmutated, what="a pod bound to a CPU node admitted")
        control_plane.kubectl("label", "node", node, f"{GPU_NODE_LABEL}=true")
        dry_run_until(
            control_plane, pod, denied_by_guard, what="the relabelled node guarded", timeout=CACHE_SECONDS
        )
    finally:
        control_plane.kubectl("delete", "node", node, "--wait=false", check=False)


def test_a_policy_naming_a_new_node_label_guards_the_nodes_carrying_it(
    control_plane: ControlPlane, live: LiveWebhook, live_ns: str, cluster: Cluster
) -> None:
    """The node cache keeps only the labels the policy names: a new policy makes gpuguard list the nodes
    again, so a label it had no reason to keep before now makes an accelerator node."""
    label = "example.com/fpga"
    node = f"e2e-fpga-node-{secrets.token_hex(3)}"
    metadata = {"name": node, "labels": {label: "true"}}
    submit(control_plane, "create", {"apiVersion": "v1", "kind": "Node", "metadata": metadata})
    try:
        pod = on_node("on-fpga", live_ns, node)
        dry_run_until(control_plane, pod, admitted_unmutated, what="a pod bound to an unknown-label node")
        labels = [*parse_policy(facts_policy(cluster.never)).accelerators.nodeLabels, label]
        live.set_policy(facts_policy(cluster.never) + f"accelerators:\n  nodeLabels: {json.dumps(labels)}\n")
        dry_run_until(control_plane, pod, denied_by_guard, what="the node guarded under the new policy")
    finally:
        control_plane.kubectl("delete", "node", node, "--wait=false", check=False)


# --- DRA ------------------------------------------------------------------------------------------------


@pytest.fixture
def claims(control_plane: ControlPlane) -> Callable[[str, str, str], dict[str, Any]]:
    """`claims(kind, namespace, device_class)`: creates a ResourceClaim(Template) and returns a pod using it."""

    def make(kind: str, namespace: str, device_class: str) -> dict[str, Any]:
        name = f"{device_class.split('.')[0]}-{kind.lower()}"
        submit(control_plane, "create", claim_source(kind, name, namespace, device_class))
        if kind == "ResourceClaimTemplate":
            return claim_pod("worker", namespace, template=name)
        return claim_pod("worker", namespace, claim=name)

    return make


@pytest.mark.parametrize("kind", ["ResourceClaimTemplate", "ResourceClaim"])
def test_claim_for_an_accelerator_device_class_makes_an_accelerator_workload(
    control_plane: ControlPlane,
    cluster: Cluster,
    live_ns: str,
    kind: str,
    claims: Callable[[str, str, str], dict[str, Any]],
) -> None:
    manifest = claims(kind, live_ns, GPU_DEVICE_CLASS)

    submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert gpuguard_annotations(pod)
    assert pod["spec"]["containers"][0]["lifecycle"] == {"preStop": PRE_STOP}
    assert readiness_tolerations(pod["spec"]) == {key: [SERVING_SECONDS] for key in READINESS_KEYS}
    assert priority_fields(pod) == (cluster.never, CLASS_VALUE, "Never")


@pytest.mark.parametrize("kind", ["ResourceClaimTemplate", "ResourceClaim"])
def test_claim_for_another_device_class_does_not(
    control_plane: ControlPlane,
    live_ns: str,
    kind: str,
    claims: Callable[[str, str, str], dict[str, Any]],
) -> None:
    manifest = claims(kind, live_ns, NIC_DEVICE_CLASS)
    # Until gpuguard has seen the claim, any claim counts (what the policy alone can decide).
    _, answers = dry_run_until(
        control_plane, manifest, admitted_unmutated, what="the claim's device class", timeout=CACHE_SECONDS
    )
    assert [a.stderr for a in answers if a.returncode != 0] == []

    submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert not gpuguard_annotations(pod)
    assert "lifecycle" not in pod["spec"]["containers"][0]
    assert pod["spec"]["priority"] == 0


# --- caches, not API calls ------------------------------------------------------------------------------


def reads_of_cached_resources(plane: ControlPlane) -> float:
    """GETs and LISTs the API server has served on the resources gpuguard caches."""
    # Not through kubectl: the whole exposition would crowd the "last kubectl calls" of a failure report.
    status, body = http_get(plane.port, "/metrics", plane.pki.admin_context())
    assert status == 200, body[:300]
    return sum(
        value
        for labels, value in metric_samples(body.decode(), "apiserver_request_total")
        if labels.get("resource") in CACHED_RESOURCES and labels.get("verb") in ("GET", "LIST")
    )


def test_admission_reads_no_cluster_object_from_the_api_server(
    control_plane: ControlPlane, cluster: Cluster, live_ns: str
) -> None:
    requests = [
        gpu_pod("gpu", live_ns),
        on_node("on-cpu", live_ns, cluster.cpu_node),
        on_node("on-gpu", live_ns, cluster.gpu_node),
        pinned_deployment("pinned", live_ns, cluster.high),
        claim_pod("worker", live_ns, template="not-there"),
    ]
    dry_run(control_plane, requests[0])  # the API server's own first look at a new namespace is not ours
    before = reads_of_cached_resources(control_plane)

    answers = [dry_run(control_plane, obj) for obj in requests for _ in range(2)]

    assert [a.returncode for a in answers] == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]  # each one was decided
    assert reads_of_cached_resources(control_plane) == before


# --- the API unreachable --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cut_off(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WebhookProcess]:
    """gpuguard with `--cluster-lookups on` and a kubeconfig whose server is a closed loopback port."""
    workdir = tmp_path_factory.mktemp("cut-off")
    kubeconfig = json.loads(control_plane.kubeconfig.read_text())
    (closed_port,) = free_ports(1)
    kubeconfig["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{closed_port}"
    path = workdir / "kubeconfig"
    path.write_text(json.dumps(kubeconfig))
    webhook = WebhookProcess(workdir, extra_args=("--kubeconfig", str(path), "--cluster-lookups", "on"))
    webhook.start()
    try:
        yield webhook
    finally:
        webhook.stop()


def answer(webhook: WebhookProcess, endpoint: str, obj: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = webhook.request_json("POST", endpoint, admission_review_json(obj))["response"]
    return response


def as_admitted(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as the API server sends it to webhooks: the Priority plugin has resolved its priority."""
    pod["spec"].update(priority=0, preemptionPolicy="PreemptLowerPriority")
    return pod


def unavailable(warnings: list[str]) -> list[str]:
    return [w for w in warnings if w.startswith("gpuguard: cluster lookups unavailable (")]


def test_unreachable_api_falls_back_to_the_policy_alone_and_says_so(cut_off: WebhookProcess) -> None:
    assert cut_off.request_json("GET", "/policy")["unavailableLookups"] == LOOKUPS

    # The policy's class is set without knowing its value: the Priority plugin will resolve it.
    gpu = answer(cut_off, "/mutate", as_admitted(gpu_pod("gpu", "team")))
    assert gpu["allowed"] is True
    operations = {(op["op"], op["path"]): op.get("value") for op in patch_of(gpu)}
    assert operations[("add", "/spec/priorityClassName")] == "gpu-workload"
    assert ("remove", "/spec/priority") in operations
    assert len(unavailable(gpu["warnings"])) == 1, gpu["warnings"]
    # A DRA claim whose device class cannot be looked up counts as an accelerator.
    claimed = answer(cut_off, "/mutate", as_admitted(claim_pod("worker", "team", template="nic")))
    assert any(op["path"] == "/spec/containers/0/lifecycle" for op in patch_of(claimed)), claimed
    assert unavailable(claimed["warnings"]), claimed
    # A class the policy does not list cannot be judged, and is let through with a warning...
    unknown = answer(cut_off, "/validate", pinned_deployment("pinned", "team", "e2e-not-in-the-policy"))
    assert unknown["allowed"] is True
    assert any("cannot check class e2e-not-in-the-policy" in w for w in unknown["warnings"]), unknown
    assert unavailable(unknown["warnings"]), unknown
    # ...a node name means nothing without the node...
    on_gpu = answer(cut_off, "/validate", as_admitted(on_node("on-gpu", "team", "gpu-node-1")))
    assert on_gpu["allowed"] is True
    assert unavailable(on_gpu["warnings"]), on_gpu
    # ...and what the manifest says by itself is still enforced.
    pinned = answer(cut_off, "/validate", as_admitted(pinned_to_gpu_nodes("crowder", "team")))
    assert pinned["allowed"] is False
    assert pinned["status"]["code"] == 403
    assert unavailable(pinned["warnings"]), pinned


def test_unreachable_api_warning_says_decisions_fell_back(cut_off: WebhookProcess) -> None:
    gpu = answer(cut_off, "/mutate", as_admitted(gpu_pod("gpu", "team")))

    (warning,) = unavailable(gpu["warnings"])
    assert "decided from the policy alone" in warning, warning
    assert "(all)" in warning, warning  # every lookup is down: the warning says so in a word


# --- offline with --facts: the server's answer -----------------------------------------------------------


def offline_answer(
    tmp_path: Path, endpoint: str, review: dict[str, Any], *, policy: Path, facts: Path
) -> dict[str, Any]:
    """`gpuguard review` with the live policy and a `kubectl get ... -o yaml` of the cluster: no server."""
    body = tmp_path / f"review-{review['request']['uid']}.json"
    body.write_text(json.dumps(review))
    flags = ["--validate"] if endpoint == "/validate" else []
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "gpuguard"),
            "review",
            *flags,
            str(body),
            "--policy",
            str(policy),
            "--facts",
            str(facts),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr
    response: dict[str, Any] = json.loads(result.stdout)["response"]
    return response


def test_offline_answers_with_the_clusters_facts_are_the_servers(
    control_plane: ControlPlane, cluster: Cluster, live: LiveWebhook, tmp_path: Path
) -> None:
    research = live.namespace("offline-research", {TEAM_LABEL: "research"})
    plain = live.namespace("offline-plain")
    pod_in_research = as_admitted(gpu_pod("gpu", research))
    # The server must have seen the new namespace's labels (a watch event) before answering for it.
    live.process.wait(
        lambda: "patch" not in answer(live.process, "/mutate", pod_in_research),  # audit: nothing changed
        what="the research namespace's labels in gpuguard's cache",
    )
    facts = tmp_path / "facts.yaml"
    facts.write_text(control_plane.kubectl("get", "priorityclasses,namespaces,nodes", "-o", "yaml").stdout)
    policy = tmp_path / "policy.yaml"
    policy.write_text(facts_policy(cluster.never))
    cases = [
        ("/mutate", as_admitted(gpu_pod("gpu", plain))),  # the cluster's class, value and preemption policy
        ("/mutate", pod_in_research),  # audit, chosen by the namespace's labels
        ("/validate", on_node("bound", plain, cluster.gpu_node)),  # an accelerator node, by its labels
        ("/validate", on_node("capacity", plain, cluster.capacity_node)),  # ... by its capacity
        ("/validate", pinned_deployment("low", plain, cluster.low)),  # a class judged by its cluster value
        ("/validate", pinned_deployment("high", plain, cluster.high)),
    ]
    for endpoint, obj in cases:
        review = admission_review_json(obj)
        served = live.process.request_json("POST", endpoint, review)["response"]
        assert offline_answer(tmp_path, endpoint, review, policy=policy, facts=facts) == served, obj[
            "metadata"
        ]
    # The facts decided: without them, the offline answers differ.
    review = admission_review_json(on_node("bound", plain, cluster.gpu_node))
    denied = live.process.request_json("POST", "/validate", review)["response"]
    assert denied["allowed"] is False
    without = tmp_path / "nothing.yaml"
    without.write_text("apiVersion: v1\nkind: List\nitems: []\n")
    assert offline_answer(tmp_path, "/validate", review, policy=policy, facts=without)["allowed"] is True
