"""One-shot reads of the cluster, page by page: the workload kinds the audit judges, and the facts
admission reads from its watch caches (`webhook.kube.fact_sources`), listed once with the same converters.

List responses leave `apiVersion` and `kind` out of their items; they are put back, so every object
reads as the API server sends it to a webhook, `metadata.managedFields` aside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from webhook.kube import fact_sources
from webhook.kube.client import AccessError, ResourceListWatch, metadata_of
from webhook.kube.informer import Converter, ExpiredError, NotServedError, paged
from webhook.policy.facts import ClusterFacts
from webhook.policy.kinds import WorkloadKind

# Called after each page with the resource and how many of its objects were read so far.
OnPage = Callable[[str, int], None]

# (API group, kind) -> (apiVersion, resource, list in all namespaces, list in one) on the typed APIs.
_WORKLOADS: dict[tuple[str, str], tuple[str, str, str, str]] = {
    ("", "Pod"): ("v1", "pods", "list_pod_for_all_namespaces", "list_namespaced_pod"),
    ("batch", "Job"): ("batch/v1", "jobs.batch", "list_job_for_all_namespaces", "list_namespaced_job"),
    ("batch", "CronJob"): (
        "batch/v1",
        "cronjobs.batch",
        "list_cron_job_for_all_namespaces",
        "list_namespaced_cron_job",
    ),
    ("apps", "Deployment"): (
        "apps/v1",
        "deployments.apps",
        "list_deployment_for_all_namespaces",
        "list_namespaced_deployment",
    ),
    ("apps", "StatefulSet"): (
        "apps/v1",
        "statefulsets.apps",
        "list_stateful_set_for_all_namespaces",
        "list_namespaced_stateful_set",
    ),
    ("apps", "ReplicaSet"): (
        "apps/v1",
        "replicasets.apps",
        "list_replica_set_for_all_namespaces",
        "list_namespaced_replica_set",
    ),
    ("apps", "DaemonSet"): (
        "apps/v1",
        "daemonsets.apps",
        "list_daemon_set_for_all_namespaces",
        "list_namespaced_daemon_set",
    ),
}
WORKLOAD_KINDS = tuple(_WORKLOADS)


def _each(source: ResourceListWatch, what: str) -> Iterator[dict[str, Any]]:
    try:
        for page in paged(source):
            yield from page.items
    except ExpiredError as exc:
        # A continue token lives about five minutes: only a consumer that stalls that long meets this.
        raise RuntimeError(f"the list of {what} expired while it was read ({exc}): run again") from exc
    except ApiException as exc:
        raise AccessError(f"list {what}", exc) from exc


class ClusterReader:
    def __init__(self, api: client.ApiClient, *, on_page: OnPage | None = None) -> None:
        self.api = api
        self.on_page = on_page or (lambda _resource, _count: None)
        self._typed: dict[str, Any] = {
            "": client.CoreV1Api(api),
            "apps": client.AppsV1Api(api),
            "batch": client.BatchV1Api(api),
        }

    def workloads(self, group: str, kind: str, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        """Every object of one workload kind (WORKLOAD_KINDS), in `namespace` or in all of them."""
        api_version, resource, all_namespaces, one_namespace = _WORKLOADS[(group, kind)]
        typed = self._typed[group]
        if namespace is None:
            source = ResourceListWatch(getattr(typed, all_namespaces))
        else:
            source = ResourceListWatch(getattr(typed, one_namespace), namespace=namespace)
        yield from self._items(source, api_version, kind, resource, namespace)

    def custom_workloads(self, kind: WorkloadKind, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        """Every object of a custom resource kind, at the first of its versions the cluster serves;
        nothing when it serves none (its CRD is not installed). MPIJob is kubeflow.org/v1 under the
        training operator and v2beta1 under mpi-operator."""
        custom = client.CustomObjectsApi(self.api)
        resource = f"{kind.resource}.{kind.group}"
        for version in kind.versions:
            arguments: dict[str, Any] = {"group": kind.group, "version": version, "plural": kind.resource}
            call: Callable[..., Any] = custom.list_cluster_custom_object
            if namespace is not None:
                call, arguments["namespace"] = custom.list_namespaced_custom_object, namespace
            try:
                ResourceListWatch(call, page_size=1, **arguments).list_page(None)  # served at all?
            except NotServedError:
                continue
            api_version = f"{kind.api_group}{version}"
            yield from self._items(
                ResourceListWatch(call, **arguments), api_version, kind.kind, resource, namespace
            )
            return

    def _items(
        self,
        source: ResourceListWatch,
        api_version: str,
        kind: str,
        resource: str,
        namespace: str | None,
    ) -> Iterator[dict[str, Any]]:
        what = (
            f"{resource} in all namespaces" if namespace is None else f"{resource} in namespace {namespace}"
        )
        count = 0
        for item in _each(source, what):
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
            # Often half an object, read by no rule, and copied by every mutation the engine tries.
            metadata_of(item).pop("managedFields", None)
            count += 1
            if count % source.page_size == 0:
                self.on_page(resource, count)
            yield item
        self.on_page(resource, count)

    def _fact(
        self, resource: str, call: Callable[..., Any], convert: Converter[Any]
    ) -> dict[Any, Any] | None:
        found: dict[Any, Any] = {}
        try:
            for raw in _each(ResourceListWatch(call), resource):
                converted = convert(raw)
                if converted is not None:
                    found[converted[0]] = converted[1]
        except NotServedError:
            return None  # not served here (a cluster without DRA): unknown, as admission has it
        self.on_page(resource, len(found))
        return found

    def facts(self) -> ClusterFacts:
        """What admission's caches would hold right now; a resource the cluster does not serve is None."""
        core, scheduling, resource = (
            self._typed[""],
            client.SchedulingV1Api(self.api),
            client.ResourceV1Api(self.api),
        )
        return ClusterFacts(
            priority_classes=self._fact(
                "priorityclasses", scheduling.list_priority_class, fact_sources.priority_class
            ),
            namespace_labels=self._fact("namespaces", core.list_namespace, fact_sources.namespace_labels),
            nodes=self._fact("nodes", core.list_node, fact_sources.node),
            claims=self._fact(
                "resourceclaims", resource.list_resource_claim_for_all_namespaces, fact_sources.resource_claim
            ),
            claim_templates=self._fact(
                "resourceclaimtemplates",
                resource.list_resource_claim_template_for_all_namespaces,
                fact_sources.resource_claim_template,
            ),
        )
