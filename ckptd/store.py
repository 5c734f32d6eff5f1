"""CheckpointStore: the save/commit/read protocol of ckptd as a plain Python class.

No gRPC here: the servicer in `ckptd.server` only translates messages, and the command line opens
a store directly on a data dir to list, verify, export and remove offline. The store owns the
rules that make a checkpoint trustworthy:

- names are validated before they touch a path or an object key (`ckptd.names`);
- every chunk is CRC-32C checked, and every file's checksum, before the write's reply
  (`ckptd.ingest`);
- a checkpoint commits only with the metadata file and a shard file from every rank, and becomes
  visible only once durable on SSD with its marker (memory is filled at the same moment, S3 in
  the background, marker last: `ckptd.replication`); "latest" only ever names such a checkpoint,
  or a memory-only one (`open_save(memory_only=True)`): the same commit protocol, its files kept
  in the memory of the node that received them and of one peer, never on SSD or S3, restorable
  while every part is in some live node's memory;
- every read verifies the per-block CRCs of the bytes it returns, and falls through to the next
  tier when a copy is damaged or missing (`ckptd.reads`);
- retention (`ckptd.retention`) never drops a copy that no slower tier holds, unless no tier
  wants the checkpoint any more;
- a restart reconciles the catalog with the tiers' markers (rebuilding it if it was lost),
  re-queues what S3 still lacks, and a janitor aborts saves whose writer went away;
- one store at a time holds a data dir (`ckptd.datadir`).

The store composes its parts and wires them at start; each is a component with what it needs
passed in, all under one lock. Callers (`ckptd.server`, the data plane, the command line) call
the part that owns what they need, as in `store.saves.commit(...)` or
`store.member.checkpoints(...)`; the parts:

- `ckptd.saves.Saves`: open, write, commit and abort of this node's saves;
- `ckptd.member.ClusterMember`: the participant's half of the commit, the peers' catalogs and
  the cluster-wide queries (list, get, latest);
- `ckptd.holding.ReplicaHolding`: the copies of parts this node holds for the cluster;
- `ckptd.retainer.Retainer`: each run's retention applied to the tiers;
- `ckptd.reads.Reader` and `ckptd.replication.S3Replication`: reads and S3's background jobs.

What stays here: recovery at start, close, memory relief, the janitor, delete (with its fan-out
to the peers), export, and waiting for S3's background jobs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from ckptd.catalog import COMMITTED, OPEN, Catalog, SaveRecord
from ckptd.cluster import Coordinator, Peers
from ckptd.config import CkptdConfig
from ckptd.datadir import lock_data_dir, node_of
from ckptd.holding import ReplicaHolding, recover_replicas
from ckptd.member import ClusterMember
from ckptd.metrics import Metrics
from ckptd.names import key_of
from ckptd.observer import TierCommit, TierObserver
from ckptd.reads import Reader
from ckptd.replicas import ReplicaTiers
from ckptd.replication import S3Replication
from ckptd.retainer import Retainer
from ckptd.saves import Saves
from ckptd.states import ABSENT, FAILED, MEMORY, PENDING, S3, SSD, TIER_COMMITTED
from ckptd.tiers import CheckpointKey
from ckptd.tiers.memory import MemoryBudget, MemoryTier
from ckptd.tiers.s3 import S3Tier
from ckptd.tiers.ssd import SsdTier
from scaletrain.errors import FailedPrecondition, NotFound
from scaletrain.names import TIER_LABELS
from scaletrain.transport import DEFAULT_TIMEOUT_S
from scaletrain.v1 import checkpoint_pb2

__all__ = ["CheckpointStore", "TierCommit"]

log = logging.getLogger(__name__)


class CheckpointStore:
    """Checkpoints of one node: catalog + memory, SSD and (optionally) S3 tiers.

    Thread-safe; one store per data dir at a time (an flock enforces it).
    """

    def __init__(
        self,
        config: CkptdConfig,
        on_tier_commit: Callable[[TierCommit], None] | None = None,
    ) -> None:
        self.config = config
        data_dir = config.data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self._lockfile = lock_data_dir(data_dir)
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self.metrics = Metrics()
        self.budget = MemoryBudget(config.memory_budget_bytes, self._relieve_memory)
        self.memory = MemoryTier(self.budget)
        self.replicas = ReplicaTiers(data_dir, self.budget)
        self.s3: S3Tier | None = None
        self._replication: S3Replication | None = None
        try:
            self.node = node_of(data_dir, config.cluster.node)
            self.peers = Peers(
                config.cluster,
                self.node,
                on_reachable=lambda peer: self.metrics.peer_reachable.labels(peer.name).set(
                    int(peer.reachable)
                ),
            )
            coordinator = Coordinator(self.peers)
            self.catalog = Catalog(data_dir, node=self.node)
            self.ssd = SsdTier(data_dir / "ssd")
            still_open = self._recover()
            recover_replicas(self.catalog, self.replicas)
            if config.s3 is not None:
                self.s3 = S3Tier(config.s3)
            self._wire(config, coordinator, TierObserver(self.catalog, self.node, on_tier_commit))
            for record in still_open:
                self.saves.restore(record)
            if self._replication is not None:
                self._replication.start()
            else:
                for run in self.catalog.runs():
                    self.retainer.apply(run)
        except BaseException:
            self._lockfile.close()
            raise
        self.metrics.watch(
            lambda: self._replication.depth if self._replication else 0,
            lambda: self.budget.used,
            config.memory_budget_bytes,
            lambda: len(self.saves),
        )
        for tier in (MEMORY, SSD):
            self.metrics.replica_bytes.labels(TIER_LABELS[tier]).set_function(
                lambda tier=tier: self.catalog.replica_bytes(tier)
            )
        if config.maintain:
            self.holding.start_copying()
            threading.Thread(target=self._janitor_loop, name="ckptd-gc", daemon=True).start()

    def _wire(self, config: CkptdConfig, coordinator: Coordinator, observer: TierObserver) -> None:
        """Build the parts, each given the others it calls (none is started here)."""
        self.reader = Reader(
            self.catalog,
            self.memory,
            self.ssd,
            self.s3,
            self.metrics,
            self._lock,
            self.peers,
            self.replicas,
            observer.damaged,
        )
        self.retainer = Retainer(
            config,
            self.catalog,
            self.budget,
            self.memory,
            self.ssd,
            self.replicas,
            has_s3=self.s3 is not None,
        )
        if self.s3 is not None:
            self._replication = S3Replication(
                self.s3,
                self.catalog,
                self._lock,
                self._closed,
                self.metrics,
                self.reader,
                self.retainer.policy,
                self.retainer.apply,
                observer.notify,
            )
            self.retainer.attach(self._replication)
        self.holding = ReplicaHolding(
            config,
            self.node,
            self.peers,
            self.catalog,
            self.memory,
            self.ssd,
            self.budget,
            self.replicas,
            self.metrics,
            self._lock,
            self._closed,
            self.reader,
            self.retainer,
            observer.notify,
        )
        self.saves = Saves(
            config,
            self.node,
            self.peers,
            coordinator,
            self._lock,
            self.catalog,
            self.ssd,
            self.memory,
            self.budget,
            self.metrics,
            self.retainer,
            self.holding,
            observer.notify,
        )
        self.member = ClusterMember(
            self.node,
            self.peers,
            self.catalog,
            self.ssd,
            self._lock,
            self._closed,
            self.saves,
            self.holding,
            self.retainer,
            self._replication,
        )

    # -- startup ---------------------------------------------------------------------------------

    def _recover(self) -> list[SaveRecord]:
        """Bring the catalog in line with the SSD tier after a restart (clean, crashed or lost);
        returns the saves still open, for `Saves` to track again.

        The SSD markers are the truth: a directory with a marker is a committed checkpoint even
        if ckptd died before its catalog said so (or the catalog is gone).
        """
        self.ssd.clean_leftovers()
        for key in self.catalog.committed_on(MEMORY):
            self.catalog.set_tier(key, MEMORY, ABSENT)
        on_disk = set()
        for key in self.ssd.list():
            try:
                manifest = self.ssd.manifest(key)
            except (OSError, ValueError) as exc:
                log.error("SSD copy of %s has an unreadable marker (%s); ignoring it", key, exc)
                continue
            on_disk.add(key)
            save = self.catalog.save_of(key)
            if (
                save is None
                or save.state != COMMITTED
                or self.catalog.tier_state(key, SSD)
                in (
                    ABSENT,
                    PENDING,
                )
            ):
                log.info("recovered %s from its SSD marker", key, extra={"run": key.run})
                self.catalog.record_commit(manifest, SSD)
        still_open: dict[str, SaveRecord] = {}
        for record in self.catalog.saves_in(OPEN):
            if record.memory_only:
                # Its files were in memory only: nothing of it survived. If it committed anyway
                # (this node voted), the sync records the step without this node's part.
                self.catalog.abort_save(record.key, "ckptd restarted: a memory-only save is lost")
                continue
            # Staged files survive a restart (the client may finish the save); the memory copies
            # of them did not. The janitor aborts the save if nobody writes to it again, unless
            # this node voted on it: then only its outcome decides (ckptd.cluster).
            still_open[record.save_id] = record
            self.ssd.staging_dir(record.save_id).mkdir(parents=True, exist_ok=True)
        for save_id in self.ssd.staged_saves():
            if save_id not in still_open:
                self.ssd.discard_staging(save_id)
        for key in self.catalog.committed_on(SSD):
            if key not in on_disk:  # the marker is written before the rename: no marker, no copy
                self.catalog.set_tier(key, SSD, FAILED, error="directory missing at startup")
        return list(still_open.values())

    def close(self, timeout_s: float = 5.0) -> None:
        """Give an S3 job in flight `timeout_s` to finish, drop the memory tier, release."""
        if self._closed.is_set():
            return
        self._closed.set()
        # A file already accepted reaches the disk first: its save may be finished after the
        # restart, and the staged file is all that survives of it.
        with self._lock:
            accepted = list(self.saves.uploads(accepted_only=True))
        deadline = time.monotonic() + timeout_s
        for upload in accepted:
            upload.settle(max(0.0, deadline - time.monotonic()))
        self.holding.stop_copying()
        if self._replication is not None:
            self._replication.close(timeout_s)  # and S3's client
        with self._lock:
            for key in self.memory.list():
                self.memory.delete(key)
                self.catalog.set_tier(key, MEMORY, ABSENT)
            while self.holding.relieve_replicas():
                pass
            self.catalog.close()
            self._lockfile.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_background(self, timeout_s: float) -> bool:
        """Wait until S3 has nothing left to do (uploads, removals); False on timeout."""
        return self._replication is None or self._replication.wait_idle(timeout_s)

    def export(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        dest_dir: Path,
        progress: Callable[[int], None] | None = None,
    ) -> list[Path]:
        """Write a committed checkpoint as a plain DCP directory (`Reader.export`)."""
        return self.reader.export(self.member.checkpoint(ref), dest_dir, progress)

    # -- memory pressure and garbage -------------------------------------------------------------

    def _relieve_memory(self) -> None:
        """The budget is full: evict the oldest memory-only copy (own or a replica), else the
        oldest memory copy a durable tier holds, else spill.

        A memory-only copy goes first and is never refused: it only spares the steps since the
        last durable checkpoint, and its run falls back to that one without it. Called by
        writers waiting for memory; what can never be freed here is data not yet on disk, and
        the writer threads free that as they write.
        """
        with self._lock:
            if self._evict_memory_only() or self.holding.relieve_replicas():
                return
            for key in self.memory.list():
                if any(self.catalog.tier_state(key, t) == TIER_COMMITTED for t in (SSD, S3)):
                    self.memory.delete(key)
                    self.catalog.set_tier(key, MEMORY, ABSENT)
                    log.info("evicted %s from memory: the budget is full", key)
                    return
            uploads = list(self.saves.uploads())
        for upload in uploads:
            upload.spill()

    def _evict_memory_only(self) -> bool:
        """Evict the oldest memory-only copy this node holds, its own part's or a replica;
        whether one was."""
        held = [(key, "") for key in self.memory.list()] + [
            (key, owner)
            for owner, tier in self.replicas.memory_tiers().items()
            for key in tier.list()
        ]
        for key, owner in sorted(held, key=lambda item: item[0].step):
            record = self.catalog.save_of(key)
            if record is None or not record.memory_only:
                continue
            if owner:
                self.replicas.memory(owner).delete(key)
                self.catalog.set_replica(key, owner, MEMORY, ABSENT)
            else:
                self.memory.delete(key)
                self.catalog.set_tier(key, MEMORY, ABSENT)
            log.info("evicted memory-only %s (%s) from memory: the budget is full", key,
                     f"node {owner}'s part" if owner else "own part")  # fmt: skip
            return True
        return False

    def _janitor_loop(self) -> None:
        """Abort saves whose writers went away; forget aborted saves after the same timeout."""
        timeout = self.config.abandon_after_s
        while not self._closed.wait(min(30.0, timeout / 4)):
            for save_id in self.saves.abandoned(timeout):
                try:
                    self.saves.abort(save_id, f"abandoned: no write for {timeout:g}s")
                except Exception:  # it was committed or aborted meanwhile
                    continue
            with self._lock:
                if not self._closed.is_set():
                    self.catalog.purge_aborted(time.time() - timeout)

    # -- delete ----------------------------------------------------------------------------------

    def delete(
        self, ref: checkpoint_pb2.CheckpointRef, local_only: bool = False
    ) -> tuple[list[int], list[int]]:
        """Remove a checkpoint (or an open or aborted save) from every tier of every node.

        Returns (tiers it was removed from, tiers it is still being removed from): S3 removal
        runs in the background, so a slow or unreachable S3 delays nothing. The checkpoint is
        invisible at once, and a restart finishes the S3 removal (the catalog remembers it).
        `local_only` (a peer passing the removal on) removes only this node's part and entry.
        """
        removed, pending = self._delete_here(key_of(ref), s3_too=not local_only)
        if not local_only:
            request = checkpoint_pb2.DeleteCheckpointRequest(ref=ref, local_only=True)
            answers = self.peers.call(
                self.peers.all(),
                lambda p: p.checkpoints().DeleteCheckpoint(request, timeout=DEFAULT_TIMEOUT_S),
            )
            for address, answer in answers.items():
                if isinstance(answer, BaseException) and not (
                    isinstance(answer, grpc.RpcError) and answer.code() == grpc.StatusCode.NOT_FOUND
                ):
                    log.warning("peer %s did not remove its part of %s: %s", address, ref, answer)
        return removed, pending

    def _delete_here(self, key: CheckpointKey, s3_too: bool) -> tuple[list[int], list[int]]:
        with self._lock:
            record = self.catalog.save_of(key)
            if record is None:
                raise NotFound(f"no checkpoint {key}")
            s3_state = self.catalog.tier_state(key, S3)
            if s3_too and self.s3 is None and s3_state == TIER_COMMITTED:
                raise FailedPrecondition(
                    f"{key} has a copy on S3 but this ckptd has no S3 configured to delete it from"
                )
            if record.state == OPEN:
                save = self.saves.get(record.save_id)
                if save is not None and save.committing:
                    raise FailedPrecondition(f"checkpoint {key} is being committed right now")
                self.saves.drop(record.save_id)
            removed, pending = [], []
            if self.memory.delete(key):
                removed.append(MEMORY)
            if self.ssd.delete(key):
                removed.append(SSD)
            self.replicas.delete(key)
            s3_objects = s3_too and self.s3 is not None and s3_state != ABSENT
            self.catalog.delete(key, s3_too=s3_objects)
            self.member.forget(key)
            if s3_objects:
                self.retainer.queue_removal(key)
                pending.append(S3)
        log.info("deleted %s", key, extra={"run": key.run, "step": key.step})
        return removed, pending
