"""S3 in the background: the store's uploads to S3, removals from it, and the sync at startup.

S3 is the slowest tier, so nothing waits for it: a checkpoint commits on SSD (and memory), and its
upload to S3 is queued (`ckptd.background`), retried until it succeeds or the checkpoint is no
longer wanted there. An upload sends the verified local copy (memory or SSD, never S3 itself),
marker last, and only then does the catalog call the S3 copy committed and retention run again.
Removals from S3 are queued the same way, and the catalog remembers them, so a restart finishes
them. At startup the catalog is reconciled with S3's markers (rebuilding what a lost catalog
knew), and whatever S3 still owes is queued again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptd.background import BackgroundQueue
from ckptd.catalog import COMMITTED, OPEN, Catalog
from ckptd.crash import crash_point
from ckptd.metrics import Metrics
from ckptd.reads import Reader
from ckptd.retention import RetentionPolicy, wanted
from ckptd.states import ABSENT, FAILED, MEMORY, PENDING, S3, SSD, TIER_COMMITTED
from ckptd.tiers import CheckpointKey
from ckptd.tiers.s3 import S3Tier, describe
from scaletrain.names import TIER_LABELS

# The store's logger still: log queries select on it.
log = logging.getLogger("ckptd.store")


class PartsMissing(Exception):
    """This node's part is on S3, another node's not yet: the marker waits (and the job retries)."""


class S3Replication:
    """The S3 tier of a store and its queue of background jobs, one at a time.

    The store's catalog, lock and closed flag are shared; `policy`, `apply_retention` (called
    with the lock held) and `notify` are the store's. Jobs start only with `start`, once the
    store can take the calls they make.
    """

    def __init__(
        self,
        s3: S3Tier,
        catalog: Catalog,
        lock: threading.RLock,
        closed: threading.Event,
        metrics: Metrics,
        reader: Reader,
        policy: Callable[[str], RetentionPolicy],
        apply_retention: Callable[[str], None],
        notify: Callable[[CheckpointKey, int, int], None],
    ) -> None:
        self.s3, self._reader, self._metrics = s3, reader, metrics
        self._catalog, self._lock, self._closed = catalog, lock, closed
        self._policy, self._apply_retention, self._notify = policy, apply_retention, notify
        self._queue = BackgroundQueue(
            "ckptd-s3", self._job_failed, s3.config.backoff_s, s3.config.backoff_max_s
        )

    def start(self) -> None:
        """Queue the startup sync (which queues whatever S3 still owes)."""
        self._queue.submit(("sync", None), self._sync)

    @property
    def depth(self) -> int:
        """Jobs waiting or running."""
        return self._queue.depth

    def wait_idle(self, timeout_s: float) -> bool:
        return self._queue.wait_idle(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Give a job in flight `timeout_s` to finish, then let go of S3."""
        self._queue.close(timeout_s)
        self.s3.close()

    def _sync(self) -> None:
        """Background: reconcile the catalog with S3's markers, then queue what S3 still owes."""
        listed = set(self.s3.list())
        for key in sorted(listed):
            with self._lock:
                if self._catalog.deleting(key):
                    continue  # removed (maybe just now, by a delete racing this sync)
                save = self._catalog.save_of(key)
                known = save is not None and save.state == COMMITTED
                state = self._catalog.tier_state(key, S3) if known else ABSENT
            if known and state == TIER_COMMITTED:
                continue
            manifest = self.s3.manifest(key)
            if manifest is None:
                continue
            with self._lock:
                if self._catalog.deleting(key):
                    continue
                save = self._catalog.save_of(key)
                known = save is not None and save.state == COMMITTED
                ours = self._catalog.manifest(key) if known else None
                if ours is None and save is not None and save.state == OPEN:
                    continue  # a new save of this step is in progress; it will overwrite S3
                if ours is not None and not ours.same_files(manifest):
                    log.warning("S3 holds a different %s; it will be uploaded again", key)
                    continue
                log.info("recovered %s from its S3 marker", key, extra={"run": key.run})
                self._catalog.record_commit(manifest, S3)
        with self._lock:
            for key in self._catalog.committed_on(S3):
                if key not in listed:
                    self._catalog.set_tier(key, S3, ABSENT, error="marker missing on S3")
            for key in self._catalog.deletions():
                self.queue_removal(key)
            for run in self._catalog.runs():
                self._apply_retention(run)

    def queue_upload(self, key: CheckpointKey) -> None:
        if self._catalog.tier_state(key, S3) != FAILED:
            self._catalog.set_tier(key, S3, PENDING)
        self._queue.submit(("upload", key), lambda: self._upload(key))

    def queue_removal(self, key: CheckpointKey) -> None:
        self._queue.submit(("remove", key), lambda: self._remove(key))

    def _upload(self, key: CheckpointKey) -> None:
        """Upload job: the verified local copy goes up, marker last; then retention runs."""
        with self._lock:
            if self._closed.is_set():
                return
            manifest = self._catalog.manifest(key)
            if manifest is None or self._catalog.tier_state(key, S3) == TIER_COMMITTED:
                return  # deleted, or done meanwhile
            wants = wanted(
                self._policy(key.run),
                list(self._catalog.run_states(key.run)),
                [k.step for k in self._catalog.committed_on(S3) if k.run == key.run],
                has_s3=True,
            )
            if S3 not in wants.get(key.step, set()):
                self._catalog.set_tier(key, S3, ABSENT)
                return
        started = time.perf_counter()
        existing = self.s3.manifest(key)
        if existing is None or not existing.same_files(manifest):
            records = {f.path: f for f in manifest.files}

            def source(path: str, offset: int, length: int) -> bytes:
                _tier, _node, data = self._reader.read_verified(
                    key, records[path], offset, offset + length, only=(MEMORY, SSD)
                )
                return data

            part = sum(f.size for f in manifest.files_on(self._catalog.node))
            with self._metrics.timed(S3, "write", part):
                missing = self.s3.put(manifest, source, self._catalog.node)
            if missing:
                nodes = sorted({f.node for f in manifest.files if f.path in missing})
                raise PartsMissing(
                    f"{key}: this node's part is on S3; waiting for the part of node(s) "
                    f"{', '.join(nodes)} ({len(missing)} file(s)) before the marker"
                )
        crash_point("s3-marker-written")
        self._committed(key, manifest.total_bytes)
        log.info(
            "uploaded %s to S3 (%d bytes, %.2fs)",
            key,
            manifest.total_bytes,
            time.perf_counter() - started,
            extra={"run": key.run, "step": key.step, "bytes": manifest.total_bytes, "tier": "S3"},
        )

    def _committed(self, key: CheckpointKey, nbytes: int) -> None:
        """S3 holds the whole of `key`, marker included: say so, or remove it if it went."""
        with self._lock:
            if self._closed.is_set() or self._catalog.tier_state(key, S3) == TIER_COMMITTED:
                return
            if self._catalog.save_of(key) is not None:
                self._catalog.set_tier(key, S3, TIER_COMMITTED, nbytes)
                self._metrics.commits.labels(TIER_LABELS[S3]).inc()
                self._notify(key, S3, nbytes)
                self._apply_retention(key.run)
            else:
                self._catalog.delete(key, s3_too=True)
                self.queue_removal(key)

    def queue_check(self, key: CheckpointKey) -> None:
        """A peer says S3 holds all of `key`: check its marker (another node wrote it)."""
        if self._catalog.tier_state(key, S3) != TIER_COMMITTED:
            self._queue.submit(("check", key), lambda: self._check(key))

    def _check(self, key: CheckpointKey) -> None:
        manifest = self.s3.manifest(key)
        ours = self._catalog.manifest(key)
        if manifest is not None and ours is not None and manifest.same_files(ours):
            self._committed(key, manifest.total_bytes)

    def _remove(self, key: CheckpointKey) -> None:
        with self._lock:
            save = self._catalog.save_of(key)
            if save is not None and self._catalog.tier_state(key, S3) == TIER_COMMITTED:
                self._catalog.deletion_done(key)
                return  # uploaded again meanwhile: wanted on S3 after all
        with self._metrics.timed(S3, "delete"):
            self.s3.delete(key)
        with self._lock:
            if not self._closed.is_set():
                self._catalog.deletion_done(key)

    def _job_failed(self, job_id: object, exc: BaseException, retry_in: float) -> None:
        kind, key = job_id  # type: ignore[misc]  # ("sync" | "upload" | "remove", key)
        reason = f"{describe(exc)} (retrying in {retry_in:.1f}s)"
        self._metrics.failed(S3, str(kind))
        log.warning("S3 job %s failed: %s", job_id, reason)
        if kind == "upload" and isinstance(key, CheckpointKey):
            state = PENDING if isinstance(exc, PartsMissing) else FAILED
            with self._lock:
                if not self._closed.is_set():
                    self._catalog.set_tier(key, S3, state, error=reason)
