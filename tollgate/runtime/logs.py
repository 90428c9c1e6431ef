"""JSON-lines logging with the service name, the current request id and trace ids."""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar
from typing import Any

import orjson

from tollgate.runtime.tracing import current_ids

request_id_var: ContextVar[str | None] = ContextVar("tollgate_request_id", default=None)

_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        # A line written while a traced call is handled names its trace and span,
        # so a log search and a trace backend find each other's records.
        if (ids := current_ids()) is not None:
            entry["trace_id"], entry["span_id"] = ids
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in entry and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def setup_logging(service: str, level: str = "INFO") -> None:
    """Send every log record to stderr as one JSON object per line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime
