"""`gpuguard audit` on the real API server: workloads created where no gpuguard answers (a namespace
the session's webhook leaves alone) are found lacking what admission would have given them, pass once
what `gpuguard mutate` suggests is applied, and are written as PolicyReports on the Policy WG's CRD.

The command runs in-process through `webhook.cli.main` (the Kubernetes client loads once for the
module); one test runs it as a subprocess, as a CI job would. There is no kube-controller-manager, so
the ReplicaSets and pods a Deployment would get are created by hand, owner references and all.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO_ROOT
from tests.harness.admission import (
    OWNER_LABEL,
    RULES_ANNOTATION,
    WebhookProcess,
    cpu_pod,
    create_namespace,
    default_priority_classes,
    device_plugin_daemonset,
    dry_run,
    gpu_cronjob,
    gpu_deployment,
    gpu_job,
    gpu_statefulset,
    install_priority_classes,
    pinned_to_gpu_nodes,
    policy_configmap,
    read_back,
    submit,
)
from tests.harness.controlplane import ControlPlane, free_ports, wait_until
from tests.harness.install import (
    CRD_FILE,
    CRD_FOLDER,
    find,
    install_crds,
    render,
    run_gpuguard,
    service_account_kubeconfig,
)
from webhook import cli
from webhook.audit import background
from webhook.audit.schedule import Schedule
from webhook.cli import audit as cli_audit
from webhook.cli import output
from webhook.kube.client import api_client
from webhook.policy.model import RULE_IDS, default_policy, parse_policy

AUDIT_ACCOUNT = "gpuguard-audit"  # its ServiceAccount, roles, bindings and CronJob in deploy/audit/
OPENREPORTS_CRD_FILE = CRD_FOLDER / "openreports.io-v1alpha1.yaml"
CRDS = ("policyreports.wgpolicyk8s.io", "clusterpolicyreports.wgpolicyk8s.io")
# A value of the label by which the session's gpuguard leaves a namespace alone, naming no webhook at
# all: what is created there is stored exactly as submitted.
UNGUARDED = "none"
# `gpuguard audit` with the arguments given: exit code, stdout, stderr.
Audit = Callable[..., tuple[int, str, str]]
GPU_NODE_LABEL = "nvidia.com/gpu.present"
CHANGED_JOB: dict[str, str] = {
    "readinessTolerations": "change",
    "podFailurePolicy": "change",
    "gracefulTermination": "change",
    "priority": "change",
    "driverCompatibility": "skip",  # states no driver it needs
    "acceleratorNodeGuard": "pass",
    "trustedDeviceSoftware": "skip",  # mounts no device software's paths
}
CHANGED_SERVING = CHANGED_JOB | {"podFailurePolicy": "skip"}
# Its image asks for a newer driver than the default policy's affinity leaves it free of.
CHANGED_DRIVER_JOB = CHANGED_JOB | {"driverCompatibility": "change"}
DENIED_CPU_POD = dict.fromkeys(RULE_IDS, "skip") | {"acceleratorNodeGuard": "deny"}
DENIED_DEVICE_PLUGIN = dict.fromkeys(RULE_IDS, "skip") | {"trustedDeviceSoftware": "deny"}
DRIVER_ANNOTATION = default_policy().rules.driverCompatibility.annotation


def as_list(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": items}


@pytest.fixture(scope="module")
def policy_ref(control_plane: ControlPlane) -> str:
    """The ConfigMap the audit reads its policy from (the default policy), as NAMESPACE/NAME."""
    install_priority_classes(control_plane, default_priority_classes())
    namespace = create_namespace(control_plane, "audit-policy")
    submit(control_plane, "apply", policy_configmap(namespace, "gpuguard-policy", "mode: enforce\n"))
    return f"{namespace}/gpuguard-policy"


@pytest.fixture
def unguarded(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    stem = request.node.originalname.removeprefix("test_")[:30].rstrip("_").replace("_", "-")
    name = create_namespace(control_plane, stem, {OWNER_LABEL: UNGUARDED})
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def run(control_plane: ControlPlane, policy_ref: str, capsys: pytest.CaptureFixture[str]) -> Audit:
    """`run(*args, kubeconfig=None)`: `gpuguard audit` with the module's policy; (exit code, stdout, stderr)."""

    def audit(*args: str, kubeconfig: Path | None = None) -> tuple[int, str, str]:
        capsys.readouterr()
        argv = ["audit", "--kubeconfig", str(kubeconfig or control_plane.kubeconfig)]
        if "--policy" not in args and "--policy-configmap" not in args:
            argv += ["--policy-configmap", policy_ref]
        code = cli.main([*argv, *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return audit


def findings_in(document: dict[str, Any], namespace: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(f["kind"], f["name"]): f for f in document["findings"] if f.get("namespace", "") == namespace}


def verdicts(finding: dict[str, Any]) -> dict[str, str]:
    return {r["rule"]: r["verdict"] for r in finding["rules"]}


def owner_ref(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def replica_set_of(plane: ControlPlane, deployment: dict[str, Any], pods: int) -> dict[str, Any]:
    """What the Deployment controller would create: a ReplicaSet owned by the Deployment, and its pods
    (not bound to any node). Returns the ReplicaSet as stored."""
    stored = read_back(plane, deployment)
    name = f"{deployment['metadata']['name']}-5d8f7"
    template = json.loads(json.dumps(stored["spec"]["template"]))
    template["metadata"]["labels"]["pod-template-hash"] = "5d8f7"
    replica_set = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": name,
            "namespace": stored["metadata"]["namespace"],
            "ownerReferences": [owner_ref(stored)],
        },
        "spec": {
            "replicas": pods,
            "selector": {"matchLabels": template["metadata"]["labels"]},
            "template": template,
        },
    }
    submit(plane, "create", replica_set)
    stored_set: dict[str, Any] = read_back(plane, replica_set)
    if not pods:
        return stored_set
    submit(
        plane,
        "create",
        as_list(
            [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"{name}-{index}",
                        "namespace": stored["metadata"]["namespace"],
                        "labels": template["metadata"]["labels"],
                        "ownerReferences": [owner_ref(stored_set)],
                    },
                    "spec": template["spec"],
                }
                for index in range(pods)
            ]
        ),
    )
    return stored_set


