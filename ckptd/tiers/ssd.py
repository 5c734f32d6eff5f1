"""The SSD tier: checkpoints as plain DCP directories under `data_dir/ssd/<run>/<step>/`.

Keeping DCP's own file names means a committed checkpoint can be read by stock PyTorch straight
from the disk. Crash safety comes from the layout, not from bookkeeping:

- a file being received lives in `.incoming/` under a unique name; once every byte is written it
  is fsynced and renamed into `.staging/<save_id>/` under its real name, so a broken stream never
  leaves a half file where a good one is expected;
- commit writes the manifest (`_COMMITTED`, see `ckptd.manifest`) into the staging dir under a
  temporary name, fsyncs it, renames it, fsyncs the staging dirs, renames the staging dir to
  `<run>/<step>` and fsyncs the parent: a checkpoint directory exists complete, with its marker,
  or not at all, and its marker is what a restart (or a lost catalog) trusts;
- delete renames the checkpoint into `.trash/`, so it disappears at once, and empties the trash
  in the background.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
import uuid
from pathlib import Path

from ckptd.crash import crash_point
from ckptd.manifest import MARKER, Manifest
from ckptd.tiers import CheckpointKey, page_aligned_buffer
from scaletrain.v1 import common_pb2

log = logging.getLogger(__name__)

_INCOMING = ".incoming"
_STAGING = ".staging"
_TRASH = ".trash"
# O_DIRECT's alignment: a page is a multiple of every common logical block size (512, 4096).
_PAGE = mmap.PAGESIZE
_BOUNCE_BYTES = 1 << 20


def fsync_path(path: Path, directory: bool = False) -> None:
    """Make a file's bytes, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class IncomingFile:
    """A file being received; becomes part of a save only through `SsdTier.stage`.

    It is written around the page cache (O_DIRECT) where the filesystem allows it: a checkpoint
    is written once and rarely read back from disk (the memory tier serves the recent ones), and
    copying it through the page cache costs about as much CPU as receiving it, CPU that a
    trainer on the same host wants. O_DIRECT needs aligned buffers, lengths and offsets: the
    data socket's buffers (`MemoryBudget.buffer`) are page-aligned and are written as they
    are; other bytes (gRPC messages, a file's last partial page) go through a small aligned
    bounce buffer, and the file is cut to its size after its padded last page. Where O_DIRECT
    is refused (tmpfs, some network filesystems) the file is written through the page cache.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
            self._direct = True
        except OSError:
            self._fd = os.open(path, flags, 0o644)
            self._direct = False
        self._size = 0
        self._bounce: mmap.mmap | None = None
        self._fill = 0  # bytes waiting in the bounce buffer

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._size += len(view)
        if not self._direct:
            self._write_all(view)
            return
        if self._fill == 0 and _page_aligned(view):
            whole = len(view) - len(view) % _PAGE
            self._write_direct(view[:whole])
            view = view[whole:]
        while view:
            if self._bounce is None:
                self._bounce = page_aligned_buffer(_BOUNCE_BYTES)
            take = min(len(view), _BOUNCE_BYTES - self._fill)
            self._bounce[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == _BOUNCE_BYTES:
                self._flush_bounce()

    def _flush_bounce(self) -> None:
        """Write what the bounce buffer holds, padded to a whole page (only the last one is)."""
        assert self._bounce is not None
        padded = -(-self._fill // _PAGE) * _PAGE
        fill = self._fill
        self._bounce[fill:padded] = bytes(padded - fill)
        self._fill = 0
        with memoryview(self._bounce) as bounce:
            if self._direct:
                self._write_direct(bounce[:padded])
            else:
                self._write_all(bounce[:fill])

    def _write_direct(self, view: memoryview) -> None:
        while view:
            try:
                written = os.write(self._fd, view)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                written = 0  # accepted at open, refused at write: go through the page cache
            if written % _PAGE or not written:
                self._buffered()
                self._write_all(view[written:])
                return
            view = view[written:]

    def _buffered(self) -> None:
        """From now on, through the page cache (a partial or refused direct write)."""
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False

    def _write_all(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self._fd, view) :]

    def sync_and_close(self) -> None:
        try:
            if self._fill:
                self._flush_bounce()
            os.ftruncate(self._fd, self._size)  # drop the padding of the last page
            os.fsync(self._fd)
        finally:
            self._close()

    def discard(self) -> None:
        self._close()
        self.path.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._bounce is not None:
            # A failed write's traceback may still hold a view of it (a full disk at the last
            # flush): then it is freed with that traceback, and the OSError is what the caller
            # hears, not a BufferError.
            with contextlib.suppress(BufferError):
                self._bounce.close()
            self._bounce = None


def _page_aligned(view: memoryview) -> bool:
    """Whether a buffer starts on a page boundary (read-only buffers are taken as not)."""
    if view.readonly or not view:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % _PAGE == 0


class SsdTier:
    """Committed checkpoints as directories of DCP files on local disk."""

    tier = common_pb2.TIER_SSD

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in (_INCOMING, _STAGING, _TRASH):
            (root / sub).mkdir(parents=True, exist_ok=True)

    # -- receiving a save ------------------------------------------------------------------------

    def incoming_file(self) -> IncomingFile:
        return IncomingFile(self.root / _INCOMING / uuid.uuid4().hex)

    def stage(self, incoming: IncomingFile, save_id: str, path: str) -> None:
        """Move a fully written, fsynced file into the save's staging dir under its real name."""
        target = self.staging_dir(save_id) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(incoming.path, target)

    def staging_dir(self, save_id: str) -> Path:
        return self.root / _STAGING / save_id

    def staged_saves(self) -> list[str]:
        return [p.name for p in (self.root / _STAGING).iterdir()]

    def discard_staging(self, save_id: str) -> None:
        shutil.rmtree(self.staging_dir(save_id), ignore_errors=True)

    def clean_leftovers(self) -> None:
        """Remove partial files and half-deleted checkpoints that a previous process left."""
        for sub in (_INCOMING, _TRASH):
            shutil.rmtree(self.root / sub, ignore_errors=True)
            (self.root / sub).mkdir()

    def sync_staging(self, save_id: str) -> None:
        """Make a staged save's directory entries durable (its files are fsynced as staged)."""
        for dirpath, _dirs, _files in os.walk(self.staging_dir(save_id)):
            fsync_path(Path(dirpath), directory=True)
        fsync_path(self.root / _STAGING, directory=True)

    def put(self, manifest: Manifest, save_id: str) -> None:
        """Commit a staged save: marker, fsyncs, rename into place, fsync of the parent."""
        staging = self.staging_dir(save_id)
        self._write_marker(staging, manifest)
        for dirpath, _dirs, _files in os.walk(staging):
            fsync_path(Path(dirpath), directory=True)
        target = self.dir_of(manifest.key)
        run_dir = target.parent
        if not run_dir.exists():
            run_dir.mkdir()
            fsync_path(self.root, directory=True)
        if target.exists():
            self._trash(target)  # an uncommitted leftover of an earlier attempt
        crash_point("ssd-before-rename")
        os.rename(staging, target)
        crash_point("ssd-after-rename")
        fsync_path(run_dir, directory=True)
        fsync_path(self.root / _STAGING, directory=True)

    @staticmethod
    def _write_marker(directory: Path, manifest: Manifest) -> None:
        tmp = directory / f"{MARKER}.tmp"
        with open(tmp, "wb") as out:
            out.write(manifest.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, directory / MARKER)
        fsync_path(directory, directory=True)

    # -- the Tier interface ----------------------------------------------------------------------

    def dir_of(self, key: CheckpointKey) -> Path:
        return self.root / key.run / str(key.step)

    def path_of(self, key: CheckpointKey, path: str) -> Path:
        return self.dir_of(key) / path

    def has(self, key: CheckpointKey) -> bool:
        return (self.dir_of(key) / MARKER).is_file()

    def manifest(self, key: CheckpointKey) -> Manifest:
        marker = self.dir_of(key) / MARKER
        return Manifest.from_json(marker.read_bytes(), str(marker))

    def read_range(self, key: CheckpointKey, path: str, offset: int, length: int) -> bytes:
        with open(self.path_of(key, path), "rb", buffering=0) as f:
            return os.pread(f.fileno(), length, offset)

    def delete(self, key: CheckpointKey) -> bool:
        target = self.dir_of(key)
        if not target.exists():
            return False
        self._trash(target)
        return True

    def list(self) -> list[CheckpointKey]:
        """Every checkpoint directory with a marker (a directory without one is not committed)."""
        keys = []
        for run_dir in self.root.iterdir():
            if run_dir.name.startswith(".") or not run_dir.is_dir():
                continue
            for step in run_dir.iterdir():
                if step.name.isdigit() and (step / MARKER).is_file():
                    keys.append(CheckpointKey(run_dir.name, int(step.name)))
        return sorted(keys)

    def _trash(self, target: Path) -> None:
        """Rename `target` away at once; its files are removed in the background (a crash leaves
        them for `clean_leftovers`), so deleting a big checkpoint never holds up a commit."""
        doomed = self.root / _TRASH / uuid.uuid4().hex
        os.rename(target, doomed)
        threading.Thread(
            target=shutil.rmtree, args=(doomed, True), name="ckptd-trash", daemon=True
        ).start()
