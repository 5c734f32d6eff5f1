"""The SSD tier: checkpoints as plain DCP directories under `data_dir/ssd/<run>/<step>/`.

Keeping DCP's own file names means a committed checkpoint can be read by stock PyTorch straight
from the disk. Crash safety comes from the layout, not from bookkeeping:

- a file being received lives in `.incoming/` under a unique name, so a broken stream never leaves
  a half file where a good one is expected;
- a received, verified file moves into `.staging/<save_id>/` under its real name;
- commit fsyncs every staged file and the staging dir, renames the staging dir to `<run>/<step>`
  and fsyncs the parent, so a checkpoint directory exists completely or not at all;
- delete renames the checkpoint into `.trash/` first, so it disappears at once.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO

from ckptd.tiers import CheckpointKey
from scaletrain.v1 import common_pb2

_INCOMING = ".incoming"
_STAGING = ".staging"
_TRASH = ".trash"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new, renamed or removed children) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class IncomingFile:
    """A file being received; becomes part of a save only through `SsdTier.stage`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close/discard)

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def close(self) -> None:
        self._file.close()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


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
        """Move a fully received file into the save's staging dir under its real name."""
        incoming.close()
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

    def put(self, key: CheckpointKey, save_id: str) -> None:
        """Commit a staged save as `key`: fsync, rename into place, fsync the parent."""
        staging = self.staging_dir(save_id)
        for dirpath, _dirs, files in os.walk(staging):
            for name in files:
                fd = os.open(Path(dirpath) / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(Path(dirpath))
        target = self.dir_of(key)
        run_dir = target.parent
        if not run_dir.exists():
            run_dir.mkdir()
            fsync_dir(self.root)
        if target.exists():
            # Left by a crash between rename and catalog update of an earlier attempt.
            self._trash(target)
        os.rename(staging, target)
        fsync_dir(run_dir)
        fsync_dir(self.root / _STAGING)

    # -- the Tier interface ----------------------------------------------------------------------

    def dir_of(self, key: CheckpointKey) -> Path:
        return self.root / key.run / str(key.step)

    def path_of(self, key: CheckpointKey, path: str) -> Path:
        return self.dir_of(key) / path

    def has(self, key: CheckpointKey) -> bool:
        return self.dir_of(key).is_dir()

    def read_range(self, key: CheckpointKey, path: str, offset: int, length: int) -> bytes:
        with open(self.path_of(key, path), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def delete(self, key: CheckpointKey) -> bool:
        target = self.dir_of(key)
        if not target.exists():
            return False
        self._trash(target)
        return True

    def list(self) -> list[CheckpointKey]:
        keys = []
        for run_dir in self.root.iterdir():
            if run_dir.name.startswith(".") or not run_dir.is_dir():
                continue
            keys.extend(
                CheckpointKey(run_dir.name, int(step.name))
                for step in run_dir.iterdir()
                if step.name.isdigit()
            )
        return sorted(keys)

    def _trash(self, target: Path) -> None:
        doomed = self.root / _TRASH / uuid.uuid4().hex
        os.rename(target, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
