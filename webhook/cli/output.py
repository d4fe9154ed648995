"""What every command shares about talking back: exit codes, errors, help with defaults, kubectl-style
tables, `-o json|yaml`, the summary line, and a progress indicator for long work on a terminal."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal, TextIO, TypeAlias

import orjson

from webhook.cli import yaml_output

EXIT_OK = 0
# The command ran and the answer is no: something was denied, a test case did not match.
EXIT_FAILED = 1
# The command could not do what was asked: bad arguments, unreadable or malformed input, an invalid
# policy, a server it could not reach. argparse exits with 2 on usage errors too.
EXIT_USAGE = 2

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Format = Literal["yaml", "json"]
FORMATS: tuple[Format, ...] = ("yaml", "json")


class UsageError(Exception):
    """What the user must fix, said in one line; `gpuguard` prints it and exits with EXIT_USAGE."""


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, when it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == [] or default == argparse.SUPPRESS
        if action.option_strings and not unset and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def add_parser(commands: Commands, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose help shows defaults and whose description is its help line."""
    kwargs.setdefault("description", kwargs.get("help"))
    return commands.add_parser(name, formatter_class=HelpFormatter, **kwargs)


def add_output_option(parser: argparse.ArgumentParser, default: Format = "yaml", help: str = "") -> None:
    parser.add_argument("-o", "--output", choices=FORMATS, default=default, help=help or "output format")


def dump_yaml(data: Any) -> str:
    # Strings any YAML reader could take for another type are quoted: `mutate | kubectl apply` keeps them.
    return yaml_output.dump(data)


def dump_json(data: Any) -> str:
    return orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n"


def dump(data: Any, fmt: Format) -> str:
    return dump_json(data) if fmt == "json" else dump_yaml(data)


def as_list(items: Sequence[Any]) -> dict[str, Any]:
    """Several objects as one, the way kubectl prints them: a v1 List."""
    return {"apiVersion": "v1", "kind": "List", "items": list(items)}


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """kubectl's table: upper-case headers, left-aligned columns three spaces apart, no trailing blanks."""
    cells = [[header.upper() for header in headers], *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    lines = ("   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in cells)
    return "".join(line.rstrip() + "\n" for line in lines)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def summary(count: int, noun: str, outcomes: Iterable[tuple[str, int]]) -> str:
    """`3 objects: 1 denied, 0 warned, 2 passed`: every outcome named, zeros too, so scripts and eyes
    find the same words on every run."""
    return f"{plural(count, noun)}: {', '.join(f'{n} {outcome}' for outcome, n in outcomes)}"


def error(message: str) -> None:
    print(f"gpuguard: {message}", file=sys.stderr)


class Progress:
    """`[3/40] examples/tests/x` rewritten in place on a terminal, while long work runs; nothing at all
    when the stream is not a terminal (CI logs, pipes), so output stays what scripts expect.

        with Progress(len(items), "checking") as progress:
            for item in items:
                progress.step(item.name)

    Work of unknown size says where it is with `show(text)` instead; `after` keeps quick work silent.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, *, after: float = 0.0) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.shown = self.stream.isatty()
        self.done = 0
        self._width = 0
        self._from = time.monotonic() + after

    def step(self, item: str) -> None:
        self.done += 1
        self.show(f"[{self.done}/{self.total}] {item}")

    def show(self, text: str) -> None:
        if self.shown and time.monotonic() >= self._from:
            self._write(f"{self.label} {text}")

    def _write(self, text: str) -> None:
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        if self.shown and self._width:
            # Leave the terminal as it was: the line is cleared, the next output starts at column 0.
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
