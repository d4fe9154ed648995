"""Each room says what it holds: every package's docstring names all its modules, and names no module
that is not there; and the unit tests mirror the rooms.

A module is named as `name.py`, a subpackage as `name/`, each standing alone (a path such as
`processes/serve.py` or `tests/unit/` names nothing of this room), so that prose may point elsewhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "webhook"
MODULE = re.compile(r"(?<![\w/.])(\w+)\.py\b")
SUBPACKAGE = re.compile(r"(?<![\w/.])(\w+)/(?![\w.])")


def packages() -> list[Path]:
    return sorted(init.parent for init in PACKAGE.rglob("__init__.py"))


def contents(package: Path) -> set[str]:
    """The package's modules (`name.py`) and subpackages (`name/`), as its docstring should name them."""
    modules = {f"{path.name}" for path in package.glob("*.py") if path.name != "__init__.py"}
    subpackages = {f"{path.parent.name}/" for path in package.glob("*/__init__.py")}
    return modules | subpackages


def named(docstring: str) -> set[str]:
    return {f"{name}.py" for name in MODULE.findall(docstring)} | {
        f"{name}/" for name in SUBPACKAGE.findall(docstring)
    }


@pytest.mark.parametrize("package", packages(), ids=lambda path: str(path.relative_to(PACKAGE.parent)))
def test_the_docstring_names_every_module_of_its_room(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    assert named(docstring) == contents(package)


def test_every_room_is_a_package() -> None:
    # A folder without __init__.py still imports (a namespace package) but is left out of the wheel the
    # image installs, and out of the check above.
    folders = {path for path in PACKAGE.rglob("*") if path.is_dir() and path.name != "__pycache__"}
    assert folders == set(packages()) - {PACKAGE}


def test_the_name_check_can_fail() -> None:
    text = (
        "    serve.py   a root\n    health/    verdicts\nsee processes/serve.py and tests/unit/ and docs/x.md"
    )
    assert named(text) == {"serve.py", "health/"}


def test_the_unit_tests_mirror_the_rooms() -> None:
    # tests/unit/<room>/ holds the in-process tests of webhook/<room>/, so a module without tests shows
    # in the tree; each folder a package, so that test modules of one name in two rooms import apart.
    unit = Path(__file__).resolve().parent
    folders = {path for path in unit.iterdir() if path.is_dir() and path.name != "__pycache__"}
    rooms = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert {folder.name for folder in folders} <= rooms
    assert all((folder / "__init__.py").is_file() for folder in folders)


def test_the_harness_names_every_module() -> None:
    harness = PACKAGE.parent / "tests" / "harness"
    docstring = ast.get_docstring(ast.parse((harness / "__init__.py").read_text(encoding="utf-8"))) or ""
    assert named(docstring) == contents(harness)
