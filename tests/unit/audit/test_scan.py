"""The audit against a cluster (audit/scan.py): what it lists, in what order, and the reports it leaves.

Judging one object is findings.py's and has its own tests (test_audit.py); these run the scan through
the real client against the in-process API server (apiserver.py): every workload kind in every
namespace or in one, custom kinds before the Jobs they own, accelerator nodes only in a cluster-wide
audit; one report per namespace with findings, unchanged reports left alone, stale ones deleted (within
the audited namespace only); and the background audit's refusal without a report API.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.apiserver import FakeApiServer
from tests.harness.manifests import container, job, templated
from tests.unit.audit.test_audit import placed
from webhook.audit import scan
from webhook.kube.client import ApiClient, metadata_of
from webhook.kube.listing import ClusterReader
from webhook.kube.reports import MISSING_REPORT_API, OPENREPORTS, WGPOLICY, ReportWriter
from webhook.policy.model import Policy

JSON = dict[str, Any]
NOW = 1_700_000_000


def path_of(obj: JSON) -> str:
    """Where the API server keeps `obj` (the kinds these tests store)."""
    plural = {"Deployment": "deployments", "Job": "jobs", "JobSet": "jobsets", "Node": "nodes"}[obj["kind"]]
    base = "/api/" + obj["apiVersion"] if "/" not in obj["apiVersion"] else "/apis/" + obj["apiVersion"]
    metadata = obj["metadata"]
    where = f"/namespaces/{metadata['namespace']}" if metadata.get("namespace") else ""
    return f"{base}{where}/{plural}/{metadata['name']}"


def stored(server: FakeApiServer, *objects: JSON) -> None:
    for obj in objects:
        server.put(path_of(obj), obj)


def gpu_deployment(namespace: str) -> JSON:
    return placed(templated("Deployment", container(gpus=1), name="serve"), namespace)


def gpu_job(namespace: str, name: str = "train", owner: JSON | None = None) -> JSON:
    return placed(job(container(gpus=8), name=name), namespace, owner=owner)


def untainted_gpu_node() -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "gpu-1", "labels": {"nvidia.com/gpu.present": "true"}},
        "status": {"capacity": {"nvidia.com/gpu": "8"}},
    }


def subjects(audit: Any) -> set[tuple[str, str, str]]:
    return {(f.subject.namespace, f.subject.kind, f.subject.name) for f in audit.findings}


@pytest.fixture
def server() -> FakeApiServer:
    server = FakeApiServer()
    stored(server, gpu_deployment("ml"), gpu_job("research"), untainted_gpu_node())
    return server


def test_a_cluster_wide_scan_judges_every_namespace_and_the_accelerator_nodes(
    server: FakeApiServer, policy: Policy
) -> None:
    audit = scan.scan(ClusterReader(server.api_client()), policy)
    assert subjects(audit) == {
        ("ml", "Deployment", "serve"),
        ("research", "Job", "train"),
        ("", "Node", "gpu-1"),
    }
    assert audit.scanned == {"Deployment": 1, "Job": 1}
    assert audit.nodes_checked


def test_a_namespace_scan_lists_that_namespace_only_and_judges_no_node(
    server: FakeApiServer, policy: Policy
) -> None:
    audit = scan.scan(ClusterReader(server.api_client()), policy, namespace="ml")
    assert subjects(audit) == {("ml", "Deployment", "serve")}
    assert not audit.nodes_checked
    workload_lists = [r.path for r in server.requests if r.path.endswith(("/deployments", "/jobs", "/pods"))]
    assert workload_lists and all("/namespaces/ml/" in path for path in workload_lists)


def test_custom_kinds_are_read_before_the_jobs_they_own(server: FakeApiServer, policy: Policy) -> None:
    jobset = placed(
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": "pretrain"},
            "spec": {
                "replicatedJobs": [{"name": "workers", "template": {"spec": job(container(gpus=8))["spec"]}}]
            },
        },
        "ml",
    )
    stored(server, jobset, gpu_job("ml", "pretrain-workers-0", owner=jobset))
    audit = scan.scan(ClusterReader(server.api_client()), policy, namespace="ml")
    # The JobSet's Job is reported through the JobSet: fixing the JobSet fixes it.
    assert ("ml", "JobSet", "pretrain") in subjects(audit)
    assert ("ml", "Job", "pretrain-workers-0") not in subjects(audit)
    assert audit.scanned["Job"] == 1


# --- reports ----------------------------------------------------------------------------------------


def report_path(namespace: str) -> str:
    group, version = OPENREPORTS.group, OPENREPORTS.version
    if namespace:
        return f"/apis/{group}/{version}/namespaces/{namespace}/{OPENREPORTS.plural}/gpuguard"
    return f"/apis/{group}/{version}/{OPENREPORTS.cluster_plural}/gpuguard"


def test_each_namespace_with_findings_gets_one_report_and_the_cluster_one(
    server: FakeApiServer, policy: Policy
) -> None:
    api = server.api_client()
    audit = scan.scan(ClusterReader(api), policy)
    assert scan.write_reports(ReportWriter(api, OPENREPORTS), audit, now=NOW) == {"created": 3}
    for namespace in ("ml", "research", ""):
        assert server.objects[report_path(namespace)]["metadata"]["labels"]
    assert server.objects[report_path("")]["kind"] == OPENREPORTS.cluster_kind
    # The same findings a run later: nothing to write.
    again = scan.scan(ClusterReader(api), policy)
    assert scan.write_reports(ReportWriter(api, OPENREPORTS), again, now=NOW + 60) == {"unchanged": 3}


def reported(server: FakeApiServer, policy: Policy) -> tuple[ApiClient, ReportWriter]:
    """The cluster audited and its reports written once, as a first run leaves them."""
    api = server.api_client()
    writer = ReportWriter(api, OPENREPORTS)
    scan.write_reports(writer, scan.scan(ClusterReader(api), policy), now=NOW)
    return api, writer


def test_a_report_of_a_namespace_without_findings_any_more_is_deleted(
    server: FakeApiServer, policy: Policy
) -> None:
    api, writer = reported(server, policy)
    del server.objects[path_of(gpu_job("research"))]
    outcomes = scan.write_reports(writer, scan.scan(ClusterReader(api), policy), now=NOW + 60)
    assert outcomes == {"unchanged": 2, "deleted": 1}
    assert report_path("research") not in server.objects


def test_a_namespace_audit_deletes_stale_reports_of_that_namespace_only(
    server: FakeApiServer, policy: Policy
) -> None:
    api, writer = reported(server, policy)
    del server.objects[path_of(gpu_deployment("ml"))]
    audit = scan.scan(ClusterReader(api), policy, namespace="ml")
    assert scan.write_reports(writer, audit, now=NOW + 60, namespace="ml") == {"deleted": 1}
    assert report_path("ml") not in server.objects
    assert report_path("research") in server.objects and report_path("") in server.objects


def test_the_background_audit_writes_in_the_report_api_the_cluster_serves(
    server: FakeApiServer, policy: Policy
) -> None:
    server.refuse(f"/apis/{OPENREPORTS.group}/{OPENREPORTS.version}/{OPENREPORTS.plural}", 404)
    audit, outcomes = scan.ClusterReports(server.api_client())(policy, NOW)
    assert outcomes == {"created": 3} and len(audit.findings) == 3
    written = [obj for obj in server.objects.values() if metadata_of(obj).get("name") == "gpuguard"]
    assert {obj["apiVersion"] for obj in written} == {WGPOLICY.api_version}


def test_the_background_audit_without_a_report_api_says_what_to_install(
    server: FakeApiServer, policy: Policy
) -> None:
    server.refuse(f"/apis/{OPENREPORTS.group}/{OPENREPORTS.version}/{OPENREPORTS.plural}", 404)
    server.refuse(f"/apis/{WGPOLICY.group}/{WGPOLICY.version}/{WGPOLICY.plural}", 404)
    with pytest.raises(RuntimeError) as raised:
        scan.ClusterReports(server.api_client())(policy, NOW)
    assert str(raised.value) == MISSING_REPORT_API
    assert not server.sent("POST")
