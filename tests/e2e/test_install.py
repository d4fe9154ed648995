"""The production install on the real API server: deploy/ as `kubectl apply -k` sends it, the service
account's exact rights, and the certificate lifecycle (bootstrap, caBundle, rotation under load).

The tests share one install and run in file order: the caBundle survives a re-apply of deploy/ only while
the configurations still name the Service, so that test comes before they are routed to the replicas.
"""

from __future__ import annotations

import itertools
import json
import secrets
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.harness import REPO_ROOT
from tests.harness.admission import cpu_pod, default_priority_classes, gpu_pod, gpuguard_annotations
from tests.harness.controlplane import ControlPlane, wait_until
from tests.harness.install import (
    CONFIGURATION,
    CONFIGURATION_KINDS,
    CONTROLLERS,
    DEPLOY,
    ENDPOINTS,
    NAMESPACE,
    POLICY_CONFIGMAP,
    SECRET,
    SERVICE_ACCOUNT,
    Replica,
    Stream,
    ca_bundles,
    deployed,
    find,
    read_secret,
    render,
    route_to,
    run_gpuguard,
    secret_exists,
    service_account_kubeconfig,
    submit_dry_run,
    wait_for,
)
from webhook import cli
from webhook.certs import files, tls
from webhook.cli import controllers as cli_controllers
from webhook.policy.nativesync import RESOURCES

SA_USER = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
# Short, so a whole rotation fits in a test; the API server still needs far less than this to pick up a
# patched caBundle (its informer), and the replicas a changed Secret (their watch).
ROTATION_DELAY = 3.0
ROUTED_LABEL = "gpuguard-e2e-install"


# --- deploy/ as kustomize renders it ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered(control_plane: ControlPlane) -> list[dict[str, Any]]:
    return render(control_plane)


def test_policy_configmap_holds_the_documented_default(rendered: list[dict[str, Any]]) -> None:
    configmap = find(rendered, "ConfigMap", POLICY_CONFIGMAP)  # no hash suffix: --policy-configmap names it

    default = (REPO_ROOT / "webhook" / "default-policy.yaml").read_text()
    assert configmap["data"] == {"policy.yaml": default}
    assert configmap["metadata"]["namespace"] == NAMESPACE
    # The class the policy injects ships with it, with the value the policy judges templates by.
    policy = yaml.safe_load(default)
    injected = policy["rules"]["priority"]["className"]
    shipped = {o["metadata"]["name"]: o["value"] for o in rendered if o["kind"] == "PriorityClass"}
    assert shipped[injected] == default_priority_classes()[injected]


def test_the_single_install_manifest_is_deploy_rendered(control_plane: ControlPlane) -> None:
    """deploy/install.yaml (for `kubectl apply -f`, no kustomize) is what deploy/ renders to, exactly."""
    lines = (DEPLOY / "install.yaml").read_text().splitlines(keepends=True)
    header = 0
    while lines[header].startswith("# "):
        header += 1
    assert header > 0, "the generated file says where it comes from"
    rendered = control_plane.kubectl("kustomize", str(DEPLOY)).stdout
    assert "".join(lines[header:]) == rendered, "deploy/install.yaml is stale: run scripts/render-install"


def _serve_args(container: dict[str, Any]) -> Any:
    # The arguments as the kubelet expands them, parsed by gpuguard's own command line.
    args = [arg.replace("$(POD_NAMESPACE)", NAMESPACE) for arg in container["args"]]
    return cli.parser().parse_args(["serve", *args])


