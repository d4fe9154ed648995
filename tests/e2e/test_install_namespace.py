"""deploy/ installed into another namespace by changing the one `namespace:` line the README names: every
field that names gpuguard's namespace follows it, the API server takes the install, and a replica running
as that namespace's ServiceAccount has every right it needs (so the RBAC subjects moved too).

Runs after test_install.py (file order) and shares its cluster-scoped names (the ClusterRole, the webhook
configurations, the PriorityClasses): that module has removed its install by then, and this one removes
its own at the end.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO_ROOT
from tests.harness.admission import policy_hash
from tests.harness.controlplane import ControlPlane
from tests.harness.install import (
    CONFIGURATION,
    CONFIGURATION_KINDS,
    DEPLOY,
    NAMESPACE,
    Replica,
    ca_bundles,
    deployed,
    find,
    namespaces_of,
    read_secret,
    render,
    service_account_kubeconfig,
    wait_for,
)
from webhook.certs import files, tls

ELSEWHERE = "gpu-admission"
EXCLUDED_BY_DEFAULT = ("kube-system", "kube-node-lease")
# deploy/node-agent: a namespace of its own (its Pod Security level is not gpuguard's), which the one
# setting leaves where it is.
AGENT_NAMESPACE = "gpuguard-node"


def gpuguards_own(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Everything but the node agent's objects."""
    return [
        obj
        for obj in rendered
        if (obj["metadata"].get("labels") or {}).get("app.kubernetes.io/name") != "gpuguard-node-agent"
    ]


@pytest.fixture(scope="module")
def moved_deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/ (and the policy kustomization it includes) with only `namespace:` changed."""
    root = tmp_path_factory.mktemp("elsewhere")
    shutil.copytree(DEPLOY, root / "deploy")
    (root / "webhook").mkdir()
    for name in ("kustomization.yaml", "default-policy.yaml"):
        shutil.copy(REPO_ROOT / "webhook" / name, root / "webhook" / name)
    kustomization = root / "deploy" / "base" / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count(f"\nnamespace: {NAMESPACE}\n") == 1, "the one namespace setting moved"
    kustomization.write_text(text.replace(f"\nnamespace: {NAMESPACE}\n", f"\nnamespace: {ELSEWHERE}\n"))
    return root / "deploy"


def namespaces_named(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, value) of every `namespace` field anywhere in a rendered object."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "namespace" and isinstance(item, str):
                yield f"{path}.{key}", item
            yield from namespaces_named(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from namespaces_named(item, f"{path}[{index}]")


def test_every_namespace_field_follows_the_one_setting(
    control_plane: ControlPlane, moved_deploy: Path
) -> None:
    rendered = render(control_plane, moved_deploy)

    named = {
        f"{obj['kind']}/{obj['metadata']['name']}{path}": value
        for obj in gpuguards_own(rendered)
        for path, value in namespaces_named(obj)
    }
    assert named, "nothing names a namespace"
    assert set(named.values()) == {ELSEWHERE}, named
    assert {n["metadata"]["name"] for n in namespaces_of(rendered)["items"]} == {ELSEWHERE, AGENT_NAMESPACE}
    for kind, account in itertools.product(
        ("RoleBinding", "ClusterRoleBinding"), ("gpuguard", "gpuguard-controllers", "gpuguard-audit")
    ):
        subjects = find(rendered, kind, account)["subjects"]
        assert {"kind": "ServiceAccount", "name": account, "namespace": ELSEWHERE} in subjects
        # The audit's ClusterRoleBinding also binds the controllers (their leader keeps the reports).
        assert all(subject["namespace"] == ELSEWHERE for subject in subjects), subjects
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for webhook in find(rendered, kind)["webhooks"]:
            assert webhook["clientConfig"]["service"]["namespace"] == ELSEWHERE
            (selected,) = webhook["namespaceSelector"]["matchExpressions"]
            if selected["operator"] == "NotIn":  # the workload webhooks leave gpuguard's namespace out
                assert selected["values"] == [*EXCLUDED_BY_DEFAULT, ELSEWHERE, AGENT_NAMESPACE], webhook[
                    "name"
                ]
            else:  # the device-software one looks at kube-system only
                assert selected == {
                    "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["kube-system"]
                }  # fmt: skip


def test_the_default_namespace_renders_as_before(control_plane: ControlPlane) -> None:
    rendered = gpuguards_own(render(control_plane))
    assert {value for obj in rendered for _, value in namespaces_named(obj)} == {NAMESPACE}


@pytest.fixture(scope="module")
def installed_elsewhere(control_plane: ControlPlane, moved_deploy: Path) -> Iterator[list[dict[str, Any]]]:
    rendered = render(control_plane, moved_deploy)
    with deployed(control_plane, moved_deploy, rendered, ELSEWHERE):
        yield rendered


def test_a_replica_in_the_other_namespace_has_every_right_it_needs(
    control_plane: ControlPlane, installed_elsewhere: list[dict[str, Any]], tmp_path: Path
) -> None:
    for kind in CONFIGURATION_KINDS:
        for webhook in control_plane.kubectl_json("get", kind, CONFIGURATION)["webhooks"]:
            assert webhook["clientConfig"]["service"]["namespace"] == ELSEWHERE

    # Ready means: it read the policy ConfigMap and created the Secret in its namespace (the Role's
    # binding), and listed the cluster facts (the ClusterRole's); then it fills caBundle (ditto).
    kubeconfig = service_account_kubeconfig(control_plane, tmp_path / "sa.kubeconfig", ELSEWHERE)
    replica = Replica(tmp_path / "replica", kubeconfig, namespace=ELSEWHERE)
    replica.start()
    try:
        replica.wait_ready()
        material = read_secret(control_plane, ELSEWHERE)
        # The certificate names the Service where the webhooks now call it.
        assert tls.covers(material.leaf, files.dns_names_for_service("gpuguard", ELSEWHERE))
        assert json.loads(replica.get("/policy")[1])["unavailableLookups"] == [], replica.log()
        # It watches the policy ConfigMap of its own namespace: an edit there takes effect.
        edited = "mode: warn\n"
        control_plane.kubectl(
            "patch", "configmap", "gpuguard-policy", "-n", ELSEWHERE, "--type=merge",
            "-p", json.dumps({"data": {"policy.yaml": edited}}),
        )  # fmt: skip
        wait_for(
            lambda: json.loads(replica.get("/policy")[1])["hash"] == policy_hash(edited),
            what="the edited policy active",
            replicas=[replica],
        )
        wait_for(
            lambda: ca_bundles(control_plane) == {kind: material.cas for kind in CONFIGURATION_KINDS},
            what="caBundle filled by the replica in the other namespace",
            replicas=[replica],
        )
    finally:
        replica.stop()
