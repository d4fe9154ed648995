"""The shared output of every command: tables, summary lines, the progress indicator, help defaults."""

from __future__ import annotations

import argparse
import io

from webhook.cli import output


def test_tables_are_kubectl_style() -> None:
    text = output.table(
        ("name", "result", "detail"), [("Pod/a", "denied", "too low"), ("Deployment/long", "passed", "")]
    )
    assert text == (
        "NAME              RESULT   DETAIL\nPod/a             denied   too low\nDeployment/long   passed\n"
    )


def test_summaries_name_every_outcome() -> None:
    assert output.summary(1, "object", [("passed", 1), ("denied", 0)]) == "1 object: 1 passed, 0 denied"
    assert output.summary(3, "case", [("passed", 3)]) == "3 cases: 3 passed"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_and_leaves_it_clean() -> None:
    terminal = Terminal()
    with output.Progress(2, "checking", stream=terminal) as progress:
        progress.step("first")
        progress.step("2nd")
    written = terminal.getvalue()
    assert written.startswith(
        "\rchecking [1/2] first\rchecking [2/2] 2nd  "
    )  # a shorter line covers the longer
    assert written.endswith("\r" + " " * len("checking [2/2] 2nd") + "\r")


def test_progress_writes_nothing_to_a_pipe() -> None:
    pipe = io.StringIO()
    with output.Progress(2, "checking", stream=pipe) as progress:
        progress.step("first")
    assert pipe.getvalue() == ""


def test_help_shows_defaults_worth_showing() -> None:
    parser = argparse.ArgumentParser(formatter_class=output.HelpFormatter)
    parser.add_argument("--port", type=int, default=8443, help="port")
    parser.add_argument("--dry", action="store_true", help="dry")
    parser.add_argument("--name", help="name (default: its own)")
    parser.add_argument("--san", action="append", default=[], help="names")
    text = " ".join(parser.format_help().split())
    assert "port (default: 8443)" in text
    assert "dry (default" not in text and "names (default" not in text
    assert "name (default: its own) --san" in text
