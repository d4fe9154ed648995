"""PolicyReports on the API server: which report API is served, and writing one report per namespace
(plus a cluster-scoped one) idempotently: read, compare, and create or update only what differs, at the
resourceVersion read.

Two APIs carry the same report body: the Policy WG's `wgpolicyk8s.io/v1alpha2` (PolicyReport and
ClusterPolicyReport, which Kyverno, Policy Reporter and others read) and its successor
`openreports.io/v1alpha1` (Report and ClusterReport), preferred when it is installed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from webhook.kube.client import REQUEST_TIMEOUT_SECONDS, AccessError, ResourceListWatch, metadata_of
from webhook.kube.informer import paged

NAME = "gpuguard"
FIELD_MANAGER = "gpuguard"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpuguard"}
CONFLICT_RETRIES = 3

log = logging.getLogger("gpuguard.reports")

# skipped: the namespace is being deleted, and the API server takes nothing new into it.
Written = Literal["created", "updated", "unchanged", "deleted", "skipped"]
# The content for a report, given the report as it is now (None when there is none yet).
Desired = Callable[[Mapping[str, Any] | None], dict[str, Any]]


@dataclass(frozen=True)
class ReportApi:
    group: str
    version: str
    kind: str
    plural: str
    cluster_kind: str
    cluster_plural: str
    # openreports.io names the producer once per report, besides in each result.
    report_source: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def describe(self) -> str:
        return f"{self.api_version} ({self.kind}, {self.cluster_kind})"


WGPOLICY = ReportApi(
    "wgpolicyk8s.io",
    "v1alpha2",
    "PolicyReport",
    "policyreports",
    "ClusterPolicyReport",
    "clusterpolicyreports",
)
OPENREPORTS = ReportApi(
    "openreports.io", "v1alpha1", "Report", "reports", "ClusterReport", "clusterreports", report_source=True
)
REPORT_APIS = (OPENREPORTS, WGPOLICY)  # in order of preference
MISSING_REPORT_API = (
    "no PolicyReport API is served by this cluster: install the wgpolicyk8s.io/v1alpha2 CRDs"
    " (policyreports and clusterpolicyreports, shipped by Kyverno and by"
    " kubernetes-sigs/wg-policy-prototypes) or the openreports.io/v1alpha1 ones (reports and"
    " clusterreports, from openreports/reports-api)"
)


class ConflictError(RuntimeError):
    """The report kept changing between our read and our write."""


def served_report_api(api: client.ApiClient) -> ReportApi | None:
    """The preferred report API whose namespaced and cluster-scoped kinds are both served, or None.

    Asked by listing one object of each, which also proves the permission to list them. The API
    server authorises before it looks the resource up, so a 403 says nothing about whether an API is
    installed: the next one is tried, and the 403 raised only when no API could be used.
    """
    custom = client.CustomObjectsApi(api)
    forbidden: AccessError | None = None
    for candidate in REPORT_APIS:
        try:
            for plural in (candidate.plural, candidate.cluster_plural):
                custom.list_cluster_custom_object(
                    candidate.group,
                    candidate.version,
                    plural,
                    limit=1,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
        except ApiException as exc:
            if exc.status == 403:
                forbidden = forbidden or AccessError(f"list {plural}.{candidate.group}", exc)
            elif exc.status != 404:
                raise
            continue
        return candidate
    if forbidden is not None:
        raise forbidden
    return None


class ReportWriter:
    """Writes gpuguard's report (named `gpuguard`) of one report API, in any namespace or cluster-wide."""

    def __init__(self, api: client.ApiClient, report_api: ReportApi) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.report_api = report_api

    def _call(self, verb: str, namespace: str, *args: Any, **kwargs: Any) -> Any:
        """`verb` (get, create, replace, delete) on the report of `namespace`, "" for the cluster-scoped
        one: the generated client has a method of each name for either scope, taking the same arguments."""
        r = self.report_api
        if namespace:
            method = getattr(self.custom, f"{verb}_namespaced_custom_object")
            where: tuple[str, ...] = (r.group, r.version, namespace, r.plural)
        else:
            method = getattr(self.custom, f"{verb}_cluster_custom_object")
            where = (r.group, r.version, r.cluster_plural)
        return method(*where, *args, _request_timeout=REQUEST_TIMEOUT_SECONDS, **kwargs)

    def _read(self, namespace: str) -> dict[str, Any] | None:
        try:
            existing: dict[str, Any] = self._call("get", namespace, NAME)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return existing

    def _wanted(
        self, namespace: str, content: Mapping[str, Any], existing: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        r = self.report_api
        old = metadata_of(existing)
        metadata: dict[str, Any] = {
            "name": NAME,
            # Labels and annotations others put there are theirs: kept.
            "labels": {**(old.get("labels") or {}), **MANAGED_BY},
            "annotations": {
                **(old.get("annotations") or {}),
                **content.get("metadata", {}).get("annotations", {}),
            },
        }
        if namespace:
            metadata["namespace"] = namespace
        if existing is not None:
            metadata["resourceVersion"] = old["resourceVersion"]
        wanted = {k: v for k, v in content.items() if k != "metadata"}
        if r.report_source:
            wanted["source"] = FIELD_MANAGER
        return {
            "apiVersion": r.api_version,
            "kind": r.kind if namespace else r.cluster_kind,
            "metadata": metadata,
            **wanted,
        }

    @staticmethod
    def _same(wanted: Mapping[str, Any], existing: Mapping[str, Any]) -> bool:
        old, new = metadata_of(existing), metadata_of(wanted)
        fields = [key for key in wanted if key not in ("apiVersion", "kind", "metadata")]
        return (
            all(existing.get(key) == wanted[key] for key in fields)
            and (old.get("labels") or {}) == new["labels"]
            and (old.get("annotations") or {}) == new["annotations"]
        )

    def write(self, namespace: str, desired: Desired) -> Written:
        """Makes the report of `namespace` ("" cluster-scoped) hold `desired(current)`; no write when it
        already does. A write that meets a newer report (409) reads it again, up to CONFLICT_RETRIES."""
        for _attempt in range(CONFLICT_RETRIES):
            existing = self._read(namespace)
            wanted = self._wanted(namespace, desired(existing), existing)
            try:
                if existing is None:
                    self._call("create", namespace, wanted, field_manager=FIELD_MANAGER)
                    return "created"
                if self._same(wanted, existing):
                    return "unchanged"
                self._call("replace", namespace, NAME, wanted, field_manager=FIELD_MANAGER)
                return "updated"
            except ApiException as exc:
                if exc.status == 403 and "NamespaceTerminating" in str(exc.body or ""):
                    return "skipped"
                if exc.status != 409:
                    raise
                log.info("report %s/%s changed since read; reading it again", namespace or "(cluster)", NAME)
        raise ConflictError(
            f"report {namespace or '(cluster)'}/{NAME} changed on every one of {CONFLICT_RETRIES} writes"
        )

    def managed_namespaces(self, namespace: str | None = None) -> dict[str, str]:
        """Namespaces ("" for the cluster-scoped report) holding a report gpuguard wrote, with its
        resourceVersion; within `namespace` only when one is given."""
        r, c = self.report_api, self.custom
        common: dict[str, Any] = {
            "group": r.group,
            "version": r.version,
            "label_selector": ",".join(f"{k}={v}" for k, v in MANAGED_BY.items()),
        }
        sources = (
            [
                ResourceListWatch(
                    c.list_namespaced_custom_object, namespace=namespace, plural=r.plural, **common
                )
            ]
            if namespace
            else [
                ResourceListWatch(c.list_cluster_custom_object, plural=plural, **common)
                for plural in (r.plural, r.cluster_plural)
            ]
        )
        found: dict[str, str] = {}
        for source in sources:
            for page in paged(source):
                for item in page.items:
                    metadata = metadata_of(item)
                    if metadata.get("name") == NAME:
                        found[str(metadata.get("namespace") or "")] = str(metadata.get("resourceVersion"))
        return found

    def delete(self, namespace: str, resource_version: str) -> bool:
        """Deletes the report if it is still the version listed; False when it changed or is gone."""
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version=resource_version)
        )
        try:
            self._call("delete", namespace, NAME, body=options)
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True
