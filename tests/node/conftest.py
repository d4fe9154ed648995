"""The node tier's fixtures: a control plane with kube-controller-manager and kube-scheduler, two
real nodes (kubelet + containerd) with a fake GPU device plugin each, and gpuguard's real webhook
registered with the API server; for the modules that ask for them (`responders`), gpuguard's
controllers and node agents with a policy of the tier's own. Where a node cannot run (no root, no
mount namespaces), every test here is skipped with the reason, and the session summary says the
tier did not run."""

from __future__ import annotations

import functools
import json
import secrets
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO_ROOT
from tests.harness.admission import (
    OWNER_LABEL,
    WebhookProcess,
    default_priority_classes,
    install_priority_classes,
    register,
    unregister,
    wait_until_called,
)
from tests.harness.chart import Helm, build_helm
from tests.harness.controllers import (
    NAMESPACE,
    PLUGIN_NAMESPACE,
    SERVICE_ACCOUNT,
    ControllersProcess,
    eventually,
    fast_policy,
    install_service_account,
    service_account_kubeconfig,
    taints,
)
from tests.harness.controlplane import CONTROLLERS, ControlPlane, log_tail
from tests.harness.device_plugin import HEALTHY, FakeDevicePlugin
from tests.harness.images import build_images
from tests.harness.kubelet_api import KubeletApis, compile_apis
from tests.harness.node import (
    GATEWAY,
    KUBERNETES_SERVICE_IP,
    Node,
    NodeBinaries,
    TierNetwork,
    host_state,
    node_tier_unavailable,
    reclaim_leftovers,
)
from tests.harness.responders import (
    AGENT_CONFIRM_SECONDS,
    AGENT_INTERVAL_SECONDS,
    AGENT_NAMESPACE,
    AGENT_SERVICE_ACCOUNT,
    REACTION_SECONDS,
    AgentProcess,
    Responders,
    plugin_daemonset,
    plugin_pod,
    pod_ready,
)
from tests.harness.session import (
    announce,
    build_control_plane,
    namespace_name,
    run_build_script,
)
from tests.harness.suite import add_summary, summary_fixture, summary_lines
from tests.harness.workloads import GPU, allocatable, delete_all_pods
from webhook import __version__
from webhook.policy.health import observed

HERE = Path(__file__).resolve().parent
RUNTIME_BUILD_SCRIPT = REPO_ROOT / "tests" / "controlplane" / "runtime" / "build.sh"
IMAGE_BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-image"
# What the `kubernetes` Service's ClusterIP is called in the API server's serving certificate, besides it.
KUBERNETES_SERVICE_NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc")
CACHE = REPO_ROOT / ".cache"
TIER = "node tier"
IMAGE = f"gpuguard:{__version__}"  # deploy/'s `image:` (kustomization images: newTag)
CLUSTER_KEY = pytest.StashKey["NodeCluster"]()
NODE_NAMES = ("node-a", "node-b")
GPU_NODE_LABELS = {"nvidia.com/gpu.present": "true"}  # what GPU feature discovery labels a GPU node
DEVICES_PER_NODE = 4
# Compressed timings, so that a node which stops reporting is tainted and its pods evicted within
# seconds instead of minutes. The kubelets renew their Lease every LEASE_SECONDS / 4.
LEASE_SECONDS = 8
NODE_MONITOR_GRACE_SECONDS = 12
# kube-apiserver's --default-{not-ready,unreachable}-toleration-seconds here (300 in production),
# and so what gpuguard's policy must recognise as the API server's default.
DEFAULT_TOLERATION_SECONDS = 10
UNGUARDED_NAMESPACE = "node-tier-unguarded"  # gpuguard's policy turns itself off there
PRE_STOP_SECONDS = 5
GRACE_SECONDS = 30
DEVICE_FAILURE_EXIT_CODE = 74
NON_RETRIABLE_EXIT_CODE = 3
POLICY = f"""
rules:
  readinessTolerations:
    apiServerDefaultSeconds: {DEFAULT_TOLERATION_SECONDS}
    servingSeconds: 600
    batchSeconds: 1800
  podFailurePolicy:
    deviceFailureExitCodes: [{DEVICE_FAILURE_EXIT_CODE}, 75]
    # Not the default (Count): a Job whose only failure is a device failure then still completes
    # with backoffLimit 0, which only the injected podFailurePolicy can explain.
    deviceFailureAction: Ignore
    nonRetriableExitCodes: [{NON_RETRIABLE_EXIT_CODE}]
  gracefulTermination:
    preStop:
      action: sleep
      seconds: {PRE_STOP_SECONDS}
    minGracePeriodSeconds: {GRACE_SECONDS}
    marginSeconds: 10
namespaces:
  - names: [{UNGUARDED_NAMESPACE}]
    mode: "off"
"""
# The controllers' policy (`responders`): every action enforced on the tier's nodes, with waits of
# seconds. A device gap or a plugin pod not Ready must outlast two of the kubelets' status updates
# (Node.status_update_seconds: a plugin restart can show allocatable 0 in one); capacity 0 waits
# longer than a kubelet restart takes to get its plugin back.
SIGNAL_SECONDS = 4
CAPACITY_VANISHED_SECONDS = 10
RECOVERY_SECONDS = 4
# How long a test watches for a write that must not come: the longest wait of the policy or the
# agents' (a poll, then the confirmation), and gpuguard's reaction.
QUIET_SECONDS = (
    max(SIGNAL_SECONDS, CAPACITY_VANISHED_SECONDS, AGENT_INTERVAL_SECONDS + AGENT_CONFIRM_SECONDS)
    + REACTION_SECONDS
)
# The device-failure chain waits on real processes on a loaded machine: generous, never a timing assertion.
PATIENCE = 120.0
TAINT = f"{observed.TAINT_KEY}:NoSchedule"


