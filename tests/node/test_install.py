"""gpuguard installed as the README installs it, running as pods on the tier's real nodes: `kubectl apply -k
deploy/` with the image built from the Dockerfile, then admission through the webhook Service, the
controllers' leader election and the node agent in pods, and `kubectl delete -k deploy/` leaving nothing.

The tests share one install and run in file order (the last one uninstalls). The workloads go to
namespaces the session's own gpuguard leaves alone (conftest.installed_namespace, and the corpus's own
ones labelled likewise), so whatever mutates or
denies them there is the installed gpuguard, called by the API server at the Service's endpoints (the pods'
addresses on the tier's bridge, node.TierNetwork).
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from cryptography import x509

from tests.e2e.test_corpus import (
    CORPUS_PRIORITY_CLASSES,
    DENIED_EXAMPLES,
    EXAMPLE_FILES,
    EXAMPLES,
    EXISTING_NAMESPACES,
    NOT_ACCELERATOR_WORKLOADS,
    WORKLOAD_KINDS,
    assert_mutated,
    assert_untouched,
    json_stream,
    key_of,
    load,
    place,
)
from tests.harness import corpus
from tests.harness.admission import (
    OWNER_LABEL,
    default_priority_classes,
    gpu_job,
    gpu_pod,
    gpuguard_annotations,
    install_priority_classes,
    metric_samples,
    pinned_to_gpu_nodes,
)
from tests.harness.controllers import eventually
from tests.harness.controlplane import ControlPlane, http_get, wait_until
from tests.harness.install import (
    CONFIGURATION,
    CONFIGURATION_KINDS,
    DEPLOY,
    NAMESPACE,
    Stream,
    ca_bundles,
    insecure_context,
    read_secret,
    submit_dry_run,
)
from tests.harness.node import condition
from tests.harness.session import namespace_name
from tests.harness.workloads import delete_all_pods
from webhook import __version__
from webhook.certs import files, tls
from webhook.processes.controllers import LEASE_NAME
from webhook.processes.serve_workers import auto_count, usable_cpus

from .conftest import DEFAULT_TOLERATION_SECONDS, PATIENCE, NodeCluster

AGENT_NAMESPACE = "gpuguard-node"
WEBHOOK_PORT = 8443  # deploy/'s containerPort `https`
AGENT_PORT = 8082  # deploy/node-agent/'s containerPort `http`
CONTROLLERS_PORT = 8081  # deploy/base/controllers.yaml's containerPort `http`
PART_OF = "app.kubernetes.io/part-of=gpuguard"  # the label deploy/'s kustomizations put on every object
# The name containerd knows gpuguard's image by (deploy/'s `image: gpuguard:<version>`), and a second tag.
IMAGE_REPOSITORY = "docker.io/library/gpuguard"
NEXT_TAG = f"{__version__}-next"
WEBHOOK_PODS = "app.kubernetes.io/name=gpuguard"
CONTROLLERS_PODS = "app.kubernetes.io/name=gpuguard-controllers"
AGENT_PODS = "app.kubernetes.io/name=gpuguard-node-agent"
CLUSTER_KINDS = (
    "mutatingwebhookconfigurations,validatingwebhookconfigurations,clusterroles,clusterrolebindings,"
    "priorityclasses,validatingadmissionpolicies,validatingadmissionpolicybindings,namespaces"
)


T = TypeVar("T")


def awaited(find: Callable[[], T | None], *, what: str, logs: Callable[[], str] | None = None) -> T:
    """What `find` returns once it returns something: the install's pods start on a loaded machine. On a
    timeout, `logs()` goes with the error."""
    found: list[T] = []

    def check() -> bool:
        value = find()
        if value is not None:
            found[:] = [value]
        return value is not None

    eventually(check, what=what, timeout=PATIENCE, logs=logs)
    return found[0]


def pods(plane: ControlPlane, namespace: str, selector: str) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = plane.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return listed


def ready(pod: dict[str, Any]) -> bool:
    state = condition(pod, "Ready")
    return (
        pod["metadata"].get("deletionTimestamp") is None and state is not None and state["status"] == "True"
    )


def ready_pods(plane: ControlPlane, namespace: str, selector: str, count: int) -> list[dict[str, Any]] | None:
    """The `count` Ready pods matching `selector`, when there are exactly that many and no others."""
    found = pods(plane, namespace, selector)
    return found if len(found) == count and all(ready(p) for p in found) else None


def served_certificate(pod: dict[str, Any]) -> x509.Certificate:
    """What a TLS handshake with the pod's own address gets."""
    with (
        socket.create_connection((pod["status"]["podIP"], WEBHOOK_PORT), timeout=5) as raw,
        insecure_context().wrap_socket(raw) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def admissions(pod: dict[str, Any]) -> float:
    """gpuguard_admission_requests_total of one webhook pod, read at its address."""
    status, body = http_get(WEBHOOK_PORT, "/metrics", insecure_context(), pod["status"]["podIP"])
    assert status == 200, f"/metrics of {pod['metadata']['name']} answered {status}"
    return sum(value for _, value in metric_samples(body.decode(), "gpuguard_admission_requests_total"))


@pytest.fixture(scope="module")
def installed(cluster: NodeCluster, gpuguard_image: str) -> Iterator[list[dict[str, Any]]]:
    """`kubectl apply -k deploy/` (the README's command) with the image on both nodes; yields the two
    webhook pods once both are Ready. Afterwards whatever is left of it goes (waited for), and the
    session's PriorityClasses (which deploy/ ships too, and its uninstall removes) are back."""
    plane = cluster.plane
    try:
        plane.kubectl("apply", "-k", str(DEPLOY))
        yield awaited(
            lambda: ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2), what="both webhook replicas Ready"
        )
    finally:
        uninstall(plane)  # before the next module, which may install gpuguard again (test_helm)
        install_priority_classes(plane, default_priority_classes())


