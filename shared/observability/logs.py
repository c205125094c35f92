"""Log setup of every role: text lines, or one JSON object per line with ``--log-format json``.

Request-scoped lines pass ``extra={"request_id": ..., ...}``; the JSON formatter writes those
fields as keys, so a log pipeline can join a request's lines across roles by its id.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, role, message, and any ``extra`` fields."""

    def __init__(self, role: str = "") -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.role:
            entry["role"] = self.role
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(log_format: Optional[str] = "text", role: str = "", level: int = logging.INFO) -> None:
    """Route the root logger to stderr in ``log_format`` (``text`` or ``json``)."""
    log_format = log_format or "text"
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
