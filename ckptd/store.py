"""CheckpointStore: the save/commit/read protocol of ckptd as a plain Python class.

No gRPC here: the servicer in `ckptd.server` only translates messages, and the command line opens
a store directly on a data dir to list, verify, export and remove offline. The store owns the
rules that make a checkpoint trustworthy:

- names are validated before they touch a path or an object key;
- every chunk is CRC-32C checked, and every file's checksum, before the write's reply
  (`ckptd.ingest`);
- a checkpoint commits only with the metadata file and a shard file from every rank, and becomes
  visible only once durable on SSD with its marker (memory is filled at the same moment, S3 in
  the background, marker last); "latest" only ever names such a checkpoint;
- every read verifies the per-block CRCs of the bytes it returns, and falls through to the next
  tier when a copy is damaged or missing;
- retention (`ckptd.retention`) never drops a copy that no slower tier holds, unless no tier
  wants the checkpoint any more;
- a restart reconciles the catalog with the tiers' markers (rebuilding it if it was lost),
  re-queues what S3 still lacks, and a janitor aborts saves whose writer went away.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ckptd.background import BackgroundQueue
from ckptd.catalog import COMMITTED, OPEN, Catalog, SaveRecord
from ckptd.config import CkptdConfig
from ckptd.crash import crash_point
from ckptd.ingest import FileUpload
from ckptd.manifest import MARKER, FileRecord, Manifest
from ckptd.metrics import Metrics
from ckptd.retention import RetentionPolicy, droppable, wanted
from ckptd.tiers import TIER_NAMES, BlockCrcs, CheckpointKey, Tier, block_span, first_bad_block
from ckptd.tiers.memory import MemoryBudget, MemoryTier
from ckptd.tiers.s3 import S3Tier, describe
from ckptd.tiers.ssd import SsdTier
from ckptd.wire import Chunk
from scaletrain.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ScaletrainError,
    Unavailable,
    UserError,
)
from scaletrain.v1 import checkpoint_pb2, common_pb2

log = logging.getLogger(__name__)

LOCK_FILE = "ckptd.lock"
MAX_WORLD_SIZE = 1 << 20
_MAX_PATH_BYTES = 1024
_MAX_NAME_BYTES = 255
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,127}")
# Reads are served in pieces of this size, each from the fastest tier whose copy verifies.
READ_PIECE_BYTES = 4 << 20

SHARD = checkpoint_pb2.FILE_KIND_SHARD
METADATA = checkpoint_pb2.FILE_KIND_METADATA
ABSENT = checkpoint_pb2.TIER_STATE_ABSENT
PENDING = checkpoint_pb2.TIER_STATE_PENDING
TIER_COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED
FAILED = checkpoint_pb2.TIER_STATE_FAILED
MEMORY, SSD, S3 = common_pb2.TIER_MEMORY, common_pb2.TIER_SSD, common_pb2.TIER_S3


# -- names -----------------------------------------------------------------------------------------


def check_run(run: str) -> str:
    """A run name is one path component and one S3 key segment: a safe, short token."""
    if not run:
        raise InvalidArgument("run name is empty")
    if not _RUN_RE.fullmatch(run):
        raise InvalidArgument(
            f"run name {run!r} is invalid: use 1-128 letters, digits and . _ : + = @ -, "
            "starting with a letter or digit"
        )
    return run


def check_step(step: int) -> int:
    if step < 0:
        raise InvalidArgument(f"step must be >= 0, got {step}")
    return step


def check_path(path: str) -> str:
    """A file path must name a file inside the checkpoint directory, as DCP names them."""
    if not path:
        raise InvalidArgument("file path is empty")
    if "\x00" in path or "\\" in path:
        raise InvalidArgument(f"file path {path!r} contains a NUL byte or a backslash")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidArgument(
            f"file path {path!r} must stay inside the checkpoint directory "
            "(relative, no '..', '.' or empty parts)"
        )
    if len(path.encode()) > _MAX_PATH_BYTES or any(
        len(part.encode()) > _MAX_NAME_BYTES for part in parts
    ):
        raise InvalidArgument(f"file path {path[:80]!r}... is too long")
    if parts[0] in (MARKER, f"{MARKER}.tmp"):
        raise InvalidArgument(f"file path {path!r} is reserved for ckptd's commit marker")
    return path


def key_of(ref: checkpoint_pb2.CheckpointRef) -> CheckpointKey:
    return CheckpointKey(check_run(ref.run), check_step(ref.step))


# -- the data dir lock -----------------------------------------------------------------------------


def _lock_data_dir(data_dir: Path) -> IO[str]:
    """Hold an exclusive flock on the data dir for this store's lifetime: one writer at a time."""
    lock = open(data_dir / LOCK_FILE, "a+")  # noqa: SIM115 (held open until close)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(
            f"{data_dir} is in use by a running ckptd; stop it, or ask it over gRPC"
        ) from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def ckptd_running(data_dir: Path) -> bool:
    """Whether some process holds `data_dir` open as a store (a running ckptd, usually)."""
    path = Path(data_dir) / LOCK_FILE
    if not path.exists():
        return False
    with open(path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


def list_offline(
    data_dir: Path, run: str = "", include_uncommitted: bool = False
) -> list[checkpoint_pb2.CheckpointInfo]:
    """List checkpoints from a data dir's catalog, read-only, whether or not ckptd runs.

    The memory tier reads ABSENT when no ckptd holds the data dir: its copies died with it.
    """
    running = ckptd_running(data_dir)
    catalog = Catalog(data_dir, readonly=True)
    try:
        infos = catalog.checkpoints(check_run(run) if run else "", include_uncommitted)
    finally:
        catalog.close()
    if not running:
        for info in infos:
            for status in info.tiers:
                if status.tier == MEMORY:
                    status.state = ABSENT
                    status.bytes = 0
    return infos


# -- saves -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierCommit:
    """A checkpoint became committed on a tier; `seconds` counts from its OpenSave."""

    run: str
    step: int
    tier: int
    bytes: int
    seconds: float


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


def _damage(data: bytes, lo: int, hi: int, record: FileRecord) -> str | None:
    """What is wrong with bytes [lo, hi) of `record` as read from a tier, or None if they verify."""
    if len(data) != hi - lo:
        return f"{record.path} is short ({len(data)} of {hi - lo} bytes at offset {lo})"
    bad = first_bad_block(data, lo, record.block_crcs)
    if bad is not None:
        return f"{record.path} fails its checksum in block {bad}"
    return None


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
        self._lockfile = _lock_data_dir(data_dir)
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._saves: dict[str, _OpenSave] = {}
        self._on_tier_commit = on_tier_commit
        self.metrics = Metrics()
        self.budget = MemoryBudget(config.memory_budget_bytes, self._relieve_memory)
        self.memory = MemoryTier(self.budget)
        self.s3: S3Tier | None = None
        self._background: BackgroundQueue | None = None
        try:
            self.catalog = Catalog(data_dir)
            self.ssd = SsdTier(data_dir / "ssd")
            self._recover()
            if config.s3 is not None:
                self.s3 = S3Tier(config.s3)
                self._background = BackgroundQueue(
                    "ckptd-s3", self._s3_job_failed, config.s3.backoff_s, config.s3.backoff_max_s
                )
                self._background.submit(("sync", None), self._sync_s3)
            else:
                for run in self.catalog.runs():
                    self._apply_retention(run)
        except BaseException:
            self._lockfile.close()
            raise
        self.metrics.watch(
            lambda: self._background.depth if self._background else 0,
            lambda: self.budget.used,
            config.memory_budget_bytes,
            lambda: len(self._saves),
        )
        if config.maintain:
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
            # Staged files survive a restart (the client may finish the save); the memory copies
            # of them did not. The janitor aborts the save if nobody writes to it again.
            self._saves[record.save_id] = _OpenSave(record, retain=False)
            self.ssd.staging_dir(record.save_id).mkdir(parents=True, exist_ok=True)
        for save_id in self.ssd.staged_saves():
            if save_id not in self._saves:
                self.ssd.discard_staging(save_id)
        for key in self.catalog.committed_on(SSD):
            if key in on_disk:
                continue
            manifest = self.catalog.manifest(key)
            if manifest is not None and self._files_present(key, manifest):
                self.ssd.write_marker(manifest)  # a directory from before markers existed
            else:
                self.catalog.set_tier(key, SSD, FAILED, error="directory missing at startup")

    def _files_present(self, key: CheckpointKey, manifest: Manifest) -> bool:
        for f in manifest.files:
            path = self.ssd.path_of(key, f.path)
            if not path.is_file() or path.stat().st_size != f.size:
                return False
        return True

    def _sync_s3(self) -> None:
        """Background: reconcile the catalog with S3's markers, then queue what S3 still owes."""
        assert self.s3 is not None
        listed = set(self.s3.list())
        for key in sorted(listed):
            with self._lock:
                if self.catalog.deleting(key):
                    continue  # removed (maybe just now, by a delete racing this sync)
                save = self.catalog.save_of(key)
                known = save is not None and save.state == COMMITTED
                state = self.catalog.tier_state(key, S3) if known else ABSENT
            if known and state == TIER_COMMITTED:
                continue
            manifest = self.s3.manifest(key)
            if manifest is None:
                continue
            with self._lock:
                if self.catalog.deleting(key):
                    continue
                save = self.catalog.save_of(key)
                known = save is not None and save.state == COMMITTED
                ours = self.catalog.manifest(key) if known else None
                if ours is None and save is not None and save.state == OPEN:
                    continue  # a new save of this step is in progress; it will overwrite S3
                if ours is not None and not ours.same_files(manifest):
                    log.warning("S3 holds a different %s; it will be uploaded again", key)
                    continue
                log.info("recovered %s from its S3 marker", key, extra={"run": key.run})
                self.catalog.record_commit(manifest, S3)
        with self._lock:
            for key in self.catalog.committed_on(S3):
                if key not in listed:
                    self.catalog.set_tier(key, S3, ABSENT, error="marker missing on S3")
            for key in self.catalog.deletions():
                self._queue_s3_removal(key)
            for run in self.catalog.runs():
                self._apply_retention(run)

    def close(self, timeout_s: float = 5.0) -> None:
        """Give an S3 job in flight `timeout_s` to finish, drop the memory tier, release."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._background is not None:
            self._background.close(timeout_s)
        if self.s3 is not None:
            self.s3.close()
        with self._lock:
            for key in self.memory.list():
                self.memory.delete(key)
                self.catalog.set_tier(key, MEMORY, ABSENT)
            self.catalog.close()
            self._lockfile.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_background(self, timeout_s: float) -> bool:
        """Wait until S3 has nothing left to do (uploads, removals); False on timeout."""
        return self._background is None or self._background.wait_idle(timeout_s)

    # -- save ------------------------------------------------------------------------------------

    def policy(self, run: str) -> RetentionPolicy:
        return self.catalog.policy(run) or self.config.retention

    def open_save(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        world_size: int,
        labels: Mapping[str, str] | None = None,
        retention: RetentionPolicy | None = None,
    ) -> str:
        """Start a save attempt of (run, step); an uncommitted earlier attempt is replaced."""
        key = key_of(ref)
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"world size must be 1..{MAX_WORLD_SIZE}, got {world_size}")
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
            if self.catalog.deleting(key):
                raise FailedPrecondition(
                    f"checkpoint {key} is still being removed from S3; save it again later"
                )
            if retention is not None or self.catalog.policy(key.run) is None:
                # A run keeps the policy it started with, even if ckptd's default changes.
                self.catalog.set_policy(key.run, retention or self.config.retention)
            save_id = uuid.uuid4().hex
            self.catalog.open_save(key, save_id, world_size, dict(labels or {}))
            self.ssd.staging_dir(save_id).mkdir(parents=True)
            record = self.catalog.save(save_id)
            assert record is not None
            retain = self.budget.total > 0 and self.policy(key.run).memory_last > 0
            self._saves[save_id] = _OpenSave(record, retain=retain)
            return save_id

    def _drop_save(self, save_id: str) -> None:
        """Forget an open save: cancel its streams' files, release memory, remove its staging."""
        save = self._saves.pop(save_id, None)
        if save is not None:
            for upload in (*save.streaming, *save.files.values()):
                upload.spill()
        self.ssd.discard_staging(save_id)

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

    def begin_file(self, header: checkpoint_pb2.FileHeader) -> _Stream:
        """Start receiving one file of an open save (the streaming form of `write_file`)."""
        with self._lock:
            save = self._check_header(header)
            try:
                incoming = self.ssd.incoming_file()
            except OSError as exc:
                raise Unavailable(f"{header.path}: ckptd cannot write to its SSD: {exc}") from None
            upload = FileUpload(
                header,
                incoming,
                self.budget,
                save.retain,
                lambda up: self._written(save, up),
                self.metrics,
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
                self.ssd.stage(upload.incoming, save.record.save_id, upload.path)
                crash_point("file-staged")
                return
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

    def commit(self, save_id: str) -> checkpoint_pb2.CheckpointInfo:
        """Make the save a checkpoint: durable on SSD and in memory now, on S3 in the background."""
        started = time.perf_counter()
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
                self._check_complete(save.record, files)
            manifest = Manifest(
                key=key,
                world_size=save.record.world_size,
                files=tuple(files),
                labels=save.record.labels,
                created_at=save.record.created_at,
                committed_at=time.time(),
            )
            with self.metrics.timed(SSD, "commit"):
                self.ssd.put(manifest, save_id)
        except OSError as exc:
            with self._lock:
                save.committing = False
            raise Unavailable(f"cannot commit {key} to SSD: {exc}") from None
        except BaseException:
            with self._lock:
                save.committing = False
            raise
        total = manifest.total_bytes
        with self._lock:
            del self._saves[save_id]
            self.catalog.record_commit(manifest, SSD)
            crash_point("ssd-committed")
            self.metrics.commits.labels("SSD").inc()
            self._notify(key, SSD, total)
            memory = {path: upload.take_memory() for path, upload in save.files.items()}
            if all(m is not None for m in memory.values()) and set(memory) == {
                f.path for f in files
            }:
                self.memory.put(key, memory)  # type: ignore[arg-type]
                self.catalog.set_tier(key, MEMORY, TIER_COMMITTED, total)
                self.metrics.commits.labels("memory").inc()
                self.metrics.bytes.labels("memory", "write").inc(total)
                self._notify(key, MEMORY, total)
            else:
                for m in memory.values():
                    if m is not None:
                        self.budget.release(m.size)
                        self.budget.recycle(m.chunks)  # the files are written: nothing reads
            self._apply_retention(key.run)
            info = self.catalog.info(key)
        log.info(
            "committed %s on SSD (%d bytes, %.3fs)", key, total, time.perf_counter() - started,
            extra={"run": key.run, "step": key.step, "bytes": total, "tier": "SSD"},
        )  # fmt: skip
        assert info is not None
        return info

    def _check_complete(self, save: SaveRecord, files: list[FileRecord]) -> None:
        key, world_size = save.key, save.world_size
        problems = []
        if not any(f.kind == METADATA for f in files):
            problems.append("no metadata file")
        ranks = {f.rank for f in files if f.kind == SHARD}
        missing = [r for r in range(world_size) if r not in ranks]
        if missing:
            shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
            problems.append(f"no shard file from rank(s) {shown} of world size {world_size}")
        staging = self.ssd.staging_dir(save.save_id)
        for f in files:
            staged = staging / f.path
            if not staged.is_file() or staged.stat().st_size != f.size:
                problems.append(f"staged file {f.path} is missing or truncated; write it again")
        if problems:
            raise FailedPrecondition(f"cannot commit {key}: " + "; ".join(problems))

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
            self._drop_save(save_id)
            self.catalog.abort_save(save.record.key, " ".join(reason.split())[:500])
        log.info("aborted save %s of %s: %s", save_id, save.record.key, reason)

    # -- memory pressure and garbage -------------------------------------------------------------

    def _relieve_memory(self) -> None:
        """The budget is full: evict the oldest memory copy a durable tier holds, else spill.

        Called by writers waiting for memory; what can never be freed here is data not yet on
        disk, and the writer threads free that as they write.
        """
        with self._lock:
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
        wants = wanted(self.policy(run), list(states), on_s3, has_s3=self.s3 is not None)
        if self.s3 is None:
            for step in on_s3:  # a store without S3 (offline) cannot manage S3's copies
                wants[step].add(S3)
        for step, tiers in states.items():
            key = CheckpointKey(run, step)
            held = {t: tiers.get(t) == TIER_COMMITTED for t in (MEMORY, SSD, S3)}
            drops = droppable(wants[step], held)
            for tier in drops:
                self._drop_copy(key, tier)
            if not wants[step]:
                s3_objects = self.s3 is not None and tiers.get(S3, ABSENT) != ABSENT
                self.catalog.delete(key, s3_too=s3_objects)
                if s3_objects:
                    self._queue_s3_removal(key)
                log.info("retention removed %s", key, extra={"run": run, "step": step})
            elif S3 in wants[step] and not held[S3] and self._background is not None:
                self._queue_upload(key)

    def _drop_copy(self, key: CheckpointKey, tier: int) -> None:
        if tier == MEMORY:
            self.memory.delete(key)
        elif tier == SSD:
            self.ssd.delete(key)
        else:
            self.catalog.queue_deletion(key)
            self._queue_s3_removal(key)
        self.catalog.set_tier(key, tier, ABSENT)
        log.info("retention dropped the %s copy of %s", TIER_NAMES[tier], key)

    # -- read ------------------------------------------------------------------------------------

    def iter_range(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        path: str,
        offset: int = 0,
        length: int = 0,
        piece_bytes: int = READ_PIECE_BYTES,
        tier: int = 0,
    ) -> Iterator[tuple[int, int, bytes]]:
        """Yield (tier, offset, bytes) pieces of [offset, offset+length) of a committed file.

        `length` 0 reads to the end. Each piece comes from the fastest tier whose copy of it
        verifies, or only from `tier` if given. Bad names and ranges raise here, before the
        first piece.
        """
        key = key_of(ref)
        check_path(path)
        save = self.catalog.save_of(key)
        if save is None or save.state != COMMITTED:
            raise NotFound(f"no committed checkpoint {key}")
        record = self.catalog.file(key, path)
        if record is None:
            raise NotFound(f"checkpoint {key} has no file {path!r}")
        if offset < 0 or length < 0:
            raise InvalidArgument(f"{path}: offset and length must be >= 0")
        end = record.size if length == 0 else offset + length
        if offset > record.size or end > record.size:
            raise InvalidArgument(
                f"{path}: range {offset}+{end - offset} is beyond its {record.size} bytes"
            )
        if tier:
            if tier not in TIER_NAMES:
                raise InvalidArgument(f"unknown tier {tier}")
            if self.catalog.tier_state(key, tier) != TIER_COMMITTED:
                raise NotFound(f"{key} has no committed copy on {TIER_NAMES[tier]}")
        only = (tier,) if tier else None
        return self._pieces(key, record, offset, end, piece_bytes, only)

    def _pieces(
        self,
        key: CheckpointKey,
        record: FileRecord,
        start: int,
        end: int,
        piece_bytes: int,
        only: tuple[int, ...] | None,
    ) -> Iterator[tuple[int, int, bytes]]:
        pos = start
        while pos < end:
            stop = min(end, (pos // piece_bytes + 1) * piece_bytes)
            tier, data = self._read_verified(key, record, pos, stop, only)
            yield tier, pos, data
            pos = stop

    def read_range(
        self, ref: checkpoint_pb2.CheckpointRef, path: str, offset: int = 0, length: int = 0
    ) -> bytes:
        return b"".join(data for _tier, _offset, data in self.iter_range(ref, path, offset, length))

    def _read_order(self, key: CheckpointKey, only: tuple[int, ...] | None) -> list[Tier]:
        tiers: list[Tier] = [self.memory, self.ssd]
        if self.s3 is not None:
            tiers.append(self.s3)
        return [
            t
            for t in tiers
            if (only is None or t.tier in only)
            and self.catalog.tier_state(key, t.tier) == TIER_COMMITTED
        ]

    def _read_verified(
        self,
        key: CheckpointKey,
        record: FileRecord,
        start: int,
        end: int,
        only: tuple[int, ...] | None = None,
    ) -> tuple[int, bytes]:
        lo, hi = block_span(start, end - start, record.size)
        problems = []
        for tier in self._read_order(key, only):
            name = TIER_NAMES[tier.tier]
            began = time.perf_counter()
            try:
                data = tier.read_range(key, record.path, lo, hi - lo)
            except FileNotFoundError:
                damage: str | None = f"{record.path} is missing"
            except Exception as exc:  # an unreachable tier: try the next one
                self.metrics.failed(tier.tier, "read")
                problems.append(f"{name}: {' '.join(str(exc).split())[:200]}")
                log.warning("reading %s/%s from %s failed: %s", key, record.path, name, exc)
                continue
            else:
                damage = _damage(data, lo, hi, record)
                if damage is None:
                    self.metrics.bytes.labels(name, "read").inc(len(data))
                    self.metrics.seconds.labels(name, "read").observe(time.perf_counter() - began)
                    if start == lo and end == hi:
                        return tier.tier, data
                    return tier.tier, data[start - lo : end - lo]
            problems.append(f"{name}: {damage}")
            self.metrics.failed(tier.tier, "verify")
            log.error(
                "%s copy of %s is damaged (%s); trying the next tier", name, key, damage,
                extra={"run": key.run, "step": key.step, "tier": name},
            )  # fmt: skip
            with self._lock:
                if tier is self.memory:
                    self.memory.delete(key)
                self.catalog.set_tier(key, tier.tier, FAILED, error=damage)
        raise DataLoss(
            f"no verified copy of bytes {start}-{end} of {key}/{record.path}: "
            + ("; ".join(problems) or "no tier holds it")
        )

    def export(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        dest_dir: Path,
        progress: Callable[[int], None] | None = None,
    ) -> list[Path]:
        """Write a committed checkpoint as a plain DCP directory (stock FileSystemReader loads it).

        Each file is written under a temporary name and renamed once its block CRC-32Cs match
        (each read is verified too).
        `progress` gets the byte count of each piece written.
        """
        info = self.get(ref)
        key = key_of(info.ref)
        dest = Path(dest_dir)
        if dest.exists() and any(dest.iterdir()):
            raise FailedPrecondition(f"export target {dest} is not empty")
        written = []
        for record in self.catalog.files(key):
            target = dest / record.path
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.partial")
            blocks = BlockCrcs()
            with open(partial, "wb") as out:
                for _tier, _offset, data in self.iter_range(info.ref, record.path):
                    out.write(data)
                    blocks.update(data)
                    if progress is not None:
                        progress(len(data))
            if blocks.packed() != record.block_crcs:
                partial.unlink()
                raise DataLoss(f"export of {key}/{record.path}: block CRC-32C mismatch")
            os.replace(partial, target)
            written.append(target)
        return written

    # -- delete ----------------------------------------------------------------------------------

    def delete(self, ref: checkpoint_pb2.CheckpointRef) -> tuple[list[int], list[int]]:
        """Remove a checkpoint (or an open or aborted save) from every tier.

        Returns (tiers it was removed from, tiers it is still being removed from): S3 removal
        runs in the background, so a slow or unreachable S3 delays nothing. The checkpoint is
        invisible at once, and a restart finishes the S3 removal (the catalog remembers it).
        """
        key = key_of(ref)
        with self._lock:
            record = self.catalog.save_of(key)
            if record is None:
                raise NotFound(f"no checkpoint {key}")
            s3_state = self.catalog.tier_state(key, S3)
            if self.s3 is None and s3_state == TIER_COMMITTED:
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
            s3_objects = self.s3 is not None and s3_state != ABSENT
            self.catalog.delete(key, s3_too=s3_objects)
            if s3_objects:
                self._queue_s3_removal(key)
                pending.append(S3)
        log.info("deleted %s", key, extra={"run": key.run, "step": key.step})
        return removed, pending

    # -- S3 in the background --------------------------------------------------------------------

    def _queue_upload(self, key: CheckpointKey) -> None:
        assert self._background is not None
        if self.catalog.tier_state(key, S3) != FAILED:
            self.catalog.set_tier(key, S3, PENDING)
        self._background.submit(("upload", key), lambda: self._upload(key))

    def _queue_s3_removal(self, key: CheckpointKey) -> None:
        assert self._background is not None
        self._background.submit(("remove", key), lambda: self._remove_from_s3(key))

    def _upload(self, key: CheckpointKey) -> None:
        """Upload job: the verified local copy goes up, marker last; then retention runs."""
        assert self.s3 is not None
        with self._lock:
            if self._closed.is_set():
                return
            manifest = self.catalog.manifest(key)
            if manifest is None or self.catalog.tier_state(key, S3) == TIER_COMMITTED:
                return  # deleted, or done meanwhile
            wants = wanted(
                self.policy(key.run),
                list(self.catalog.run_states(key.run)),
                [k.step for k in self.catalog.committed_on(S3) if k.run == key.run],
                has_s3=True,
            )
            if S3 not in wants.get(key.step, set()):
                self.catalog.set_tier(key, S3, ABSENT)
                return
        started = time.perf_counter()
        existing = self.s3.manifest(key)
        if existing is None or not existing.same_files(manifest):
            records = {f.path: f for f in manifest.files}

            def source(path: str, offset: int, length: int) -> bytes:
                _tier, data = self._read_verified(
                    key, records[path], offset, offset + length, only=(MEMORY, SSD)
                )
                return data

            with self.metrics.timed(S3, "write", manifest.total_bytes):
                self.s3.put(manifest, source)
        crash_point("s3-marker-written")
        with self._lock:
            if self._closed.is_set():
                return
            still_there = self.catalog.save_of(key) is not None
            if still_there:
                self.catalog.set_tier(key, S3, TIER_COMMITTED, manifest.total_bytes)
                self.metrics.commits.labels("S3").inc()
                self._notify(key, S3, manifest.total_bytes)
                self._apply_retention(key.run)
            else:
                self.catalog.delete(key, s3_too=True)
                self._queue_s3_removal(key)
        log.info(
            "uploaded %s to S3 (%d bytes, %.2fs)", key, manifest.total_bytes,
            time.perf_counter() - started,
            extra={"run": key.run, "step": key.step, "bytes": manifest.total_bytes, "tier": "S3"},
        )  # fmt: skip

    def _remove_from_s3(self, key: CheckpointKey) -> None:
        assert self.s3 is not None
        with self._lock:
            save = self.catalog.save_of(key)
            if save is not None and self.catalog.tier_state(key, S3) == TIER_COMMITTED:
                self.catalog.deletion_done(key)
                return  # uploaded again meanwhile: wanted on S3 after all
        with self.metrics.timed(S3, "delete"):
            self.s3.delete(key)
        with self._lock:
            if not self._closed.is_set():
                self.catalog.deletion_done(key)

    def _s3_job_failed(self, job_id: object, exc: BaseException, retry_in: float) -> None:
        kind, key = job_id  # type: ignore[misc]  # ("sync" | "upload" | "remove", key)
        reason = f"{describe(exc)} (retrying in {retry_in:.1f}s)"
        self.metrics.failed(S3, str(kind))
        log.warning("S3 job %s failed: %s", job_id, reason)
        if kind == "upload" and isinstance(key, CheckpointKey):
            with self._lock:
                if not self._closed.is_set():
                    self.catalog.set_tier(key, S3, FAILED, error=reason)

    def _notify(self, key: CheckpointKey, tier: int, nbytes: int) -> None:
        """Tell the observer (telemetry) about a tier commit; its failures never fail a save."""
        if self._on_tier_commit is None:
            return
        record = self.catalog.save_of(key)
        seconds = time.time() - record.created_at if record is not None else 0.0
        try:
            self._on_tier_commit(TierCommit(key.run, key.step, tier, nbytes, seconds))
        except Exception:  # an observer must never break a commit
            log.exception("tier commit observer failed for %s", key)

    # -- query -----------------------------------------------------------------------------------

    def list(
        self, run: str = "", include_uncommitted: bool = False
    ) -> list[checkpoint_pb2.CheckpointInfo]:
        return self.catalog.checkpoints(check_run(run) if run else "", include_uncommitted)

    def get(
        self, ref: checkpoint_pb2.CheckpointRef, latest: bool = False
    ) -> checkpoint_pb2.CheckpointInfo:
        """A committed checkpoint, or with `latest` the newest committed one of `ref.run`."""
        if latest:
            found = self.catalog.latest(check_run(ref.run))
            if found is None:
                raise NotFound(f"run {ref.run!r} has no committed checkpoint")
            key = found
        else:
            key = key_of(ref)
        info = self.catalog.info(key)
        if info is None or not info.committed:
            raise NotFound(f"no committed checkpoint {key}")
        return info