def responders_policy() -> dict[str, Any]:
    policy = fast_policy(
        "node-tier",
        signals={
            "deviceGap": {"forSeconds": SIGNAL_SECONDS},
            "devicePlugin": {
                "notReadyForSeconds": SIGNAL_SECONDS,
                "capacityVanishedForSeconds": CAPACITY_VANISHED_SECONDS,
            },
            "podDeviceHealth": {"unknownForSeconds": SIGNAL_SECONDS},
        },
        recovery={"afterSeconds": RECOVERY_SECONDS},
    )
    policy["health"]["nodeSelector"] = {"matchLabels": GPU_NODE_LABELS}  # both real nodes, nothing else
    return policy


@dataclass
class NodeCluster:
    plane: ControlPlane
    gpuguard: WebhookProcess
    apis: KubeletApis
    network: TierNetwork
    host_before: dict[str, Any]  # node.host_state() before the first node started
    # gpuguard's image built from the Dockerfile (an OCI archive), when a test of the session needs it.
    image_archive: Path | None
    helm_binary: Path | None  # Helm, when a test of the session needs it (`helm`)
    nodes: dict[str, Node] = field(default_factory=dict)
    plugins: dict[str, FakeDevicePlugin] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


# The modules that install gpuguard as pods, in their order: they run last, because uninstalling removes
# deploy/'s namespaces and RBAC, which the session's `accounts` put there for gpuguard's processes.
INSTALLING_MODULES = ("test_install.py", "test_device_failure_installed.py", "test_helm.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.node)

    def installing_last(item: pytest.Item) -> int:
        installing = item.path.is_relative_to(HERE) and item.path.name in INSTALLING_MODULES
        return 1 + INSTALLING_MODULES.index(item.path.name) if installing else 0

    items.sort(key=installing_last)  # stable: everything else keeps its order


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    for line in summary_lines(config, TIER):
        terminalreporter.write_line(f"{TIER}: {line}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    cluster = item.config.stash.get(CLUSTER_KEY, None)
    if report.failed and cluster is not None and item.path.is_relative_to(HERE):
        # The kubelets' and containerd's last words, the control plane's last kubectl calls.
        for node in cluster.nodes.values():
            report.sections.append((f"{node.name} logs", node.log_tails()))
        report.sections.append(("last kubectl calls", "\n".join(str(c) for c in cluster.plane.history)))
        report.sections.append(("kube-controller-manager", log_tail(cluster.plane.controller_manager_log)))
    return report


@pytest.fixture(scope="session")
def cluster(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[NodeCluster]:
    """The node tier's cluster, shared by its tests, in the tier's own network namespace (node.TierNetwork),
    entered once everything the session needs is built; torn down to nothing at the end (a teardown that
    leaves a process, cgroup, mount or socket behind, or changes the host, fails the session)."""
    unavailable = node_tier_unavailable()
    if unavailable is not None:
        add_summary(pytestconfig, TIER, f"not run: {unavailable}")
        pytest.skip(f"node tier not run: {unavailable}")
    begin = time.monotonic()
    if reclaimed := reclaim_leftovers():
        add_summary(pytestconfig, TIER, f"reclaimed what killed sessions left: {', '.join(reclaimed)}")
    k8s_bin = build_control_plane(pytestconfig)
    runtime_bin = run_build_script(pytestconfig, RUNTIME_BUILD_SCRIPT)
    apis = compile_apis(CACHE / "kubelet-api")
    images = build_images(runtime_bin, tmp_path_factory.mktemp("images"))

    # Only when a test asks for it: a change to webhook/ builds the image again (minutes).
    def needed(fixture: str) -> bool:
        return any(fixture in getattr(item, "fixturenames", ()) for item in request.session.items)

    image_archive = run_build_script(pytestconfig, IMAGE_BUILD_SCRIPT) if needed("gpuguard_image") else None
    helm_binary = build_helm() if needed("helm") else None
    setup_seconds = time.monotonic() - begin
    host_before = host_state()

    network = TierNetwork()
    network.enter()
    problems: list[str] = []
    try:
        plane = ControlPlane.start(
            k8s_bin,
            tmp_path_factory.mktemp("controlplane"),
            apiserver_flags={
                "authorization-mode": "Node,RBAC",
                # ServiceAccount admission too (the e2e tier's control plane has it off): pods get their
                # account's token, gpuguard's pods authenticate with it.
                "enable-admission-plugins": "NodeRestriction,ServiceAccount",
                "disable-admission-plugins": "",
                # Webhook Services are called at their endpoints: no kube-proxy (node.TierNetwork).
                "enable-aggregator-routing": "true",
                "default-not-ready-toleration-seconds": str(DEFAULT_TOLERATION_SECONDS),
                "default-unreachable-toleration-seconds": str(DEFAULT_TOLERATION_SECONDS),
            },
            address=GATEWAY,
            serving_sans=[KUBERNETES_SERVICE_IP, *KUBERNETES_SERVICE_NAMES],
        )
    except BaseException:
        network.leave()
        raise
    network.route_kubernetes_service(plane.port)
    gpuguard = WebhookProcess(tmp_path_factory.mktemp("gpuguard"))
    state = NodeCluster(plane, gpuguard, apis, network, host_before, image_archive, helm_binary)
    pytestconfig.stash[CLUSTER_KEY] = state
    try:
        plane.start_controller_manager(
            # The device plugin's pods; DRA: claims from pods' templates, pods on NoExecute-tainted devices.
            # Service endpoints (for the API server's calls to webhook Services) and every namespace's
            # kube-root-ca.crt (in each pod's token volume): for gpuguard's own pods.
            controllers=(
                *CONTROLLERS,
                "daemonset-controller",
                "resource-claim-controller",
                "device-taint-eviction-controller",
                "endpointslice-controller",
                "root-ca-certificate-publisher-controller",
            ),
            node_monitor_period=1,
            node_monitor_grace_period=NODE_MONITOR_GRACE_SECONDS,
            node_startup_grace_period=30,
        )
        plane.start_scheduler()
        policy = tmp_path_factory.mktemp("policy") / "policy.yaml"
        policy.write_text(POLICY)
        gpuguard.start(policy)
        install_priority_classes(plane, default_priority_classes())
        register(plane, gpuguard)
        wait_until_called(plane)
        control_plane_seconds = time.monotonic() - begin - setup_seconds

        binaries = NodeBinaries(kubelet=k8s_bin / "kubelet", runtime=runtime_bin)
        for index, name in enumerate(NODE_NAMES):
            node = Node(
                name,
                index,
                plane,
                binaries,
                tmp_path_factory.mktemp(name),
                images,
                labels=GPU_NODE_LABELS,
                lease_seconds=LEASE_SECONDS,
            )
            state.nodes[name] = node
            node.start()
            plugin = FakeDevicePlugin(
                apis, node.device_plugin_dir, GPU, [f"gpu-{name[-1]}{i}" for i in range(DEVICES_PER_NODE)]
            )
            state.plugins[name] = plugin
            plugin.start()
        for node in state.nodes.values():
            node.wait_for(functools.partial(all_devices_allocatable, node), what="fake GPUs allocatable")
        nodes_seconds = time.monotonic() - begin - setup_seconds - control_plane_seconds
        state.timings.update(setup=setup_seconds, control_plane=control_plane_seconds, nodes=nodes_seconds)
        message = (
            f"{len(state.nodes)} nodes with {DEVICES_PER_NODE} fake GPUs each ready in {nodes_seconds:.1f} s "
            f"(binaries, APIs and images {setup_seconds:.1f} s, control plane + gpuguard {control_plane_seconds:.1f} s)"
        )
        announce(pytestconfig, f"{TIER}: {message}")
        add_summary(pytestconfig, TIER, message)
        yield state
    finally:
        teardown_begin = time.monotonic()
        for plugin in state.plugins.values():
            plugin.stop()
        for node in state.nodes.values():
            problems += [f"{node.name}: {problem}" for problem in node.stop()]
        gpuguard.stop()
        if plane.running:
            unregister(plane)
        plane.stop()
        network.leave()
        if changed := host_changes(state.host_before, host_state()):
            problems.append(f"the host changed: {changed}")
        add_summary(pytestconfig, TIER, f"teardown in {time.monotonic() - teardown_begin:.1f} s")
    assert not problems, f"the node tier's teardown left things behind: {problems}"


def host_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {key: (before[key], after[key]) for key in before if before[key] != after[key]}


def all_devices_allocatable(node: Node) -> bool:
    return allocatable(node.node(), GPU) == DEVICES_PER_NODE


def restore_health(cluster: NodeCluster, name: str) -> None:
    """Every device of node `name` healthy again, the ones its plugin started with (it restarts with
    them if it was restarted with others), and its allocatable back to all of them."""
    plugin, node = cluster.plugins[name], cluster.nodes[name]
    if set(plugin.health()) != set(plugin.device_ids):
        plugin.restart()
    for device in plugin.health():
        plugin.set_health(device, HEALTHY)
    node.wait_for(
        functools.partial(all_devices_allocatable, node), what=f"every GPU of {name} allocatable again"
    )


@pytest.fixture(scope="session")
def gpuguard_image(cluster: NodeCluster) -> str:
    """gpuguard's image built from the Dockerfile (scripts/build-image, before the tier's network was
    entered), imported into every node's containerd; its name as deploy/ has it."""
    assert cluster.image_archive is not None, "built for every session with a test that asks for it"
    for node in cluster.nodes.values():
        node.ctr("images", "import", "--local", str(cluster.image_archive))
    return IMAGE


@pytest.fixture(scope="session")
def helm(cluster: NodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """Helm (built before the tier's network was entered) on the tier's API server, its homes in a test folder."""
    assert cluster.helm_binary is not None, "built for every session with a test that asks for it"
    return Helm(cluster.helm_binary, tmp_path_factory.mktemp("helm"), cluster.plane.kubeconfig)


@pytest.fixture(scope="module")
def installed_namespace(cluster: NodeCluster) -> Iterator[str]:
    """A namespace for workloads only gpuguard installed as pods sees: the session's own gpuguard leaves
    it alone (admission.OWNER_LABEL)."""
    name = f"installed-{secrets.token_hex(3)}"
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {OWNER_LABEL: "installed"}},
    }
    cluster.plane.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    yield name
    cluster.plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def kubelets_back(cluster: NodeCluster) -> Iterator[None]:
    """Whatever happens in the test, every node's kubelet runs again afterwards."""
    yield
    for node in cluster.nodes.values():
        if not node.kubelet_running:
            node.start_kubelet()


@pytest.fixture
def namespace_labels() -> dict[str, str]:
    """The labels `namespace` is created with: none, unless a module says otherwise (OWNER_LABEL
    "installed", for workloads only gpuguard installed as pods sees)."""
    return {}


@pytest.fixture
def namespace(
    cluster: NodeCluster, request: pytest.FixtureRequest, namespace_labels: dict[str, str]
) -> Iterator[str]:
    """A fresh namespace per test, with `namespace_labels` from its creation on (a webhook's namespace
    selector must never see it without them). Afterwards its pods are deleted at once (not after their
    grace periods) so the next test finds every fake GPU free, and the namespace controller removes it."""
    name = namespace_name(request, "node")
    metadata = {"name": name, "labels": namespace_labels}
    cluster.plane.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": metadata})
    )
    yield name
    delete_all_pods(cluster.plane, name)
    cluster.plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@dataclass(frozen=True)
class Accounts:
    controllers: Path  # a kubeconfig for gpuguard-controllers
    agent: Path  # and one for gpuguard-node-agent


@pytest.fixture(scope="session")
def device_plugin_pods(cluster: NodeCluster) -> None:
    """The device plugin's pods, Ready on every node (responders.plugin_daemonset), in the GPU operator's
    namespace."""
    plane = cluster.plane
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PLUGIN_NAMESPACE}}
    plane.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    plane.kubectl("apply", "-f", "-", input=json.dumps(plugin_daemonset(GPU_NODE_LABELS)))
    for name, node in cluster.nodes.items():
        node.wait_for(
            functools.partial(lambda name: pod_ready(plugin_pod(plane, name)), name),
            what="the device plugin's pod Ready",
        )


