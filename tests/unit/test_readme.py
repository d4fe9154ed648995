"""The examples of the README and of docs/*.md, run, so they cannot drift from what the command does.

Three kinds: ```console sessions are run in a copy of examples/ and their output compared (a line
`...` stands for any lines, `...` inside a line for any text); every `gpuguard` command line in a
```bash block must parse; the block that talks to `./scripts/serve` runs against a real server. Their
tables name every rule and every policy key. And every relative link of the project's Markdown, there
and in CONTRIBUTING.md, CHANGELOG.md, bench/ and docs/ below, names a file that exists and, into a
Markdown file, a heading it has (what a site generator's strict mode would refuse to build).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness import REPO_ROOT
from tests.harness.manifests import EXAMPLES
from tests.integration.test_http import start_server
from webhook import cli
from webhook.policy.model import RULE_IDS

README = REPO_ROOT / "README.md"
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINKED_PAGES = sorted(
    {
        *PAGES,
        *REPO_ROOT.glob("*.md"),
        *(REPO_ROOT / "docs").rglob("*.md"),
        *(REPO_ROOT / "bench").glob("*.md"),
    }
)
SESSION_TIMEOUT_SECONDS = 120
SERVE_URL = "https://localhost:8443"
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1"}


def blocks(language: str) -> list[str]:
    pattern = re.compile(rf"^```{language}\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    return [block for page in PAGES for block in pattern.findall(page.read_text())]


def sessions() -> list[list[tuple[str, list[str]]]]:
    """Each console block as (command, expected output lines) pairs."""
    found = []
    for block in blocks("console"):
        steps: list[tuple[str, list[str]]] = []
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                assert steps, f"output before any command in a console block: {line!r}"
                steps[-1][1].append(line)
        found.append(steps)
    return found


def expected_pattern(lines: list[str]) -> re.Pattern[str]:
    parts = []
    for line in lines:
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append("[^\n]*".join(re.escape(piece) for piece in line.split("...")) + r"\n")
    return re.compile("".join(parts))


def shell_env() -> dict[str, str]:
    # The installed command first on PATH, as after `pip install .`; unbuffered, so stdout and stderr
    # interleave as on a terminal.
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    return env | {"PATH": f"{bin_dir}:{env.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def run_session(steps: list[tuple[str, list[str]]], cwd: Path) -> list[str]:
    """Runs the commands in one shell (so `echo $?` sees the command before it); each one's output."""
    marker = "@@readme-step@@"
    # The marker's own echo must not become the `$?` the next command sees: the status is put back.
    keep_status = f'status=$?; echo {marker}; (exit "$status")'
    script = "exec 2>&1\n" + "".join(f"{keep_status}\n{command}\n" for command, _ in steps)
    result = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=shell_env(),
        timeout=SESSION_TIMEOUT_SECONDS,
        check=False,
    )
    outputs = result.stdout.split(f"{marker}\n")
    assert outputs[0] == "" and len(outputs) == len(steps) + 1, result.stdout
    return outputs[1:]


def test_the_readme_has_sessions_to_run() -> None:
    assert len(sessions()) >= 6
    assert sum(len(steps) for steps in sessions()) >= 15