def test_deployment_is_hardened_and_highly_available(rendered: list[dict[str, Any]]) -> None:
    deployment = find(rendered, "Deployment", "gpuguard")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]

    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    spread = {c["topologyKey"]: c["whenUnsatisfiable"] for c in pod["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"] == "DoNotSchedule"
    budget = find(rendered, "PodDisruptionBudget", "gpuguard")
    assert budget["spec"]["minAvailable"] == 1
    assert (
        budget["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    own_class = find(rendered, "PriorityClass", pod["priorityClassName"])
    assert own_class["value"] > max(default_priority_classes().values())

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) == {"cpu", "memory"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert pod["serviceAccountName"] == SERVICE_ACCOUNT

    args = _serve_args(container)
    assert args.tls_secret == (NAMESPACE, SECRET)
    assert args.webhook_config == CONFIGURATION
    assert args.policy_configmap == f"{NAMESPACE}/{POLICY_CONFIGMAP}"
    # Workers follow the CPU limit, so a bigger limit is all it takes to use the cores it grants.
    assert args.workers == "auto"
    # The only place gpuguard writes is the in-memory emptyDir holding the serving files.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[args.cert_dir]]["emptyDir"]["medium"] == "Memory"
    service = find(rendered, "Service", args.service)
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]


def test_controllers_deployment_is_hardened_and_elects_a_leader(rendered: list[dict[str, Any]]) -> None:
    deployment = find(rendered, "Deployment", CONTROLLERS)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]

    assert deployment["spec"]["replicas"] == 2  # a leader and a warm standby
    assert pod["serviceAccountName"] == CONTROLLERS != SERVICE_ACCOUNT
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # The arguments as the kubelet expands them, parsed by gpuguard's own command line.
    args = [
        arg.replace("$(POD_NAMESPACE)", NAMESPACE).replace("$(POD_NAME)", "pod-a")
        for arg in container["args"]
    ]
    assert container["command"] == ["gpuguard"]
    parsed = cli.parser().parse_args(args)
    assert parsed.run is cli_controllers.run_controllers
    assert parsed.policy_configmap == f"{NAMESPACE}/{POLICY_CONFIGMAP}"
    assert (parsed.namespace, parsed.identity) == (NAMESPACE, "pod-a")
    assert container["ports"][0]["containerPort"] == parsed.port
    budget = find(rendered, "PodDisruptionBudget", CONTROLLERS)
    assert budget["spec"]["minAvailable"] == 1


def test_gpuguards_own_class_protects_it_and_preempts_nothing(rendered: list[dict[str, Any]]) -> None:
    own = find(rendered, "PriorityClass", "gpuguard-critical")
    assert own["value"] == 1_000_000_000  # nothing a workload can name outranks it
    assert own["preemptionPolicy"] == "Never"  # ...and it never evicts a workload to make room
    # The class gpuguard gives accelerator workloads keeps Kubernetes' default: it may preempt pods of
    # lower priority (class-less ones, at 0), as a GPU workload that waits for room should.
    injected = find(rendered, "PriorityClass", "gpu-workload")
    assert injected.get("preemptionPolicy", "PreemptLowerPriority") == "PreemptLowerPriority"


def test_webhook_configurations_are_deliberate(rendered: list[dict[str, Any]]) -> None:
    mutating_webhooks = find(rendered, "MutatingWebhookConfiguration", CONFIGURATION)["webhooks"]
    validating_webhooks = find(rendered, "ValidatingWebhookConfiguration", CONFIGURATION)["webhooks"]
    assert [w["name"] for w in validating_webhooks] == ["validate.gpuguard.io", "device-software.gpuguard.io"]
    for webhook, path in (
        *((w, "/mutate") for w in mutating_webhooks),
        *((w, "/validate") for w in validating_webhooks),
    ):
        assert webhook["failurePolicy"] == "Ignore"
        assert 1 <= webhook["timeoutSeconds"] <= 5
        assert webhook["sideEffects"] == "None"
        assert webhook["admissionReviewVersions"] == ["v1"]
        assert webhook["matchConditions"]
        assert webhook["clientConfig"] == {
            "service": {"name": "gpuguard", "namespace": NAMESPACE, "path": path, "port": 443}
        }  # and no caBundle: gpuguard owns it
    (mutating,) = mutating_webhooks
    guarded, device_software = validating_webhooks
    assert mutating["reinvocationPolicy"] == "IfNeeded"
    # Mutation on CREATE only; validation also on UPDATE (matchConditions pass device software alone).
    assert {op for rule in mutating["rules"] for op in rule["operations"]} == {"CREATE"}
    assert {op for rule in guarded["rules"] for op in rule["operations"]} == {"CREATE", "UPDATE"}
    assert "daemonsets" not in {r for rule in mutating["rules"] for r in rule["resources"]}
    assert {"daemonsets", "pods/ephemeralcontainers"} <= {
        r for rule in guarded["rules"] for r in rule["resources"]
    }
    assert device_software["rules"] == guarded["rules"]
    # The first two leave out the control plane's namespaces and gpuguard's own; the third sees only
    # kube-system, where device plugins live.
    for webhook in (mutating, guarded):
        (excluded,) = webhook["namespaceSelector"]["matchExpressions"]
        assert (excluded["key"], excluded["operator"]) == ("kubernetes.io/metadata.name", "NotIn")
        assert {"kube-system", "kube-node-lease", NAMESPACE} <= set(excluded["values"])
    assert device_software["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["kube-system"]}
    ]


def test_fail_closed_overlay_changes_only_the_failure_policy(
    control_plane: ControlPlane, rendered: list[dict[str, Any]]
) -> None:
    fail_closed = render(control_plane, DEPLOY / "fail-closed")

    expected = json.loads(json.dumps(rendered))
    for obj in expected:
        if obj["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            obj["webhooks"][0]["failurePolicy"] = "Fail"
    assert fail_closed == expected


def test_image_installs_the_pinned_runtime_dependencies_as_non_root() -> None:
    # Every dependency pyproject.toml declares is pinned, and no dev tool is. (Whether the pins still
    # match the virtualenv is `python scripts/constraints.py --check`: a fresh venv may be newer.)
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(
        line.split("==")
        for line in (REPO_ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    pinned = {canonicalize_name(name) for name in pins}
    assert all(version and "=" not in version for version in pins.values()), pins
    declared = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    assert declared <= pinned, declared - pinned
    dev = {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["dev"]}
    assert not dev & pinned, dev & pinned

    stages = (REPO_ROOT / "Dockerfile").read_text().split("\nFROM ")
    build, run = stages[-2], stages[-1]
    assert "--constraint constraints.txt" in build and "--only-binary=:all:" in build
    assert "--without-pip" in build
    assert "COPY --from=build /opt/gpuguard /opt/gpuguard" in run
    assert "pip uninstall --yes pip setuptools wheel" in run
    assert "USER 65532:65532" in run
    assert run.rstrip().endswith('ENTRYPOINT ["gpuguard", "serve"]')


# --- deploy/ on the API server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane, rendered: list[dict[str, Any]]) -> Iterator[str]:
    """deploy/ applied for real; yields the output of the server-side dry run that preceded it."""
    with deployed(control_plane, DEPLOY, rendered, NAMESPACE) as dry_run:
        yield dry_run


def test_dry_run_on_the_api_server_accepts_every_object(
    installed: str, rendered: list[dict[str, Any]]
) -> None:
    lines = installed.strip().splitlines()

    assert len(lines) == len(rendered), installed
    assert all(line.endswith("(server dry run)") for line in lines), installed
    # Nothing to warn about either: the Pod Security admission (restricted) would, for the Deployment.
    assert "Warning" not in installed


def test_gpuguards_pods_get_its_class_and_never_preempt(
    control_plane: ControlPlane, installed: str, rendered: list[dict[str, Any]]
) -> None:
    # What the scheduler reads: the Priority admission plugin resolves the class onto the pod.
    template = find(rendered, "Deployment", "gpuguard")["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpuguard-probe", "namespace": NAMESPACE, **template["metadata"]},
        "spec": template["spec"],
    }
    stored = control_plane.kubectl_json("create", "--dry-run=server", "-f", "-", input=json.dumps(pod))
    assert stored["spec"]["priorityClassName"] == "gpuguard-critical"
    assert (stored["spec"]["priority"], stored["spec"]["preemptionPolicy"]) == (1_000_000_000, "Never")


ALLOWED = [
    ("list", "priorityclasses.scheduling.k8s.io", None),
    ("watch", "namespaces", None),
    ("list", "nodes", None),
    ("watch", "resourceclaims.resource.k8s.io", "--all-namespaces"),
    ("list", "resourceclaimtemplates.resource.k8s.io", "--all-namespaces"),
    ("watch", f"configmaps/{POLICY_CONFIGMAP}", NAMESPACE),
    ("get", f"secrets/{SECRET}", NAMESPACE),
    ("update", f"secrets/{SECRET}", NAMESPACE),
    ("create", "secrets", NAMESPACE),
    ("create", "events.events.k8s.io", NAMESPACE),
    ("get", f"mutatingwebhookconfigurations/{CONFIGURATION}", None),
    ("patch", f"validatingwebhookconfigurations/{CONFIGURATION}", None),
]
DENIED = [
    ("get", "secrets", "kube-system"),  # no Secret outside its namespace
    ("get", f"secrets/{SECRET}", "default"),
    ("list", "secrets", NAMESPACE),  # nor any other Secret inside it
    ("get", "secrets/other", NAMESPACE),
    ("delete", f"secrets/{SECRET}", NAMESPACE),
    ("create", "secrets", "default"),
    ("create", "pods", "default"),  # never writes workloads: the API server applies its patches
    ("patch", "pods", "default"),
    ("update", "jobs.batch", "default"),
    ("get", "configmaps/other", NAMESPACE),
    ("update", f"configmaps/{POLICY_CONFIGMAP}", NAMESPACE),
    ("create", "events.events.k8s.io", "default"),
    ("patch", "mutatingwebhookconfigurations/someone-else", None),
    ("update", f"mutatingwebhookconfigurations/{CONFIGURATION}", None),
    ("create", "validatingwebhookconfigurations", None),  # never recreates a deleted configuration
    ("delete", f"validatingwebhookconfigurations/{CONFIGURATION}", None),
    ("update", "priorityclasses.scheduling.k8s.io", None),
]


def can_i(plane: ControlPlane, verb: str, resource: str, scope: str | None, user: str = SA_USER) -> bool:
    """`resource` may carry kubectl's own flag: "pods --subresource=eviction"."""
    args = ["auth", "can-i", verb, *resource.split(), f"--as={user}"]
    if scope == "--all-namespaces":
        args.append(scope)
    elif scope is not None:
        args += ["-n", scope]
    result = plane.kubectl(*args, check=False)
    assert result.stdout.strip() in ("yes", "no"), result.stderr
    return result.stdout.strip() == "yes"


@pytest.mark.parametrize(
    ("verb", "resource", "scope"), ALLOWED, ids=[f"{v} {r} in {s}" for v, r, s in ALLOWED]
)
def test_service_account_can_do_what_gpuguard_needs(
    control_plane: ControlPlane, installed: str, verb: str, resource: str, scope: str | None
) -> None:
    assert can_i(control_plane, verb, resource, scope)


@pytest.mark.parametrize(("verb", "resource", "scope"), DENIED, ids=[f"{v} {r} in {s}" for v, r, s in DENIED])
def test_service_account_can_do_nothing_more(
    control_plane: ControlPlane, installed: str, verb: str, resource: str, scope: str | None
) -> None:
    assert not can_i(control_plane, verb, resource, scope)


Rule = tuple[str, str, str, str]  # apiGroup, resource, resourceName ("" for any), verb


def rules_of(plane: ControlPlane, user: str, namespace: str) -> set[Rule]:
    """Every (group, resource, name, verb) `user` may use in `namespace`, as the API server lists them."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectRulesReview",
        "spec": {"namespace": namespace},
    }
    # No client-side validation: it would need to list CRDs, which `user` (rightly) may not.
    answer = plane.kubectl_json(
        "create", f"--as={user}", "--validate=false", "-f", "-", input=json.dumps(review)
    )
    return {
        (group, resource, name, verb)
        for rule in answer["status"]["resourceRules"]
        for group, resource, verb in itertools.product(rule["apiGroups"], rule["resources"], rule["verbs"])
        for name in rule.get("resourceNames") or [""]
    }


def test_service_account_rules_are_exactly_gpuguards(control_plane: ControlPlane, installed: str) -> None:
    # Everything any authenticated user gets (self reviews and the like) is measured on an identity with
    # no bindings of its own, and set aside.
    baseline = f"system:serviceaccount:{NAMESPACE}:nobody"
    cluster_wide = {
        *{("scheduling.k8s.io", "priorityclasses", "", v) for v in ("get", "list", "watch")},
        *{("", r, "", v) for r in ("namespaces", "nodes") for v in ("get", "list", "watch")},
        *{
            ("resource.k8s.io", r, "", v)
            for r in ("resourceclaims", "resourceclaimtemplates")
            for v in ("get", "list", "watch")
        },
        *{
            ("admissionregistration.k8s.io", r, CONFIGURATION, v)
            for r in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")
            for v in ("get", "patch")
        },
    }
    in_namespace = {
        *{("", "configmaps", POLICY_CONFIGMAP, v) for v in ("get", "list", "watch")},
        *{("", "secrets", SECRET, v) for v in ("get", "list", "watch", "update")},
        ("", "secrets", "", "create"),
        ("events.k8s.io", "events", "", "create"),
    }

    for namespace, expected in ((NAMESPACE, cluster_wide | in_namespace), ("default", cluster_wide)):
        granted = rules_of(control_plane, SA_USER, namespace) - rules_of(control_plane, baseline, namespace)
        assert granted == expected, namespace


CONTROLLERS_USER = f"system:serviceaccount:{NAMESPACE}:{CONTROLLERS}"
CONTROLLERS_ALLOWED = [
    ("patch", "nodes", None),
    ("patch", "nodes --subresource=status", None),
    ("watch", "pods", "--all-namespaces"),
    ("create", "pods --subresource=eviction", "team-a"),
    ("create", "events.events.k8s.io", "default"),
    ("update", "leases.coordination.k8s.io/gpuguard-controllers", NAMESPACE),
    ("update", "configmaps/gpuguard-remediation", NAMESPACE),
    ("watch", f"configmaps/{POLICY_CONFIGMAP}", NAMESPACE),
    ("watch", "poddisruptionbudgets.policy", "--all-namespaces"),  # who evicts from a fenced DRA device
    ("patch", f"mutatingwebhookconfigurations.admissionregistration.k8s.io/{CONFIGURATION}", None),
]
CONTROLLERS_DENIED = [
    ("update", "poddisruptionbudgets.policy", "team-a"),
    # gpuguard's own webhook configurations alone, and only patched (one match condition of its own).
    ("patch", "validatingwebhookconfigurations.admissionregistration.k8s.io/someone-else", None),
    ("update", f"validatingwebhookconfigurations.admissionregistration.k8s.io/{CONFIGURATION}", None),
    ("delete", "pods", "team-a"),  # evictions only: the API server checks the disruption budget
    ("update", "pods", "team-a"),
    ("patch", "pods --subresource=status", "team-a"),
    ("delete", "nodes", None),  # deleting a node is for a node remediator, not gpuguard
    ("update", "nodes", None),
    ("update", f"configmaps/{POLICY_CONFIGMAP}", NAMESPACE),  # reads the policy, never writes it
    ("update", "leases.coordination.k8s.io/someone-else", NAMESPACE),
    ("get", "secrets", NAMESPACE),
    ("update", "jobs.batch", "team-a"),
]


CONTROLLERS_CASES = [
    *((verb, resource, scope, True) for verb, resource, scope in CONTROLLERS_ALLOWED),
    *((verb, resource, scope, False) for verb, resource, scope in CONTROLLERS_DENIED),
]


@pytest.mark.parametrize(
    ("verb", "resource", "scope", "allowed"),
    CONTROLLERS_CASES,
    ids=[f"{v} {r} in {s}: {'yes' if a else 'no'}" for v, r, s, a in CONTROLLERS_CASES],
)
def test_controllers_service_account_can_do_what_they_need_and_nothing_more(
    control_plane: ControlPlane, installed: str, verb: str, resource: str, scope: str | None, allowed: bool
) -> None:
    assert can_i(control_plane, verb, resource, scope, user=CONTROLLERS_USER) is allowed


def test_controllers_service_account_rules_are_exactly_theirs(
    control_plane: ControlPlane, installed: str, rendered: list[dict[str, Any]]
) -> None:
    baseline = f"system:serviceaccount:{NAMESPACE}:nobody"
    # The leader keeps the audit's reports current, with the audit's own ClusterRole (bound to both).
    audit = {
        (group, resource, "", verb)
        for rule in find(rendered, "ClusterRole", "gpuguard-audit")["rules"]
        for group, resource, verb in itertools.product(rule["apiGroups"], rule["resources"], rule["verbs"])
    }
    cluster_wide = audit | {
        *{("", "nodes", "", v) for v in ("get", "list", "watch", "patch")},
        ("", "nodes/status", "", "patch"),
        *{("", r, "", v) for r in ("pods", "namespaces") for v in ("get", "list", "watch")},
        ("", "pods/eviction", "", "create"),
        ("events.k8s.io", "events", "", "create"),
        # health.dra.evict auto: whether a PodDisruptionBudget selects a pod on a fenced DRA device.
        *{("policy", "poddisruptionbudgets", "", v) for v in ("get", "list", "watch")},
        *{
            ("resource.k8s.io", r, "", v)
            for r in ("resourceslices", "resourceclaims")
            for v in ("get", "list", "watch")
        },
        *{
            ("resource.k8s.io", "devicetaintrules", "", v)
            for v in ("get", "list", "watch", "create", "patch", "delete")
        },
        # admission.mode hybrid and native: gpuguard's own admission policies and bindings.
        *{
            ("admissionregistration.k8s.io", r, "", v)
            for r in RESOURCES.values()
            for v in ("get", "list", "watch", "create", "update", "delete")
        },
        # and the match condition and entries hybrid and native give gpuguard's own webhooks
        # (nativenarrow), watched to be narrowed again when someone else rewrites them.
        *{
            ("admissionregistration.k8s.io", r, CONFIGURATION, v)
            for r in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")
            for v in ("get", "list", "watch", "patch")
        },
    }
    in_namespace = {
        *{("coordination.k8s.io", "leases", CONTROLLERS, v) for v in ("get", "update")},
        ("coordination.k8s.io", "leases", "", "create"),
        *{("", "configmaps", POLICY_CONFIGMAP, v) for v in ("get", "list", "watch")},
        *{("", "configmaps", "gpuguard-remediation", v) for v in ("get", "list", "watch", "update")},
        ("", "configmaps", "", "create"),
    }
    for namespace, expected in ((NAMESPACE, cluster_wide | in_namespace), ("default", cluster_wide)):
        granted = rules_of(control_plane, CONTROLLERS_USER, namespace) - rules_of(
            control_plane, baseline, namespace
        )
        assert granted == expected, namespace


NODE_AGENT_USER = "system:serviceaccount:gpuguard-node:gpuguard-node-agent"


def test_node_agent_service_account_rules_are_exactly_its_own(
    control_plane: ControlPlane, installed: str
) -> None:
    """It reads pods and ResourceSlices and writes one thing, their status (its condition): no eviction,
    delete or node write."""
    baseline = f"system:serviceaccount:{NAMESPACE}:nobody"
    expected = {
        *{("", "pods", "", v) for v in ("get", "list", "watch")},
        *{("resource.k8s.io", "resourceslices", "", v) for v in ("get", "list", "watch")},
        ("", "pods/status", "", "patch"),
        ("events.k8s.io", "events", "", "create"),
    }
    for namespace in (NAMESPACE, "default"):
        granted = rules_of(control_plane, NODE_AGENT_USER, namespace) - rules_of(
            control_plane, baseline, namespace
        )
        assert granted == expected, namespace
    for verb, resource in (("create", "pods --subresource=eviction"), ("delete", "pods"), ("patch", "nodes")):
        assert not can_i(control_plane, verb, resource, "team-a", user=NODE_AGENT_USER), f"{verb} {resource}"


NODE_AGENT_NAMESPACE = "gpuguard-node"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


# `kubectl patch` reads the object before patching it (the agent itself never does): a group of the test's
# own lets the impersonated agent read pods/status, which its role, rightly, does not grant.
STATUS_READERS = "gpuguard-e2e:pod-status-readers"


def as_node_agent(node: str | None) -> list[str]:
    """kubectl flags acting as the node agent as its pod's token presents it: its user, its groups, and
    its node in the user's extra (None: a credential that names no node)."""
    extra = [f"--as-user-extra={NODE_NAME_EXTRA}={node}"] if node is not None else []
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{NODE_AGENT_NAMESPACE}", STATUS_READERS]
    return [f"--as={NODE_AGENT_USER}", *(f"--as-group={group}" for group in groups), *extra]


@pytest.fixture
def status_readers(control_plane: ControlPlane) -> Iterator[None]:
    name = "gpuguard-e2e-pod-status-reader"
    control_plane.kubectl("create", "clusterrole", name, "--verb=get", "--resource=pods/status")
    control_plane.kubectl(
        "create", "clusterrolebinding", name, f"--clusterrole={name}", f"--group={STATUS_READERS}"
    )
    yield
    control_plane.kubectl("delete", "clusterrolebinding,clusterrole", name, check=False)


def report_on(plane: ControlPlane, pod: str, identity: list[str]) -> subprocess.CompletedProcess[str]:
    """The agent's pod status patch (its condition only, as it writes it), sent as `identity`."""
    condition = {"type": "GPUGuardDevicesAllocatable", "status": "True", "reason": "DevicesAllocatable"}
    patch = json.dumps({"status": {"conditions": [condition]}})
    return plane.kubectl(
        "patch", "pod", pod, "-n", NODE_AGENT_NAMESPACE, "--subresource=status", "--type=strategic",
        "-p", patch, *identity, check=False,
    )  # fmt: skip


def event_on(
    plane: ControlPlane, pod: str, node: str | None, reporter: str
) -> subprocess.CompletedProcess[str]:
    event = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{pod}.{secrets.token_hex(6)}", "namespace": NODE_AGENT_NAMESPACE},
        "eventTime": "2026-03-01T00:00:00.000000Z",
        "reportingController": "gpuguard.io/gpuguard",
        "reportingInstance": reporter,
        "action": "ReportDeviceHealth",
        "reason": "DevicesAllocatable",
        "note": "every device the pod holds is allocatable again",
        "type": "Normal",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": NODE_AGENT_NAMESPACE, "name": pod},
    }
    return plane.kubectl("create", "-f", "-", *as_node_agent(node), input=json.dumps(event), check=False)


def refused_by_policy(result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode != 0 and "ValidatingAdmissionPolicy 'gpuguard-node-agent'" in result.stderr


def test_the_node_agent_writes_only_for_pods_on_its_own_node(
    control_plane: ControlPlane, installed: str, status_readers: None
) -> None:
    """deploy/node-agent's admission policy, on the API server, with the agent's identity impersonated as
    its pod's token presents it: its node in the user's extra."""
    pods = {"on-node-a": "node-a", "on-node-b": "node-b"}
    for name, node in pods.items():
        pod = cpu_pod(name, NODE_AGENT_NAMESPACE)
        pod["spec"]["nodeName"] = node  # bound, as the scheduler binds it (no kubelet runs here)
        control_plane.kubectl("create", "-f", "-", input=json.dumps(pod))
    try:
        # The policy takes effect once the API server's informers have it: wait on the first refusal.
        wait_until(
            lambda: refused_by_policy(report_on(control_plane, "on-node-b", as_node_agent("node-a"))),
            timeout=30,
            what="the node agent's admission policy in force",
        )
        written = report_on(control_plane, "on-node-a", as_node_agent("node-a"))
        assert written.returncode == 0, written.stderr
        refused = report_on(control_plane, "on-node-b", as_node_agent("node-a"))
        assert refused_by_policy(refused) and "not of a pod on node 'node-b'" in refused.stderr
        # A credential that names no node (a token not bound to the agent's pod).
        assert refused_by_policy(report_on(control_plane, "on-node-a", as_node_agent(None)))

        recorded = event_on(control_plane, "on-node-a", "node-a", reporter="node-a")
        assert recorded.returncode == 0, recorded.stderr
        assert refused_by_policy(event_on(control_plane, "on-node-a", "node-a", reporter="node-b"))
        assert refused_by_policy(event_on(control_plane, "on-node-a", None, reporter="node-a"))

        # Only the agent is bound: the same write by anyone else (here the cluster admin) goes through.
        assert report_on(control_plane, "on-node-b", []).returncode == 0
    finally:
        control_plane.kubectl(
            "delete", "pod", *pods, "-n", NODE_AGENT_NAMESPACE, "--grace-period=0", "--force", check=False
        )


def test_the_node_agent_reads_the_resource_slices_of_its_own_node_by_field_selector(
    control_plane: ControlPlane, installed: str
) -> None:
    """The agent lists and watches ResourceSlices with the field selector spec.nodeName=<its node>
    (webhook.kube.remediation.slices_on_node): the API server selects slices by that field, and the
    agent's role reads them."""
    slices = {f"agent-e2e-{node}": node for node in ("node-a", "node-b")}
    for name, node in slices.items():
        pool = {"name": node, "generation": 1, "resourceSliceCount": 1}
        spec = {"driver": "gpu.example.com", "nodeName": node, "pool": pool, "devices": [{"name": "gpu-0"}]}
        piece = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": spec,
        }
        control_plane.kubectl("create", "-f", "-", input=json.dumps(piece))
    try:
        listed = control_plane.kubectl_json(
            "get", "resourceslices", "--field-selector=spec.nodeName=node-a", *as_node_agent("node-a")
        )
        names = {item["metadata"]["name"] for item in listed["items"]}
        assert "agent-e2e-node-a" in names and "agent-e2e-node-b" not in names
        assert {item["spec"]["nodeName"] for item in listed["items"]} == {"node-a"}
    finally:
        control_plane.kubectl("delete", "resourceslices", *slices, "--ignore-not-found", check=False)


def node_agent_daemonset(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    (daemonset,) = [
        d for d in rendered if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpuguard-node-agent"
    ]
    return daemonset


def test_node_agent_runs_on_accelerator_nodes_with_the_socket_read_only(
    rendered: list[dict[str, Any]],
) -> None:
    spec = node_agent_daemonset(rendered)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"][0] == "node-agent"
    (mount,) = container["volumeMounts"]
    assert (mount["mountPath"], mount["readOnly"]) == ("/var/lib/kubelet/pod-resources", True)
    (volume,) = spec["volumes"]
    assert volume["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    security = container["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"] and security["readOnlyRootFilesystem"] is True
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert spec["tolerations"] == [{"operator": "Exists"}]  # it must stay where gpuguard tainted
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in [
        e for t in terms for e in t["matchExpressions"]
    ]


def test_the_webhook_service_account_still_writes_no_workload_or_node(
    control_plane: ControlPlane, installed: str
) -> None:
    for verb, resource in (
        ("create", "pods --subresource=eviction"),
        ("patch", "nodes"),
        ("patch", "nodes --subresource=status"),
    ):
        assert not can_i(control_plane, verb, resource, "team-a")


# --- the certificate lifecycle ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(
    control_plane: ControlPlane, installed: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Replica, Replica]]:
    """Two replicas, started together so that both find no Secret and race to create it."""
    work = tmp_path_factory.mktemp("install")
    kubeconfig = service_account_kubeconfig(control_plane, work / "sa.kubeconfig")
    # b runs two workers: each adopts, serves and rotates the shared certificate like a replica of its own.
    pair = tuple(
        Replica(work / name, kubeconfig, rotation_delay=ROTATION_DELAY, workers=workers)
        for name, workers in (("a", 1), ("b", 2))
    )
    assert not secret_exists(control_plane)
    try:
        for replica in pair:
            replica.start()
        for replica in pair:
            replica.wait_ready()
        yield pair[0], pair[1]
    finally:
        for replica in pair:
            replica.stop()


def test_replicas_bootstrap_one_shared_certificate(
    control_plane: ControlPlane, replicas: tuple[Replica, Replica]
) -> None:
    material = read_secret(control_plane)

    assert material.phase == "steady"
    assert len(material.cas) == 1
    for replica in replicas:
        assert replica.served_certificates() == {material.leaf}, replica.log()
    logs = "".join(replica.log_path.read_text() for replica in replicas)
    assert logs.count("certificates: create") == 1
    assert tls.covers(material.leaf, files.dns_names_for_service("gpuguard", NAMESPACE))
    assert ca_bundles(control_plane) == {kind: material.cas for kind in CONFIGURATION_KINDS}
    # With the ServiceAccount's rights alone, every cluster lookup works.
    for replica in replicas:
        status, body = replica.get("/policy")
        assert status == 200 and json.loads(body)["unavailableLookups"] == []


def test_reapplying_deploy_keeps_the_ca_bundle(
    control_plane: ControlPlane, replicas: tuple[Replica, Replica]
) -> None:
    before = ca_bundles(control_plane)

    control_plane.kubectl("apply", "-k", str(DEPLOY))

    assert ca_bundles(control_plane) == before
    assert all(before.values())


@pytest.fixture(scope="module")
def routed(control_plane: ControlPlane, replicas: tuple[Replica, Replica]) -> Iterator[str]:
    """The webhook configurations sent to the replicas (mutating: a, validating: b) with failurePolicy Fail,
    for a namespace of their own; yields that namespace once the API server calls both replicas."""
    mutating, validating = replicas
    namespace = f"install-{secrets.token_hex(3)}"
    control_plane.kubectl("create", "namespace", namespace)
    control_plane.kubectl("label", "namespace", namespace, f"{ROUTED_LABEL}=true")
    urls = {
        "mutatingwebhookconfiguration": mutating.url(ENDPOINTS["mutatingwebhookconfiguration"]),
        "validatingwebhookconfiguration": validating.url(ENDPOINTS["validatingwebhookconfiguration"]),
    }
    route_to(control_plane, urls, failure_policy="Fail", namespace_label=ROUTED_LABEL)
    before = (mutating.admissions("mutate"), validating.admissions("validate"))

    def called() -> bool:
        result = submit_dry_run(control_plane, gpu_pod("probe", namespace))
        after = (mutating.admissions("mutate"), validating.admissions("validate"))
        return result.returncode == 0 and all(a > b for a, b in zip(after, before, strict=True))

    # The API server's informer picks up the new URLs within moments.
    wait_for(called, what="the API server calling both replicas", replicas=replicas)
    try:
        yield namespace
    finally:
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _owned_by(pod: dict[str, Any], kind: str, api_version: str) -> dict[str, Any]:
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": api_version, "kind": kind, "name": "owner", "uid": "0b1d", "controller": True}
    ]
    return pod


def _cpu_deployment(name: str, namespace: str) -> dict[str, Any]:
    template = cpu_pod(name, namespace)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": template["spec"]},
        },
    }


