"""JSON log lines on stderr: one object per line, so that a log pipeline needs no parser of its own."""

from __future__ import annotations

import datetime
import logging
import math
import sys
import time
from typing import Any, TextIO

import orjson

# The last second a line was written in and its ISO 8601 text: the seconds' part is the same for every
# line in a second, and making it through datetime costs a third of the decision line.
_second: tuple[int, str] = (0, "1970-01-01T00:00:00")


def _iso_time(created: float) -> str:
    """`datetime.fromtimestamp(created, UTC).isoformat()`, exactly: the microseconds rounded half to even
    as datetime rounds them, and left out when they are 0, as isoformat leaves them out."""
    global _second
    if created < 0:  # before 1970: never the clock, but a record may say so
        return datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat()
    fraction, whole = math.modf(created)
    micro = round(fraction * 1e6)
    if micro >= 1_000_000:
        micro -= 1_000_000
        whole += 1
    second = int(whole)
    cached, text = _second
    if second != cached:
        text = datetime.datetime.fromtimestamp(second, datetime.UTC).isoformat().removesuffix("+00:00")
        _second = (second, text)
    return f"{text}.{micro:06d}+00:00" if micro else f"{text}+00:00"


def _line(
    created: float,
    level: str,
    logger: str,
    message: str,
    worker: int | None,
    fields: object,
    exception: str | None = None,
) -> str:
    """One log line; the only place its shape is defined."""
    line: dict[str, Any] = {
        "time": _iso_time(created),
        "level": level,
        "logger": logger,
        "message": message,
    }
    if worker is not None:
        line["worker"] = worker
    if isinstance(fields, dict):
        line.update(fields)
    if exception is not None:
        line["exception"] = exception
    try:
        return orjson.dumps(line, default=str).decode()
    except (TypeError, orjson.JSONEncodeError):
        # A field orjson cannot write (nested past its depth limit, say): the line still goes out,
        # that field described instead of lost with the rest.
        return orjson.dumps({key: _writable(value) for key, value in line.items()}, default=str).decode()


class JSONFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        # Which of `gpuguard serve --workers N`'s processes wrote the line (None: it serves alone).
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        exception = self.formatException(record.exc_info) if record.exc_info else None
        fields = getattr(record, "fields", None)
        return _line(
            record.created,
            record.levelname.lower(),
            record.name,
            record.getMessage(),
            self.worker,
            fields,
            exception,
        )


def _writable(value: Any) -> Any:
    try:
        orjson.dumps(value, default=str)
    except (TypeError, orjson.JSONEncodeError) as exc:
        return f"<not written: {exc}>"
    return value


class JSONHandler(logging.StreamHandler[TextIO]):
    """The handler `configure` installs: JSON lines on a stream, and `write`, which takes a line's parts
    directly, for the line written once per admission request."""

    def __init__(self, stream: TextIO, worker: int | None = None) -> None:
        super().__init__(stream)
        self.setFormatter(JSONFormatter(worker))
        self.worker = worker

    def write(self, level: str, logger: str, message: str, fields: dict[str, Any]) -> None:
        """What emitting a record with these parts writes, without making the record."""
        try:
            text = _line(time.time(), level, logger, message, self.worker, fields)
            with self.lock:  # type: ignore[union-attr]  # made by Handler.__init__
                self.stream.write(text + self.terminator)
                self.stream.flush()
        except RecursionError:  # as StreamHandler.emit: not hidden as a logging error
            raise
        except Exception:
            record = logging.makeLogRecord({"name": logger, "levelname": level.upper(), "msg": message})
            self.handleError(record)


def _sole_handler(logger: logging.Logger) -> JSONHandler | None:
    """The one handler a record from `logger` would reach, when it is `configure`'s and no filter stands
    on the way; None for anything else (a test's capture, handlers added by an embedding program)."""
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters:
            return None
        if current.handlers:
            handlers = current.handlers
            if (
                current.parent is None
                and len(handlers) == 1
                and type(handlers[0]) is JSONHandler
                and not handlers[0].filters
            ):
                return handlers[0]
            return None
        if not current.propagate:
            return None
        current = current.parent
    return None


def info(logger: logging.Logger, message: str, fields: dict[str, Any]) -> None:
    """`logger.info(message)` with `fields` in the line, as `logger.info("%s", message, extra={"fields":
    fields})` writes it. Under `configure`'s logging the line is written straight to its handler: the
    logging module's record, caller lookup and dispatch cost several times the line itself, once per
    admission request."""
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _sole_handler(logger)
    if handler is None or handler.level > logging.INFO:
        logger.info("%s", message, extra={"fields": fields})
        return
    handler.write("info", logger.name, message, fields)


def configure(level: int = logging.INFO, *, worker: int | None = None) -> None:
    handler = JSONHandler(sys.stderr, worker)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
