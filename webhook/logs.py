"""JSON log lines on stderr: one object per line, so that a log pipeline needs no parser of its own."""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

import orjson


class JSONFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        # Which of `gpuguard serve --workers N`'s processes wrote the line (None: it serves alone).
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            line["worker"] = self.worker
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        try:
            return orjson.dumps(line, default=str).decode()
        except (TypeError, orjson.JSONEncodeError):
            # A field orjson cannot write (nested past its depth limit, say): the line still goes out,
            # that field described instead of lost with the rest.
            return orjson.dumps({key: _writable(value) for key, value in line.items()}, default=str).decode()


def _writable(value: Any) -> Any:
    try:
        orjson.dumps(value, default=str)
    except (TypeError, orjson.JSONEncodeError) as exc:
        return f"<not written: {exc}>"
    return value


def configure(level: int = logging.INFO, *, worker: int | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter(worker))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