def test_both_webhook_replicas_serve_the_one_certificate_they_bootstrapped(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    material = read_secret(cluster.plane)

    assert {pod["spec"]["nodeName"] for pod in installed} == set(cluster.nodes)  # one per node
    assert material.phase == "steady"
    assert len(material.cas) == 1
    logs = "".join(
        cluster.plane.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"]).stdout for pod in installed
    )
    assert logs.count("certificates: create") == 1  # one replica created the Secret, the other adopted it
    assert tls.covers(material.leaf, files.dns_names_for_service("gpuguard", NAMESPACE))
    for pod in installed:
        assert served_certificate(pod) == material.leaf, pod["metadata"]["name"]
    eventually(
        lambda: ca_bundles(cluster.plane) == {kind: material.cas for kind in CONFIGURATION_KINDS},
        what="caBundle of both configurations filled with the Secret's CA",
        timeout=PATIENCE,
    )


def test_pod_security_enforces_restricted_and_admits_gpuguards_pods(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    plane = cluster.plane
    labels = plane.kubectl_json("get", "namespace", NAMESPACE)["metadata"]["labels"]
    privileged = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "privileged", "namespace": NAMESPACE},
        "spec": {"containers": [{"name": "c", "image": "gpuguard", "securityContext": {"privileged": True}}]},
    }

    refused = plane.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(privileged), check=False
    )

    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
    # Admitted and running there under it: the webhook replicas, and the controllers.
    assert all(ready(pod) for pod in installed)
    awaited(lambda: ready_pods(plane, NAMESPACE, CONTROLLERS_PODS, 2), what="both controllers replicas Ready")


def test_a_gpu_job_is_mutated_through_the_service(
    cluster: NodeCluster, installed: list[dict[str, Any]], installed_namespace: str
) -> None:
    plane = cluster.plane
    job = gpu_job("train", installed_namespace)
    job["spec"]["suspend"] = True  # admission is the point: no pod
    calls_before = sum(admissions(pod) for pod in installed)

    dry_run = submit_dry_run(plane, job)
    plane.kubectl("apply", "-f", "-", input=json.dumps(job))
    stored = plane.kubectl_json("get", "job", "train", "-n", installed_namespace)

    assert dry_run.returncode == 0, dry_run.stderr
    for mutated in (json.loads(dry_run.stdout), stored):
        assert gpuguard_annotations(mutated)
        spec = mutated["spec"]
        assert {
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        } in spec["podFailurePolicy"]["rules"]
        template = spec["template"]["spec"]
        assert template["priorityClassName"] == "gpu-workload"
        readiness = {t["key"]: t["tolerationSeconds"] for t in template["tolerations"]}
        assert readiness == {"node.kubernetes.io/not-ready": 1800, "node.kubernetes.io/unreachable": 1800}
    # Both requests (dry run and apply) went to the replicas, each called once per webhook at least.
    assert sum(admissions(pod) for pod in installed) >= calls_before + 4