@pytest.fixture(scope="session")
def accounts(
    cluster: NodeCluster, device_plugin_pods: None, tmp_path_factory: pytest.TempPathFactory
) -> Accounts:
    """deploy/'s ServiceAccounts of the controllers and of the node agent with their rights, a
    kubeconfig each; and the device plugin's pods they read (`device_plugin_pods`)."""
    plane = cluster.plane
    install_service_account(plane, SERVICE_ACCOUNT)
    install_service_account(plane, AGENT_SERVICE_ACCOUNT)
    workdir = tmp_path_factory.mktemp("accounts")
    return Accounts(
        service_account_kubeconfig(plane, workdir / "controllers.kubeconfig"),
        service_account_kubeconfig(
            plane, workdir / "agent.kubeconfig", AGENT_SERVICE_ACCOUNT, AGENT_NAMESPACE
        ),
    )


@pytest.fixture(scope="module")
def responders(
    cluster: NodeCluster, accounts: Accounts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Responders]:
    """gpuguard's controllers (responders_policy) and a node agent per node, as their deploy/
    ServiceAccounts, for the tests of one module: the other node tests flip device health and expect
    nobody to act."""
    workdir = tmp_path_factory.mktemp("responders")
    controllers = ControllersProcess(
        workdir / "controllers", accounts.controllers, responders_policy(), identity="a"
    )
    agents = {
        name: AgentProcess(workdir, accounts.agent, name, node.pod_resources_socket)
        for name, node in cluster.nodes.items()
    }
    started = Responders(controllers, agents)
    try:
        controllers.start()
        controllers.wait_ready()
        controllers.wait_leading()
        for agent in agents.values():
            agent.start()
        eventually(lambda: all(a.ready() for a in agents.values()), what="every node agent ready")
        yield started
    finally:
        controllers.stop()
        for agent in agents.values():
            agent.stop()
        cluster.plane.kubectl(
            "delete", "configmap", "gpuguard-remediation", "-n", NAMESPACE, "--ignore-not-found"
        )


@pytest.fixture
def healthy_again(cluster: NodeCluster, responders: Responders) -> Iterator[None]:
    """After the test: every node's devices as its plugin started with them, healthy, and gpuguard's
    taint gone again (the controllers undo it)."""
    yield
    for name in cluster.nodes:
        restore_health(cluster, name)
        untainted(cluster, responders, name)


def untainted(cluster: NodeCluster, responders: Responders, name: str) -> None:
    eventually(
        lambda: TAINT not in taints(cluster.plane, name),
        what=f"gpuguard's taint removed from {name} on recovery",
        timeout=PATIENCE,
        logs=responders.logs,
    )


summary = summary_fixture(TIER)
