"""The telemetry schema: runs, their ranks, per-rank step records, checkpoints and events.

Migrations in `telemetry/migrations` create exactly this schema (a test compares them), so a change
here needs a new Alembic revision. Times are timezone-aware UTC on both SQLite and PostgreSQL.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from scaletrain.names import TIER_NAMES
from scaletrain.v1 import common_pb2

RUN_STATUSES = ("running", "finished", "failed")
# The `tier` of a checkpoint row that describes the save as the trainer saw it.
TRAINER_TIER = "trainer"
# The storage tier that holds the whole checkpoint (every node's part): one row per step, node "".
WHOLE_TIER = TIER_NAMES[common_pb2.TIER_S3]

# Deterministic constraint names, so that later migrations can name what they alter.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python.

    SQLite has no time zones: values are stored there as naive UTC and get UTC attached on the way
    back, so code comparing times never mixes naive and aware datetimes.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()}: pass a timezone-aware time")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class NanDouble(TypeDecorator[float]):
    """A double that keeps NaN: stored as NULL, read back as NaN.

    SQLite turns NaN into NULL anyway; doing the same on PostgreSQL makes aggregates (AVG, MAX)
    skip NaN losses on both databases instead of returning NaN on one of them.
    """

    impl = Double()
    cache_ok = True

    def process_bind_param(self, value: float | None, dialect: Dialect) -> float | None:
        return None if value is None or math.isnan(value) else value

    def process_result_value(self, value: float | None, dialect: Dialect) -> float:
        return math.nan if value is None else value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    """One training run; a resumed run keeps its id and registers again."""

    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(
            "status IN ({})".format(", ".join(f"'{s}'" for s in RUN_STATUSES)), name="status"
        ),
    )

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    config_json: Mapped[str] = mapped_column(Text, default="")
    world_size: Mapped[int] = mapped_column(Integer)
    dp_replicate: Mapped[int] = mapped_column(Integer, default=1)
    dp_shard: Mapped[int] = mapped_column(Integer, default=1)
    tp: Mapped[int] = mapped_column(Integer, default=1)
    pp: Mapped[int] = mapped_column(Integer, default=1)
    cp: Mapped[int] = mapped_column(Integer, default=1)
    ep: Mapped[int] = mapped_column(Integer, default=1)
    model_params: Mapped[int] = mapped_column(BigInteger, default=0)
    hardware: Mapped[str] = mapped_column(String(128), default="")
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    status: Mapped[str] = mapped_column(String(16), default="running")
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # What MFU divides by: the precision of the matrix multiplications, the dense peak FLOP/s of
    # one device in it (0: unknown) and where that figure comes from (datasheet, calibration GEMM).
    precision: Mapped[str] = mapped_column(String(16), default="", server_default="")
    peak_flops: Mapped[float] = mapped_column(Double, default=0.0, server_default="0")
    peak_flops_source: Mapped[str] = mapped_column(String(128), default="", server_default="")
    # Fraction of the forward pass recomputed in backward (activation checkpointing), for HFU.
    recompute_fraction: Mapped[float] = mapped_column(Double, default=0.0, server_default="0")
    # Restart generation: 0 when created, one more at every registration after that.
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Rank(Base):
    """Where one rank of a run lives (host, device), as the run registered it."""

    __tablename__ = "ranks"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(256), default="")
    device: Mapped[str] = mapped_column(String(128), default="")


class RankStep(Base):
    """What one rank reported about one optimizer step of one attempt (restart generation).

    (run_id, step, rank, attempt) identifies a record, which is what makes reports idempotent. It is
    the primary key rather than a unique index beside a surrogate id: its index is the only one the
    table needs (per-step lookups use its (run_id, step) prefix), which keeps bulk inserts cheap.

    On PostgreSQL the table is partitioned by run, each run's partition by step range (migration
    0006, `telemetry.partitions`), so that retention drops whole ranges instead of deleting rows;
    SQLite keeps one plain table. The partition key is the primary key's prefix, as PostgreSQL
    requires of a partitioned table's unique indexes.
    """

    __tablename__ = "rank_steps"
    __table_args__ = {"postgresql_partition_by": "LIST (run_id)"}

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    loss: Mapped[float] = mapped_column(NanDouble, nullable=True)
    grad_norm: Mapped[float] = mapped_column(NanDouble, nullable=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    step_s: Mapped[float] = mapped_column(Double, default=0.0)
    data_s: Mapped[float] = mapped_column(Double, default=0.0)
    forward_s: Mapped[float] = mapped_column(Double, default=0.0)
    backward_s: Mapped[float] = mapped_column(Double, default=0.0)
    optimizer_s: Mapped[float] = mapped_column(Double, default=0.0)
    comm_wait_s: Mapped[float] = mapped_column(Double, default=0.0)
    checkpoint_s: Mapped[float] = mapped_column(Double, default=0.0)
    # The rank's own work without waits for other ranks (what stragglers are scored on), and the
    # time spent replaying a suspicious step.
    compute_s: Mapped[float] = mapped_column(Double, default=0.0, server_default="0")
    replay_s: Mapped[float] = mapped_column(Double, default=0.0, server_default="0")
    memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    peak_memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    lr: Mapped[float] = mapped_column(Double, default=0.0)
    time: Mapped[datetime] = mapped_column(UTCDateTime)
    param_checksum: Mapped[str] = mapped_column(String(128), default="")
    global_sample: Mapped[int] = mapped_column(BigInteger, default=0)
    rank_sample: Mapped[int] = mapped_column(BigInteger, default=0)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    # Records the rank's telemetry client had dropped (queue overflow) when it made this record.
    dropped_records: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Checkpoint(Base):
    """The life of one checkpoint on one tier of one node, kept up to date from checkpoint events.

    `tier` is "memory", "ssd" or "s3" for ckptd's tiers, or TRAINER_TIER for the save as the trainer
    saw it: `started_at` when it began, `staged_at` when training resumed, and `seconds` the time
    training was blocked. On a storage tier, `seconds` is what the commit there took.

    A checkpoint is spread over nodes: each node's ckptd holds its part (the files its ranks wrote)
    on its memory and SSD tiers, so those tiers have one row per node, `node` naming it; a copy of
    another node's part (a peer replica) has a row of its own, `part` naming that node. S3
    (WHOLE_TIER) holds the whole checkpoint and the trainer row describes the whole save: their
    `node` is "", as is every row recorded before nodes were.
    """

    __tablename__ = "checkpoints"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    tier: Mapped[str] = mapped_column(String(16), primary_key=True)
    node: Mapped[str] = mapped_column(String(128), primary_key=True, default="", server_default="")
    # A replica: the node whose part `node` holds a copy of ("": `node`'s own part).
    part: Mapped[str] = mapped_column(String(128), primary_key=True, default="", server_default="")
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    staged_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    committed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    seconds: Mapped[float] = mapped_column(Double, default=0.0)


class Event(Base):
    """Something that happened to a run at a step: a checkpoint commit on a tier, a failure, ...

    `kind` is the lower-case name of the proto EventKind ("checkpoint_committed"), readable in SQL
    and stable when enum values are added. A reporter stamps `time` when the event happens, so a
    retried report of the same event is recognised by the unique index and stored once.
    """

    __tablename__ = "events"
    __table_args__ = (
        # `node` too: every node's ckptd reports its own commits, at times that may coincide.
        UniqueConstraint("run_id", "kind", "step", "rank", "time", "node"),
        Index("ix_events_run_id_time", "run_id", "time"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    run_id: Mapped[str] = mapped_column(String(128), ForeignKey("runs.run_id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    # -1 when the event concerns the whole run.
    rank: Mapped[int] = mapped_column(Integer, default=-1)
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text, default="")
    time: Mapped[datetime] = mapped_column(UTCDateTime)
    attributes: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Checkpoint events only: the tier ("memory", "ssd", "s3"), bytes and seconds on it.
    tier: Mapped[str | None] = mapped_column(String(16), nullable=True)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    seconds: Mapped[float | None] = mapped_column(Double, nullable=True)
    # The node the event came from (ckptd's commits: the node whose copy it is); "" when none.
    node: Mapped[str] = mapped_column(String(128), default="", server_default="")


# What a step rollup summarises across ranks: each phase time, loss, gradient norm and memory, as
# (name in step_rollups, column of rank_steps). Phase names drop the "_s" of their column.
ROLLUP_METRICS = (
    ("step", "step_s"),
    ("compute", "compute_s"),
    ("data", "data_s"),
    ("forward", "forward_s"),
    ("backward", "backward_s"),
    ("optimizer", "optimizer_s"),
    ("comm_wait", "comm_wait_s"),
    ("checkpoint", "checkpoint_s"),
    ("replay", "replay_s"),
    ("loss", "loss"),
    ("grad_norm", "grad_norm"),
    ("memory", "memory_bytes"),
    ("peak_memory", "peak_memory_bytes"),
)
# The statistics kept of each metric: a step_rollups column is named "<metric>_<statistic>".
ROLLUP_STATISTICS = ("min", "median", "p99", "max")


class StepRollup(Base):
    """One step of one attempt summarised across its ranks, kept for the whole run.

    Per-rank rows are kept only for a recent window (`telemetry.retention`); what the run's charts,
    goodput and MFU need over the whole run is here, one row per step whatever the world size.
    Written by the service as each step completes (`telemetry.rollup`). For each of ROLLUP_METRICS
    there are four columns, `<metric>_<statistic>` for ROLLUP_STATISTICS (NULL: no rank had a
    value, e.g. every loss NaN). `slowest` lists the step's slowest ranks by compute time, slowest
    first: [[rank, node, compute seconds], ...].
    """

    __tablename__ = "step_rollups"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    # Ranks that reported the step (the world size unless records were lost).
    ranks: Mapped[int] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(BigInteger)
    loss_mean: Mapped[float | None] = mapped_column(Double, nullable=True)
    # When the step began on its earliest rank (record time minus step time), and its latest record.
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime)
    slowest: Mapped[list[Any]] = mapped_column(JSON, default=list)


for _metric, _ in ROLLUP_METRICS:
    for _statistic in ROLLUP_STATISTICS:
        setattr(
            StepRollup,
            f"{_metric}_{_statistic}",
            mapped_column(f"{_metric}_{_statistic}", Double, nullable=True),
        )


class NodeStep(Base):
    """One node at one step: its worst (slowest computing) rank, relative to the step's median rank.

    What the run page's nodes x steps view draws: 8 ranks a node make this table an eighth of
    rank_steps; it is kept for the same recent window. A rank whose host was never registered is a
    node of its own, named "rank<N>".
    """

    __tablename__ = "node_steps"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    node: Mapped[str] = mapped_column(String(256), primary_key=True)
    ranks: Mapped[int] = mapped_column(Integer)
    worst_rank: Mapped[int] = mapped_column(Integer)
    worst_compute_s: Mapped[float] = mapped_column(Double)
    # worst_compute_s over the median compute time of all ranks at the step (1: typical).
    relative: Mapped[float | None] = mapped_column(Double, nullable=True)
