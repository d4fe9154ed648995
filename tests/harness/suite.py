"""The suite's own pytest plugin (loaded with `-p tests.harness.suite`, pyproject.toml): what every run says
about itself, the Kubernetes version the end-to-end tests use and whether the shared corpus is there
(its tests run, or are skipped and counted), and `summary`, the figures a test measures, printed at the
end of the run (each tier's under its name: the unit tier's here, the others' in their conftest).

A plugin rather than tests/conftest.py: pytest consults only the conftest files loaded when the run
starts for its header.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import REPO_ROOT, corpus

GO_MOD = REPO_ROOT / "tests" / "controlplane" / "go.mod"
SUMMARY_KEY = pytest.StashKey[dict[str, list[str]]]()
CORPUS_TESTS_KEY = pytest.StashKey[list[str]]()


def pinned_kubernetes_version() -> str:
    """The Kubernetes version tests/controlplane/go.mod pins (what build.sh builds)."""
    match = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\S+)", GO_MOD.read_text(), re.MULTILINE)
    return match.group(1) if match else "unknown"


def _corpus_header() -> str:
    if corpus.PRESENT:
        return f"corpus: {corpus.CORPUS} ({len(corpus.FILES)} manifests): its tests run"
    return f"corpus: none at {corpus.CORPUS}: its tests are skipped (clone it there or set {corpus.ENV}=DIR)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "corpus: needs the shared corpus (skipped when it is absent)")
    if corpus.REQUIRED and not corpus.PRESENT:
        raise pytest.UsageError(f"{corpus.ENV}={corpus.CORPUS}: no such folder")


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [
        f"e2e: Kubernetes {pinned_kubernetes_version()} (tests/controlplane/go.mod), "
        "etcd + kube-apiserver on loopback",
        _corpus_header(),
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    corpus_tests = [item.nodeid for item in items if item.get_closest_marker("corpus")]
    config.stash[CORPUS_TESTS_KEY] = corpus_tests
    if corpus.PRESENT:
        return
    skip = pytest.mark.skip(reason=f"no shared corpus at {corpus.CORPUS}")
    for item in items:
        if item.get_closest_marker("corpus"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    count = len(config.stash.get(CORPUS_TESTS_KEY, []))
    if corpus.PRESENT:
        line = f"corpus: {count} corpus tests ran on {corpus.CORPUS}"
    else:
        line = f"corpus: {count} corpus tests skipped, no corpus at {corpus.CORPUS}"
    terminalreporter.write_line(line)
    for figure in summary_lines(config, "unit"):
        terminalreporter.write_line(f"unit: {figure}")


def add_summary(config: pytest.Config, tier: str, line: str) -> None:
    config.stash.setdefault(SUMMARY_KEY, {}).setdefault(tier, []).append(line)


def summary_lines(config: pytest.Config, tier: str) -> list[str]:
    """What the tier's tests and fixtures asked to print in the terminal summary, in order."""
    return config.stash.get(SUMMARY_KEY, {}).get(tier, [])


def summary_fixture(tier: str) -> Any:
    """A `summary` fixture for a tier (`summary = summary_fixture("e2e")` in its conftest; the unit
    tier's is this plugin's own)."""

    @pytest.fixture
    def summary(
        pytestconfig: pytest.Config, record_property: Callable[[str, object], None]
    ) -> Callable[[str, str], None]:
        """`summary(key, text)`: a measurement worth reading without -s. It is printed in the terminal
        summary (also under -q) and recorded as a property of the test (JUnit XML)."""

        def add(key: str, text: str) -> None:
            record_property(key, text)
            add_summary(pytestconfig, tier, text)

        return add

    return summary


summary = summary_fixture("unit")
