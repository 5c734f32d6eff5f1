"""CheckpointStore: the save/commit/read protocol of ckptd as a plain Python class.

No gRPC here: the servicer in `ckptd.server` only translates messages, and the command line opens
a store directly on a data dir (S3 disabled, no memory budget) to list and export offline. The
store owns the rules that make a checkpoint trustworthy:

- names are validated before they touch a path or an object key;
- every chunk is CRC-32C checked and every file SHA-256 checked before it counts;
- a checkpoint commits only with the metadata file and a shard file from every rank, and becomes
  visible only once durable on SSD (memory is filled at the same moment, S3 in the background);
- every read verifies the per-block CRCs of the bytes it returns, and falls through to the next
  tier when a copy is damaged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import google_crc32c

from ckptd.catalog import ABORTED, COMMITTED, OPEN, Catalog, FileRecord, SaveRecord
from ckptd.config import CkptdConfig
from ckptd.tiers import (
    BLOCK_BYTES,
    TIER_NAMES,
    BlockCrcs,
    CheckpointKey,
    Tier,
    block_span,
    first_bad_block,
)
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.s3 import MARKER, S3Tier, UploadQueue
from ckptd.tiers.ssd import IncomingFile, SsdTier
from scaletrain.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    UserError,
)
from scaletrain.v1 import checkpoint_pb2, common_pb2

log = logging.getLogger(__name__)

LOCK_FILE = "ckptd.lock"
# Reads are served in pieces of this size, each from the fastest tier whose copy verifies.
READ_PIECE_BYTES = 16 * BLOCK_BYTES
MAX_WORLD_SIZE = 1 << 20
_MAX_PATH_BYTES = 1024
_MAX_NAME_BYTES = 255
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,127}")

SHARD = checkpoint_pb2.FILE_KIND_SHARD
METADATA = checkpoint_pb2.FILE_KIND_METADATA
ABSENT = checkpoint_pb2.TIER_STATE_ABSENT
PENDING = checkpoint_pb2.TIER_STATE_PENDING
TIER_COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED
FAILED = checkpoint_pb2.TIER_STATE_FAILED


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
    if parts[0] == MARKER:
        raise InvalidArgument(f"file path {path!r} is reserved for ckptd's S3 commit marker")
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
                if status.tier == common_pb2.TIER_MEMORY:
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
    # Completed files' bytes for the memory tier, or None once the save outgrew the budget.
    memory: dict[str, bytes] | None
    uploads: int = 0
    committing: bool = False

    @property
    def memory_bytes(self) -> int:
        return sum(len(data) for data in (self.memory or {}).values())


class FileUpload:
    """One file of a save being received chunk by chunk; see `CheckpointStore.begin_file`.

    Use as a context manager: leaving without `finish` discards what was received, so a broken
    stream stores nothing.
    """

    def __init__(
        self,
        store: CheckpointStore,
        save: _OpenSave,
        header: checkpoint_pb2.FileHeader,
        incoming: IncomingFile,
        memory_room: int,
    ) -> None:
        self.path = header.path
        self._store = store
        self._save = save
        self._header = header
        self._incoming = incoming
        self._sha = hashlib.sha256()
        self._crcs = BlockCrcs()
        self._size = 0
        self._memory_room = memory_room
        self._parts: list[bytes] | None = [] if memory_room > 0 else None
        self._open = True

    def __enter__(self) -> FileUpload:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._open:
            self._close()
            self._incoming.discard()

    def write(self, chunk: checkpoint_pb2.FileChunk) -> None:
        if chunk.offset != self._size:
            raise InvalidArgument(
                f"{self.path}: chunk at offset {chunk.offset}, expected {self._size} "
                "(chunks must arrive in order without gaps)"
            )
        data = chunk.data
        crc = google_crc32c.value(data)
        if crc != chunk.crc32c:
            raise DataLoss(
                f"{self.path}: CRC-32C mismatch in chunk at offset {chunk.offset} "
                f"(sent {chunk.crc32c:08x}, received bytes give {crc:08x})"
            )
        try:
            self._incoming.write(data)
        except OSError as exc:
            raise Unavailable(f"{self.path}: ckptd cannot write to its SSD: {exc}") from None
        self._sha.update(data)
        self._crcs.update(data)
        self._size += len(data)
        if self._parts is not None:
            if self._size <= self._memory_room:
                self._parts.append(data)
            else:
                self._parts = None

    def finish(self, trailer: checkpoint_pb2.FileTrailer) -> FileRecord:
        """Check the trailer against the bytes received and add the file to the save."""
        if trailer.size != self._size:
            raise DataLoss(
                f"{self.path}: trailer says {trailer.size} bytes, {self._size} were received"
            )
        digest = self._sha.hexdigest()
        if trailer.sha256.lower() != digest:
            raise DataLoss(
                f"{self.path}: SHA-256 mismatch (trailer {trailer.sha256[:16]}..., "
                f"received bytes give {digest[:16]}...)"
            )
        record = FileRecord(
            path=self.path,
            rank=self._header.rank,
            kind=self._header.kind,
            size=self._size,
            sha256=digest,
            block_crcs=self._crcs.packed(),
        )
        data = b"".join(self._parts) if self._parts is not None else None
        try:
            self._store._accept(self._save, record, self._incoming, data)
        finally:
            # Only now may a commit proceed: the file is part of the save (or refused).
            self._close()
        return record

    def _close(self) -> None:
        self._open = False
        self._store._release(self._save)


def _damage(data: bytes, lo: int, hi: int, record: FileRecord) -> str | None:
    """What is wrong with bytes [lo, hi) of `record` as read from a tier, or None if they verify."""
    if len(data) != hi - lo:
        return f"{record.path} is short ({len(data)} of {hi - lo} bytes at offset {lo})"
    bad = first_bad_block(data, lo, record.block_crcs)
    if bad is not None:
        return f"{record.path} fails its checksum in block {bad}"
    return None


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
        self._closed = False
        self._saves: dict[str, _OpenSave] = {}
        self._on_tier_commit = on_tier_commit
        try:
            self.catalog = Catalog(data_dir)
            self.memory = MemoryTier(config.memory_budget_bytes)
            self.ssd = SsdTier(data_dir / "ssd")
            self.s3 = S3Tier(config.s3) if config.s3 is not None else None
            self._recover()
        except BaseException:
            self._lockfile.close()
            raise
        self._uploads: UploadQueue | None = None
        if self.s3 is not None:
            s3 = self.s3.config
            self._uploads = UploadQueue(
                self._upload, self._upload_failed, s3.upload_attempts, s3.backoff_s
            )
            for key in self.catalog.missing_on(common_pb2.TIER_S3):
                if self.catalog.tier_state(key, common_pb2.TIER_SSD) == TIER_COMMITTED:
                    self._queue_upload(key)

    def _recover(self) -> None:
        """Bring the catalog in line with the disk after a restart (clean or not)."""
        self.ssd.clean_leftovers()
        for key in self.catalog.committed_on(common_pb2.TIER_MEMORY):
            self.catalog.set_tier(key, common_pb2.TIER_MEMORY, ABSENT)
        for record in self.catalog.open_saves():
            # Staged files survive a restart; the memory copies of them did not.
            self._saves[record.save_id] = _OpenSave(record, memory=None)
            self.ssd.staging_dir(record.save_id).mkdir(parents=True, exist_ok=True)
        for save_id in self.ssd.staged_saves():
            if save_id not in self._saves:
                self.ssd.discard_staging(save_id)
        known = set()
        for key in self.catalog.committed_on(common_pb2.TIER_SSD):
            known.add(key)
            if not self.ssd.has(key):
                self.catalog.set_tier(
                    key, common_pb2.TIER_SSD, FAILED, error="directory missing at startup"
                )
        for key in set(self.ssd.list()) - known:
            log.warning("SSD holds %s, which the catalog does not know; leaving it", key)

    def close(self, timeout_s: float = 5.0) -> None:
        """Give an S3 upload in flight `timeout_s` to finish, drop the memory tier, release."""
        if self._uploads is not None:
            self._uploads.close(timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for key in self.memory.list():
                self.memory.delete(key)
                self.catalog.set_tier(key, common_pb2.TIER_MEMORY, ABSENT)
            self.catalog.close()
            self._lockfile.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- save ------------------------------------------------------------------------------------

    def open_save(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        world_size: int,
        labels: Mapping[str, str] | None = None,
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
                self._saves.pop(existing.save_id, None)
                self.ssd.discard_staging(existing.save_id)
            save_id = uuid.uuid4().hex
            self.catalog.open_save(key, save_id, world_size, dict(labels or {}))
            self.ssd.staging_dir(save_id).mkdir(parents=True)
            record = self.catalog.save(save_id)
            assert record is not None
            memory: dict[str, bytes] | None = {} if self.memory.budget_bytes > 0 else None
            self._saves[save_id] = _OpenSave(record, memory=memory)
            return save_id

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

    def begin_file(self, header: checkpoint_pb2.FileHeader) -> FileUpload:
        """Start receiving one file of an open save (the streaming form of `write_file`)."""
        check_path(header.path)
        if header.kind not in (SHARD, METADATA):
            raise InvalidArgument(
                f"{header.path}: kind must be FILE_KIND_SHARD or FILE_KIND_METADATA"
            )
        with self._lock:
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
            try:
                incoming = self.ssd.incoming_file()
            except OSError as exc:
                raise Unavailable(f"{header.path}: ckptd cannot write to its SSD: {exc}") from None
            save.uploads += 1
            room = 0
            if save.memory is not None:
                room = self.memory.budget_bytes - save.memory_bytes
            return FileUpload(self, save, header, incoming, room)

    def write_file(
        self,
        header: checkpoint_pb2.FileHeader,
        chunks: Iterable[checkpoint_pb2.FileChunk],
        trailer: checkpoint_pb2.FileTrailer,
    ) -> FileRecord:
        """Receive a whole file: chunks in order, each CRC-checked, then size and SHA-256."""
        with self.begin_file(header) as upload:
            for chunk in chunks:
                upload.write(chunk)
            return upload.finish(trailer)

    def _release(self, save: _OpenSave) -> None:
        with self._lock:
            save.uploads -= 1

    def _accept(
        self, save: _OpenSave, record: FileRecord, incoming: IncomingFile, data: bytes | None
    ) -> None:
        with self._lock:
            if self._saves.get(save.record.save_id) is not save or save.committing:
                incoming.discard()
                raise FailedPrecondition(
                    f"{record.path}: save {save.record.save_id} was replaced, aborted or "
                    "committed while the file was being written"
                )
            try:
                self.ssd.stage(incoming, save.record.save_id, record.path)
            except OSError as exc:
                incoming.discard()
                raise Unavailable(f"{record.path}: ckptd cannot write to its SSD: {exc}") from None
            self.catalog.add_file(save.record.key, record)
            if save.memory is not None:
                save.memory.pop(record.path, None)
                if data is not None and save.memory_bytes + len(data) <= self.memory.budget_bytes:
                    save.memory[record.path] = data
                else:
                    save.memory = None

    def commit(self, save_id: str) -> checkpoint_pb2.CheckpointInfo:
        """Make the save a checkpoint: durable on SSD and in memory now, on S3 in the background."""
        with self._lock:
            save = self._writable(save_id)
            key = save.record.key
            if save.uploads:
                raise FailedPrecondition(
                    f"cannot commit {key}: {save.uploads} file(s) are still being written"
                )
            files = self.catalog.files(key)
            self._check_complete(save.record, files)
            save.committing = True
        try:
            self.ssd.put(key, save_id)
        except OSError as exc:
            with self._lock:
                save.committing = False
            raise Unavailable(f"cannot commit {key} to SSD: {exc}") from None
        total = sum(f.size for f in files)
        with self._lock:
            del self._saves[save_id]
            self.catalog.finish_save(key, COMMITTED)
            self.catalog.set_tier(key, common_pb2.TIER_SSD, TIER_COMMITTED, total)
            self._notify(key, common_pb2.TIER_SSD, total)
            if save.memory is not None and set(save.memory) == {f.path for f in files}:
                kept, evicted = self.memory.put(key, save.memory, self._has_slower_copy)
                for old in evicted:
                    self.catalog.set_tier(old, common_pb2.TIER_MEMORY, ABSENT)
                if kept:
                    self.catalog.set_tier(key, common_pb2.TIER_MEMORY, TIER_COMMITTED, total)
                    self._notify(key, common_pb2.TIER_MEMORY, total)
            if self._uploads is not None:
                self._queue_upload(key)
            info = self.catalog.info(key)
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

    def _has_slower_copy(self, key: CheckpointKey) -> bool:
        return any(
            self.catalog.tier_state(key, tier) == TIER_COMMITTED
            for tier in (common_pb2.TIER_SSD, common_pb2.TIER_S3)
        )

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
            del self._saves[save_id]
            self.ssd.discard_staging(save_id)
            self.catalog.remove_files(save.record.key)
            self.catalog.finish_save(save.record.key, ABORTED, " ".join(reason.split())[:500])

    # -- read ------------------------------------------------------------------------------------

    def iter_range(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        path: str,
        offset: int = 0,
        length: int = 0,
        piece_bytes: int = READ_PIECE_BYTES,
    ) -> Iterator[tuple[int, int, bytes]]:
        """Yield (tier, offset, bytes) pieces of [offset, offset+length) of a committed file.

        `length` 0 reads to the end. Each piece comes from the fastest tier whose copy of it
        verifies. Bad names and ranges raise here, before the first piece.
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
        return self._pieces(key, record, offset, end, piece_bytes)

    def _pieces(
        self, key: CheckpointKey, record: FileRecord, start: int, end: int, piece_bytes: int
    ) -> Iterator[tuple[int, int, bytes]]:
        pos = start
        while pos < end:
            stop = min(end, (pos // piece_bytes + 1) * piece_bytes)
            tier, data = self._read_verified(key, record, pos, stop)
            yield tier, pos, data
            pos = stop

    def read_range(
        self, ref: checkpoint_pb2.CheckpointRef, path: str, offset: int = 0, length: int = 0
    ) -> bytes:
        return b"".join(data for _tier, _offset, data in self.iter_range(ref, path, offset, length))

    def _read_order(self, key: CheckpointKey) -> list[Tier]:
        tiers: list[Tier] = [self.memory, self.ssd]
        if self.s3 is not None:
            tiers.append(self.s3)
        return [t for t in tiers if self.catalog.tier_state(key, t.tier) == TIER_COMMITTED]

    def _read_verified(
        self, key: CheckpointKey, record: FileRecord, start: int, end: int
    ) -> tuple[int, bytes]:
        lo, hi = block_span(start, end - start, record.size)
        problems = []
        for tier in self._read_order(key):
            name = TIER_NAMES[tier.tier]
            try:
                data = tier.read_range(key, record.path, lo, hi - lo)
            except FileNotFoundError:
                damage: str | None = f"{record.path} is missing"
            except Exception as exc:  # an unreachable tier: try the next one
                problems.append(f"{name}: {' '.join(str(exc).split())[:200]}")
                log.warning("reading %s/%s from %s failed: %s", key, record.path, name, exc)
                continue
            else:
                damage = _damage(data, lo, hi, record)
                if damage is None:
                    return tier.tier, data[start - lo : end - lo]
            problems.append(f"{name}: {damage}")
            log.error("%s copy of %s is damaged (%s); trying the next tier", name, key, damage)
            with self._lock:
                if tier is self.memory:
                    self.memory.delete(key)
                self.catalog.set_tier(key, tier.tier, FAILED, error=damage)
        raise DataLoss(
            f"no verified copy of bytes {start}-{end} of {key}/{record.path}: "
            + ("; ".join(problems) or "no tier holds it")
        )

    def export(self, ref: checkpoint_pb2.CheckpointRef, dest_dir: Path) -> list[Path]:
        """Write a committed checkpoint as a plain DCP directory (stock FileSystemReader loads it).

        Each file is written under a temporary name and renamed once its SHA-256 matches.
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
            sha = hashlib.sha256()
            with open(partial, "wb") as out:
                for _tier, _offset, data in self.iter_range(info.ref, record.path):
                    out.write(data)
                    sha.update(data)
            if sha.hexdigest() != record.sha256:
                partial.unlink()
                raise DataLoss(f"export of {key}/{record.path}: SHA-256 mismatch")
            os.replace(partial, target)
            written.append(target)
        return written

    # -- delete ----------------------------------------------------------------------------------

    def delete(self, ref: checkpoint_pb2.CheckpointRef) -> list[int]:
        """Remove a checkpoint (or an open or aborted save) from every tier; returns the tiers."""
        key = key_of(ref)
        with self._lock:
            record = self.catalog.save_of(key)
            if record is None:
                raise NotFound(f"no checkpoint {key}")
            s3_state = self.catalog.tier_state(key, common_pb2.TIER_S3)
            if self.s3 is None and s3_state == TIER_COMMITTED:
                raise FailedPrecondition(
                    f"{key} has a copy on S3 but this ckptd has no S3 configured to delete it from"
                )
            if record.state == OPEN:
                save = self._saves.pop(record.save_id, None)
                if save is not None and save.committing:
                    self._saves[record.save_id] = save
                    raise FailedPrecondition(f"checkpoint {key} is being committed right now")
                self.ssd.discard_staging(record.save_id)
            removed = []
            if self.memory.delete(key):
                removed.append(common_pb2.TIER_MEMORY)
            if self.ssd.delete(key):
                removed.append(common_pb2.TIER_SSD)
            self.catalog.delete(key)
        if self.s3 is not None and s3_state != ABSENT:
            try:
                if self.s3.delete(key):
                    removed.append(common_pb2.TIER_S3)
            except Exception as exc:  # reported, with what was done
                raise Unavailable(
                    f"deleted {key} locally, but its objects on S3 remain: "
                    + " ".join(str(exc).split())[:200]
                ) from None
        return removed

    # -- S3 in the background --------------------------------------------------------------------

    def _queue_upload(self, key: CheckpointKey) -> None:
        assert self._uploads is not None
        self.catalog.set_tier(key, common_pb2.TIER_S3, PENDING)
        self._uploads.submit(key)

    def _upload(self, key: CheckpointKey) -> None:
        """Upload job: verify the SSD copy, upload it with its manifest, record the commit."""
        assert self.s3 is not None
        with self._lock:
            if self._closed:
                return
            info = self.catalog.info(key)
            if info is None or not info.committed:
                return  # deleted meanwhile
            files = self.catalog.files(key)
        sources = []
        for f in files:
            local = self.ssd.path_of(key, f.path)
            with open(local, "rb") as src:
                for pos in range(0, f.size, READ_PIECE_BYTES):
                    end = min(f.size, pos + READ_PIECE_BYTES)
                    damage = _damage(src.read(end - pos), pos, end, f)
                    if damage is not None:
                        raise OSError(f"SSD copy of {key} is damaged: {damage}")
            sources.append((f.path, local, f.size))
        manifest = {
            "run": key.run,
            "step": key.step,
            "world_size": info.world_size,
            "block_bytes": BLOCK_BYTES,
            "files": [
                {
                    "path": f.path,
                    "rank": f.rank,
                    "kind": checkpoint_pb2.FileKind.Name(f.kind),
                    "size": f.size,
                    "sha256": f.sha256,
                    "block_crc32c": f.block_crcs.hex(),
                }
                for f in files
            ],
        }
        self.s3.put(key, sources, json.dumps(manifest, indent=1).encode())
        with self._lock:
            if self._closed:
                return
            still_there = self.catalog.save_of(key) is not None
            if still_there:
                total = sum(f.size for f in files)
                self.catalog.set_tier(key, common_pb2.TIER_S3, TIER_COMMITTED, total)
                self._notify(key, common_pb2.TIER_S3, total)
        if not still_there:
            self.s3.delete(key)

    def _upload_failed(self, key: CheckpointKey, reason: str) -> None:
        with self._lock:
            if not self._closed:
                self.catalog.set_tier(key, common_pb2.TIER_S3, FAILED, error=reason)

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
