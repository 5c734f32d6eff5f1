"""Structured logs: one JSON object per line, with the fields a log query filters on.

ckptd logs through the standard `logging` module; fields such as run, step, tier and bytes travel
as `extra=` on the record and come out as keys of the JSON object, so a log pipeline can select
"every S3 failure of run X" without parsing prose.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """time, level, logger, message, the record's extra fields, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_"):
                doc[name] = value if isinstance(value, int | float | bool | None) else str(value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure(fmt: str = "json", level: int = logging.INFO) -> None:
    """Send the process's logs to stderr as JSON lines (`json`) or as plain text (`text`)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # boto's and urllib3's own chatter stays out unless it is a warning.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
