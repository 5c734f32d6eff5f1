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
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ckptd import cluster
from ckptd.catalog import COMMITTED, OPEN, Catalog, Coordination, SaveRecord
from ckptd.cluster import Coordinator, Peers, check_votes, new_epoch, vote_problems
from ckptd.config import CkptdConfig
from ckptd.crash import crash_point
from ckptd.datadir import lock_data_dir, node_of
from ckptd.holding import ReplicaHolding
from ckptd.ingest import FileUpload
from ckptd.manifest import FileRecord, Manifest
from ckptd.member import ClusterMember
from ckptd.metrics import Metrics
from ckptd.names import MAX_WORLD_SIZE, check_path, check_run, key_of
from ckptd.reads import READ_PIECE_BYTES, Piece, Reader
from ckptd.replicas import ReplicaTiers, Replicator, copies_for_safety
from ckptd.replication import S3Replication
from ckptd.retention import RetentionPolicy, droppable, wanted
from ckptd.states import ABSENT, FAILED, MEMORY, METADATA, PENDING, S3, SHARD, SSD, TIER_COMMITTED
from ckptd.tiers import CheckpointKey
from ckptd.tiers.memory import MemoryBudget, MemoryTier, release
from ckptd.tiers.s3 import S3Tier
from ckptd.tiers.ssd import SsdTier
from ckptd.wire import Chunk
from scaletrain.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ScaletrainError,
    Unavailable,
)
from scaletrain.names import TIER_LABELS
from scaletrain.transport import DEFAULT_TIMEOUT_S
from scaletrain.v1 import checkpoint_pb2

log = logging.getLogger(__name__)


# -- saves -----------------------------------------------------------------------------------------


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


@dataclass
class _OpenSave:
    """What the store tracks of a save in progress besides the catalog rows."""

    record: SaveRecord
    # Whether its files' chunks are kept for the memory tier (until memory runs short).
    retain: bool
    # Files being streamed, and the accepted file of each path (its disk write may still run).
    streaming: set[FileUpload] = field(default_factory=set)
    files: dict[str, FileUpload] = field(default_factory=dict)
    committing: bool = False
    touched: float = field(default_factory=time.monotonic)
    # Bytes of its files, accepted or being streamed (checked against max_checkpoint_bytes).
    bytes: int = 0


class _Stream:
    """The context of one WriteFile stream: leaving it without `finish` stores nothing."""

    def __init__(self, store: CheckpointStore, save: _OpenSave, upload: FileUpload) -> None:
        self._store, self._save, self.upload = store, save, upload
        self.path = upload.path
        self._done = False

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._done:
            self.upload.cancel()
        self._store._stream_ended(self._save, self.upload)

    def write(self, chunk: checkpoint_pb2.FileChunk | Chunk) -> None:
        self._save.touched = time.monotonic()
        before = self.upload.size
        self.upload.write(chunk)
        self._store._grew(self._save, self.upload.size - before)

    def finish(self, trailer: checkpoint_pb2.FileTrailer) -> FileRecord:
        record = self.upload.finish(trailer)
        self._store._accept(self._save, record, self.upload)
        self._done = True
        self.upload.end_input()
        return record


# -- the store -------------------------------------------------------------------------------------


