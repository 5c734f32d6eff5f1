"""Warnings that a hostile or broken client can repeat at will, said a few times, not each time.

A client that opens thousands of bad connections, or calls with an unknown token in a loop, must
not turn the log into a copy of its traffic (one line per refusal drowns every other line and
costs disk and CPU). `Throttled` says the first warning of a kind at once, then at most one line
per interval with how many more came; the exact counts are Prometheus counters where it matters
(`ckptd_refused_connections_total`).
"""

from __future__ import annotations

import logging
import threading
import time


class Throttled:
    """Warnings of one kind at most once per `every_s`: the first at once, then one line per
    interval saying how many more came and the last of them.

    `flush` writes the count of an interval that ended without a new warning (ckptd's data
    socket calls it every second; a new warning calls it first anyway).
    """

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self._log, self._every_s = logger, every_s
        self._lock = threading.Lock()
        # kind -> when its last line was written, warnings since, and the newest of them
        self._said: dict[str, float] = {}
        self._held: dict[str, tuple[int, str, tuple[object, ...]]] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        self.flush()  # an interval that ended quietly gets its count first
        now = time.monotonic()
        with self._lock:
            if now - self._said.get(kind, -self._every_s) < self._every_s:
                count = self._held.get(kind, (0, "", ()))[0]
                self._held[kind] = (count + 1, message, args)
                return
            self._said[kind] = now
        self._log.warning(message, *args, extra={"kind": kind})

    def flush(self) -> None:
        """One line for each kind whose interval is over and that had warnings left unsaid."""
        now = time.monotonic()
        due = []
        with self._lock:
            for kind in [k for k in self._held if now - self._said[k] >= self._every_s]:
                count, message, args = self._held.pop(kind)
                due.append((kind, count, now - self._said[kind], message, args))
                self._said[kind] = now
        for kind, count, seconds, message, args in due:
            self._log.warning(
                f"{count} more like this in the last {seconds:.0f}s; the last: {message}",
                *args,
                extra={"kind": kind, "count": count},
            )
