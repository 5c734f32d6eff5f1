"""A value loaded from files and loaded again when they change, without a restart.

A long-running service keeps credentials that operators replace while it runs: a certificate that
cert-manager renews in a mounted Kubernetes Secret, a tokens file that gains a run's token. Each
is loaded once, then loaded again when any of its files changes.

A change is a new (inode, mtime, size) of a file, following symlinks: Kubernetes updates a Secret
volume by pointing a symlink at a new directory, `os.replace` gives a new inode, `cp` rewrites in
place; each shows here. A load that fails (files caught halfway through a replacement, content
not yet valid) keeps the last good value and is tried again once the files change again, so a
service never drops working credentials for broken ones (and logs each broken state once).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from scaletrain.errors import UserError

log = logging.getLogger(__name__)

T = TypeVar("T")

Stamp = tuple[tuple[int, int, int], ...]


def _stamp(paths: Sequence[Path]) -> Stamp | None:
    """The files' (inode, mtime, size), or None while one is missing (mid-replacement)."""
    try:
        stats = [os.stat(path) for path in paths]
    except OSError:
        return None
    return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in stats)


class Reloaded(Generic[T]):
    """`load()`'s value, loaded again by `refresh` when one of `paths` has changed.

    The first load happens here and its errors propagate (a service should not start with
    credentials it cannot read; `load` says why in its own words). Thread-safe: concurrent
    refreshes load once.
    """

    def __init__(self, paths: Sequence[Path], load: Callable[[], T]) -> None:
        self._paths = tuple(paths)
        self._load = load
        self._lock = threading.Lock()
        # Stamped before loading: a file that changes during the load is loaded again next time.
        self._stamp = _stamp(self._paths)
        self._failed: Stamp | None = None
        self.value = load()

    def refresh(self) -> T | None:
        """The value loaded anew if a file changed since the last good load, else None."""
        with self._lock:
            stamp = _stamp(self._paths)
            if stamp is None or stamp in (self._stamp, self._failed):
                return None
            try:
                value = self._load()
            except (OSError, ValueError, UserError) as exc:
                self._failed = stamp
                log.warning("keeping what was loaded from %s: %s", self._paths[0].parent, exc)
                return None
            self._stamp, self.value = stamp, value
            return value
