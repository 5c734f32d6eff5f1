"""The catalog: every checkpoint ckptd knows, its files, and its state on each tier, in SQLite.

It lives in the data dir beside the SSD tier (`data_dir/catalog.db`) so that the command line can
list and export checkpoints with no service running, and so that a restarted ckptd knows which
uploads to S3 it still owes. WAL mode lets such an offline reader look while ckptd writes.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp

from ckptd.tiers import TIER_NAMES, CheckpointKey
from scaletrain.errors import UserError
from scaletrain.v1 import checkpoint_pb2

CATALOG_FILE = "catalog.db"
SCHEMA_VERSION = 1

OPEN, COMMITTED, ABORTED = "open", "committed", "aborted"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    save_id TEXT NOT NULL UNIQUE,
    world_size INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('open', 'committed', 'aborted')),
    labels TEXT NOT NULL,
    created_at REAL NOT NULL,
    committed_at REAL,
    reason TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run, step)
);
CREATE TABLE IF NOT EXISTS files (
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    rank INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    block_crcs BLOB NOT NULL,
    PRIMARY KEY (run, step, path),
    FOREIGN KEY (run, step) REFERENCES checkpoints (run, step) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS tiers (
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier INTEGER NOT NULL,
    state INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    error TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run, step, tier),
    FOREIGN KEY (run, step) REFERENCES checkpoints (run, step) ON DELETE CASCADE
);
"""


@dataclass(frozen=True)
class FileRecord:
    """A received, verified file of a checkpoint; block_crcs are the per-block CRC-32Cs."""

    path: str
    rank: int
    kind: int
    size: int
    sha256: str
    block_crcs: bytes

    def to_proto(self) -> checkpoint_pb2.FileInfo:
        return checkpoint_pb2.FileInfo(
            path=self.path, rank=self.rank, kind=self.kind, size=self.size, sha256=self.sha256
        )


@dataclass(frozen=True)
class SaveRecord:
    """One save attempt of a checkpoint, as OpenSave created it."""

    save_id: str
    key: CheckpointKey
    world_size: int
    state: str
    created_at: float


def _timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


