"""JSON log lines: one object per line with time, level, logger, message and the record's fields."""

from __future__ import annotations

import io
import json
import logging

from webhook.logs import JSONFormatter


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
