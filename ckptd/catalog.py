"""The catalog: every checkpoint ckptd knows, its files, and its state on each tier, in SQLite.

It lives in the data dir beside the SSD tier (`data_dir/catalog.db`) so that the command line can
list and export checkpoints with no service running. It is an index, not the truth: the truth is
the commit markers on the tiers (`ckptd.manifest`), and a restart reconciles the catalog with
them, or rebuilds it whole when it is lost. Two of its tables are the persistent work queues of
the S3 tier: a committed checkpoint whose S3 state is PENDING or FAILED still has to be uploaded,
and a row of `deletions` still has to be removed from S3. WAL mode lets an offline reader look
while ckptd writes.
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

from ckptd.manifest import FileRecord, Manifest
from ckptd.retention import RetentionPolicy
from ckptd.states import ABSENT, TIER_COMMITTED
from ckptd.tiers import CheckpointKey
from scaletrain.errors import UserError
from scaletrain.names import TIER_LABELS
from scaletrain.v1 import checkpoint_pb2

CATALOG_FILE = "catalog.db"
# The catalog's schema (SQLite's user_version). A data dir of any other version is refused but
# one of MIGRATED_FROM, which gains the columns added since; a lost catalog is rebuilt from the
# markers on disk.
SCHEMA_VERSION = 6
# 5 -> 6: checkpoints.memory_only.
MIGRATED_FROM = 5

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
    epoch INTEGER NOT NULL DEFAULT 0,
    coordinator TEXT NOT NULL DEFAULT '',
    coordinator_address TEXT NOT NULL DEFAULT '',
    prepared INTEGER NOT NULL DEFAULT 0,
    memory_only INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run, step)
);
CREATE TABLE IF NOT EXISTS files (
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    rank INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    size INTEGER NOT NULL,
    block_crcs BLOB NOT NULL,
    node TEXT NOT NULL DEFAULT '',
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
CREATE TABLE IF NOT EXISTS replicas (
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    owner TEXT NOT NULL,
    tier INTEGER NOT NULL,
    state INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    error TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run, step, owner, tier),
    FOREIGN KEY (run, step) REFERENCES checkpoints (run, step) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS runs (
    run TEXT PRIMARY KEY,
    memory_last INTEGER NOT NULL,
    ssd_last INTEGER NOT NULL,
    s3_every INTEGER NOT NULL,
    replicas INTEGER NOT NULL DEFAULT 0
);
-- Each run's newest node-loss-safe step, which SSD keeps whatever its age: kept here, as a
-- restart must not forget it while no newer step is safe (a node lost before its copies).
CREATE TABLE IF NOT EXISTS safe_steps (
    run TEXT PRIMARY KEY,
    step INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS deletions (
    run TEXT NOT NULL,
    step INTEGER NOT NULL,
    queued_at REAL NOT NULL,
    PRIMARY KEY (run, step)
);
"""

_FILE_COLUMNS = "path, rank, kind, size, block_crcs, node"


@dataclass(frozen=True)
class Coordination:
    """Who coordinates a save attempt's commit, and its epoch (ckptd.cluster)."""

    epoch: int = 0
    coordinator: str = ""
    coordinator_address: str = ""


@dataclass(frozen=True)
class SaveRecord:
    """One save attempt of a checkpoint, as OpenSave (or a rank's JoinSave) created it."""

    save_id: str
    key: CheckpointKey
    world_size: int
    state: str
    created_at: float
    labels: dict[str, str]
    coordination: Coordination = Coordination()
    # This node voted to commit it (its part is durable); it must wait for the outcome.
    prepared: bool = False
    # A memory-only save (OpenSaveRequest.memory_only).
    memory_only: bool = False


def _timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _file_row(f: FileRecord) -> tuple:
    return (f.path, f.rank, f.kind, f.size, f.block_crcs, f.node)


