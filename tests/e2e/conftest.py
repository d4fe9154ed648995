"""End-to-end fixtures: a real kube-apiserver + etcd, and the real gpuguard server registered with it."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.harness.admission import (
    WebhookProcess,
    default_priority_classes,
    install_priority_classes,
    register,
    unregister,
    wait_until_called,
)
from tests.harness.controlplane import ControlPlane, log_tail
from tests.harness.session import (
    announce,
    build_control_plane,
    namespace_name,
)
from tests.harness.suite import summary_fixture, summary_lines

HERE = Path(__file__).resolve().parent
CONTROL_PLANE_KEY = pytest.StashKey[ControlPlane]()
WEBHOOK_KEY = pytest.StashKey[WebhookProcess]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    plane = config.stash.get(CONTROL_PLANE_KEY, None)
    if plane is not None:
        terminalreporter.write_line(
            f"e2e: ran against Kubernetes {plane.version} (etcd {plane.etcd_version}), "
            f"control plane started in {plane.startup_seconds:.1f} s"
        )
    for line in summary_lines(config, "e2e"):
        terminalreporter.write_line(f"e2e: {line}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and report.when in ("setup", "call"):
        # Attach what a failure needs to be understood without re-running: the last kubectl calls and
        # the tail of gpuguard's JSON log. From the stash, so a failing fixture setup is explained too.
        plane = item.config.stash.get(CONTROL_PLANE_KEY, None)
        if plane is not None and plane.history:
            report.sections.append(("last kubectl calls", "\n".join(str(c) for c in plane.history)))
        webhook = item.config.stash.get(WEBHOOK_KEY, None)
        if webhook is not None and "gpuguard" in getattr(item, "fixturenames", ()):
            report.sections.append((f"gpuguard log ({webhook.log_path})", log_tail(webhook.log_path)))
    return report


@pytest.fixture(scope="session")
def k8s_bin(pytestconfig: pytest.Config) -> Path:
    """The folder of the Go-built Kubernetes binaries and etcd."""
    return build_control_plane(pytestconfig)


@pytest.fixture(scope="session")
def control_plane(
    k8s_bin: Path, pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    plane = ControlPlane.start(k8s_bin, tmp_path_factory.mktemp("controlplane"))
    try:
        pytestconfig.stash[CONTROL_PLANE_KEY] = plane
        announce(
            pytestconfig,
            f"e2e: Kubernetes {plane.version} control plane ready in {plane.startup_seconds:.1f} s",
        )
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def gpuguard(
    control_plane: ControlPlane, pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WebhookProcess]:
    """gpuguard with its default policy, registered with failurePolicy Fail and proven to be called.

    Tests that restart it with another policy or stop it must bring it back with `restart(None)`.
    """
    webhook = WebhookProcess(tmp_path_factory.mktemp("gpuguard"))
    pytestconfig.stash[WEBHOOK_KEY] = webhook
    try:
        webhook.start()
        install_priority_classes(control_plane, default_priority_classes())
        register(control_plane, webhook)
        wait_until_called(control_plane)
        yield webhook
    finally:
        webhook.stop()
        if control_plane.running:
            unregister(control_plane)


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test. Deletion is fire-and-forget: without kube-controller-manager a
    namespace stays Terminating forever."""
    name = namespace_name(request, "e2e")
    control_plane.kubectl("create", "namespace", name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


summary = summary_fixture("e2e")
