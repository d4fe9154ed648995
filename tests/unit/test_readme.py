"""The README's examples, run, so they cannot drift from what the command does.

Three kinds: ```console sessions are run in a copy of examples/ and their output compared (a line
`...` stands for any lines, `...` inside a line for any text); every `gpuguard` command line in a
```bash block must parse; the block that talks to `./scripts/serve` runs against a real server. And
its tables name every rule and every policy key.
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
SESSION_TIMEOUT_SECONDS = 120
SERVE_URL = "https://localhost:8443"
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1"}


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), re.MULTILINE | re.DOTALL)


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
    for cell in re.findall(r"^\| ([^|]*`[^|]*) \|", README.read_text(), re.MULTILINE):
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
