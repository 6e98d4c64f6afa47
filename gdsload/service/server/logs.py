"""Structured logs: one JSON object per line, for the server's events.

`event(logger, "stream_end", dataset="train", batches=12, ...)` logs a record whose JSON line has
`ts` (UTC, ISO 8601), `level`, `logger`, `event` and the given fields. The library only logs to the
"gdsload.service" logger; `configure()` (called by `gdsload serve`) installs the JSON handler.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

LOGGER = "gdsload.service"


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def event(logger: logging.Logger, name: str, *, level: int = logging.INFO, exc_info: Any = None,
          **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields}, exc_info=exc_info)


def configure(stream: IO[str] | None = None, level: str | int = "INFO") -> logging.Logger:
    """JSON lines on `stream` (stderr) for the service logger; idempotent."""
    logger = logging.getLogger(LOGGER)
    for h in list(logger.handlers):
        if getattr(h, "_gdsload_json", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLines())
    handler._gdsload_json = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level if isinstance(level, int) else level.upper())
    logger.propagate = False
    return logger
