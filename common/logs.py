"""Structured JSON logs (one object per line) with the request id when there is one."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import orjson


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def setup_logging(level: str = "INFO", log_file: Path | None = None) -> None:
    """JSON lines to stderr; with `log_file`, to that file instead, and only sluice's own
    errors to stderr (the Kafka client's transient retries stay in the file)."""
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    handlers = [handler]
    if log_file is not None:
        handler = logging.FileHandler(log_file)
        errors = logging.StreamHandler(sys.stderr)
        errors.setLevel(logging.ERROR)
        errors.addFilter(lambda record: not record.name.startswith("aiokafka"))
        errors.setFormatter(JsonFormatter())
        handlers = [handler, errors]
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(level.upper())
    # aiokafka is chatty at INFO about routine group membership.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