def test_a_default_priority_pod_bound_for_gpu_nodes_is_denied_through_the_service(
    cluster: NodeCluster, installed: list[dict[str, Any]], installed_namespace: str
) -> None:
    plane = cluster.plane
    crowder = pinned_to_gpu_nodes("crowder", installed_namespace)

    dry_run = submit_dry_run(plane, crowder)
    applied = plane.kubectl("apply", "-f", "-", input=json.dumps(crowder), check=False)

    for refused in (dry_run, applied):
        assert refused.returncode != 0
        assert 'admission webhook "validate.gpuguard.io" denied the request' in refused.stderr, refused.stderr
        assert "acceleratorNodeGuard" in refused.stderr
    assert plane.kubectl("get", "pod", "crowder", "-n", installed_namespace, check=False).returncode != 0
    # A GPU pod in the same namespace is admitted and mutated.
    admitted = submit_dry_run(plane, gpu_pod("trainer", installed_namespace))
    assert admitted.returncode == 0 and gpuguard_annotations(json.loads(admitted.stdout)), admitted.stderr


# --- every example and corpus workload, as the process-based e2e expects it (tests/e2e/test_corpus.py) -----


@dataclass(frozen=True)
class Source:
    """One example or corpus file, loaded and placed as the e2e does, as written for the batch."""

    path: Path
    written: Path
    docs: list[dict[str, Any]]  # without its Namespaces (created beforehand: a dry run creates none)

    def untouched(self, stored: dict[str, Any]) -> bool:
        """Whether the e2e expects `stored` as submitted: every document of an example is mutated; of a
        corpus file, every workload but those it lists as not accelerator workloads."""
        if self.path.parent == EXAMPLES:
            return False
        return stored["kind"] not in WORKLOAD_KINDS or key_of(stored) in NOT_ACCELERATOR_WORKLOADS.get(
            self.path.name, {}
        )


def batch(sources: list[Path], namespace: str, folder: Path) -> tuple[list[Source], list[dict[str, Any]]]:
    """Each source written, one file per source, into folder/apply, or folder/create when it uses
    generateName (which apply refuses; the e2e's submit_file does the same), or folder/denied when the
    e2e expects it denied (`kubectl apply` prints nothing of a batch with a refusal in it), named so that
    kubectl's walk of each folder keeps their order; and the Namespaces they create, as a list. Each
    source is placed in a namespace of its own, `namespace`-<index>, as the e2e gives each its own test
    (two corpus files both name a Pod pod1, and applied for real the second would patch the first)."""
    written, namespaces = [], []
    for index, path in enumerate(sources):
        docs = load(path)
        place(docs, f"{namespace}-{index:03d}")
        namespaces += [doc for doc in docs if doc["kind"] == "Namespace"]
        docs = [doc for doc in docs if doc["kind"] != "Namespace"]
        group = (
            "denied"
            if path.name in DENIED_EXAMPLES
            else "create"
            if any("generateName" in doc["metadata"] for doc in docs)
            else "apply"
        )
        target = folder / group / f"{index:03d}-{path.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        written.append(Source(path, target, docs))
    return written, namespaces


@dataclass(frozen=True)
class Prepared:
    created: list[str]  # the namespaces made for the batch, deleted after it
    labelled: list[str]  # the namespaces that were there already (the tier's gpu-operator), labelled for it