def workloads(namespace: str) -> list[dict[str, Any]]:
    """A team's manifests from before gpuguard: four GPU workloads, a CPU pod pinned to GPU nodes, a CPU
    pod, a GPU DaemonSet that is no device software (no rule speaks to it), a Job stating the driver it
    needs, and a device plugin from an untrusted registry."""
    daemon_set = gpu_deployment("agent", namespace)
    daemon_set["kind"] = "DaemonSet"
    del daemon_set["spec"]["replicas"]
    needs_driver = gpu_job("needs-570", namespace)
    needs_driver["metadata"]["annotations"] = {DRIVER_ANNOTATION: "570"}
    return [
        gpu_job("train", namespace),
        gpu_cronjob("nightly", namespace),
        gpu_deployment("serve", namespace),
        gpu_statefulset("db", namespace),
        pinned_to_gpu_nodes("crowd", namespace),
        cpu_pod("plain", namespace),
        daemon_set,
        needs_driver,
        device_plugin_daemonset("rogue-plugin", namespace, "quay.io/example/device-plugin:v1"),
    ]


def write_manifests(path: Path, objects: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return path


# --- findings ----------------------------------------------------------------------------------------


def test_workloads_created_without_gpuguard_are_reported_with_what_they_lack(
    control_plane: ControlPlane, gpuguard: WebhookProcess, unguarded: str, namespace: str, run: Audit
) -> None:
    manifests = workloads(unguarded)
    submit(control_plane, "apply", as_list(manifests))
    replica_set_of(control_plane, manifests[2], pods=2)

    code, out, err = run("-n", unguarded, "-o", "json")
    assert code == 0, err
    found = findings_in(json.loads(out), unguarded)
    assert {key: verdicts(f) for key, f in found.items()} == {
        ("Job", "train"): CHANGED_JOB,
        ("CronJob", "nightly"): CHANGED_JOB,
        ("Deployment", "serve"): CHANGED_SERVING,
        ("StatefulSet", "db"): CHANGED_SERVING,
        ("Pod", "crowd"): DENIED_CPU_POD,
        ("Job", "needs-570"): CHANGED_DRIVER_JOB,
        ("DaemonSet", "rogue-plugin"): DENIED_DEVICE_PLUGIN,
    }
    # The ReplicaSet and its two pods are the Deployment's, reported once, through it.
    assert found[("Deployment", "serve")]["pods"] == 2
    assert "pods" not in found[("Job", "train")]

    # The webhook agrees: the same manifests, created where gpuguard answers, get exactly those rules.
    for manifest in [*manifests[:4], manifests[7]]:
        submitted = json.loads(json.dumps(manifest))
        submitted["metadata"]["namespace"] = namespace
        answer = dry_run(control_plane, submitted)
        assert answer.returncode == 0, answer.stderr
        applied = json.loads(answer.stdout)["metadata"]["annotations"][RULES_ANNOTATION].split(",")
        audited = found[(manifest["kind"], manifest["metadata"]["name"])]
        assert sorted(applied) == sorted(r["rule"] for r in audited["rules"] if r["verdict"] == "change")
    refused = dry_run(control_plane, pinned_to_gpu_nodes("crowd", namespace))
    assert refused.returncode != 0 and "acceleratorNodeGuard" in refused.stderr
    plugin = json.loads(json.dumps(manifests[8]))
    plugin["metadata"]["namespace"] = namespace
    refused = dry_run(control_plane, plugin)
    assert refused.returncode != 0 and "trustedDeviceSoftware" in refused.stderr


def test_applying_what_mutate_suggests_makes_them_pass(
    control_plane: ControlPlane, unguarded: str, run: Audit, tmp_path: Path
) -> None:
    manifests = workloads(unguarded)[:5]
    submit(control_plane, "apply", as_list(manifests))
    code, out, _ = run("-n", unguarded, "--fail-on", "change")
    assert code == output.EXIT_FAILED
    assert out.splitlines()[-1].startswith("5 findings: 1 deny, 4 change, 0 warn, 0 pass, 0 skip; read ")
    assert {line.split()[0] for line in out.splitlines()[1:-2]} == {unguarded}

    # What the audit's messages say to do: `gpuguard mutate` the manifests, and give the CPU pod that
    # is pinned to GPU nodes a priority class of at least minPriority.
    mutate = run_gpuguard("mutate", "-f", str(write_manifests(tmp_path / "team.yaml", manifests)))
    assert mutate.returncode == 0, mutate.stderr
    fixed = [doc for doc in yaml.safe_load_all(mutate.stdout) if doc]
    fixed[4]["spec"]["priorityClassName"] = "gpu-workload"
    # A Job's template and a Pod's spec are immutable: those are recreated, the rest applied.
    recreated = [doc for doc in fixed if doc["kind"] in ("Job", "Pod")]
    submit(control_plane, "delete", as_list(recreated), "--wait=false")
    submit(control_plane, "create", as_list(recreated))
    submit(control_plane, "apply", as_list([doc for doc in fixed if doc["kind"] not in ("Job", "Pod")]))

    code, out, err = run("-n", unguarded, "--fail-on", "change", "-o", "json")
    assert code == 0, out + err
    found = findings_in(json.loads(out), unguarded)
    assert {key: f["verdict"] for key, f in found.items()} == dict.fromkeys(
        [
            ("Job", "train"),
            ("CronJob", "nightly"),
            ("Deployment", "serve"),
            ("StatefulSet", "db"),
            ("Pod", "crowd"),
        ],
        "pass",
    )


def test_a_low_priority_pod_running_on_an_untainted_gpu_node_is_found(
    control_plane: ControlPlane, unguarded: str, run: Audit
) -> None:
    token = secrets.token_hex(3)
    gpu_node, cpu_node = f"audit-gpu-{token}", f"audit-cpu-{token}"
    nodes = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": gpu_node, "labels": {GPU_NODE_LABEL: "true"}},
        },
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": cpu_node}},
    ]
    submit(control_plane, "create", as_list(nodes))
    try:
        web = gpu_deployment("web", unguarded)
        web["spec"]["template"]["spec"]["containers"] = cpu_pod("web", unguarded)["spec"]["containers"]
        submit(control_plane, "create", web)
        stored_set = replica_set_of(control_plane, web, pods=0)
        # Its pods, where a scheduler would have put them (without one, a pod names its node).
        bound = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"web-on-{node}",
                    "namespace": unguarded,
                    "ownerReferences": [owner_ref(stored_set)],
                },
                "spec": {**cpu_pod("x", unguarded)["spec"], "nodeName": node},
            }
            for node in (gpu_node, cpu_node)
        ]
        submit(control_plane, "create", as_list(bound))

        code, out, err = run("-A", "-o", "json")
        assert code == 0, err
        document = json.loads(out)
        found = findings_in(document, unguarded)
        assert list(found) == [("Pod", f"web-on-{gpu_node}")]  # the CPU Deployment itself is fine
        (result,) = found[("Pod", f"web-on-{gpu_node}")]["rules"]
        assert result["verdict"] == "deny"
        assert result["messages"][0].startswith(
            f"running on accelerator node {gpu_node}: priority 0 (no class)"
        )
        node_finding = findings_in(document, "")[("Node", gpu_node)]
        assert verdicts(node_finding) == {"acceleratorNodeGuard": "warn"}
        assert (
            f"kubectl taint nodes {gpu_node} nvidia.com/gpu=present:NoSchedule"
            in node_finding["rules"][0]["messages"][0]
        )
        assert ("Node", cpu_node) not in findings_in(document, "")

        control_plane.kubectl("taint", "nodes", gpu_node, "nvidia.com/gpu=present:NoSchedule")
        code, out, _ = run("-A", "-o", "json")
        assert verdicts(findings_in(json.loads(out), "")[("Node", gpu_node)]) == {
            "acceleratorNodeGuard": "pass"
        }
    finally:
        submit(control_plane, "delete", as_list(nodes), "--ignore-not-found", "--wait=false")


