"""JSON log lines: one object per line with time, level, logger, message and the record's fields."""

from __future__ import annotations

import datetime
import io
import json
import logging
from collections.abc import Callable, Iterator

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from webhook.runtime import logs
from webhook.runtime.logs import JSONFormatter


def formatted(record: logging.LogRecord) -> dict[str, object]:
    line = JSONFormatter().format(record)
    assert "\n" not in line
    parsed: dict[str, object] = json.loads(line)
    return parsed


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("gpuguard.test")
    made = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, args, None, extra=extra)
    return made


def test_a_line_carries_the_message_and_the_fields() -> None:
    line = formatted(
        record("refused policy from %s", "file p.yaml", fields={"error": "bad\nvalue", "errors": 3})
    )
    assert line["level"] == "warning" and line["logger"] == "gpuguard.test"
    assert line["message"] == "refused policy from file p.yaml"
    assert line["error"] == "bad\nvalue" and line["errors"] == 3
    assert str(line["time"]).endswith("+00:00")


@given(
    st.floats(min_value=-1e10, max_value=1e10)
    | st.integers(min_value=0, max_value=10**10).map(lambda second: second + 0.9999995)
    | st.integers(min_value=0, max_value=10**10).map(float)
)
@example(1_000_000_000.0000005)  # rounds half to even: down to .000000
@example(1_000_000_000.9999996)  # rounds up into the next second
def test_the_time_is_datetimes_iso_format_to_the_microsecond(created: float) -> None:
    made = record("at a time")
    made.created = created
    expected = datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat()
    assert formatted(made)["time"] == expected
    assert formatted(made)["time"] == expected  # the same second again, from what the first line kept


def test_fields_that_json_cannot_hold_are_written_as_text() -> None:
    line = formatted(record("odd", fields={"value": frozenset({"x"})}))
    assert line["value"] == "frozenset({'x'})"


def test_an_exception_is_kept_inside_the_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logger = logging.getLogger("gpuguard.test")
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JSONFormatter())
        logger.addHandler(handler)
        try:
            logger.exception("handler failed")
        finally:
            logger.removeHandler(handler)
    (line,) = stream.getvalue().splitlines()
    parsed = json.loads(line)
    assert parsed["message"] == "handler failed" and "ValueError: boom" in parsed["exception"]


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[[], str]]:
    """What `configure`'s logging wrote to stderr so far; the root logger's handlers and level restored
    after the test."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        yield lambda: capsys.readouterr().err
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def untimed(line: str) -> str:
    """The line with its time, the one part two lines written one after the other cannot share."""
    stamp = json.loads(line)["time"]
    return line.replace(stamp, "T", 1)


@pytest.mark.parametrize("worker", [None, 1])
def test_a_line_written_directly_is_the_line_logging_writes(
    stderr: Callable[[], str], worker: int | None
) -> None:
    logs.configure(worker=worker)
    logger = logging.getLogger("gpuguard.test")
    fields = {"uid": "u-1", "applied": ["priority: set"], "level": "a field wins", "odd": frozenset({"x"})}

    logs.info(logger, "admission allowed", fields)
    logger.info("%s", "admission allowed", extra={"fields": fields})

    direct, through_logging = stderr().splitlines()
    assert untimed(direct) == untimed(through_logging)
    assert json.loads(direct)["level"] == "a field wins" and json.loads(direct)["odd"] == "frozenset({'x'})"
    assert json.loads(direct).get("worker") == worker


def test_a_line_below_the_configured_level_is_not_written(stderr: Callable[[], str]) -> None:
    logs.configure(logging.WARNING)
    logs.info(logging.getLogger("gpuguard.test"), "admission allowed", {"uid": "u-1"})
    assert stderr() == ""


def test_handlers_and_filters_other_than_configures_get_the_record(
    stderr: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    logs.configure()
    logging.getLogger().addHandler(caplog.handler)  # configure replaced every handler, pytest's too
    logger = logging.getLogger("gpuguard.test")
    with caplog.at_level(logging.INFO, "gpuguard.test"):
        logs.info(logger, "admission denied", {"uid": "u-2"})
    (record,) = caplog.records
    assert record.getMessage() == "admission denied" and record.__dict__["fields"] == {"uid": "u-2"}

    caplog.clear()
    hidden = logging.Filter("elsewhere")
    logger.addFilter(hidden)
    try:
        logs.info(logger, "admission denied", {"uid": "u-3"})
    finally:
        logger.removeFilter(hidden)
    assert "u-3" not in stderr()
