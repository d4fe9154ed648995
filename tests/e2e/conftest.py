"""End-to-end fixtures: a real kube-apiserver + etcd, and the real gpuguard server registered with it."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from controlplane import ControlPlane, log_tail
from webhook_harness import (
    REPO_ROOT,
    WebhookProcess,
    default_priority_classes,
    install_priority_classes,
    register,
    unregister,
    wait_until_called,
)

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = REPO_ROOT / "tests" / "controlplane" / "build.sh"
CONTROL_PLANE_KEY = pytest.StashKey[ControlPlane]()
WEBHOOK_KEY = pytest.StashKey[WebhookProcess]()


def _announce(config: pytest.Config, message: str) -> None:
    """Writes straight to the terminal, even with output capture on and under -q."""
    reporter: pytest.TerminalReporter | None = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(message, file=sys.stderr)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(message)


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


def _build_control_plane(config: pytest.Config) -> Path:
    # No-op once the binaries are cached; a cold build takes about 10 min, so let its progress through.
    capture = config.pluginmanager.get_plugin("capturemanager")
    assert capture is not None
    with capture.global_and_fixture_disabled():
        result = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    if result.returncode != 0:
        pytest.fail(f"{BUILD_SCRIPT} failed with exit code {result.returncode}", pytrace=False)
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def control_plane(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    bin_dir = _build_control_plane(pytestconfig)
    plane = ControlPlane.start(bin_dir, tmp_path_factory.mktemp("controlplane"))
    try:
        pytestconfig.stash[CONTROL_PLANE_KEY] = plane
        _announce(
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
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"{stem or 'e2e'}-{secrets.token_hex(3)}"
    control_plane.kubectl("create", "namespace", name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)