def test_the_audit_judges_with_the_live_policy(
    control_plane: ControlPlane, unguarded: str, run: Audit
) -> None:
    submit(control_plane, "apply", gpu_job("train", unguarded))
    configmap = f"{unguarded}/team-policy"
    submit(
        control_plane,
        "apply",
        policy_configmap(unguarded, "team-policy", 'rules:\n  podFailurePolicy:\n    mode: "off"\n'),
    )
    code, out, _ = run("-n", unguarded, "-o", "json", "--policy-configmap", configmap)
    assert code == 0
    (finding,) = findings_in(json.loads(out), unguarded).values()
    skipped = next(r for r in finding["rules"] if r["rule"] == "podFailurePolicy")
    assert (skipped["verdict"], skipped["messages"]) == ("skip", [f"off in namespace {unguarded}"])

    submit(control_plane, "apply", policy_configmap(unguarded, "team-policy", "mode: sometimes\n"))
    code, out, err = run("-n", unguarded, "--policy-configmap", configmap)
    assert (code, out) == (output.EXIT_USAGE, "")
    assert f"ConfigMap {configmap}, key policy.yaml: invalid policy: mode" in err

    code, out, err = run("-n", unguarded, "--policy-configmap", f"{unguarded}/absent")
    assert code == 0 and "auditing with the embedded default policy" in err