def prepare_for(plane: ControlPlane, sources: list[Source], namespaces: list[dict[str, Any]]) -> Prepared:
    """What the sources need to exist for real, as in the clusters they are written for: the namespaces
    they create or name (labelled so that only the installed gpuguard sees them; one the tier has already,
    such as gpu-operator where its device plugin runs, is labelled and never deleted), the ServiceAccounts
    their bare pods run as (ServiceAccount admission is on here, off in the e2e tier) and the
    PriorityClasses they name (first: gpuguard learns of a class through its watch)."""
    install_priority_classes(plane, CORPUS_PRIORITY_CLASSES)
    named = {
        doc["metadata"]["namespace"] for s in sources for doc in s.docs if "namespace" in doc["metadata"]
    }
    existing = {
        name.removeprefix("namespace/")
        for name in plane.kubectl("get", "namespaces", "-o", "name").stdout.split()
    }
    wanted = {ns["metadata"]["name"]: ns for ns in namespaces} | {
        name: {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}} for name in named
    }
    created = {name: ns for name, ns in wanted.items() if name not in existing}
    labelled = sorted(name for name in wanted.keys() & existing if name != "kube-system")
    for ns in created.values():
        ns["metadata"].setdefault("labels", {})[OWNER_LABEL] = "installed"
    accounts = {
        (doc["metadata"]["namespace"], doc["spec"].get("serviceAccountName") or "default")
        for s in sources
        for doc in s.docs
        if doc["kind"] == "Pod"
    }
    items = [
        *created.values(),
        *(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns}}
            for ns, name in sorted(accounts)
        ),
    ]
    plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    if labelled:
        plane.kubectl("label", "namespace", *labelled, f"{OWNER_LABEL}=installed", "--overwrite")
    return Prepared(sorted(created), labelled)


def pods_in(plane: ControlPlane, namespaces: list[str]) -> set[tuple[str, str]]:
    listed = plane.kubectl_json("get", "pods", "--all-namespaces")["items"]
    return {
        (p["metadata"]["namespace"], p["metadata"]["name"])
        for p in listed
        if p["metadata"]["namespace"] in namespaces
    }


def remove_batch(
    plane: ControlPlane,
    folder: Path,
    prepared: Prepared,
    stored: list[dict[str, Any]],
    pods_before: set[tuple[str, str]],  # those in the namespaces that were there (EXISTING_NAMESPACES)
) -> None:
    """What the batch left, gone before the next test: what it applied for real (by file, and the objects
    named by the server by their names: the corpus's device plugin DaemonSets in kube-system, a
    DeviceClass, a validator pod in gpu-operator), the namespaces made for it, the label on those that
    were there, the corpus's PriorityClasses, and every pod their controllers started (none starts a
    container here: their images are not on the nodes, which reach no registry), which hold fake GPUs
    until their objects are gone."""
    if (folder / "apply").is_dir():
        plane.kubectl(
            "delete", "-f", str(folder / "apply"), "--ignore-not-found", "--wait=false", check=False
        )
    for obj in stored:
        if obj["metadata"].get("generateName"):
            where = ["-n", obj["metadata"]["namespace"]] if "namespace" in obj["metadata"] else []
            plane.kubectl(
                "delete", obj["kind"], obj["metadata"]["name"], *where, "--ignore-not-found", check=False
            )
    if prepared.created:
        plane.kubectl("delete", "namespace", *prepared.created, "--wait=false", check=False)
    for namespace in prepared.created:  # a terminating namespace takes no new pod: these are the last
        delete_all_pods(plane, namespace)
    if prepared.labelled:
        plane.kubectl("label", "namespace", *prepared.labelled, f"{OWNER_LABEL}-", check=False)
    plane.kubectl("delete", "priorityclass", *CORPUS_PRIORITY_CLASSES, "--ignore-not-found", check=False)

    def gone() -> bool:
        namespaces = plane.kubectl(
            "get", "namespace", *prepared.created, "--ignore-not-found", "-o", "name"
        ).stdout
        return not namespaces.strip() and pods_in(plane, sorted(EXISTING_NAMESPACES)) <= pods_before

    eventually(gone, what="the batch's namespaces and pods gone", timeout=PATIENCE)


