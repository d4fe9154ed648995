"""The Helm chart charts/gpuguard: generated from deploy/ and rendering exactly what deploy/ renders with
default values, each value doing what the README's table says, and `helm install`, `upgrade` and
`uninstall` on the real API server.

The install uses a namespace of its own and leaves the PriorityClasses and the node agent out: with no
garbage collector here, a deleted namespace never goes away, and the rest of the suite installs deploy/
into `gpuguard` and `gpuguard-node` and uses the classes.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO_ROOT
from tests.harness.chart import CHART, RELEASE, Helm, build_helm, canonical
from tests.harness.controlplane import ControlPlane
from tests.harness.install import CONFIGURATION, CONFIGURATION_KINDS, DEPLOY, find, render
from webhook.policy.model import parse_policy

INSTALLED_NAMESPACE = "gpuguard-helm"
COMPONENT_LABEL = "app.kubernetes.io/name"


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(build_helm(), tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def deploy_rendered(control_plane: ControlPlane) -> list[dict[str, Any]]:
    return render(control_plane)


def test_the_chart_is_generated_from_deploy(k8s_bin: Path) -> None:
    check = subprocess.run(
        [str(REPO_ROOT / "scripts" / "render-chart"), "--check"],
        capture_output=True,
        text=True,
        env=os.environ | {"KUBECTL": str(k8s_bin / "kubectl")},
    )
    assert check.returncode == 0, check.stderr


def test_helm_lint_passes(helm: Helm) -> None:
    lint = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in lint.stdout, lint.stdout


def test_default_values_render_exactly_deploy(helm: Helm, deploy_rendered: list[dict[str, Any]]) -> None:
    assert canonical(helm.template()) == canonical(deploy_rendered)


def test_fail_policy_renders_exactly_deploy_fail_closed(helm: Helm, control_plane: ControlPlane) -> None:
    fail_closed = render(control_plane, DEPLOY / "fail-closed")
    assert canonical(helm.template("--set", "failurePolicy=Fail")) == canonical(fail_closed)


@pytest.mark.parametrize(
    ("value", "component"),
    [
        ("controllers.enabled", "gpuguard-controllers"),
        ("nodeAgent.enabled", "gpuguard-node-agent"),
        ("audit.enabled", "gpuguard-audit"),
    ],
)
def test_a_component_switched_off_leaves_out_its_objects_only(
    helm: Helm, deploy_rendered: list[dict[str, Any]], value: str, component: str
) -> None:
    kept = [o for o in deploy_rendered if o["metadata"].get("labels", {}).get(COMPONENT_LABEL) != component]
    assert len(kept) < len(deploy_rendered)
    assert canonical(helm.template("--set", f"{value}=false")) == canonical(kept)


def test_priority_classes_can_be_left_to_the_cluster(
    helm: Helm, deploy_rendered: list[dict[str, Any]]
) -> None:
    kept = [o for o in deploy_rendered if o["kind"] != "PriorityClass"]
    assert canonical(helm.template("--set", "priorityClasses.create=false")) == canonical(kept)


def test_the_namespace_value_moves_what_deploys_one_setting_moves(
    helm: Helm, control_plane: ControlPlane, tmp_path: Path
) -> None:
    # deploy/ moved the way the README says: its one `namespace:` line (test_install_namespace.py).
    moved = tmp_path / "deploy"
    subprocess.run(["cp", "-r", str(DEPLOY), str(moved)], check=True)
    subprocess.run(["cp", "-r", str(REPO_ROOT / "webhook"), str(tmp_path / "webhook")], check=True)
    kustomization = moved / "base" / "kustomization.yaml"
    kustomization.write_text(
        kustomization.read_text().replace("\nnamespace: gpuguard\n", "\nnamespace: elsewhere\n")
    )
    assert canonical(helm.template("--set", "namespace=elsewhere")) == canonical(render(control_plane, moved))


def test_image_replicas_resources_labels_and_tolerations_reach_every_workload(helm: Helm) -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}
    small = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "500m", "memory": "128Mi"}}
    rendered = helm.template(
        "--set", "image.repository=registry.example.com/gpuguard,image.tag=1.2.3,image.pullPolicy=Always",
        "--set", "replicas=3,controllers.replicas=4,commonLabels.team=platform",
        "--set-json", f"tolerations=[{json.dumps(toleration)}]",
        "--set-json", f"resources={json.dumps(small)}",
    )  # fmt: skip
    assert all(o["metadata"]["labels"]["team"] == "platform" for o in rendered)
    assert find(rendered, "Deployment", "gpuguard")["spec"]["replicas"] == 3
    assert find(rendered, "Deployment", "gpuguard-controllers")["spec"]["replicas"] == 4
    pod_templates = {
        name: find(rendered, kind, name)["spec"]["template"]
        for kind, name in [
            ("Deployment", "gpuguard"),
            ("Deployment", "gpuguard-controllers"),
            ("DaemonSet", "gpuguard-node-agent"),
        ]
    }
    pod_templates["gpuguard-audit"] = find(rendered, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]
    for name, template in pod_templates.items():
        assert template["metadata"]["labels"]["team"] == "platform", name
        (container,) = template["spec"]["containers"]
        assert container["image"] == "registry.example.com/gpuguard:1.2.3", name
        assert container["imagePullPolicy"] == "Always", name
        if name == "gpuguard-node-agent":  # it tolerates every taint already
            assert template["spec"]["tolerations"] == [{"operator": "Exists"}]
        else:
            assert template["spec"]["tolerations"] == [toleration], name
    assert pod_templates["gpuguard"]["spec"]["containers"][0]["resources"] == small
    assert pod_templates["gpuguard-controllers"]["spec"]["containers"][0]["resources"] != small


def test_an_inline_policy_is_laid_over_the_default(helm: Helm) -> None:
    rendered = helm.template(
        "--set-json", 'policy={"mode": "warn", "rules": {"priority": {"className": "batch-gpu"}}}'
    )
    text = find(rendered, "ConfigMap", "gpuguard-policy")["data"]["policy.yaml"]
    policy = parse_policy(text)
    assert policy.mode == "warn"
    assert policy.rules.priority.className == "batch-gpu"
    assert policy.accelerators == parse_policy("").accelerators  # the rest is the default


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("policy.mode=sometimes", "mode"),
        ("policy.rules.priority.className=7", "className"),
        ("policy.nosuchkey=1", "nosuchkey"),
        ("failurePolicy=Sometimes", "failurePolicy"),
        ("replicas=0", "replicas"),
        ("namespace=Not_A_Name", "namespace"),
        ("contollers.enabled=false", "contollers"),
    ],
)
def test_the_schema_refuses_wrong_values_at_install(helm: Helm, flag: str, named: str) -> None:
    refused = helm("template", RELEASE, str(CHART), "--set", flag, check=False)
    assert refused.returncode != 0
    assert "schema" in refused.stderr and named in refused.stderr, refused.stderr


# --- helm install, upgrade and uninstall on the real API server -----------------------------------------


@pytest.fixture(scope="module")
def installing_helm(helm: Helm, control_plane: ControlPlane) -> Helm:
    return Helm(helm.binary, helm.home, control_plane.kubeconfig)


LEFT_TO_THE_SUITE = (
    "--set",
    f"namespace={INSTALLED_NAMESPACE},priorityClasses.create=false,nodeAgent.enabled=false",
)


@pytest.fixture(scope="module")
def installed(installing_helm: Helm, control_plane: ControlPlane) -> Iterator[list[dict[str, Any]]]:
    rendered = installing_helm.template(*LEFT_TO_THE_SUITE)
    installing_helm("install", RELEASE, str(CHART), "--namespace", "default", *LEFT_TO_THE_SUITE)
    try:
        yield rendered
    finally:
        installing_helm("uninstall", RELEASE, "--namespace", "default", check=False)
        control_plane.kubectl(
            "delete", "namespace", INSTALLED_NAMESPACE, "--ignore-not-found", "--wait=false"
        )


def test_helm_install_creates_every_rendered_object(
    control_plane: ControlPlane, installed: list[dict[str, Any]]
) -> None:
    live = control_plane.kubectl_json(
        "get", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": installed})
    )
    assert len(live["items"]) == len(installed)
    assert all(obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm" for obj in live["items"])


def test_helm_upgrade_changes_the_failure_policy_and_keeps_the_ca_bundle_gpuguard_wrote(
    installing_helm: Helm, control_plane: ControlPlane, installed: list[dict[str, Any]]
) -> None:
    # What a replica does once it has its CA: caBundle is no field of the chart's, so Helm leaves it.
    ca_bundle = "Y2EgYnVuZGxl"
    for kind in CONFIGURATION_KINDS:
        control_plane.kubectl(
            "patch", kind, CONFIGURATION, "--type=json",
            "-p", json.dumps([{"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": ca_bundle}]),
        )  # fmt: skip
    installing_helm(
        "upgrade",
        RELEASE,
        str(CHART),
        "--namespace",
        "default",
        *LEFT_TO_THE_SUITE,
        "--set",
        "failurePolicy=Fail",
    )
    for kind in CONFIGURATION_KINDS:
        first = control_plane.kubectl_json("get", kind, CONFIGURATION)["webhooks"][0]
        assert first["failurePolicy"] == "Fail", kind
        assert first["clientConfig"]["caBundle"] == ca_bundle, kind


def test_helm_uninstall_leaves_nothing(
    installing_helm: Helm, control_plane: ControlPlane, installed: list[dict[str, Any]]
) -> None:
    # No --wait: with no namespace controller here, the namespace itself stays Terminating.
    installing_helm("uninstall", RELEASE, "--namespace", "default")
    for obj in installed:
        if obj["kind"] == "Namespace":
            continue
        where = ["-n", obj["metadata"]["namespace"]] if "namespace" in obj["metadata"] else []
        gone = control_plane.kubectl("get", obj["kind"], obj["metadata"]["name"], *where, check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr, f"{obj['kind']}/{obj['metadata']['name']}"
    assert installing_helm("list", "--all-namespaces", "--short").stdout.strip() == ""