# --- PolicyReports -----------------------------------------------------------------------------------


def test_report_without_a_policyreport_crd_says_which_to_install(
    control_plane: ControlPlane, unguarded: str, policy_ref: str
) -> None:
    # As a CI job runs it: the real entry point, its exit code and its streams.
    assert control_plane.kubectl("get", "crd", *CRDS, "--ignore-not-found", "-o", "name").stdout == ""
    result = run_gpuguard(
        "audit",
        "--kubeconfig",
        str(control_plane.kubeconfig),
        "--policy-configmap",
        policy_ref,
        "-n",
        unguarded,
        "--report",
    )
    assert (result.returncode, result.stdout) == (cli_audit.EXIT_NO_REPORT_API, "")
    assert "install the wgpolicyk8s.io/v1alpha2 CRDs" in result.stderr


@pytest.fixture(scope="module")
def report_crd(control_plane: ControlPlane) -> Iterator[None]:
    """The Policy WG's PolicyReport CRDs, installed for the module's report tests."""
    crds = install_crds(control_plane, CRD_FILE)
    yield
    if control_plane.running:
        submit(control_plane, "delete", crds, "--ignore-not-found", "--wait=false")


def policy_report(plane: ControlPlane, namespace: str) -> dict[str, Any] | None:
    result = plane.kubectl("get", "policyreport", "gpuguard", "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def test_report_creates_then_updates_policy_reports(
    control_plane: ControlPlane, unguarded: str, run: Audit, report_crd: None, tmp_path: Path
) -> None:
    job, crowd = gpu_job("train", unguarded), pinned_to_gpu_nodes("crowd", unguarded)
    submit(control_plane, "apply", as_list([job, crowd]))

    code, out, err = run("-n", unguarded, "--report")
    assert code == 0, err
    lines = out.splitlines()  # stdout is the report, nothing else
    assert lines[0].split()[0] == "NAMESPACE" and lines[-1].startswith("2 findings: 1 deny, 1 change,")
    assert "wgpolicyk8s.io/v1alpha2 (PolicyReport, ClusterPolicyReport) reports: 1 created" in err
    report = policy_report(control_plane, unguarded)
    assert report is not None
    assert report["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gpuguard"
    # The Job: four changes, the guard passes, the driver and device-software rules do not apply;
    # the pod: the guard refuses it, nothing else applies.
    assert report["summary"] == {"pass": 1, "fail": 5, "warn": 0, "error": 0, "skip": 8}
    results = report["results"]
    assert [r["result"] for r in results] == ["fail"] * 5 + ["pass"] + ["skip"] * 8
    crowd_result = next(r for r in results if r["resources"][0]["name"] == "crowd" and r["result"] == "fail")
    assert crowd_result["rule"] == "acceleratorNodeGuard" and crowd_result["severity"] == "high"
    assert crowd_result["resources"][0] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "crowd",
        "namespace": unguarded,
        "uid": read_back(control_plane, crowd)["metadata"]["uid"],
    }

    # The same findings again: no write at all.
    code, _, err = run("-n", unguarded, "--report")
    assert code == 0 and "reports: 1 unchanged" in err
    same = policy_report(control_plane, unguarded)
    assert same is not None and same["metadata"]["resourceVersion"] == report["metadata"]["resourceVersion"]

    # The Job fixed: an update at the version read; the pod's unchanged results keep their timestamps.
    mutate = run_gpuguard("mutate", "-f", str(write_manifests(tmp_path / "job.yaml", [job])))
    submit(control_plane, "delete", job, "--wait=false")
    submit(control_plane, "create", yaml.safe_load(mutate.stdout))
    code, _, err = run("-n", unguarded, "--report")
    assert code == 0 and "reports: 1 updated" in err
    updated = policy_report(control_plane, unguarded)
    assert (
        updated is not None
        and updated["metadata"]["resourceVersion"] != report["metadata"]["resourceVersion"]
    )
    assert updated["summary"] == {"pass": 5, "fail": 1, "warn": 0, "error": 0, "skip": 8}
    assert crowd_result in updated["results"]

    # Nothing left to report: gpuguard's report goes.
    submit(control_plane, "delete", as_list([job, crowd]), "--wait=false")
    code, _, err = run("-n", unguarded, "--report")
    assert code == 0 and "reports: 1 deleted" in err
    assert policy_report(control_plane, unguarded) is None