class Catalog:
    """Thread-safe access to `catalog.db`; one connection, serialized by a lock."""

    def __init__(self, data_dir: Path, *, readonly: bool = False) -> None:
        path = Path(data_dir) / CATALOG_FILE
        if readonly:
            if not path.exists():
                raise UserError(f"no ckptd catalog at {path}; is {data_dir} a ckptd data dir?")
            uri = f"file:{path}?mode=ro"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            uri = f"file:{path}"
        self._db = sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=30
        )
        self._lock = threading.Lock()
        self._db.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise UserError(f"{path} has catalog schema {version}; this ckptd knows 1")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- saves -----------------------------------------------------------------------------------

    def open_save(
        self, key: CheckpointKey, save_id: str, world_size: int, labels: dict[str, str]
    ) -> None:
        """Record a new save attempt, replacing any earlier uncommitted attempt of the same key."""
        with self._tx() as db:
            db.execute("DELETE FROM checkpoints WHERE run = ? AND step = ?", (key.run, key.step))
            db.execute(
                "INSERT INTO checkpoints (run, step, save_id, world_size, state, labels, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key.run, key.step, save_id, world_size, OPEN, json.dumps(labels), time.time()),
            )

    def save(self, save_id: str) -> SaveRecord | None:
        rows = self._query(
            "SELECT save_id, run, step, world_size, state, created_at FROM checkpoints "
            "WHERE save_id = ?",
            (save_id,),
        )
        return self._save_record(rows[0]) if rows else None

    def save_of(self, key: CheckpointKey) -> SaveRecord | None:
        rows = self._query(
            "SELECT save_id, run, step, world_size, state, created_at FROM checkpoints "
            "WHERE run = ? AND step = ?",
            (key.run, key.step),
        )
        return self._save_record(rows[0]) if rows else None

    def open_saves(self) -> list[SaveRecord]:
        rows = self._query(
            "SELECT save_id, run, step, world_size, state, created_at FROM checkpoints "
            "WHERE state = ?",
            (OPEN,),
        )
        return [self._save_record(row) for row in rows]

    @staticmethod
    def _save_record(row: tuple) -> SaveRecord:
        save_id, run, step, world_size, state, created_at = row
        return SaveRecord(save_id, CheckpointKey(run, step), world_size, state, created_at)

    def add_file(self, key: CheckpointKey, record: FileRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO files (run, step, path, rank, kind, size, sha256, "
                "block_crcs) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (key.run, key.step, record.path, record.rank, record.kind, record.size,
                 record.sha256, record.block_crcs),
            )  # fmt: skip

    def files(self, key: CheckpointKey) -> list[FileRecord]:
        rows = self._query(
            "SELECT path, rank, kind, size, sha256, block_crcs FROM files "
            "WHERE run = ? AND step = ? ORDER BY path",
            (key.run, key.step),
        )
        return [FileRecord(*row) for row in rows]

    def file(self, key: CheckpointKey, path: str) -> FileRecord | None:
        rows = self._query(
            "SELECT path, rank, kind, size, sha256, block_crcs FROM files "
            "WHERE run = ? AND step = ? AND path = ?",
            (key.run, key.step, path),
        )
        return FileRecord(*rows[0]) if rows else None

    def remove_files(self, key: CheckpointKey) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE run = ? AND step = ?", (key.run, key.step))

    def finish_save(self, key: CheckpointKey, state: str, reason: str = "") -> None:
        """Mark a save committed (visible from now on) or aborted (kept only for listing)."""
        with self._tx() as db:
            db.execute(
                "UPDATE checkpoints SET state = ?, committed_at = ?, reason = ? "
                "WHERE run = ? AND step = ?",
                (state, time.time() if state == COMMITTED else None, reason, key.run, key.step),
            )

    def delete(self, key: CheckpointKey) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM checkpoints WHERE run = ? AND step = ?", (key.run, key.step))

    # -- tiers -----------------------------------------------------------------------------------

    def set_tier(
        self, key: CheckpointKey, tier: int, state: int, nbytes: int = 0, error: str = ""
    ) -> None:
        """Record a tier's state; a no-op when the checkpoint was deleted meanwhile."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO tiers (run, step, tier, state, bytes, updated_at, error) "
                "SELECT run, step, ?, ?, ?, ?, ? FROM checkpoints WHERE run = ? AND step = ?",
                (tier, state, nbytes, time.time(), error, key.run, key.step),
            )

    def tier_state(self, key: CheckpointKey, tier: int) -> int:
        rows = self._query(
            "SELECT state FROM tiers WHERE run = ? AND step = ? AND tier = ?",
            (key.run, key.step, tier),
        )
        return rows[0][0] if rows else checkpoint_pb2.TIER_STATE_ABSENT

    def committed_on(self, tier: int) -> list[CheckpointKey]:
        rows = self._query(
            "SELECT run, step FROM tiers WHERE tier = ? AND state = ? ORDER BY run, step",
            (tier, checkpoint_pb2.TIER_STATE_COMMITTED),
        )
        return [CheckpointKey(run, step) for run, step in rows]

    def missing_on(self, tier: int) -> list[CheckpointKey]:
        """Committed checkpoints that `tier` does not hold a committed copy of."""
        rows = self._query(
            "SELECT c.run, c.step FROM checkpoints c LEFT JOIN tiers t "
            "ON t.run = c.run AND t.step = c.step AND t.tier = ? "
            "WHERE c.state = ? AND (t.state IS NULL OR t.state != ?) ORDER BY c.run, c.step",
            (tier, COMMITTED, checkpoint_pb2.TIER_STATE_COMMITTED),
        )
        return [CheckpointKey(run, step) for run, step in rows]

    # -- listing ---------------------------------------------------------------------------------

    def latest(self, run: str) -> CheckpointKey | None:
        rows = self._query(
            "SELECT step FROM checkpoints WHERE run = ? AND state = ? ORDER BY step DESC LIMIT 1",
            (run, COMMITTED),
        )
        return CheckpointKey(run, rows[0][0]) if rows else None

    def info(self, key: CheckpointKey) -> checkpoint_pb2.CheckpointInfo | None:
        found = self._infos("c.run = ? AND c.step = ?", (key.run, key.step))
        return found[0] if found else None

    def checkpoints(
        self, run: str = "", include_uncommitted: bool = False
    ) -> list[checkpoint_pb2.CheckpointInfo]:
        """CheckpointInfo of every checkpoint (of `run`, if given), oldest step first."""
        where, args = [], []
        if run:
            where.append("c.run = ?")
            args.append(run)
        if not include_uncommitted:
            where.append("c.state = ?")
            args.append(COMMITTED)
        return self._infos(" AND ".join(where) or "1", tuple(args))

    def _infos(self, where: str, args: tuple) -> list[checkpoint_pb2.CheckpointInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT run, step, world_size, state, labels, created_at, committed_at "
                f"FROM checkpoints c WHERE {where} ORDER BY run, step",
                args,
            ).fetchall()
            infos = []
            for run, step, world_size, state, labels, created_at, committed_at in rows:
                files = self._db.execute(
                    "SELECT path, rank, kind, size, sha256, block_crcs FROM files "
                    "WHERE run = ? AND step = ? ORDER BY path",
                    (run, step),
                ).fetchall()
                tiers = {
                    tier: (tier_state, nbytes, updated_at, error)
                    for tier, tier_state, nbytes, updated_at, error in self._db.execute(
                        "SELECT tier, state, bytes, updated_at, error FROM tiers "
                        "WHERE run = ? AND step = ?",
                        (run, step),
                    )
                }
                info = checkpoint_pb2.CheckpointInfo(
                    ref=checkpoint_pb2.CheckpointRef(run=run, step=step),
                    world_size=world_size,
                    committed=state == COMMITTED,
                    files=[FileRecord(*f).to_proto() for f in files],
                    total_bytes=sum(f[3] for f in files),
                    created_at=_timestamp(created_at),
                    committed_at=_timestamp(committed_at),
                    labels=json.loads(labels),
                )
                for tier in TIER_NAMES:
                    tier_state, nbytes, updated_at, error = tiers.get(
                        tier, (checkpoint_pb2.TIER_STATE_ABSENT, 0, None, "")
                    )
                    info.tiers.add(
                        tier=tier,
                        state=tier_state,
                        bytes=nbytes,
                        updated_at=_timestamp(updated_at),
                        error=error,
                    )
                infos.append(info)
            return infos