@pytest.mark.parametrize("index", range(len(sessions())))
def test_console_sessions_print_what_the_readme_shows(index: int, tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    steps = sessions()[index]
    for (command, expected), actual in zip(steps, run_session(steps, tmp_path), strict=True):
        assert expected_pattern(expected).fullmatch(actual), (
            f"$ {command}\n--- README\n" + "\n".join(expected) + f"\n--- actual\n{actual}"
        )


def gpuguard_invocations(block: str) -> Iterator[list[str]]:
    """The argument lists given to `gpuguard` (or to `./scripts/serve`, which passes them to serve)."""
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        for start, word in enumerate(words):
            at_command = start == 0 or words[start - 1] in SHELL_OPERATORS or words[start - 1] == "--"
            if at_command and word in ("gpuguard", "./scripts/serve"):
                rest = words[start + 1 :]
                end = next((i for i, w in enumerate(rest) if w in SHELL_OPERATORS), len(rest))
                yield (["serve"] if word == "./scripts/serve" else []) + rest[:end]


def test_every_gpuguard_line_in_the_readme_parses(capsys: pytest.CaptureFixture[str]) -> None:
    invocations = [args for block in blocks("bash") for args in gpuguard_invocations(block)]
    assert len(invocations) >= 8
    for args in invocations:
        if args in (["--version"], ["--help"]):
            continue
        try:
            parsed = cli.parser().parse_args(args)
        except SystemExit as exc:
            raise AssertionError(
                f"README: `gpuguard {shlex.join(args)}` does not parse: {capsys.readouterr().err}"
            ) from exc
        assert callable(parsed.run)


def test_the_curl_examples_against_a_server(tmp_path: Path) -> None:
    (block,) = [block for block in blocks("bash") if "curl " in block]
    lines = [line for line in block.splitlines() if not line.startswith("./scripts/serve")]
    assert any(line.startswith("curl ") for line in lines)
    server = start_server(tmp_path)  # what ./scripts/serve runs, on a free port, its CA in certs/
    try:
        shutil.copytree(EXAMPLES, tmp_path / "examples")
        for line in lines:
            command = line.replace(SERVE_URL, server.base_url.replace("127.0.0.1", "localhost"))
            result = subprocess.run(
                ["bash", "-c", command],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                env=shell_env(),
                timeout=60,
            )
            assert result.returncode == 0, f"{line}\n{result.stderr}"
            if "curl " in line:
                assert '"kind":"AdmissionReview"' in result.stdout and '"uid":"' in result.stdout, (
                    result.stdout
                )
            else:
                assert result.stdout.startswith("policy "), result.stdout
    finally:
        server.stop()


def table_keys() -> set[str]:
    """The code in the first cells of the README's tables: rule ids, policy keys, paths. A cell may name
    several keys, later ones relative to the first (`a.b.c`, `.d`: a.b.d; `.e.f`: a.e.f)."""
    found: set[str] = set()
    text = "".join(page.read_text() for page in PAGES)
    for cell in re.findall(r"^\| ([^|]*`[^|]*) \|", text, re.MULTILINE):
        spans = re.findall(r"`([^`]+)`", cell)
        if not spans:
            continue
        first = spans[0]
        found.add(first)
        for span in spans[1:]:
            if span.startswith("."):
                parts = span[1:].split(".")
                found.add(".".join(first.split(".")[: -len(parts)] + parts))
            else:
                found.add(span)
    return found


def policy_keys(node: object, path: str = "") -> Iterator[str]:
    # priorityClasses maps class names (the user's) to values: the key itself is the documented one.
    if isinstance(node, dict) and path != "priorityClasses":
        for key, value in node.items():
            yield from policy_keys(value, f"{path}.{key}" if path else key)
    else:
        yield path


def test_every_policy_key_and_rule_is_in_the_readme() -> None:
    documented = table_keys()
    default = yaml.safe_load((REPO_ROOT / "webhook" / "default-policy.yaml").read_text())
    assert [key for key in policy_keys(default) if key not in documented] == []
    assert [rule for rule in RULE_IDS if rule not in documented] == []


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)


def without_code(text: str) -> str:
    """The Markdown with its code blocks and code spans blanked: links in them are not links."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated id numbered."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+?)#*$", without_code_blocks(page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def relative_links(page: Path) -> Iterator[str]:
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):
            yield target


def test_the_pages_have_links_to_check() -> None:
    assert sum(1 for page in LINKED_PAGES for _ in relative_links(page)) >= 50


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(REPO_ROOT)}")
    assert broken == []


# A path in a code span that starts at one of these folders names a file of this repository.
REPOSITORY_FOLDERS = ("tests", "bench", "webhook", "scripts", "deploy", "charts", "docs", "examples")


def cited_paths(page: Path) -> Iterator[str]:
    """Repository paths the page cites in code spans (`tests/unit/policy/test_rules.py`), not globs."""
    pattern = rf"`((?:{'|'.join(REPOSITORY_FOLDERS)})/[\w./-]+)`"
    for path in re.findall(pattern, without_code_blocks(page.read_text())):
        if "*" not in path:
            yield path


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_every_cited_path_exists(page: Path) -> None:
    # Files move (tests into their rooms, the harness into one package); the prose citing them must follow.
    assert [path for path in cited_paths(page) if not (REPO_ROOT / path).exists()] == []