def test_a_cluster_wide_report_holds_the_nodes(
    control_plane: ControlPlane, run: Audit, report_crd: None
) -> None:
    node = f"audit-report-gpu-{secrets.token_hex(3)}"
    submit(
        control_plane,
        "create",
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {GPU_NODE_LABEL: "true"}}},
    )
    try:
        code, _, err = run("-A", "--report")
        assert code == 0, err
        cluster = control_plane.kubectl_json("get", "clusterpolicyreport", "gpuguard")
        (result,) = [r for r in cluster["results"] if r["resources"][0]["name"] == node]
        assert (result["result"], result["rule"], result["resources"][0]["kind"]) == (
            "warn",
            "acceleratorNodeGuard",
            "Node",
        )
    finally:
        control_plane.kubectl("delete", "node", node, "--wait=false")


def test_report_prefers_openreports_when_it_is_installed(
    control_plane: ControlPlane, unguarded: str, run: Audit, report_crd: None
) -> None:
    submit(control_plane, "apply", gpu_job("train", unguarded))
    crds = install_crds(control_plane, OPENREPORTS_CRD_FILE)
    try:
        code, _, err = run("-n", unguarded, "--report")
        assert code == 0 and "openreports.io/v1alpha1 (Report, ClusterReport) reports: 1 created" in err
        report = control_plane.kubectl_json("get", "reports.openreports.io", "gpuguard", "-n", unguarded)
        assert report["source"] == "gpuguard"
        assert report["summary"] == {"pass": 1, "fail": 4, "warn": 0, "error": 0, "skip": 2}
        code, _, err = run("-n", unguarded, "--report")
        assert code == 0 and "reports: 1 unchanged" in err  # its schema keeps every field written
        assert policy_report(control_plane, unguarded) is None  # nothing went to the older API
    finally:
        submit(control_plane, "delete", crds, "--ignore-not-found")  # waits: the next tests use wgpolicy


