"""Saves in progress on this node: open, write, commit and abort (the save protocol's half here).

A save is a catalog row plus what lives only while it is open: its files being streamed or
accepted, its size so far, whether a commit froze it. `Saves` owns that table; the coordinator's
commit and the participant's vote and decision (`ckptd.member`, through the public methods
below) act on it under the store's lock. Why a committed save is trustworthy: `ckptd.store`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from ckptd.catalog import COMMITTED, Catalog, Coordination, SaveRecord
from ckptd.cluster import Coordinator, Peers, check_votes, new_epoch, vote_problems
from ckptd.config import CkptdConfig
from ckptd.crash import crash_point
from ckptd.holding import ReplicaHolding
from ckptd.ingest import FileUpload
from ckptd.manifest import FileRecord, Manifest
from ckptd.metrics import Metrics
from ckptd.names import MAX_WORLD_SIZE, check_path, key_of
from ckptd.retainer import Retainer
from ckptd.retention import RetentionPolicy
from ckptd.states import MEMORY, METADATA, SHARD, SSD, TIER_COMMITTED
from ckptd.tiers import CheckpointKey
from ckptd.tiers.memory import MemoryBudget, MemoryTier, release
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
from scaletrain.v1 import checkpoint_pb2

log = logging.getLogger("ckptd.store")


@dataclass
class OpenSave:
    """What this node tracks of a save in progress besides the catalog rows."""

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


class FileStream:
    """The context of one WriteFile stream: leaving it without `finish` stores nothing.

    It reports to its `Saves` through the three callables it is given: the bytes it grew by
    (which may refuse them), the file it verified, and its end."""

    def __init__(
        self,
        save: OpenSave,
        upload: FileUpload,
        grew: Callable[[OpenSave, int], None],
        accept: Callable[[OpenSave, FileRecord, FileUpload], None],
        ended: Callable[[OpenSave, FileUpload], None],
    ) -> None:
        self._save, self.upload = save, upload
        self._grew, self._accept, self._ended = grew, accept, ended
        self.path = upload.path
        self._done = False

    def __enter__(self) -> FileStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._done:
            self.upload.cancel()
        self._ended(self._save, self.upload)

    def write(self, chunk: checkpoint_pb2.FileChunk | Chunk) -> None:
        self._save.touched = time.monotonic()
        before = self.upload.size
        self.upload.write(chunk)
        self._grew(self._save, self.upload.size - before)

    def finish(self, trailer: checkpoint_pb2.FileTrailer) -> FileRecord:
        record = self.upload.finish(trailer)
        self._accept(self._save, record, self.upload)
        self._done = True
        self.upload.end_input()
        return record


class Saves:
    """The open saves of this node and the protocol that writes and commits them.

    Thread-safe under the store's `lock`, which every component of the store shares: a commit
    touches the catalog, the tiers and the retention of its run in one step.
    """

    def __init__(
        self,
        config: CkptdConfig,
        node: str,
        peers: Peers,
        coordinator: Coordinator,
        lock: threading.RLock,
        catalog: Catalog,
        ssd: SsdTier,
        memory: MemoryTier,
        budget: MemoryBudget,
        metrics: Metrics,
        retainer: Retainer,
        holding: ReplicaHolding,
        notify: Callable[..., None],
    ) -> None:
        self._config, self._node, self._coordinator = config, node, coordinator
        self._peers = peers  # its address may be set after start: read at each OpenSave
        self._catalog, self._ssd, self._memory, self._budget = catalog, ssd, memory, budget
        self._metrics, self._lock, self._notify = metrics, lock, notify
        self._retainer, self._holding = retainer, holding
        self._saves: dict[str, OpenSave] = {}

    # -- the table -------------------------------------------------------------------------------

    def restore(self, record: SaveRecord) -> None:
        """Track a save that was open when ckptd stopped (startup recovery): its staged files
        survived, the memory copies of them did not. If this node voted on it, only its outcome
        decides (it is never abandoned)."""
        self._saves[record.save_id] = OpenSave(record, retain=False, committing=record.prepared)

    def __len__(self) -> int:
        return len(self._saves)

    def get(self, save_id: str) -> OpenSave | None:
        """The open save `save_id` as this node tracks it, or None."""
        return self._saves.get(save_id)

    def uploads(self, accepted_only: bool = False) -> Iterator[FileUpload]:
        """The files of every open save: accepted ones, and unless `accepted_only` those still
        being streamed (call under the lock)."""
        for save in self._saves.values():
            if not accepted_only:
                yield from save.streaming
            yield from save.files.values()

    def in_doubt(self) -> list[SaveRecord]:
        """Saves this node voted on whose outcome it has not heard."""
        with self._lock:
            return [s.record for s in self._saves.values() if s.record.prepared]

    def set_prepared(self, save: OpenSave) -> None:
        """Record this node's vote on `save`: from here only the outcome decides."""
        with self._lock:
            self._catalog.set_prepared(save.record.save_id)
            save.record = dataclasses.replace(save.record, prepared=True)

    def abandoned(self, timeout_s: float) -> list[str]:
        """The saves no writer touched for `timeout_s` that no commit or vote holds."""
        now = time.monotonic()
        with self._lock:
            return [
                save_id
                for save_id, save in self._saves.items()
                if not save.committing and now - save.touched > timeout_s
            ]

    # -- the protocol ----------------------------------------------------------------------------

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
        checkpoint kept in memory only (see `ckptd.store`)."""
        key = key_of(ref)
        if memory_only and self._budget.total <= 0:
            raise FailedPrecondition(
                f"memory-only checkpoint {key}: this ckptd has no memory tier (its memory budget "
                "is 0)"
            )
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"world size must be 1..{MAX_WORLD_SIZE}, got {world_size}")
        if replicas < 0:
            raise InvalidArgument(f"replicas must be >= 1 (0: keep the run's), got {replicas}")
        self._holding.check_replicas(replicas or (retention.replicas if retention else 0))
        with self._lock:
            existing = self._catalog.save_of(key)
            if existing is not None:
                if existing.state == COMMITTED:
                    raise AlreadyExists(
                        f"checkpoint {key} is already committed; delete it or save another step"
                    )
                stale = self._saves.get(existing.save_id)
                if stale is not None and stale.committing:
                    raise FailedPrecondition(f"checkpoint {key} is being committed right now")
                self.drop(existing.save_id)
            if retention is not None or replicas or self._catalog.policy(key.run) is None:
                # A run keeps the policy it started with, even if ckptd's default changes.
                policy = retention or self._retainer.policy(key.run)
                if replicas:
                    policy = dataclasses.replace(policy, replicas=replicas)
                self._catalog.set_policy(key.run, policy)
            save_id = uuid.uuid4().hex
            coordination = Coordination(
                new_epoch(self._catalog.epoch_of(key)), self._node, self._peers.address
            )
            return self.open_attempt(
                key, save_id, world_size, dict(labels or {}), coordination, memory_only
            ).save_id

    def open_attempt(
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
        if self._catalog.deleting(key):
            raise FailedPrecondition(
                f"checkpoint {key} is still being removed from S3; save it again later"
            )
        self._catalog.open_save(key, save_id, world_size, labels, coordination, memory_only)
        if not memory_only:
            self._ssd.staging_dir(save_id).mkdir(parents=True)
        record = self._catalog.save(save_id)
        assert record is not None
        self._saves[save_id] = OpenSave(
            record, retain=memory_only or self._retainer.retains(key.run)
        )
        return record

    def coordination(self, save_id: str) -> Coordination:
        """Who coordinates the save `save_id`, and its epoch."""
        record = self._catalog.save(save_id)
        if record is None:
            raise NotFound(f"unknown save {save_id!r}")
        return record.coordination

    def drop(self, save_id: str) -> None:
        """Forget an open save: cancel its streams' files, release memory, remove its staging
        (under the lock)."""
        save = self._saves.pop(save_id, None)
        if save is not None:
            for upload in (*save.streaming, *save.files.values()):
                upload.spill()
        self._ssd.discard_staging(save_id)

    def drop_aborted(self, record: SaveRecord, reason: str) -> None:
        """Forget an open save and record it aborted, with `reason` on one line (under the lock)."""
        self.drop(record.save_id)
        self._catalog.abort_save(record.key, " ".join(reason.split())[:500])

    def writable(self, save_id: str) -> OpenSave:
        """The open save `save_id`, or the reason it cannot take writes or a commit."""
        save = self._saves.get(save_id)
        if save is not None:
            if save.committing:
                raise FailedPrecondition(f"save {save_id} of {save.record.key} is being committed")
            return save
        record = self._catalog.save(save_id)
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

    def _check_header(self, header: checkpoint_pb2.FileHeader) -> OpenSave:
        """The open save `header` writes to, or the reason it may not (under the lock)."""
        check_path(header.path)
        if header.kind not in (SHARD, METADATA):
            raise InvalidArgument(
                f"{header.path}: kind must be FILE_KIND_SHARD or FILE_KIND_METADATA"
            )
        save = self.writable(header.save_id)
        world_size = save.record.world_size
        if not 0 <= header.rank < world_size:
            raise InvalidArgument(
                f"{header.path}: rank {header.rank} is outside 0..{world_size - 1}"
            )
        if header.kind == METADATA:
            for other in self._catalog.files(save.record.key):
                if other.kind == METADATA and other.path != header.path:
                    raise InvalidArgument(
                        f"{header.path}: save already has the metadata file {other.path}"
                    )
        return save

    def begin_file(
        self,
        header: checkpoint_pb2.FileHeader,
        on_settled: Callable[[int], None] | None = None,
    ) -> FileStream:
        """Start receiving one file of an open save (the streaming form of `write_file`);
        `on_settled` as FileUpload takes it."""
        with self._lock:
            save = self._check_header(header)
            try:
                incoming = None if save.record.memory_only else self._ssd.incoming_file()
            except OSError as exc:
                raise Unavailable(f"{header.path}: ckptd cannot write to its SSD: {exc}") from None
            upload = FileUpload(
                header,
                incoming,
                self._budget,
                save.retain,
                lambda up: self._written(save, up),
                self._metrics,
                on_settled,
            )
            save.streaming.add(upload)
            save.touched = time.monotonic()
        return FileStream(save, upload, self._grew, self._accept, self._stream_ended)

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

    def _stream_ended(self, save: OpenSave, upload: FileUpload) -> None:
        with self._lock:
            save.streaming.discard(upload)
            save.touched = time.monotonic()
            if save.files.get(upload.path) is not upload:
                save.bytes -= upload.size  # not accepted: its bytes count no more

    def _grew(self, save: OpenSave, nbytes: int) -> None:
        """Count `nbytes` more of a save; refuse them when the checkpoint would be too big."""
        limit = self._config.max_checkpoint_bytes
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
            record = save.record if save is not None else self._catalog.save(save_id)
        return record.key.run if record is not None else None

    def _current(self, save: OpenSave) -> bool:
        return self._saves.get(save.record.save_id) is save

    def _accept(self, save: OpenSave, record: FileRecord, upload: FileUpload) -> None:
        """A verified file joins its save (its bytes may still be on their way to the disk)."""
        with self._lock:
            if not self._current(save) or save.committing:
                raise FailedPrecondition(
                    f"{record.path}: save {save.record.save_id} was replaced, aborted or "
                    "committed while the file was being written"
                )
            record = dataclasses.replace(record, node=self._node)
            self._catalog.add_file(save.record.key, record)
            replaced = save.files.get(record.path)
            save.files[record.path] = upload
            if replaced is not None:
                save.bytes -= replaced.size
        if replaced is not None:
            replaced.spill()

    def _written(self, save: OpenSave, upload: FileUpload) -> None:
        """Writer thread: the file is on disk; stage it if it is still its save's current copy."""
        with self._lock:
            if self._current(save) and save.files.get(upload.path) is upload:
                if upload.incoming is not None:  # a memory-only file has nothing to stage
                    self._ssd.stage(upload.incoming, save.record.save_id, upload.path)
                    crash_point("file-staged")
                return
        if upload.incoming is not None:
            upload.incoming.discard()
        upload.spill()

    def _forget_file(self, save: OpenSave, upload: FileUpload) -> None:
        """A file of the save failed after it was accepted (the disk): it leaves the save, which
        needs it written again."""
        with self._lock:
            if save.files.get(upload.path) is upload:
                del save.files[upload.path]
                save.bytes -= upload.size
                self._catalog.remove_file(save.record.key, upload.path)

    def freeze(self, save_id: str) -> tuple[OpenSave, list[FileRecord]]:
        """Stop a save taking writes and wait for its files here to be on disk; returns them.

        The first half of a commit, on the coordinator and on every node that votes.
        """
        with self._lock:
            save = self.writable(save_id)
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
                files = self._catalog.files(key)
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
        save, files = self.freeze(save_id)
        record = save.record
        key = record.key
        phase = self._metrics.commit_phase
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
                coordinator=self._node,
                memory_only=record.memory_only,
            )
            # This node's commit marker is the decision: from here on the step is committed.
            with phase.labels("decide").time():
                info = self.commit_part(save, manifest)
        except BaseException:
            with self._lock:
                save.committing = False
            raise
        crash_point("cluster-decided")
        with phase.labels("notify").time():
            self._coordinator.decide(
                record,
                manifest,
                retention=self._retainer.policy(key.run).to_proto(),
                unreachable=votes.unreachable,
            )
        self._holding.offer_replicas(manifest)
        log.info(
            "committed %s (%d bytes on %d node(s), %.3fs)",
            key,
            manifest.total_bytes,
            len({f.node for f in manifest.files}),
            time.perf_counter() - started,
            extra={"run": key.run, "step": key.step, "bytes": manifest.total_bytes},
        )
        return info

    def commit_part(self, save: OpenSave, manifest: Manifest) -> checkpoint_pb2.CheckpointInfo:
        """This node's part of a committed checkpoint: onto SSD with the checkpoint's marker,
        into memory, and queued for S3; a memory-only one's into memory alone."""
        key = manifest.key
        mine = manifest.files_on(self._node)
        if manifest.memory_only:
            return self._commit_to_memory(save, manifest, mine)
        try:
            with self._metrics.timed(SSD, "commit"):
                self._ssd.put(manifest, save.record.save_id)
        except OSError as exc:
            raise Unavailable(f"cannot commit {key} to SSD: {exc}") from None
        total = sum(f.size for f in mine)
        with self._lock:
            self._saves.pop(save.record.save_id, None)
            self._catalog.record_commit(manifest, SSD)
            crash_point("ssd-committed")
            self._metrics.commits.labels(TIER_LABELS[SSD]).inc()
            self._notify(key, SSD, total)
            memory = {path: upload.take_memory() for path, upload in save.files.items()}
            if all(m is not None for m in memory.values()) and set(memory) == {
                f.path for f in mine
            }:
                self._memory.put(key, memory)  # type: ignore[arg-type]
                self._catalog.set_tier(key, MEMORY, TIER_COMMITTED, total)
                self._metrics.commits.labels(TIER_LABELS[MEMORY]).inc()
                self._metrics.bytes.labels(TIER_LABELS[MEMORY], "write").inc(total)
                self._notify(key, MEMORY, total)
            else:
                for m in memory.values():
                    if m is not None:
                        self._budget.release(m.size)
                        self._budget.recycle(m.chunks)  # the files are written: nothing reads
            self._retainer.apply(key.run)
            info = self._catalog.info(key)
        assert info is not None
        return info

    def _commit_to_memory(
        self, save: OpenSave, manifest: Manifest, mine: tuple[FileRecord, ...]
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
            self._catalog.record_commit(manifest, MEMORY if whole else None)
            if whole:
                self._memory.put(key, memory)  # type: ignore[arg-type]
                self._metrics.commits.labels(TIER_LABELS[MEMORY]).inc()
                self._metrics.bytes.labels(TIER_LABELS[MEMORY], "write").inc(total)
                self._notify(key, MEMORY, total)
            else:
                # Spilled under memory pressure since the vote: the step is committed, but this
                # node's part only lives on where a peer holds it (latest then passes it by).
                release({p: m for p, m in memory.items() if m is not None}, self._budget)
                log.warning("memory-only %s lost this node's part to memory pressure", key)
            self._retainer.apply(key.run)
            info = self._catalog.info(key)
        assert info is not None
        return info

    def _check_in_memory(self, save: OpenSave, files: list[FileRecord]) -> None:
        """Refuse to commit a memory-only save whose files here were spilled from memory."""
        spilled = [f.path for f in files if not save.files[f.path].keeps_memory]
        if spilled:
            raise ResourceExhausted(
                f"cannot commit memory-only {save.record.key}: ckptd's memory budget is full "
                f"and {len(spilled)} of its files here left memory ({', '.join(spilled[:3])})"
            )

    def _check_staged(self, save: SaveRecord, files: list[FileRecord]) -> None:
        staging = self._ssd.staging_dir(save.save_id)
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
                record = self._catalog.save(save_id)
                if record is None:
                    raise NotFound(f"unknown save {save_id!r}")
                if record.state == COMMITTED:
                    raise FailedPrecondition(
                        f"save {save_id} is committed as {record.key}; delete the checkpoint"
                    )
                return
            if save.committing:
                raise FailedPrecondition(f"save {save_id} of {save.record.key} is being committed")
            self.drop_aborted(save.record, reason)
        log.info("aborted save %s of %s: %s", save_id, save.record.key, reason)
        if save.record.coordination.coordinator == self._node:
            self._coordinator.decide(save.record, None, reason)