def _with_device_plugin_mount(pod: dict[str, Any]) -> dict[str, Any]:
    pod["spec"]["volumes"] = [{"name": "dp", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "dp", "mountPath": "/var/lib/kubelet/device-plugins"}
    ]
    return pod


def _daemonset(name: str, namespace: str, template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": template["spec"]},
        },
    }


def _device_plugin_daemonset(name: str, namespace: str) -> dict[str, Any]:
    return _daemonset(name, namespace, _with_device_plugin_mount(cpu_pod(name, namespace)))


def _pinned_pod(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    pod = cpu_pod(name, namespace)
    pod["spec"].update(spec)
    return pod


# (object, called by /mutate, called by /validate): the matchConditions at work in the API server.
CALLS: dict[str, tuple[Any, bool, bool]] = {
    "gpu-pod": (lambda ns: gpu_pod("gpu", ns), True, True),
    "cpu-pod": (lambda ns: cpu_pod("cpu", ns), False, False),
    "cpu-pod-any-linux-node": (
        lambda ns: _pinned_pod("os", ns, nodeSelector={"kubernetes.io/os": "linux"}),
        False,
        False,
    ),
    "cpu-pod-on-gpu-nodes": (
        lambda ns: _pinned_pod("pinned", ns, nodeSelector={"nvidia.com/gpu.present": "true"}),
        False,
        True,
    ),
    "cpu-pod-tolerating-gpu-taint": (
        lambda ns: _pinned_pod("tol", ns, tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}]),
        False,
        True,
    ),
    "gpu-pod-of-a-daemonset": (lambda ns: _owned_by(gpu_pod("ds", ns), "DaemonSet", "apps/v1"), False, False),
    "gpu-pod-of-a-job": (lambda ns: _owned_by(gpu_pod("job", ns), "Job", "batch/v1"), False, True),
    "cpu-deployment": (lambda ns: _cpu_deployment("cpu", ns), False, False),
    "device-plugin-daemonset": (lambda ns: _device_plugin_daemonset("plugin", ns), False, True),
    "cpu-daemonset": (lambda ns: _daemonset("agent", ns, cpu_pod("agent", ns)), False, False),
    "device-plugin-pod-of-a-daemonset": (
        lambda ns: _owned_by(_with_device_plugin_mount(cpu_pod("ds", ns)), "DaemonSet", "apps/v1"),
        False,
        False,
    ),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_api_server_calls_gpuguard_only_for_what_its_rules_act_on(
    control_plane: ControlPlane, replicas: tuple[Replica, Replica], routed: str, case: str
) -> None:
    make, mutate_called, validate_called = CALLS[case]
    mutating, validating = replicas
    before = (mutating.admissions("mutate"), validating.admissions("validate"))

    result = submit_dry_run(control_plane, make(routed))

    after = (mutating.admissions("mutate"), validating.admissions("validate"))
    assert (after[0] > before[0], after[1] > before[1]) == (mutate_called, validate_called), result.stderr
    if case == "gpu-pod":
        assert result.returncode == 0, result.stderr
        assert gpuguard_annotations(json.loads(result.stdout))