# --- who may run it, and what it says when it cannot ---------------------------------------------------


def audit_rbac(plane: ControlPlane, namespace: str, *, without: str | None = None) -> list[dict[str, Any]]:
    """The install's audit ServiceAccount, roles and bindings (deploy/audit/), moved into `namespace` (and
    named after it, so two tests never share a ClusterRole); `without` drops one resource from the
    ClusterRole."""
    objects = [o for o in render(plane) if o["metadata"]["name"] == AUDIT_ACCOUNT and o["kind"] != "CronJob"]
    assert {o["kind"] for o in objects} == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    }
    for obj in objects:
        metadata = obj["metadata"]
        if "namespace" in metadata:
            metadata["namespace"] = namespace
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            metadata["name"] = f"{metadata['name']}-{namespace}"
        if obj["kind"] == "ClusterRoleBinding":
            obj["roleRef"]["name"] = metadata["name"]
        for subject in obj.get("subjects", []):
            subject["namespace"] = namespace
        if obj["kind"] == "ClusterRole" and without is not None:
            for rule in obj["rules"]:
                rule["resources"] = [r for r in rule["resources"] if r != without]
            obj["rules"] = [rule for rule in obj["rules"] if rule["resources"]]
    submit(plane, "apply", as_list(objects))
    return objects


def test_deploy_audit_rbac_is_enough_and_reads_only(
    control_plane: ControlPlane, run: Audit, report_crd: None, tmp_path: Path
) -> None:
    namespace = create_namespace(control_plane, "audit-rbac")
    objects = audit_rbac(control_plane, namespace)
    try:
        submit(control_plane, "apply", policy_configmap(namespace, "gpuguard-policy", "mode: enforce\n"))
        kubeconfig = service_account_kubeconfig(
            control_plane, tmp_path / "sa", namespace, account=AUDIT_ACCOUNT
        )
        code, _, err = run(
            "-A", "--report", "--policy-configmap", f"{namespace}/gpuguard-policy", kubeconfig=kubeconfig
        )
        assert code == 0, err

        user = f"system:serviceaccount:{namespace}:gpuguard-audit"

        def can(verb: str, resource: str, *scope: str) -> bool:
            answer = control_plane.kubectl(
                "auth", "can-i", verb, resource, f"--as={user}", *scope, check=False
            )
            return answer.stdout.strip() == "yes"

        assert can("create", "policyreports.wgpolicyk8s.io", "-n", "default")
        assert can("update", "clusterpolicyreports.wgpolicyk8s.io")
        assert can("list", "pods", "--all-namespaces")
        for verb, resource in [
            ("create", "pods"),
            ("delete", "pods"),
            ("update", "deployments.apps"),
            ("patch", "jobs.batch"),
            ("patch", "nodes"),
            ("watch", "pods"),
            ("get", "secrets"),
            ("list", "secrets"),
            ("get", "configmaps"),
        ]:
            assert not can(verb, resource, "-n", "default"), (verb, resource)

        # The CronJob runs the command this test ran.
        # The CronJob is part of the install, in its namespace, and waits for a report CRD to be resumed.
        cronjob = find(render(control_plane), "CronJob", AUDIT_ACCOUNT)
        assert cronjob["metadata"]["namespace"] == "gpuguard" and cronjob["spec"]["suspend"] is True
        pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert pod["serviceAccountName"] == AUDIT_ACCOUNT
        assert container["command"] == ["gpuguard", "audit"]
        args = cli.parser().parse_args(
            ["audit", *(a.replace("$(POD_NAMESPACE)", "gpuguard") for a in container["args"])]
        )
        assert args.report and args.policy_configmap == "gpuguard/gpuguard-policy"
    finally:
        submit(control_plane, "delete", as_list(objects), "--ignore-not-found", "--wait=false")