class Catalog:
    """Thread-safe access to `catalog.db`; one connection, serialized by a lock.

    `node` is the node this ckptd is: its tier states are of that node's part of each
    checkpoint (and of the whole checkpoint on S3).
    """

    def __init__(self, data_dir: Path, *, readonly: bool = False, node: str = "") -> None:
        self.node = node
        path = Path(data_dir) / CATALOG_FILE
        if readonly:
            if not path.exists():
                raise UserError(f"no ckptd catalog at {path}; is {data_dir} a ckptd data dir?")
            uri = f"file:{path}?mode=ro"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            uri = f"file:{path}"
        self.created = not readonly and not path.exists()
        self._db = sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=30
        )
        self._lock = threading.Lock()
        self._db.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version == MIGRATED_FROM:
                self._db.execute(
                    "ALTER TABLE checkpoints ADD COLUMN memory_only INTEGER NOT NULL DEFAULT 0"
                )
            elif version not in (0, SCHEMA_VERSION):
                raise UserError(
                    f"{path} has catalog schema {version}; this ckptd knows {SCHEMA_VERSION} "
                    "(move the file away: ckptd rebuilds the catalog from the checkpoints on disk)"
                )
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
        self,
        key: CheckpointKey,
        save_id: str,
        world_size: int,
        labels: dict[str, str],
        coordination: Coordination,
        memory_only: bool = False,
    ) -> None:
        """Record a new save attempt, replacing any earlier uncommitted attempt of the same key."""
        with self._tx() as db:
            db.execute("DELETE FROM checkpoints WHERE run = ? AND step = ?", (key.run, key.step))
            db.execute(
                "INSERT INTO checkpoints (run, step, save_id, world_size, state, labels, "
                "created_at, epoch, coordinator, coordinator_address, memory_only) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key.run,
                    key.step,
                    save_id,
                    world_size,
                    OPEN,
                    json.dumps(labels),
                    time.time(),
                    coordination.epoch,
                    coordination.coordinator,
                    coordination.coordinator_address,
                    int(memory_only),
                ),
            )

    def epoch_of(self, key: CheckpointKey) -> int:
        """The newest epoch recorded for `key` (any state; 0 if none)."""
        rows = self._query(
            "SELECT epoch FROM checkpoints WHERE run = ? AND step = ?", (key.run, key.step)
        )
        return rows[0][0] if rows else 0

    def set_prepared(self, save_id: str) -> None:
        """Record this node's vote to commit `save_id`: from now on only the outcome decides."""
        with self._tx() as db:
            db.execute("UPDATE checkpoints SET prepared = 1 WHERE save_id = ?", (save_id,))

    _SAVE_COLUMNS = (
        "save_id, run, step, world_size, state, created_at, labels, epoch, coordinator, "
        "coordinator_address, prepared, memory_only"
    )

    def save(self, save_id: str) -> SaveRecord | None:
        rows = self._query(
            f"SELECT {self._SAVE_COLUMNS} FROM checkpoints WHERE save_id = ?", (save_id,)
        )
        return self._save_record(rows[0]) if rows else None

    def save_of(self, key: CheckpointKey) -> SaveRecord | None:
        rows = self._query(
            f"SELECT {self._SAVE_COLUMNS} FROM checkpoints WHERE run = ? AND step = ?",
            (key.run, key.step),
        )
        return self._save_record(rows[0]) if rows else None

    def saves_in(self, state: str) -> list[SaveRecord]:
        rows = self._query(
            f"SELECT {self._SAVE_COLUMNS} FROM checkpoints WHERE state = ?", (state,)
        )
        return [self._save_record(row) for row in rows]

    @staticmethod
    def _save_record(row: tuple) -> SaveRecord:
        save_id, run, step, world_size, state, created_at, labels, *rest = row
        *coordination, prepared, memory_only = rest
        key = CheckpointKey(run, step)
        return SaveRecord(
            save_id,
            key,
            world_size,
            state,
            created_at,
            json.loads(labels),
            Coordination(*coordination),
            bool(prepared),
            bool(memory_only),
        )

    def add_file(self, key: CheckpointKey, record: FileRecord) -> None:
        with self._tx() as db:
            db.execute(
                f"INSERT OR REPLACE INTO files ({_FILE_COLUMNS}, run, step) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (*_file_row(record), key.run, key.step),
            )

    def files(self, key: CheckpointKey) -> list[FileRecord]:
        rows = self._query(
            f"SELECT {_FILE_COLUMNS} FROM files WHERE run = ? AND step = ? ORDER BY path",
            (key.run, key.step),
        )
        return [FileRecord(*row) for row in rows]

    def file(self, key: CheckpointKey, path: str) -> FileRecord | None:
        rows = self._query(
            f"SELECT {_FILE_COLUMNS} FROM files WHERE run = ? AND step = ? AND path = ?",
            (key.run, key.step, path),
        )
        return FileRecord(*rows[0]) if rows else None

    def remove_file(self, key: CheckpointKey, path: str) -> None:
        with self._tx() as db:
            db.execute(
                "DELETE FROM files WHERE run = ? AND step = ? AND path = ?",
                (key.run, key.step, path),
            )

    def abort_save(self, key: CheckpointKey, reason: str) -> None:
        """Mark a save aborted (kept only for listing, until purged) and forget its files."""
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE run = ? AND step = ?", (key.run, key.step))
            db.execute(
                "UPDATE checkpoints SET state = ?, reason = ?, created_at = ? "
                "WHERE run = ? AND step = ?",
                (ABORTED, reason, time.time(), key.run, key.step),
            )

    def purge_aborted(self, before: float) -> int:
        """Forget aborted saves older than `before` (their files are long gone)."""
        with self._tx() as db:
            return db.execute(
                "DELETE FROM checkpoints WHERE state = ? AND created_at < ?", (ABORTED, before)
            ).rowcount

    def record_commit(self, manifest: Manifest, tier: int | None) -> None:
        """Make `manifest` a committed checkpoint held by `tier`, whatever the catalog said.

        Used by commit and by recovery from a tier's marker (after a crash between the marker and
        the catalog, or with a lost catalog): the marker is the truth. `tier` None: this node
        holds no copy of it (its part is another node's), it only knows it is committed.
        """
        key = manifest.key
        with self._tx() as db:
            row = db.execute(
                "SELECT state FROM checkpoints WHERE run = ? AND step = ?", (key.run, key.step)
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO checkpoints (run, step, save_id, world_size, state, labels, "
                    "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        key.run,
                        key.step,
                        f"recovered-{key.run}-{key.step}",
                        manifest.world_size,
                        OPEN,
                        json.dumps(manifest.labels),
                        manifest.created_at,
                    ),
                )
            if row is None or row[0] != COMMITTED:
                db.execute("DELETE FROM files WHERE run = ? AND step = ?", (key.run, key.step))
                db.executemany(
                    f"INSERT INTO files ({_FILE_COLUMNS}, run, step) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(*_file_row(f), key.run, key.step) for f in manifest.files],
                )
                db.execute(
                    "UPDATE checkpoints SET state = ?, committed_at = ?, world_size = ?, "
                    "labels = ?, epoch = ?, coordinator = ?, prepared = 0, memory_only = ? "
                    "WHERE run = ? AND step = ?",
                    (
                        COMMITTED,
                        manifest.committed_at or time.time(),
                        manifest.world_size,
                        json.dumps(manifest.labels),
                        manifest.epoch,
                        manifest.coordinator,
                        int(manifest.memory_only),
                        key.run,
                        key.step,
                    ),
                )
            if tier is not None:
                nbytes = sum(f.size for f in manifest.files_on(self.node))
                self._set_tier(db, key, tier, TIER_COMMITTED, nbytes, "")

    def manifest(self, key: CheckpointKey) -> Manifest | None:
        """The manifest of a committed checkpoint, as its markers carry it."""
        save = self.save_of(key)
        if save is None or save.state != COMMITTED:
            return None
        committed_at = self._query(
            "SELECT committed_at FROM checkpoints WHERE run = ? AND step = ?", (key.run, key.step)
        )[0][0]
        return Manifest(
            key=key,
            world_size=save.world_size,
            files=tuple(self.files(key)),
            labels=save.labels,
            created_at=save.created_at,
            committed_at=committed_at or 0.0,
            epoch=save.coordination.epoch,
            coordinator=save.coordination.coordinator,
            memory_only=save.memory_only,
        )

    def memory_only_steps(self, run: str) -> set[int]:
        """The committed memory-only steps of `run` (retention keeps them apart)."""
        rows = self._query(
            "SELECT step FROM checkpoints WHERE run = ? AND state = ? AND memory_only = 1",
            (run, COMMITTED),
        )
        return {step for (step,) in rows}

    def delete(self, key: CheckpointKey, s3_too: bool = False) -> None:
        """Forget a checkpoint; with `s3_too`, queue the removal of its S3 objects."""
        with self._tx() as db:
            db.execute("DELETE FROM checkpoints WHERE run = ? AND step = ?", (key.run, key.step))
            if s3_too:
                self._queue_deletion(db, key)

    def queue_deletion(self, key: CheckpointKey) -> None:
        """Remember that `key`'s S3 objects must go, until `deletion_done`."""
        with self._tx() as db:
            self._queue_deletion(db, key)

    @staticmethod
    def _queue_deletion(db: sqlite3.Connection, key: CheckpointKey) -> None:
        db.execute(
            "INSERT OR REPLACE INTO deletions (run, step, queued_at) VALUES (?, ?, ?)",
            (key.run, key.step, time.time()),
        )

    def deletions(self) -> list[CheckpointKey]:
        rows = self._query("SELECT run, step FROM deletions ORDER BY queued_at")
        return [CheckpointKey(run, step) for run, step in rows]

    def deleting(self, key: CheckpointKey) -> bool:
        """Whether `key`'s S3 objects are queued for removal."""
        return bool(
            self._query("SELECT 1 FROM deletions WHERE run = ? AND step = ?", (key.run, key.step))
        )

    def deletion_done(self, key: CheckpointKey) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM deletions WHERE run = ? AND step = ?", (key.run, key.step))

    # -- runs ------------------------------------------------------------------------------------

    def set_policy(self, run: str, policy: RetentionPolicy) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO runs (run, memory_last, ssd_last, s3_every, replicas) "
                "VALUES (?, ?, ?, ?, ?)",
                (run, policy.memory_last, policy.ssd_last, policy.s3_every, policy.replicas),
            )

    def policy(self, run: str) -> RetentionPolicy | None:
        rows = self._query(
            "SELECT memory_last, ssd_last, s3_every, replicas FROM runs WHERE run = ?", (run,)
        )
        return RetentionPolicy(*rows[0]) if rows else None

    def set_latest_safe(self, run: str, step: int) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO safe_steps (run, step) VALUES (?, ?)", (run, step))

    def latest_safe(self, run: str = "") -> dict[str, int]:
        """run -> its newest node-loss-safe step as this node last learned it (of `run`)."""
        if run:
            return dict(self._query("SELECT run, step FROM safe_steps WHERE run = ?", (run,)))
        return dict(self._query("SELECT run, step FROM safe_steps"))

    def runs(self) -> list[str]:
        rows = self._query("SELECT DISTINCT run FROM checkpoints WHERE state = ?", (COMMITTED,))
        return [run for (run,) in rows]

    # -- tiers -----------------------------------------------------------------------------------

    @staticmethod
    def _set_tier(
        db: sqlite3.Connection, key: CheckpointKey, tier: int, state: int, nbytes: int, error: str
    ) -> None:
        db.execute(
            "INSERT OR REPLACE INTO tiers (run, step, tier, state, bytes, updated_at, error) "
            "SELECT run, step, ?, ?, ?, ?, ? FROM checkpoints WHERE run = ? AND step = ?",
            (tier, state, nbytes, time.time(), error, key.run, key.step),
        )

    def set_tier(
        self, key: CheckpointKey, tier: int, state: int, nbytes: int = 0, error: str = ""
    ) -> None:
        """Record a tier's state; a no-op when the checkpoint was deleted meanwhile."""
        with self._tx() as db:
            self._set_tier(db, key, tier, state, nbytes, error)

    def tier_state(self, key: CheckpointKey, tier: int) -> int:
        rows = self._query(
            "SELECT state FROM tiers WHERE run = ? AND step = ? AND tier = ?",
            (key.run, key.step, tier),
        )
        return rows[0][0] if rows else ABSENT

    def committed_on(self, tier: int) -> list[CheckpointKey]:
        rows = self._query(
            "SELECT run, step FROM tiers WHERE tier = ? AND state = ? ORDER BY run, step",
            (tier, TIER_COMMITTED),
        )
        return [CheckpointKey(run, step) for run, step in rows]

    def run_states(self, run: str) -> dict[int, dict[int, int]]:
        """step -> {tier: state} for every committed checkpoint of `run`."""
        states: dict[int, dict[int, int]] = {}
        with self._lock:
            for (step,) in self._db.execute(
                "SELECT step FROM checkpoints WHERE run = ? AND state = ?", (run, COMMITTED)
            ):
                states[step] = {}
            for step, tier, state in self._db.execute(
                "SELECT step, tier, state FROM tiers WHERE run = ?", (run,)
            ):
                if step in states:
                    states[step][tier] = state
        return states

    # -- replicas (copies of other nodes' parts) ------------------------------------------------

    def set_replica(
        self,
        key: CheckpointKey,
        owner: str,
        tier: int,
        state: int,
        nbytes: int = 0,
        error: str = "",
    ) -> None:
        """Record the state of this node's copy of `owner`'s part on `tier`; a no-op when the
        checkpoint was deleted meanwhile."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO replicas "
                "(run, step, owner, tier, state, bytes, updated_at, error) "
                "SELECT run, step, ?, ?, ?, ?, ?, ? FROM checkpoints WHERE run = ? AND step = ?",
                (owner, tier, state, nbytes, time.time(), error, key.run, key.step),
            )

    def replica_state(self, key: CheckpointKey, owner: str, tier: int) -> int:
        rows = self._query(
            "SELECT state FROM replicas WHERE run = ? AND step = ? AND owner = ? AND tier = ?",
            (key.run, key.step, owner, tier),
        )
        return rows[0][0] if rows else ABSENT

    def replicas(self, run: str = "") -> dict[CheckpointKey, dict[str, dict[int, int]]]:
        """key -> owner -> {tier: state} of every replica this node has a row for (of `run`)."""
        found: dict[CheckpointKey, dict[str, dict[int, int]]] = {}
        rows = self._query(
            "SELECT run, step, owner, tier, state FROM replicas"
            + (" WHERE run = ?" if run else ""),
            (run,) if run else (),
        )
        for run_, step, owner, tier, state in rows:
            found.setdefault(CheckpointKey(run_, step), {}).setdefault(owner, {})[tier] = state
        return found

    def replica_statuses(self, key: CheckpointKey) -> dict[str, list[checkpoint_pb2.TierStatus]]:
        """owner -> this node's copies of that owner's part of `key`, as TierStatus."""
        statuses: dict[str, list[checkpoint_pb2.TierStatus]] = {}
        for owner, tier, state, nbytes, updated_at, error in self._query(
            "SELECT owner, tier, state, bytes, updated_at, error FROM replicas "
            "WHERE run = ? AND step = ? ORDER BY owner, tier",
            (key.run, key.step),
        ):
            statuses.setdefault(owner, []).append(
                checkpoint_pb2.TierStatus(
                    tier=tier,
                    state=state,
                    bytes=nbytes,
                    updated_at=_timestamp(updated_at),
                    error=error,
                )
            )
        return statuses

    def replica_bytes(self, tier: int) -> int:
        """Bytes of the committed replicas this node holds on `tier`."""
        rows = self._query(
            "SELECT COALESCE(SUM(bytes), 0) FROM replicas WHERE tier = ? AND state = ?",
            (tier, TIER_COMMITTED),
        )
        return rows[0][0]

    def drop_replicas(self, key: CheckpointKey, owner: str) -> None:
        with self._tx() as db:
            db.execute(
                "DELETE FROM replicas WHERE run = ? AND step = ? AND owner = ?",
                (key.run, key.step, owner),
            )

    # -- listing ---------------------------------------------------------------------------------

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
                "SELECT c.run, c.step, c.world_size, c.state, c.labels, c.created_at, "
                "c.committed_at, c.memory_only, r.memory_last, r.ssd_last, r.s3_every, r.replicas "
                f"FROM checkpoints c LEFT JOIN runs r ON r.run = c.run WHERE {where} "
                "ORDER BY c.run, c.step",
                args,
            ).fetchall()
            infos = []
            for run, step, world_size, state, labels, created, committed, mem, *policy in rows:
                files = self._db.execute(
                    f"SELECT {_FILE_COLUMNS} FROM files WHERE run = ? AND step = ? ORDER BY path",
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
                    created_at=_timestamp(created),
                    committed_at=_timestamp(committed),
                    labels=json.loads(labels),
                    node=self.node,
                    memory_only=bool(mem),
                )
                if policy[0] is not None:
                    info.retention.CopyFrom(RetentionPolicy(*policy).to_proto())
                for tier in TIER_LABELS:
                    tier_state, nbytes, updated_at, error = tiers.get(tier, (ABSENT, 0, None, ""))
                    info.tiers.add(
                        tier=tier,
                        state=tier_state,
                        bytes=nbytes,
                        updated_at=_timestamp(updated_at),
                        error=error,
                    )
                infos.append(info)
            return infos