def test_forced_rotation_under_a_steady_stream_loses_no_request(
    control_plane: ControlPlane, replicas: tuple[Replica, Replica], routed: str, summary: Any
) -> None:
    old = read_secret(control_plane)
    pids = [replica.pid for replica in replicas]
    calls_before = replicas[0].admissions("mutate")
    moments: dict[str, float] = {}
    # Generous: on a loaded machine one kubectl call can take seconds, and each wait polls with kubectl.
    patience = 120.0

    def reached(name: str, condition: bool) -> bool:
        if condition:
            moments.setdefault(name, time.monotonic())
        return condition

    with Stream(control_plane, routed) as stream:
        wait_until(lambda: stream.count_after(0) >= 5, timeout=patience, what="the stream under way")
        moments["start"] = time.monotonic()
        rotate = run_gpuguard(
            "certs", "rotate", f"--secret={NAMESPACE}/{SECRET}", f"--kubeconfig={control_plane.kubeconfig}"
        )
        assert rotate.returncode == 0, rotate.stderr
        new_ca = read_secret(control_plane).newest_ca
        assert new_ca != old.newest_ca

        # 1. both CAs trusted; 2. every replica serves a certificate from the new CA; 3. only it is trusted.
        wait_for(
            lambda: reached(
                "trusting", all(b == [old.newest_ca, new_ca] for b in ca_bundles(control_plane).values())
            ),
            replicas=replicas,
            what="caBundle with the old and the new CA",
            timeout=patience,
        )
        wait_for(
            lambda: reached(
                "serving",
                all(tls.signed_by(cert, new_ca) for r in replicas for cert in r.served_certificates()),
            ),
            replicas=replicas,
            what="every replica serving a certificate from the new CA",
            timeout=patience,
        )
        wait_for(
            lambda: reached("finished", all(b == [new_ca] for b in ca_bundles(control_plane).values())),
            replicas=replicas,
            what="caBundle with the new CA alone",
            timeout=patience,
        )
        # Keep going a while on the new CA alone: the API server's connections are all new by now.
        finished = moments["finished"]
        wait_until(
            lambda: stream.count_after(finished) >= 20, timeout=patience, what="requests after the rotation"
        )
        # The stream ran without a break from before the rotation began to after it ended, so every
        # step had whatever traffic the machine's pace allowed; that pace is a figure, not a bound.
        assert stream.thread.is_alive(), "the stream stopped before the rotation was over"

    outcomes = stream.outcomes
    failures = [o.detail for o in outcomes if not o.ok]
    assert not failures, f"{len(failures)} of {len(outcomes)} requests failed, first: {failures[0]}"
    assert [replica.pid for replica in replicas] == pids, "a replica restarted"
    assert replicas[0].admissions("mutate") - calls_before >= len(outcomes)
    final = read_secret(control_plane)
    assert final.phase == "steady" and final.cas == [new_ca]
    bounds = [moments[name] for name in ("start", "trusting", "serving", "finished")] + [float("inf")]
    per_step = [sum(1 for o in outcomes if low < o.at <= high) for low, high in itertools.pairwise(bounds)]
    summary(
        "rotation",
        f"CA rotation under load: {len(outcomes)} kubectl apply, 0 failed; "
        f"completed per step {per_step}, steps {ROTATION_DELAY:.0f} s apart",
    )