def submit_batch(
    plane: ControlPlane, folder: Path, dry_run: bool
) -> tuple[list[dict[str, Any]], dict[Path, str]]:
    """One kubectl call over each of the batch's folders, a server-side dry run or for real: the objects
    as stored (or as they would be), in the order of the folders and of the files in each (kubectl walks a
    folder in lexical order), and kubectl's errors by the file they name."""
    stored: list[dict[str, Any]] = []
    errors: dict[Path, str] = {}
    for group, verb in (("apply", "apply"), ("create", "create"), ("denied", "apply")):
        if not (folder / group).is_dir():
            continue
        dry = ["--dry-run=server"] if dry_run else []
        result = plane.kubectl(verb, *dry, "-o", "json", "-f", str(folder / group), check=False, timeout=180)
        stored += json_stream(result.stdout)
        last: Path | None = None  # a message of several lines names its file in the first
        for line in result.stderr.splitlines():
            if named := re.search(rf'"({re.escape(str(folder))}/[^"]+)"', line):
                last = Path(named[1])
            if last is not None:
                errors[last] = f"{errors.get(last, '')}{line}\n"
    return stored, errors


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "applied"])
def test_every_example_and_corpus_workload_is_mutated_or_denied_through_the_service_as_in_the_e2e(
    cluster: NodeCluster,
    installed: list[dict[str, Any]],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    dry_run: bool,
) -> None:
    """`kubectl apply` (and `create` for generateName) of every example and corpus workload through the
    installed Service, as a server-side dry run and for real, each source in a namespace of its own that
    only the installed gpuguard sees."""
    plane = cluster.plane
    namespace = namespace_name(request, "corpus")
    sources, namespaces = batch([*EXAMPLE_FILES, *corpus.FILES], namespace, tmp_path)
    pods_before = pods_in(plane, sorted(EXISTING_NAMESPACES))
    prepared = prepare_for(plane, sources, namespaces)
    stored: list[dict[str, Any]] = []
    try:
        stored, errors = submit_batch(plane, tmp_path, dry_run)
    finally:
        remove_batch(plane, tmp_path, prepared, stored, pods_before)

    denied = {s.written: s for s in sources if s.path.name in DENIED_EXAMPLES}
    assert set(errors) == set(denied), "\n".join(errors.values())
    for written, source in denied.items():
        assert 'admission webhook "validate.gpuguard.io" denied the request' in errors[written]
        assert DENIED_EXAMPLES[source.path.name] in errors[written], errors[written]
    in_order = sorted(sources, key=lambda s: (s.written.parent.name, s.written.name))  # as submit_batch sends
    admitted = [(s, doc) for s in in_order if s.written not in denied for doc in s.docs]
    assert [key_of(obj) for obj in stored] == [key_of(doc) for _, doc in admitted]
    assert admitted, "nothing was admitted, so nothing below would be checked"
    for (source, doc), obj in zip(admitted, stored, strict=True):
        if source.untouched(obj):
            assert_untouched(doc, obj, default_seconds=DEFAULT_TOLERATION_SECONDS)
        else:
            assert_mutated(obj)


def lease_holder(plane: ControlPlane) -> str | None:
    """Who holds the controllers' Lease (a pod's name: deploy/ gives each replica its own as identity)."""
    lease = plane.kubectl("get", "lease", LEASE_NAME, "-n", NAMESPACE, "-o", "json", check=False)
    return json.loads(lease.stdout)["spec"].get("holderIdentity") if lease.returncode == 0 else None