class CheckpointStore(ClusterMember, ReplicaHolding):
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
        self._saves: dict[str, _OpenSave] = {}
        # Checkpoints deleted here, which a peer's catalog may still list for a while.
        self._forgotten: set[CheckpointKey] = set()
        self._on_tier_commit = on_tier_commit
        self.metrics = Metrics()
        self.budget = MemoryBudget(config.memory_budget_bytes, self._relieve_memory)
        self.memory = MemoryTier(self.budget)
        self.replicas = ReplicaTiers(data_dir, self.budget)
        self.s3: S3Tier | None = None
        self._replication: S3Replication | None = None
        self._replicator: Replicator | None = None
        try:
            self.node = node_of(data_dir, config.cluster.node)
            self.peers = Peers(
                config.cluster,
                self.node,
                on_reachable=lambda peer: self.metrics.peer_reachable.labels(peer.name).set(
                    int(peer.reachable)
                ),
            )
            self._coordinator = Coordinator(self.peers)
            self.catalog = Catalog(data_dir, node=self.node)
            self.ssd = SsdTier(data_dir / "ssd")
            self._recover()
            self.recover_replicas()
            if config.s3 is not None:
                self.s3 = S3Tier(config.s3)
            self._reader = Reader(
                self.catalog, self.memory, self.ssd, self.s3, self.metrics, self._lock,
                self.peers, self.replicas, self._damaged,
            )  # fmt: skip
            if self.s3 is not None:
                self._replication = S3Replication(
                    self.s3,
                    self.catalog,
                    self._lock,
                    self._closed,
                    self.metrics,
                    self._reader,
                    self.policy,
                    self._apply_retention,
                    self._notify,
                )
                self._replication.start()
            else:
                for run in self.catalog.runs():
                    self._apply_retention(run)
        except BaseException:
            self._lockfile.close()
            raise
        self.metrics.watch(
            lambda: self._replication.depth if self._replication else 0,
            lambda: self.budget.used,
            config.memory_budget_bytes,
            lambda: len(self._saves),
        )
        for tier in (MEMORY, SSD):
            self.metrics.replica_bytes.labels(TIER_LABELS[tier]).set_function(
                lambda tier=tier: self.catalog.replica_bytes(tier)
            )
        if config.maintain:
            self._replicator = Replicator(
                self.copy_job, config.cluster.replica_bytes_s, self._closed
            )
            threading.Thread(target=self._janitor_loop, name="ckptd-gc", daemon=True).start()

    # -- startup ---------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Bring the catalog in line with the SSD tier after a restart (clean, crashed or lost).

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
        for record in self.catalog.saves_in(OPEN):
            if record.memory_only:
                # Its files were in memory only: nothing of it survived. If it committed anyway
                # (this node voted), the sync records the step without this node's part.
                self.catalog.abort_save(record.key, "ckptd restarted: a memory-only save is lost")
                continue
            # Staged files survive a restart (the client may finish the save); the memory copies
            # of them did not. The janitor aborts the save if nobody writes to it again, unless
            # this node voted on it: then only its outcome decides (ckptd.cluster).
            self._saves[record.save_id] = _OpenSave(
                record, retain=False, committing=record.prepared
            )
            self.ssd.staging_dir(record.save_id).mkdir(parents=True, exist_ok=True)
        for save_id in self.ssd.staged_saves():
            if save_id not in self._saves:
                self.ssd.discard_staging(save_id)
        for key in self.catalog.committed_on(SSD):
            if key not in on_disk:  # the marker is written before the rename: no marker, no copy
                self.catalog.set_tier(key, SSD, FAILED, error="directory missing at startup")

    def close(self, timeout_s: float = 5.0) -> None:
        """Give an S3 job in flight `timeout_s` to finish, drop the memory tier, release."""
        if self._closed.is_set():
            return
        self._closed.set()
        # A file already accepted reaches the disk first: its save may be finished after the
        # restart, and the staged file is all that survives of it.
        with self._lock:
            accepted = [u for save in self._saves.values() for u in save.files.values()]
        deadline = time.monotonic() + timeout_s
        for upload in accepted:
            upload.settle(max(0.0, deadline - time.monotonic()))
        if self._replicator is not None:
            self._replicator.close()
        if self._replication is not None:
            self._replication.close(timeout_s)  # and S3's client
        with self._lock:
            for key in self.memory.list():
                self.memory.delete(key)
                self.catalog.set_tier(key, MEMORY, ABSENT)
            while self.relieve_replicas():
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

    # -- save ------------------------------------------------------------------------------------

    def policy(self, run: str) -> RetentionPolicy:
        return self.catalog.policy(run) or self.config.retention

    def retains(self, run: str) -> bool:
        """Whether `run`'s new copies (a save's files, a replica) are kept in memory too."""
        return self.budget.total > 0 and self.policy(run).memory_last > 0

    def open_save(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        world_size: int,
        labels: Mapping[str, str] | None = None,
        retention: RetentionPolicy | None = None,
        replicas: int = 0,
        memory_only: bool = False,
    ) -> str:
        """Start a save attempt of (run, step); an uncommitted earlier attempt is replaced.
        `retention` and `replicas` (R), if given, are the run's from now on. `memory_only`: a
        checkpoint kept in memory only (see the module doc)."""
        key = key_of(ref)
        if memory_only and self.budget.total <= 0:
            raise FailedPrecondition(
                f"memory-only checkpoint {key}: this ckptd has no memory tier (its memory budget "
                "is 0)"
            )
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"world size must be 1..{MAX_WORLD_SIZE}, got {world_size}")
        if replicas < 0:
            raise InvalidArgument(f"replicas must be >= 1 (0: keep the run's), got {replicas}")
        self.check_replicas(replicas or (retention.replicas if retention else 0))
        with self._lock:
            existing = self.catalog.save_of(key)
            if existing is not None:
                if existing.state == COMMITTED:
                    raise AlreadyExists(
                        f"checkpoint {key} is already committed; delete it or save another step"
                    )
                stale = self._saves.get(existing.save_id)
                if stale is not None and stale.committing:
                    raise FailedPrecondition(f"checkpoint {key} is being committed right now")
                self._drop_save(existing.save_id)
            if retention is not None or replicas or self.catalog.policy(key.run) is None:
                # A run keeps the policy it started with, even if ckptd's default changes.
                policy = retention or self.policy(key.run)
                if replicas:
                    policy = dataclasses.replace(policy, replicas=replicas)
                self.catalog.set_policy(key.run, policy)
            save_id = uuid.uuid4().hex
            coordination = Coordination(
                new_epoch(self.catalog.epoch_of(key)), self.node, self.peers.address
            )
            return self._open(
                key, save_id, world_size, dict(labels or {}), coordination, memory_only
            ).save_id

    def _open(
        self,
        key: CheckpointKey,
        save_id: str,
        world_size: int,
        labels: dict[str, str],
        coordination: Coordination,
        memory_only: bool = False,
    ) -> SaveRecord:
        """Record a save attempt and make room for its files (under the lock): a staging dir
        on SSD, or for a memory-only save nothing but their place in the memory budget."""
        if self.catalog.deleting(key):
            raise FailedPrecondition(
                f"checkpoint {key} is still being removed from S3; save it again later"
            )
        self.catalog.open_save(key, save_id, world_size, labels, coordination, memory_only)
        if not memory_only:
            self.ssd.staging_dir(save_id).mkdir(parents=True)
        record = self.catalog.save(save_id)
        assert record is not None
        self._saves[save_id] = _OpenSave(record, retain=memory_only or self.retains(key.run))
        return record

    def coordination(self, save_id: str) -> Coordination:
        """Who coordinates the save `save_id`, and its epoch."""
        record = self.catalog.save(save_id)
        if record is None:
            raise NotFound(f"unknown save {save_id!r}")
        return record.coordination

    def _drop_save(self, save_id: str) -> None:
        """Forget an open save: cancel its streams' files, release memory, remove its staging."""
        save = self._saves.pop(save_id, None)
        if save is not None:
            for upload in (*save.streaming, *save.files.values()):
                upload.spill()
        self.ssd.discard_staging(save_id)

    def _drop_aborted(self, record: SaveRecord, reason: str) -> None:
        """Forget an open save and record it aborted, with `reason` on one line (under the lock)."""
        self._drop_save(record.save_id)
        self.catalog.abort_save(record.key, " ".join(reason.split())[:500])

    def _writable(self, save_id: str) -> _OpenSave:
        """The open save `save_id`, or the reason it cannot take writes or a commit."""
        save = self._saves.get(save_id)
        if save is not None:
            if save.committing:
                raise FailedPrecondition(f"save {save_id} of {save.record.key} is being committed")
            return save
        record = self.catalog.save(save_id)
        if record is None:
            raise NotFound(f"unknown save {save_id!r}; open a save first")
        if record.state == COMMITTED:
            raise FailedPrecondition(
                f"save {save_id} is already committed as {record.key}; open a new save"
            )
        raise FailedPrecondition(f"save {save_id} of {record.key} was aborted")

    def check_header(self, header: checkpoint_pb2.FileHeader) -> None:
        """Raise what `begin_file` would refuse in `header`, without starting the file (the
        fast path checks a header before its bytes arrive)."""
        with self._lock:
            self._check_header(header)

    def _check_header(self, header: checkpoint_pb2.FileHeader) -> _OpenSave:
        """The open save `header` writes to, or the reason it may not (under the lock)."""
        check_path(header.path)
        if header.kind not in (SHARD, METADATA):
            raise InvalidArgument(
                f"{header.path}: kind must be FILE_KIND_SHARD or FILE_KIND_METADATA"
            )
        save = self._writable(header.save_id)
        world_size = save.record.world_size
        if not 0 <= header.rank < world_size:
            raise InvalidArgument(
                f"{header.path}: rank {header.rank} is outside 0..{world_size - 1}"
            )
        if header.kind == METADATA:
            for other in self.catalog.files(save.record.key):
                if other.kind == METADATA and other.path != header.path:
                    raise InvalidArgument(
                        f"{header.path}: save already has the metadata file {other.path}"
                    )
        return save

    def begin_file(
        self,
        header: checkpoint_pb2.FileHeader,
        on_settled: Callable[[int], None] | None = None,
    ) -> _Stream:
        """Start receiving one file of an open save (the streaming form of `write_file`);
        `on_settled` as FileUpload takes it."""
        with self._lock:
            save = self._check_header(header)
            try:
                incoming = None if save.record.memory_only else self.ssd.incoming_file()
            except OSError as exc:
                raise Unavailable(f"{header.path}: ckptd cannot write to its SSD: {exc}") from None
            upload = FileUpload(
                header,
                incoming,
                self.budget,
                save.retain,
                lambda up: self._written(save, up),
                self.metrics,
                on_settled,
            )
            save.streaming.add(upload)
            save.touched = time.monotonic()
        return _Stream(self, save, upload)

    def write_file(
        self,
        header: checkpoint_pb2.FileHeader,
        chunks: Iterable[checkpoint_pb2.FileChunk | Chunk],
        trailer: checkpoint_pb2.FileTrailer,
    ) -> FileRecord:
        """Receive a whole file: chunks in order, each CRC-checked, then the size and the file's
        checksum."""
        with self.begin_file(header) as stream:
            for chunk in chunks:
                stream.write(chunk)
            return stream.finish(trailer)

    def _stream_ended(self, save: _OpenSave, upload: FileUpload) -> None:
        with self._lock:
            save.streaming.discard(upload)
            save.touched = time.monotonic()
            if save.files.get(upload.path) is not upload:
                save.bytes -= upload.size  # not accepted: its bytes count no more

    def _grew(self, save: _OpenSave, nbytes: int) -> None:
        """Count `nbytes` more of a save; refuse them when the checkpoint would be too big."""
        limit = self.config.max_checkpoint_bytes
        with self._lock:
            save.bytes += nbytes
            total = save.bytes
        if total > limit:
            raise ResourceExhausted(
                f"checkpoint {save.record.key} would hold over {limit} bytes, "
                "ckptd's max_checkpoint_bytes"
            )

    def run_of_save(self, save_id: str) -> str | None:
        """The run a save was opened for (to authorize writes to it); None for an unknown id."""
        with self._lock:
            save = self._saves.get(save_id)
            record = save.record if save is not None else self.catalog.save(save_id)
        return record.key.run if record is not None else None

    def _current(self, save: _OpenSave) -> bool:
        return self._saves.get(save.record.save_id) is save

    def _accept(self, save: _OpenSave, record: FileRecord, upload: FileUpload) -> None:
        """A verified file joins its save (its bytes may still be on their way to the disk)."""
        with self._lock:
            if not self._current(save) or save.committing:
                raise FailedPrecondition(
                    f"{record.path}: save {save.record.save_id} was replaced, aborted or "
                    "committed while the file was being written"
                )
            record = dataclasses.replace(record, node=self.node)
            self.catalog.add_file(save.record.key, record)
            replaced = save.files.get(record.path)
            save.files[record.path] = upload
            if replaced is not None:
                save.bytes -= replaced.size
        if replaced is not None:
            replaced.spill()

    def _written(self, save: _OpenSave, upload: FileUpload) -> None:
        """Writer thread: the file is on disk; stage it if it is still its save's current copy."""
        with self._lock:
            if self._current(save) and save.files.get(upload.path) is upload:
                if upload.incoming is not None:  # a memory-only file has nothing to stage
                    self.ssd.stage(upload.incoming, save.record.save_id, upload.path)
                    crash_point("file-staged")
                return
        if upload.incoming is not None:
            upload.incoming.discard()
        upload.spill()

    def _forget_file(self, save: _OpenSave, upload: FileUpload) -> None:
        """A file of the save failed after it was accepted (the disk): it leaves the save, which
        needs it written again."""
        with self._lock:
            if save.files.get(upload.path) is upload:
                del save.files[upload.path]
                save.bytes -= upload.size
                self.catalog.remove_file(save.record.key, upload.path)

    def _freeze(self, save_id: str) -> tuple[_OpenSave, list[FileRecord]]:
        """Stop a save taking writes and wait for its files here to be on disk; returns them.

        The first half of a commit, on the coordinator and on every node that votes.
        """
        with self._lock:
            save = self._writable(save_id)
            key = save.record.key
            if save.streaming:
                raise FailedPrecondition(
                    f"cannot commit {key}: {len(save.streaming)} file(s) are still being written"
                )
            save.committing = True
        try:
            for upload in list(save.files.values()):
                try:
                    upload.wait_written()
                except ScaletrainError as exc:
                    self._forget_file(save, upload)
                    raise type(exc)(f"cannot commit {key}: {exc}") from None
            with self._lock:
                files = self.catalog.files(key)
                if save.record.memory_only:
                    self._check_in_memory(save, files)
                else:
                    self._check_staged(save.record, files)
        except BaseException:
            with self._lock:
                save.committing = False
            raise
        return save, files

    def commit(self, save_id: str) -> checkpoint_pb2.CheckpointInfo:
        """Make the save a checkpoint on every node: this node's part durable on SSD (and in
        memory) now, every peer's once it voted (`ckptd.cluster`), S3 in the background."""
        started = time.perf_counter()
        save, files = self._freeze(save_id)
        record = save.record
        key = record.key
        phase = self.metrics.commit_phase
        try:
            phase.labels("local").observe(time.perf_counter() - started)
            with phase.labels("prepare").time():
                votes = self._coordinator.prepare(
                    record,
                    lambda v: not vote_problems(record.world_size, [*files, *v.files], v),
                )
            everything = sorted([*files, *votes.files], key=lambda f: f.path)
            check_votes(key, record.world_size, everything, votes)
            crash_point("cluster-voted")
            manifest = Manifest(
                key=key,
                world_size=record.world_size,
                files=tuple(everything),
                labels=record.labels,
                created_at=record.created_at,
                committed_at=time.time(),
                epoch=record.coordination.epoch,
                coordinator=self.node,
                memory_only=record.memory_only,
            )
            # This node's commit marker is the decision: from here on the step is committed.
            with phase.labels("decide").time():
                info = self._commit_part(save, manifest)
        except BaseException:
            with self._lock:
                save.committing = False
            raise
        crash_point("cluster-decided")
        with phase.labels("notify").time():
            self._coordinator.decide(
                record, manifest, retention=self.policy(key.run).to_proto(),
                unreachable=votes.unreachable,
            )  # fmt: skip
        self.offer_replicas(manifest)
        log.info(
            "committed %s (%d bytes on %d node(s), %.3fs)", key, manifest.total_bytes,
            len({f.node for f in manifest.files}), time.perf_counter() - started,
            extra={"run": key.run, "step": key.step, "bytes": manifest.total_bytes},
        )  # fmt: skip
        return info

    def _commit_part(self, save: _OpenSave, manifest: Manifest) -> checkpoint_pb2.CheckpointInfo:
        """This node's part of a committed checkpoint: onto SSD with the checkpoint's marker,
        into memory, and queued for S3; a memory-only one's into memory alone."""
        key = manifest.key
        mine = manifest.files_on(self.node)
        if manifest.memory_only:
            return self._commit_to_memory(save, manifest, mine)
        try:
            with self.metrics.timed(SSD, "commit"):
                self.ssd.put(manifest, save.record.save_id)
        except OSError as exc:
            raise Unavailable(f"cannot commit {key} to SSD: {exc}") from None
        total = sum(f.size for f in mine)
        with self._lock:
            self._saves.pop(save.record.save_id, None)
            self.catalog.record_commit(manifest, SSD)
            crash_point("ssd-committed")
            self.metrics.commits.labels(TIER_LABELS[SSD]).inc()
            self._notify(key, SSD, total)
            memory = {path: upload.take_memory() for path, upload in save.files.items()}
            if all(m is not None for m in memory.values()) and set(memory) == {
                f.path for f in mine
            }:
                self.memory.put(key, memory)  # type: ignore[arg-type]
                self.catalog.set_tier(key, MEMORY, TIER_COMMITTED, total)
                self.metrics.commits.labels(TIER_LABELS[MEMORY]).inc()
                self.metrics.bytes.labels(TIER_LABELS[MEMORY], "write").inc(total)
                self._notify(key, MEMORY, total)
            else:
                for m in memory.values():
                    if m is not None:
                        self.budget.release(m.size)
                        self.budget.recycle(m.chunks)  # the files are written: nothing reads
            self._apply_retention(key.run)
            info = self.catalog.info(key)
        assert info is not None
        return info

    def _commit_to_memory(
        self, save: _OpenSave, manifest: Manifest, mine: tuple[FileRecord, ...]
    ) -> checkpoint_pb2.CheckpointInfo:
        """This node's part of a memory-only checkpoint, into its memory tier (no SSD, no S3):
        the part's one copy here, and its copy to a peer comes from `offer_replicas`."""
        key = manifest.key
        total = sum(f.size for f in mine)
        with self._lock:
            self._saves.pop(save.record.save_id, None)
            memory = {path: upload.take_memory() for path, upload in save.files.items()}
            whole = all(m is not None for m in memory.values()) and set(memory) == {
                f.path for f in mine
            }
            self.catalog.record_commit(manifest, MEMORY if whole else None)
            if whole:
                self.memory.put(key, memory)  # type: ignore[arg-type]
                self.metrics.commits.labels(TIER_LABELS[MEMORY]).inc()
                self.metrics.bytes.labels(TIER_LABELS[MEMORY], "write").inc(total)
                self._notify(key, MEMORY, total)
            else:
                # Spilled under memory pressure since the vote: the step is committed, but this
                # node's part only lives on where a peer holds it (latest then passes it by).
                release({p: m for p, m in memory.items() if m is not None}, self.budget)
                log.warning("memory-only %s lost this node's part to memory pressure", key)
            self._apply_retention(key.run)
            info = self.catalog.info(key)
        assert info is not None
        return info

    def _check_in_memory(self, save: _OpenSave, files: list[FileRecord]) -> None:
        """Refuse to commit a memory-only save whose files here were spilled from memory."""
        spilled = [f.path for f in files if not save.files[f.path].keeps_memory]
        if spilled:
            raise ResourceExhausted(
                f"cannot commit memory-only {save.record.key}: ckptd's memory budget is full "
                f"and {len(spilled)} of its files here left memory ({', '.join(spilled[:3])})"
            )

    def _check_staged(self, save: SaveRecord, files: list[FileRecord]) -> None:
        staging = self.ssd.staging_dir(save.save_id)
        problems = []
        for f in files:
            staged = staging / f.path
            if not staged.is_file() or staged.stat().st_size != f.size:
                problems.append(f"staged file {f.path} is missing or truncated; write it again")
        if problems:
            raise FailedPrecondition(f"cannot commit {save.key}: " + "; ".join(problems))

    def abort(self, save_id: str, reason: str = "") -> None:
        """Drop a save in progress and its staged files; aborting twice is harmless."""
        with self._lock:
            save = self._saves.get(save_id)
            if save is None:
                record = self.catalog.save(save_id)
                if record is None:
                    raise NotFound(f"unknown save {save_id!r}")
                if record.state == COMMITTED:
                    raise FailedPrecondition(
                        f"save {save_id} is committed as {record.key}; delete the checkpoint"
                    )
                return
            if save.committing:
                raise FailedPrecondition(f"save {save_id} of {save.record.key} is being committed")
            self._drop_aborted(save.record, reason)
        log.info("aborted save %s of %s: %s", save_id, save.record.key, reason)
        if save.record.coordination.coordinator == self.node:
            self._coordinator.decide(save.record, None, reason)

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
            if self._evict_memory_only() or self.relieve_replicas():
                return
            for key in self.memory.list():
                if any(self.catalog.tier_state(key, t) == TIER_COMMITTED for t in (SSD, S3)):
                    self.memory.delete(key)
                    self.catalog.set_tier(key, MEMORY, ABSENT)
                    log.info("evicted %s from memory: the budget is full", key)
                    return
            uploads = [
                upload
                for save in self._saves.values()
                for upload in (*save.streaming, *save.files.values())
            ]
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
            now = time.monotonic()
            with self._lock:
                stale = [
                    save_id
                    for save_id, save in self._saves.items()
                    if not save.committing and now - save.touched > timeout
                ]
            for save_id in stale:
                try:
                    self.abort(save_id, f"abandoned: no write for {timeout:g}s")
                except Exception:  # it was committed or aborted meanwhile
                    continue
            with self._lock:
                if not self._closed.is_set():
                    self.catalog.purge_aborted(time.time() - timeout)

    # -- retention -------------------------------------------------------------------------------

    def _apply_retention(self, run: str) -> None:
        """Drop the copies of `run`'s checkpoints that no tier wants; queue S3 uploads it lacks.

        Called with the lock held after every tier commit, and at startup.
        """
        if not self.config.maintain:
            return
        states = self.catalog.run_states(run)
        on_s3 = [s for s, tiers in states.items() if tiers.get(S3) == TIER_COMMITTED]
        wants = wanted(
            self.policy(run), list(states), on_s3, has_s3=self.s3 is not None,
            keep=self.catalog.latest_safe(run).get(run),
            memory_only=self.catalog.memory_only_steps(run),
        )  # fmt: skip
        if self.s3 is None:
            for step in on_s3:  # a store without S3 (offline) cannot manage S3's copies
                wants[step].add(S3)
        self.retain_replicas(run, wants, set(on_s3))
        for step, tiers in states.items():
            key = CheckpointKey(run, step)
            held = {t: tiers.get(t) == TIER_COMMITTED for t in (MEMORY, SSD, S3)}
            drops = droppable(wants[step], held)
            for tier in drops:
                self._drop_copy(key, tier)
            if not wants[step]:
                s3_objects = self.s3 is not None and tiers.get(S3, ABSENT) != ABSENT
                self.replicas.delete(key)
                self.catalog.delete(key, s3_too=s3_objects)
                if s3_objects:
                    self._s3_jobs().queue_removal(key)
                log.info("retention removed %s", key, extra={"run": run, "step": step})
            elif S3 in wants[step] and not held[S3] and self._replication is not None:
                self._replication.queue_upload(key)

    def _drop_copy(self, key: CheckpointKey, tier: int) -> None:
        if tier == MEMORY:
            self.memory.delete(key)
        elif tier == SSD:
            self.ssd.delete(key)
        else:
            self.catalog.queue_deletion(key)
            self._s3_jobs().queue_removal(key)
        self.catalog.set_tier(key, tier, ABSENT)
        log.info("retention dropped the %s copy of %s", TIER_LABELS[tier], key)

    # -- read (`ckptd.reads`) -------------------------------------------------------------------

    def iter_range(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        path: str,
        offset: int = 0,
        length: int = 0,
        piece_bytes: int = READ_PIECE_BYTES,
        tier: int = 0,
        local_only: bool = False,
        lend: bool = False,
    ) -> Iterator[Piece]:
        """Yield the pieces of a committed file, each with the copy that served it
        (`Reader.iter_range`)."""
        return self._reader.iter_range(
            ref, path, offset, length, piece_bytes, tier, local_only, lend
        )

    def open_elsewhere(
        self, request: checkpoint_pb2.OpenReadRequest
    ) -> checkpoint_pb2.OpenReadResponse | None:
        """A peer's ticket for a range this node holds no copy of (`Reader.open_elsewhere`)."""
        return self._reader.open_elsewhere(request)

    def read_range(
        self, ref: checkpoint_pb2.CheckpointRef, path: str, offset: int = 0, length: int = 0
    ) -> bytes:
        return self._reader.read_range(ref, path, offset, length)

    def export(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        dest_dir: Path,
        progress: Callable[[int], None] | None = None,
    ) -> list[Path]:
        """Write a committed checkpoint as a plain DCP directory (`Reader.export`)."""
        return self._reader.export(self.get(ref), dest_dir, progress)

    # -- replica rate ----------------------------------------------------------------------------

    def set_replica_rate(self, bytes_s: float) -> float:
        """Copy parts to peers at `bytes_s` from now on (0: no limit); returns the rate before.
        A node that keeps no replicas (no maintenance thread) has nothing to throttle."""
        if bytes_s < 0 or bytes_s != bytes_s:
            raise InvalidArgument(f"replica rate must be >= 0 bytes/s (0: no limit), got {bytes_s}")
        if self._replicator is None:
            raise FailedPrecondition(f"node {self.node} copies no replicas (it runs no upkeep)")
        return self._replicator.set_rate(bytes_s)

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
                save = self._saves.get(record.save_id)
                if save is not None and save.committing:
                    raise FailedPrecondition(f"checkpoint {key} is being committed right now")
                self._drop_save(record.save_id)
            removed, pending = [], []
            if self.memory.delete(key):
                removed.append(MEMORY)
            if self.ssd.delete(key):
                removed.append(SSD)
            self.replicas.delete(key)
            s3_objects = s3_too and self.s3 is not None and s3_state != ABSENT
            self.catalog.delete(key, s3_too=s3_objects)
            self._forgotten.add(key)
            if s3_objects:
                self._s3_jobs().queue_removal(key)
                pending.append(S3)
        log.info("deleted %s", key, extra={"run": key.run, "step": key.step})
        return removed, pending

    def _damaged(self, key: CheckpointKey, tier: int, owner: str, reason: str) -> None:
        """A copy here failed its checksums on a read (Reader): telemetry hears of it."""
        replica_of = "" if owner in ("", self.node) or tier == S3 else owner
        self._notify(key, tier, 0, replica_of, failed=reason)

    def _notify(
        self, key: CheckpointKey, tier: int, nbytes: int, replica_of: str = "", failed: str = ""
    ) -> None:
        """Tell the observer (telemetry) about a tier commit, or a copy found damaged
        (`failed`); its failures never fail a save."""
        if self._on_tier_commit is None:
            return
        record = self.catalog.save_of(key)
        seconds = time.time() - record.created_at if record is not None else 0.0
        commit = TierCommit(key.run, key.step, tier, nbytes, seconds, self.node, replica_of, failed)
        try:
            self._on_tier_commit(commit)
        except Exception:  # an observer must never break a commit
            log.exception("tier commit observer failed for %s", key)

    def _s3_jobs(self) -> S3Replication:
        assert self._replication is not None
        return self._replication

    # -- query -----------------------------------------------------------------------------------

    def list(
        self, run: str = "", include_uncommitted: bool = False, nodes: bool = False
    ) -> list[checkpoint_pb2.CheckpointInfo]:
        """Checkpoints (of `run`); with `nodes`, each with every node's part as that node says
        (CheckpointInfo.parts)."""
        infos = self.catalog.checkpoints(check_run(run) if run else "", include_uncommitted)
        if nodes:
            views = cluster.catalogs(self.peers, run)
            for info in infos:
                if info.committed:
                    info.parts.extend(self._parts(info, views))
                    key = CheckpointKey(info.ref.run, info.ref.step)
                    info.node_loss_safe = self.node_loss_safe(key, views)
        return infos

    def get(
        self, ref: checkpoint_pb2.CheckpointRef, latest: bool = False, node_loss_safe: bool = False
    ) -> checkpoint_pb2.CheckpointInfo:
        """A committed checkpoint, or with `latest` the newest committed one of `ref.run` that
        can be restored in full right now (each part on a live node, or S3 whole); with
        `node_loss_safe` too, the newest whose every part has its run's R copies (at least 2).
        A latest one comes with every node's part and its copies (CheckpointInfo.parts)."""
        views: dict[str, checkpoint_pb2.CatalogResponse | str] = {}
        if latest:
            run = check_run(ref.run)
            steps = self.catalog.run_states(run)
            if not steps:
                raise NotFound(f"run {ref.run!r} has no committed checkpoint")
            views = cluster.catalogs(self.peers, run) if self.peers.enabled else {}
            key = self.latest(run, views, safe=node_loss_safe)
            if key is None:
                # Not NotFound: the run has commits, so a trainer must never take this for
                # "start from scratch"; it is a state that passes (a node comes back).
                newest = CheckpointKey(run, max(steps))
                what = "is node-loss safe now" if node_loss_safe else "can be restored in full now"
                raise Unavailable(
                    f"run {ref.run!r} has {len(steps)} committed checkpoint(s), none of which "
                    f"{what}; the newest, step {newest.step}, lacks "
                    f"{self._lacking(newest, views, node_loss_safe)}"
                )
        else:
            key = key_of(ref)
        info = self.catalog.info(key)
        if info is None or not info.committed:
            raise NotFound(f"no committed checkpoint {key}")
        if latest:
            info.parts.extend(self._parts(info, views))
            info.node_loss_safe = self.node_loss_safe(key, views)
        return info

    def _lacking(
        self,
        key: CheckpointKey,
        views: dict[str, checkpoint_pb2.CatalogResponse | str],
        node_loss_safe: bool,
    ) -> str:
        """What keeps `key` from being restorable (or node-loss safe) now, naming each part
        short of copies and the nodes that did not answer."""
        copies = self._copies(key, views)
        need = copies_for_safety(self.copies_wanted(key)) if node_loss_safe else 1
        short = [
            f"{owner}'s part ({len(self._holders(held))} of {need} copies on a live node)"
            for owner, held in sorted(copies.items())
            if len(self._holders(held)) < need
        ]
        down = sorted(node for node, view in views.items() if isinstance(view, str))
        missing = ", ".join(short) or "its parts' copies"
        where = " and S3 lacks it" if not node_loss_safe else ""
        return missing + where + (f" (down or unreachable: {', '.join(down)})" if down else "")