def test_a_deleted_secret_is_recreated_and_trusted_again(
    control_plane: ControlPlane, replicas: tuple[Replica, Replica], routed: str
) -> None:
    old = read_secret(control_plane)

    control_plane.kubectl("delete", "secret", SECRET, "-n", NAMESPACE)

    def recreated() -> bool:
        if not secret_exists(control_plane):
            return False
        material = read_secret(control_plane)
        return (
            material.newest_ca != old.newest_ca
            and all(bundle == material.cas for bundle in ca_bundles(control_plane).values())
            and all(replica.served_certificates() == {material.leaf} for replica in replicas)
        )

    wait_for(recreated, what="a new Secret, trusted and served", replicas=replicas)
    # failurePolicy Fail: the first calls may still meet the old bundle in the API server; then all pass.
    wait_until(
        lambda: submit_dry_run(control_plane, gpu_pod("after", routed)).returncode == 0,
        timeout=30,
        what="the API server calling gpuguard again",
    )


def test_readyz_waits_for_a_valid_certificate(
    control_plane: ControlPlane, installed: str, tmp_path: Path
) -> None:
    # A Secret the ServiceAccount may not read: the replica never gets a certificate.
    kubeconfig = service_account_kubeconfig(control_plane, tmp_path / "sa.kubeconfig")
    replica = Replica(tmp_path / "forbidden", kubeconfig, secret="gpuguard-forbidden", webhook_config=None)
    replica.start()
    try:
        wait_until(lambda: replica.get("/healthz")[0] == 200, timeout=30, what="replica /healthz")
        wait_until(
            lambda: "certificate reconcile failed" in replica.log_path.read_text(),
            timeout=30,
            what="a failed attempt to read the Secret",
        )

        assert replica.get("/readyz") == (503, b"not ready")
        assert replica.served_certificate().issuer.rfc4514_string() == "CN=gpuguard-placeholder"
    finally:
        replica.stop()


def test_rotation_command_explains_what_it_cannot_do(control_plane: ControlPlane, installed: str) -> None:
    missing = run_gpuguard(
        "certs", "rotate", f"--secret={NAMESPACE}/no-such-secret", f"--kubeconfig={control_plane.kubeconfig}"
    )

    assert missing.returncode == 1
    assert "not found; gpuguard creates it on start" in missing.stderr
