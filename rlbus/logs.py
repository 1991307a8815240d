"""Process-wide logging, tracing and metrics set-up, done once per process with its role tag."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "role": self.role,
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure_logging(role: str, *, metrics_port: int | None = None) -> None:
    """Role-tagged logs on stderr; ``RLBUS_LOG_JSON=1`` for JSON lines, ``RLBUS_LOG_LEVEL`` for level;
    then spans and metrics as ``rlbus.observability`` describes."""
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("RLBUS_LOG_JSON") == "1":
        handler.setFormatter(_JsonFormatter(role))
    else:
        fmt = logging.Formatter(f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        fmt.converter = time.localtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("RLBUS_LOG_LEVEL", "INFO").upper())
    for noisy in ("botocore", "urllib3", "s3transfer", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from rlbus.observability import configure

    configure(role, metrics_port=metrics_port)