def test_a_kind_it_may_not_list_is_named_with_its_exit_code(
    control_plane: ControlPlane, run: Audit, tmp_path: Path
) -> None:
    namespace = create_namespace(control_plane, "audit-partial")
    objects = audit_rbac(control_plane, namespace, without="cronjobs")
    try:
        submit(control_plane, "apply", policy_configmap(namespace, "gpuguard-policy", "mode: enforce\n"))
        kubeconfig = service_account_kubeconfig(
            control_plane, tmp_path / "sa", namespace, account=AUDIT_ACCOUNT
        )
        code, out, err = run("--policy-configmap", f"{namespace}/gpuguard-policy", kubeconfig=kubeconfig)
        assert (code, out) == (output.EXIT_USAGE, "")
        assert "cannot list cronjobs.batch in all namespaces: 403 Forbidden" in err
    finally:
        submit(control_plane, "delete", as_list(objects), "--ignore-not-found", "--wait=false")


def test_an_unreachable_api_server_and_a_bad_kubeconfig_have_their_exit_codes(
    control_plane: ControlPlane, run: Audit, tmp_path: Path
) -> None:
    config = json.loads(control_plane.kubeconfig.read_text())
    (port,) = free_ports(1)
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    closed = tmp_path / "closed"
    closed.write_text(json.dumps(config))
    code, out, err = run(
        "-n",
        "default",
        "--policy",
        str(REPO_ROOT / "webhook" / "default-policy.yaml"),
        kubeconfig=closed,
    )
    assert (code, out) == (output.EXIT_USAGE, "")
    assert f"the API server at https://127.0.0.1:{port} did not answer" in err

    garbage = tmp_path / "garbage"
    garbage.write_text("not a kubeconfig\n")
    code, out, err = run("-n", "default", kubeconfig=garbage)
    assert (code, out) == (output.EXIT_USAGE, "")
    assert "no usable cluster credentials" in err


# --- in the background ---------------------------------------------------------------------------------


def test_the_report_loop_writes_reports_and_runs_again_on_a_policy_change(
    control_plane: ControlPlane, unguarded: str, report_crd: None
) -> None:
    submit(control_plane, "apply", gpu_job("train", unguarded))
    policies = [parse_policy("mode: enforce\n")]
    stop = threading.Event()
    loop = background.ReportLoop.for_cluster(
        api_client(str(control_plane.kubeconfig)),
        lambda: policies[-1],
        stop=stop,
        schedule=Schedule(interval=3600, settle=0.1),
    )
    loop.start()
    try:
        wait_until(lambda: loop.metrics.runs["success"] >= 1, timeout=60, what="the first audit run")
        report = policy_report(control_plane, unguarded)
        assert report is not None and report["summary"]["fail"] == 4

        policies.append(parse_policy('rules:\n  podFailurePolicy:\n    mode: "off"\n'))
        loop.policy_changed()
        wait_until(
            lambda: loop.metrics.runs["success"] >= 2, timeout=60, what="the run after the policy change"
        )
        report = policy_report(control_plane, unguarded)
        assert report is not None and report["summary"]["fail"] == 3
        skipped = next(r for r in report["results"] if r["rule"] == "podFailurePolicy")
        assert (skipped["result"], skipped["properties"]["mode"]) == ("skip", "off")
        assert 'gpuguard_audit_results{rule="podFailurePolicy",result="fail"} 0' in loop.metrics.render()
        assert loop.metrics.runs["error"] == 0
    finally:
        stop.set()
        loop.shutdown(timeout=60)
    assert not loop.running
