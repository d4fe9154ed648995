"""The import rules between the package's rooms, as tests that can fail.

The module lists come from the folders: a module added to `webhook/policy/` is held to the pure core's
rules without editing this file. Two kinds of check: the static import graph (every `import` statement,
including the lazy ones inside functions and under TYPE_CHECKING), and what a fresh interpreter
actually loads.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "webhook"
SHELL_LIBRARIES = frozenset({"fastapi", "starlette", "uvicorn", "kubernetes", "cryptography"})
# Rooms that answer to different callers and must never lean on one another.
INDEPENDENT_ROOMS = ("admission", "controllers", "audit", "agent")
# The audit's pure core (objects in, findings, report bodies and the schedule out): its cluster side is scan and
# background, which reach the API through webhook.kube.
PURE_AUDIT = (
    "webhook.audit.findings",
    "webhook.audit.reports",
    "webhook.audit.output",
    "webhook.audit.schedule",
)
# The device-health verdicts, from the bottom up: each module imports only those before it.
HEALTH_LAYERS = tuple(
    f"webhook.policy.health.{name}"
    for name in ("records", "holdings", "observed", "signals", "claimloss", "fences", "ladder", "podverdicts")
)


@dataclass(frozen=True)
class Import:
    target: str
    # Made when the module loads (not inside a function or under TYPE_CHECKING): what forms cycles.
    at_load: bool


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runs_later(node: ast.AST) -> bool:
    """A function body, or the TYPE_CHECKING block: imports there are not made when the module loads."""
    lazy = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
    return lazy or (isinstance(node, ast.If) and _is_type_checking(node))


def imports_of(source: str) -> list[Import]:
    """Absolute imports only: the package uses no relative ones (an `ImportFrom` with a level is kept
    as its bare module name, which no rule then recognises, so a test below forbids them)."""
    found: list[Import] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(alias.name, at_load) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = "." * child.level + (child.module or "")
                found.append(Import(base, at_load))
                # `from webhook.policy import engine` imports the module webhook.policy.engine.
                found.extend(Import(f"{base}.{alias.name}", at_load) for alias in child.names)
            elif _runs_later(child):
                visit(child, False)
            else:
                visit(child, at_load)

    visit(ast.parse(source), True)
    return found


def import_graph() -> dict[str, list[Import]]:
    return {name: imports_of(path.read_text(encoding="utf-8")) for name, path in modules().items()}


def room(module: str) -> str:
    """webhook.policy.rules -> policy; webhook.runtime.probes -> runtime; a library -> its top-level name."""
    parts = module.split(".")
    if parts[0] != "webhook":
        return parts[0]
    return parts[1] if len(parts) > 1 else "webhook"


def violations(graph: Mapping[str, Iterable[Import]], known: Iterable[str]) -> list[str]:
    """Every broken import rule in `graph`, as readable lines (empty when the layout holds)."""
    known = set(known)
    problems: list[str] = []
    for module, imports in sorted(graph.items()):
        here = room(module)
        for target in sorted({i.target for i in imports}):
            there = room(target)
            top = target.split(".")[0]
            if top == "webhook" and target not in known:
                continue  # `from webhook.policy import engine` also names the symbol webhook.policy.engine
            if top == "kubernetes" and here != "kube":
                problems.append(f"{module} imports {target}: only webhook.kube talks to the Kubernetes API")
            if here == "policy" and (
                top in SHELL_LIBRARIES or (top == "webhook" and there not in ("policy", "webhook"))
            ):
                problems.append(f"{module} imports {target}: the policy engine is pure")
            if module == "webhook.admission.review" and (
                top in SHELL_LIBRARIES or there not in ("policy", "admission", top)
            ):
                problems.append(f"{module} imports {target}: the review is pure (bytes in, bytes out)")
            if module in PURE_AUDIT and (top in SHELL_LIBRARIES or there == "kube"):
                problems.append(f"{module} imports {target}: the audit's core is pure")
            if here == "admission" and there == "kube":
                problems.append(f"{module} imports {target}: admission never calls the Kubernetes API")
            if here == "kube" and top == "webhook" and there not in ("kube", "policy", "webhook"):
                problems.append(f"{module} imports {target}: webhook.kube imports nothing above it")
            if here == "runtime" and top == "webhook" and there not in ("runtime", "policy", "webhook"):
                problems.append(
                    f"{module} imports {target}: the shared runtime imports only the policy engine"
                )
            if there == "processes" and here not in ("processes", "cli"):
                problems.append(f"{module} imports {target}: only the command line starts a process")
            if here == "processes" and there == "cli":
                problems.append(f"{module} imports {target}: a composition root never calls the command line")
            if here in INDEPENDENT_ROOMS and there in INDEPENDENT_ROOMS and here != there:
                problems.append(f"{module} imports {target}: {here} and {there} are independent")
            if (
                module in HEALTH_LAYERS
                and target in HEALTH_LAYERS
                and HEALTH_LAYERS.index(target) >= HEALTH_LAYERS.index(module)
            ):
                problems.append(f"{module} imports {target}: the health verdicts import only downwards")
    problems.extend(f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph, known))
    return problems


def cycles(graph: Mapping[str, Iterable[Import]], known: set[str]) -> list[list[str]]:
    """Cycles among imports made at load time (a lazy import inside a function cannot deadlock a load)."""
    edges = {
        m: sorted({i.target for i in imports if i.at_load and i.target in known and i.target != m})
        for m, imports in graph.items()
    }
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in edges.get(node, []):
            # A package's __init__ importing its own submodule is how packages load, not a cycle.
            if target.startswith(f"{node}.") or node.startswith(f"{target}."):
                continue
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node)
    return found


def test_the_package_keeps_its_import_rules() -> None:
    graph = import_graph()
    assert violations(graph, graph) == []


def test_no_relative_imports() -> None:
    relative = sorted(m for m, imports in import_graph().items() for i in imports if i.target.startswith("."))
    assert relative == []


def test_the_rooms_are_where_the_rules_expect_them() -> None:
    # A renamed folder would make every rule above vacuous: say so instead.
    rooms = {room(name) for name in modules()}
    assert {"policy", "admission", "certs", "kube", "controllers", "audit", "processes", "runtime"} <= rooms
    assert set(PURE_AUDIT) <= set(modules())
    health = {name for name in modules() if name.startswith("webhook.policy.health.")}
    assert health == set(HEALTH_LAYERS)


@pytest.mark.parametrize(
    ("module", "target", "expected"),
    [
        ("webhook.policy.rules", "fastapi", "the policy engine is pure"),
        ("webhook.policy.engine", "webhook.admission.review", "the policy engine is pure"),
        ("webhook.admission.review", "orjson", None),
        ("webhook.admission.review", "webhook.runtime.probes", "the review is pure"),
        ("webhook.admission.app", "webhook.kube.client", "admission never calls the Kubernetes API"),
        ("webhook.certs.rotation", "kubernetes", "only webhook.kube talks to the Kubernetes API"),
        ("webhook.kube.fact_sources", "webhook.runtime.probes", "webhook.kube imports nothing above it"),
        ("webhook.kube.fact_sources", "webhook.policy.facts", None),
        ("webhook.audit.report", "webhook.controllers.node", "audit and controllers are independent"),
        ("webhook.audit.findings", "webhook.kube.listing", "the audit's core is pure"),
        ("webhook.audit.scan", "webhook.kube.listing", None),
        (
            "webhook.runtime.metrics",
            "webhook.kube.client",
            "the shared runtime imports only the policy engine",
        ),
        ("webhook.runtime.metrics", "webhook.runtime.policy_store", None),
        (
            "webhook.controllers.nodehealth",
            "webhook.processes.controllers",
            "only the command line starts a process",
        ),
        ("webhook.cli.controllers", "webhook.processes.controllers", None),
        ("webhook.processes.serve", "webhook.cli.output", "a composition root never calls the command line"),
        ("webhook.processes.controllers", "webhook.audit.background", None),
        (
            "webhook.policy.health.signals",
            "webhook.policy.health.ladder",
            "the health verdicts import only downwards",
        ),
        ("webhook.policy.health.ladder", "webhook.policy.health.signals", None),
    ],
)
def test_each_rule_can_fail(module: str, target: str, expected: str | None) -> None:
    known = {module, target} | set(modules())
    found = violations({module: [Import(target, at_load=True)]}, known)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found


def test_the_cycle_check_can_fail() -> None:
    graph = {
        "webhook.a": [Import("webhook.b", at_load=True)],
        "webhook.b": [Import("webhook.a", at_load=True)],
        "webhook.c": [Import("webhook.a", at_load=False)],
    }
    assert cycles(graph, set(graph)) == [["webhook.a", "webhook.b", "webhook.a"]]


def test_lazy_and_type_checking_imports_are_seen() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kubernetes import client\n"
        "def f():\n    import cryptography\n"
    )
    found = imports_of(source)
    assert Import("kubernetes", False) in found and Import("cryptography", False) in found


def _loaded_after_import(names: Iterable[str]) -> set[str]:
    code = (
        f"import importlib, json, sys; [importlib.import_module(m) for m in {sorted(names)!r}]; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(result.stdout))


def test_the_pure_core_loads_no_shell_library() -> None:
    pure = [name for name in modules() if room(name) == "policy"] + ["webhook.admission.review", *PURE_AUDIT]
    assert _loaded_after_import(pure) & SHELL_LIBRARIES == set()


def test_the_load_check_itself_sees_shell_imports() -> None:
    # The probe must be able to fail: the probes app does pull FastAPI in.
    assert {"fastapi", "starlette"} <= _loaded_after_import(["webhook.runtime.probes"])


def test_serving_existing_certificates_never_imports_cryptography() -> None:
    # cryptography costs every replica about 10 MB of resident memory: only generating or rotating
    # certificates may load it.
    # Every module of the command line is loaded by every `gpuguard` run, `serve` included: taken from
    # the folder, so a command group added later is held to the same rule.
    command_line = [name for name in modules() if room(name) == "cli"]
    serving = [
        "webhook.processes.serve",
        "webhook.admission.app",
        "webhook.admission.server",
        "webhook.runtime.probes",
    ]
    assert {"webhook.cli", "webhook.cli.serve", "webhook.cli.certs"} <= set(command_line)
    assert "cryptography" not in _loaded_after_import([*command_line, *serving, "webhook.certs.files"])