def test_the_controllers_elect_a_leader_among_their_pods(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    plane = cluster.plane
    controllers = awaited(
        lambda: ready_pods(plane, NAMESPACE, CONTROLLERS_PODS, 2), what="both controllers replicas Ready"
    )

    leader = awaited(lambda: lease_holder(plane), what="the controllers' Lease held")

    assert leader in {pod["metadata"]["name"] for pod in controllers}


def test_the_node_agent_runs_on_each_gpu_node(cluster: NodeCluster, installed: list[dict[str, Any]]) -> None:
    plane = cluster.plane

    agents = awaited(
        lambda: ready_pods(plane, AGENT_NAMESPACE, AGENT_PODS, len(cluster.nodes)),
        what="a Ready node agent pod on each node",
    )

    assert sorted(pod["spec"]["nodeName"] for pod in agents) == sorted(cluster.nodes)
    labels = plane.kubectl_json("get", "namespace", AGENT_NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def cpus(quantity: str) -> float:
    """A CPU quantity as a manifest writes it ("1", "1.5", "500m"), in CPUs."""
    return int(quantity.removesuffix("m")) / 1000 if quantity.endswith("m") else float(quantity)


def test_each_webhook_replica_runs_as_many_workers_as_its_containers_cpu_limit_makes(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    plane = cluster.plane
    container = plane.kubectl_json("get", "deployment", "gpuguard", "-n", NAMESPACE)["spec"]["template"][
        "spec"
    ]["containers"][0]
    # The containers get every CPU of the machine (no CPU manager policy here), as this process does: what
    # `--workers=auto` would make of no limit at all (2 workers on the 2-core machine, against 1 for
    # deploy/'s limit of 1 CPU).
    expected = auto_count(cpus(container["resources"]["limits"]["cpu"]), usable_cpus())

    counts = {}
    for pod in installed:
        log = plane.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"]).stdout
        serving = re.search(r"gpuguard: serving https://\S+ \((\d+) workers?\)", log)
        assert serving, f"{pod['metadata']['name']} never said how many workers it runs:\n{log}"
        counts[pod["metadata"]["name"]] = int(serving[1])

    assert "--workers=auto" in container["args"]
    assert set(counts.values()) == {expected}, counts


def test_each_node_agent_pod_reads_its_kubelets_pod_resources_socket(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    plane = cluster.plane
    try:
        agents = awaited(
            lambda: ready_pods(plane, AGENT_NAMESPACE, AGENT_PODS, len(cluster.nodes)),
            what="a Ready node agent pod on each node",
        )
    except TimeoutError as exc:  # with how their containers last ended
        ended = {
            pod["metadata"]["name"]: [
                s.get("lastState") for s in pod["status"].get("containerStatuses") or []
            ]
            for pod in pods(plane, AGENT_NAMESPACE, AGENT_PODS)
        }
        raise TimeoutError(f"{exc}: {ended}") from None

    for pod in agents:
        address, name = pod["status"]["podIP"], pod["metadata"]["name"]
        status, body = http_get(AGENT_PORT, "/policy", host=address)
        assert status == 200, f"/policy of {name} answered {status}"
        report = json.loads(body)
        status, body = http_get(AGENT_PORT, "/metrics", host=address)
        assert status == 200, f"/metrics of {name} answered {status}"
        polls = {
            labels["outcome"]: value
            for labels, value in metric_samples(body.decode(), "gpuguard_node_agent_polls_total")
        }

        assert report["node"] == pod["spec"]["nodeName"], report
        assert report["socket"] == "/var/lib/kubelet/pod-resources/kubelet.sock"  # through the hostPath
        assert report["lastPollOk"] is True, report  # List and GetAllocatableResources both answered
        assert polls.get("ok", 0) >= 1 and not polls.get("error"), polls


# --- operations under a steady stream of GPU pods, with failurePolicy Fail ---------------------------------


def expect_no_loss(stream: Stream) -> None:
    """Every GPU pod of the stream came back admitted and mutated by gpuguard."""
    outcomes = stream.outcomes
    failures = [o.detail for o in outcomes if not o.ok]
    assert not failures, f"{len(failures)} of {len(outcomes)} requests failed, first: {failures[0]}"


def more_requests(stream: Stream, count: int = 10) -> None:
    """Waits until `count` requests more went through, so that the stream ran on after what happened."""
    moment = time.monotonic()
    wait_until(lambda: stream.count_after(moment) >= count, timeout=PATIENCE, what=f"{count} requests more")
    assert stream.thread.is_alive(), "the stream stopped early"


@pytest.fixture(scope="module")
def fail_closed(cluster: NodeCluster, installed: list[dict[str, Any]]) -> None:
    """deploy/fail-closed/ applied over the install: a webhook that cannot answer refuses the pod."""
    cluster.plane.kubectl("apply", "-k", str(DEPLOY / "fail-closed"))
    for kind in CONFIGURATION_KINDS:
        webhook = cluster.plane.kubectl_json("get", kind, CONFIGURATION)["webhooks"][0]
        assert webhook["failurePolicy"] == "Fail"


def test_a_rolling_update_to_another_tag_under_a_stream_of_gpu_pods_loses_none(
    cluster: NodeCluster, installed: list[dict[str, Any]], fail_closed: None, installed_namespace: str
) -> None:
    plane = cluster.plane
    for node in cluster.nodes.values():  # the same image under a second tag: a new template all the same
        node.ctr("images", "tag", f"{IMAGE_REPOSITORY}:{__version__}", f"{IMAGE_REPOSITORY}:{NEXT_TAG}")
    before = {pod["metadata"]["name"] for pod in pods(plane, NAMESPACE, WEBHOOK_PODS)}

    with Stream(plane, installed_namespace) as stream:
        wait_until(lambda: stream.count_after(0) >= 5, timeout=PATIENCE, what="the stream under way")
        plane.kubectl("set", "image", "deployment/gpuguard", f"gpuguard=gpuguard:{NEXT_TAG}", "-n", NAMESPACE)
        plane.kubectl(
            "rollout",
            "status",
            "deployment/gpuguard",
            "-n",
            NAMESPACE,
            f"--timeout={PATIENCE:.0f}s",
            timeout=PATIENCE + 30,
        )
        more_requests(stream)

    expect_no_loss(stream)
    after = awaited(lambda: ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2), what="the new replicas alone")
    assert not before & {pod["metadata"]["name"] for pod in after}
    assert {pod["spec"]["containers"][0]["image"] for pod in after} == {f"gpuguard:{NEXT_TAG}"}


def test_deleting_a_webhook_pod_under_a_stream_of_gpu_pods_loses_none(
    cluster: NodeCluster, installed: list[dict[str, Any]], fail_closed: None, installed_namespace: str
) -> None:
    plane = cluster.plane
    victim = pods(plane, NAMESPACE, WEBHOOK_PODS)[0]["metadata"]["name"]

    with Stream(plane, installed_namespace) as stream:
        wait_until(lambda: stream.count_after(0) >= 5, timeout=PATIENCE, what="the stream under way")
        plane.kubectl("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")
        replaced = awaited(
            lambda: ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2),
            what="the deleted replica replaced and gone",
        )
        more_requests(stream)

    expect_no_loss(stream)
    assert victim not in {pod["metadata"]["name"] for pod in replaced}


def test_the_disruption_budget_blocks_a_drain_that_would_take_both_replicas(
    cluster: NodeCluster, installed: list[dict[str, Any]], fail_closed: None, installed_namespace: str
) -> None:
    plane = cluster.plane
    nodes = sorted(cluster.nodes)
    plane.kubectl("cordon", *nodes)  # so an evicted replica's replacement has nowhere to go
    try:
        drain = plane.kubectl(
            "drain",
            *nodes,
            f"--pod-selector={WEBHOOK_PODS}",
            "--delete-emptydir-data",  # the replicas' in-memory certificate folder, as any drain of them needs
            "--timeout=30s",
            check=False,
            timeout=120,
        )
        standing = [pod for pod in pods(plane, NAMESPACE, WEBHOOK_PODS) if ready(pod)]
        admitted = submit_dry_run(plane, gpu_pod("during-drain", installed_namespace))
    finally:
        plane.kubectl("uncordon", *nodes)

    assert drain.returncode != 0
    assert "Cannot evict pod as it would violate the pod's disruption budget" in drain.stderr, drain.stderr
    assert len(standing) == 1  # one evicted, the other kept by the budget, still serving
    assert admitted.returncode == 0 and gpuguard_annotations(json.loads(admitted.stdout)), admitted.stderr
    awaited(lambda: ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2), what="both replicas back once uncordoned")


def leftovers(plane: ControlPlane) -> list[str]:
    """gpuguard's objects still in the cluster: anything labelled part of it, the webhook configurations
    and the node agent's admission policy by name, its namespaces."""
    labelled = plane.kubectl("get", CLUSTER_KINDS, "-l", PART_OF, "-o", "name").stdout.split()
    named = plane.kubectl(
        "get",
        ",".join(CONFIGURATION_KINDS),
        CONFIGURATION,
        "--ignore-not-found",
        "-o",
        "name",
    ).stdout.split()
    spaces = plane.kubectl(
        "get", "namespace", NAMESPACE, AGENT_NAMESPACE, "--ignore-not-found", "-o", "name"
    ).stdout.split()
    return sorted({*labelled, *named, *spaces})


def uninstall(plane: ControlPlane) -> None:
    """Whatever deploy/ has in the cluster deleted, and gone: namespaces included."""
    plane.kubectl("delete", "-k", str(DEPLOY), "--ignore-not-found", "--wait=false")
    eventually(lambda: not leftovers(plane), what="nothing of gpuguard left", timeout=PATIENCE)


def test_deleting_deploy_leaves_nothing_of_gpuguard(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    plane = cluster.plane
    assert leftovers(plane)  # installed, to begin with

    plane.kubectl("delete", "-k", str(DEPLOY), "--wait=false")

    eventually(lambda: not leftovers(plane), what="nothing of gpuguard left", timeout=PATIENCE)
    assert not plane.kubectl("get", "pods", "-A", "-l", PART_OF, "-o", "name").stdout.split()
