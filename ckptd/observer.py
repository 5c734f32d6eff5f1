"""What the store tells its observer: a copy of a checkpoint committed on a tier, or found damaged.

The saves, the replicas, S3 replication and the reads all have news for telemetry; they share
one `TierObserver`, so every event carries the same node and age, and an observer that fails
never fails the commit or read that had the news (reporting is the server's concern: the store
works offline with no observer at all).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.catalog import Catalog
from ckptd.states import S3
from ckptd.tiers import CheckpointKey

log = logging.getLogger("ckptd.store")


@dataclass(frozen=True)
class TierCommit:
    """A checkpoint became committed on a tier; `seconds` counts from its OpenSave."""

    run: str
    step: int
    tier: int
    bytes: int
    seconds: float
    # The node whose copy it is (memory and SSD: that node's part; S3: the whole checkpoint).
    node: str = ""
    # A replica: the node whose part `node` holds a copy of ("": its own part).
    replica_of: str = ""
    # Not a commit: the copy failed its checksums, for this reason (it is FAILED on the tier).
    failed: str = ""


class TierObserver:
    """Turns the store's news into `TierCommit`s for one callback (None: nobody listens)."""

    def __init__(
        self, catalog: Catalog, node: str, on_tier_commit: Callable[[TierCommit], None] | None
    ) -> None:
        self._catalog = catalog
        self._node = node
        self._on_tier_commit = on_tier_commit

    def notify(
        self, key: CheckpointKey, tier: int, nbytes: int, replica_of: str = "", failed: str = ""
    ) -> None:
        """Tell the observer (telemetry) about a tier commit, or a copy found damaged
        (`failed`); its failures never fail a save."""
        if self._on_tier_commit is None:
            return
        record = self._catalog.save_of(key)
        seconds = time.time() - record.created_at if record is not None else 0.0
        commit = TierCommit(
            key.run, key.step, tier, nbytes, seconds, self._node, replica_of, failed
        )
        try:
            self._on_tier_commit(commit)
        except Exception:  # an observer must never break a commit
            log.exception("tier commit observer failed for %s", key)

    def damaged(self, key: CheckpointKey, tier: int, owner: str, reason: str) -> None:
        """A copy here failed its checksums on a read (Reader): telemetry hears of it."""
        replica_of = "" if owner in ("", self._node) or tier == S3 else owner
        self.notify(key, tier, 0, replica_of, failed=reason)
