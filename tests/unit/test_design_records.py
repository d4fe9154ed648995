"""docs/design/ holds the project's decisions: every record is in its index, and every record the code,
the tests and the benches cite exists, so a citation cannot point at nothing after a rename."""

from __future__ import annotations

import re

from tests.harness import REPO_ROOT

DESIGN = REPO_ROOT / "docs" / "design"
RECORD_NAME = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md")


def _records() -> set[str]:
    return {path.name for path in DESIGN.glob("*.md") if path.name != "README.md"}


def test_every_record_is_named_by_date_and_listed_in_the_index() -> None:
    index = (DESIGN / "README.md").read_text()
    listed = set(re.findall(rf"\]\(({RECORD_NAME.pattern})\)", index))
    assert _records(), "no records"
    assert {name for name in _records() if not RECORD_NAME.fullmatch(name)} == set()
    assert listed == _records()


def test_every_cited_record_exists() -> None:
    cited = {
        (path.relative_to(REPO_ROOT).as_posix(), name)
        for folder in ("webhook", "tests", "bench")
        for path in (REPO_ROOT / folder).rglob("*")
        if path.suffix in (".py", ".md") and path.is_file()
        for name in re.findall(rf"docs/design/({RECORD_NAME.pattern})", path.read_text())
    }
    assert cited, "no citations found"
    assert {(path, name) for path, name in cited if name not in _records()} == set()
