"""Per-step rollups across ranks and each node's worst rank per step, computed as steps complete.

A job of 16,384 ranks reports 16,384 rows a step; a chart of the whole run, its goodput or its MFU
must not read them all. So when a step is complete (every rank reported it, `telemetry.live`), the
service summarises its rows here, in memory and in O(ranks) numpy passes, into one `step_rollups`
row (min, median, p99 and max across ranks of every ROLLUP_METRICS column, the mean loss, tokens,
when the step began and ended, the ROLLUP_SLOWEST slowest ranks and their nodes) and one
`node_steps` row per node (its worst rank relative to the step's median rank). Percentiles are
numpy's default (linear between the closest ranks); NaN and NULL values are left out.

Ranks are slow on their own work, not on the step time every rank shares in synchronous training:
`work_seconds` is what the straggler detector scores, the slowest list and node view rank by.
A step that never completed (a record lost, the service restarted) is rolled up from the rows the
database holds (`roll_up_from_database`), so every step with rank rows gets its rollup; retention
deletes rank rows only of steps that have one.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from sqlalchemy import Connection, func, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite

from telemetry.ingest import ATTEMPT, PHASE, RANK, STEP, STEP_COLUMNS, TIME, TOKENS
from telemetry.models import (
    ROLLUP_METRICS,
    ROLLUP_STATISTICS,
    NodeStep,
    Rank,
    RankStep,
    Run,
    StepRollup,
)

# Slowest ranks named in each step's rollup.
ROLLUP_SLOWEST = 8
# Rank rows read at once when rolling up from the database.
_READ_ROWS = 50_000
_METRIC_VALUES = operator.itemgetter(*(STEP_COLUMNS.index(column) for _, column in ROLLUP_METRICS))
_STATISTIC_COLUMNS = [f"{m}_{s}" for m, _ in ROLLUP_METRICS for s in ROLLUP_STATISTICS]
_LOSS = [metric for metric, _ in ROLLUP_METRICS].index("loss")
_WAITS = [PHASE[phase] for phase in ("comm_wait", "data", "checkpoint", "replay")]
Row = tuple[Any, ...]


@dataclass(frozen=True)
class NodeMap:
    """Which node each rank of a run is on: `names[of_rank[r]]` is rank r's host.

    A rank whose host was never registered is a node of its own, "rank<N>", so that it is never
    lumped together with other unknown ranks.
    """

    names: list[str]
    of_rank: np.ndarray

    @classmethod
    def of_hosts(cls, world_size: int, hosts: Mapping[int, str]) -> NodeMap:
        names: list[str] = []
        index: dict[str, int] = {}
        of_rank = np.empty(world_size, dtype=np.int64)
        for rank in range(world_size):
            name = hosts.get(rank) or f"rank{rank}"
            of_rank[rank] = index.setdefault(name, len(names))
            if of_rank[rank] == len(names):
                names.append(name)
        return cls(names, of_rank)

    @property
    def sizes(self) -> np.ndarray:
        """Ranks on each node."""
        return np.bincount(self.of_rank, minlength=len(self.names))


@dataclass(frozen=True)
class StepSummary:
    """A step rolled up: its step_rollups row, its node_steps rows, and every rank's own work
    (NaN for a rank that did not report), which the straggler detector scores."""

    rollup: dict[str, Any]
    nodes: list[dict[str, Any]]
    work: np.ndarray


def work_seconds(rows: Sequence[Row]) -> np.ndarray:
    """Each row's own work: `compute` when the reporter measured it, else the step time without
    the phases that are not the rank's own work (waits, data, checkpoint, replay)."""
    phases = np.array(
        [(row[PHASE["compute"]], row[PHASE["step"]], *(row[i] for i in _WAITS)) for row in rows],
        dtype=float,
    ).reshape(len(rows), 2 + len(_WAITS))
    derived = phases[:, 1] - phases[:, 2:].sum(axis=1)
    return np.where(phases[:, 0] > 0, phases[:, 0], derived)


def summarise(
    run_id: str, attempt: int, step: int, rows: Sequence[Row], nodes: NodeMap
) -> StepSummary:
    """The rollup of one step from its rows (tuples in STEP_COLUMNS order, one per rank)."""
    metrics = np.array(
        [_METRIC_VALUES(row) for row in rows], dtype=float
    ).reshape(len(rows), len(ROLLUP_METRICS))  # fmt: skip
    ranks = np.fromiter((row[RANK] for row in rows), dtype=np.int64, count=len(rows))
    world = len(nodes.of_rank)
    work = np.full(world, np.nan)
    work[ranks] = work_seconds(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a column with no value: NULL
        low, high = np.nanmin(metrics, axis=0), np.nanmax(metrics, axis=0)
        middle, p99 = _median_and_p99(metrics)
        loss_mean = np.nanmean(metrics[:, _LOSS])
        median_work = np.nanmedian(work)
    statistics = np.stack([low, middle, p99, high], axis=1).reshape(-1)
    times = [as_datetime(row[TIME]) for row in rows]
    ends = np.fromiter((t.timestamp() for t in times), dtype=float, count=len(rows))
    first = int(np.argmin(ends - metrics[:, 0]))
    rollup = {
        "run_id": run_id,
        "step": step,
        "attempt": attempt,
        "ranks": len(rows),
        "tokens": int(sum(row[TOKENS] for row in rows)),
        "loss_mean": _value(loss_mean),
        "started_at": times[first] - timedelta(seconds=float(metrics[first, 0])),
        "ended_at": times[int(np.argmax(ends))],
        "slowest": _slowest(work, nodes),
        **{
            column: _value(value)
            for column, value in zip(_STATISTIC_COLUMNS, statistics, strict=True)
        },
    }
    return StepSummary(rollup, _node_rows(run_id, attempt, step, work, median_work, nodes), work)


def _median_and_p99(metrics: np.ndarray) -> np.ndarray:
    """The median and p99 of each column, leaving NaN (not measured) out.

    `np.nanpercentile` goes a column at a time in Python (7 ms of a step of 8 ranks, most of the
    service's work per record at that size); `np.percentile` does every column at once and gives
    NaN where a column has one, so only those columns take the slow path.
    """
    result = np.percentile(metrics, [50, 99], axis=0)
    gaps = np.isnan(result).any(axis=0)
    if gaps.any():
        result[:, gaps] = np.nanpercentile(metrics[:, gaps], [50, 99], axis=0)
    return result


def _slowest(work: np.ndarray, nodes: NodeMap) -> list[list[Any]]:
    """The ROLLUP_SLOWEST ranks of most own work, slowest first, as [rank, node, seconds]."""
    measured = np.flatnonzero(~np.isnan(work))
    count = min(ROLLUP_SLOWEST, len(measured))
    if not count:
        return []
    top = measured[np.argpartition(-work[measured], count - 1)[:count]]
    top = top[np.argsort(-work[top], kind="stable")]
    return [[int(r), nodes.names[nodes.of_rank[r]], round(float(work[r]), 6)] for r in top]


def _node_rows(
    run_id: str, attempt: int, step: int, work: np.ndarray, median: float, nodes: NodeMap
) -> list[dict[str, Any]]:
    """One row per node with a reporting rank: its worst rank and that rank's work relative to
    the step's median, from one sort of the ranks by node (computed once per run)."""
    order = _node_order(nodes)
    grouped = work[order]
    sizes = nodes.sizes
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    reported = np.add.reduceat(~np.isnan(grouped), starts)
    filled = np.where(np.isnan(grouped), -np.inf, grouped)
    worst = np.maximum.reduceat(filled, starts)
    # The first rank of each node holding its maximum.
    is_worst = np.flatnonzero(filled == np.repeat(worst, sizes))
    groups = np.searchsorted(starts, is_worst, side="right") - 1
    first = np.full(len(sizes), -1)
    first[groups[::-1]] = order[is_worst[::-1]]
    relative = worst / median if median > 0 else np.full(len(worst), np.nan)
    return [
        {
            "run_id": run_id,
            "step": step,
            "attempt": attempt,
            "node": nodes.names[node],
            "ranks": int(reported[node]),
            "worst_rank": int(first[node]),
            "worst_compute_s": float(worst[node]),
            "relative": _value(relative[node]),
        }
        for node in np.flatnonzero(reported > 0)
    ]


_ORDERS: dict[int, np.ndarray] = {}


def _node_order(nodes: NodeMap) -> np.ndarray:
    """Ranks sorted by node (stable), cached per NodeMap: it is the same every step of a run."""
    key = id(nodes.of_rank)
    order = _ORDERS.get(key)
    if order is None or len(order) != len(nodes.of_rank):
        if len(_ORDERS) > 64:
            _ORDERS.clear()
        order = _ORDERS[key] = np.argsort(nodes.of_rank, kind="stable")
    return order


def write(connection: Connection, summaries: Iterable[StepSummary]) -> None:
    """Store (or replace) the summaries' rollups and node rows in the open transaction."""
    summaries = list(summaries)
    if not summaries:
        return
    _upsert(connection, StepRollup, [s.rollup for s in summaries], ["run_id", "step", "attempt"])
    node_rows = [row for s in summaries for row in s.nodes]
    if node_rows:
        _upsert(connection, NodeStep, node_rows, ["run_id", "step", "attempt", "node"])


def _upsert(
    connection: Connection, model: type[Any], rows: list[dict[str, Any]], key: list[str]
) -> None:
    insert = (postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert)(
        model
    )
    changed = {name: insert.excluded[name] for name in rows[0] if name not in key}
    connection.execute(insert.on_conflict_do_update(index_elements=key, set_=changed), rows)


def node_map(connection: Connection, run_id: str) -> NodeMap:
    """The run's ranks' nodes, from the hosts its registration gave (empty map: no such run)."""
    world = connection.execute(select(Run.world_size).where(Run.run_id == run_id)).scalar() or 0
    hosts = dict(
        connection.execute(select(Rank.rank, Rank.host).where(Rank.run_id == run_id)).all()
    )
    return NodeMap.of_hosts(world, hosts)


def roll_up_from_database(
    connection: Connection, run_id: str, steps: Iterable[tuple[int, int]], nodes: NodeMap
) -> list[StepSummary]:
    """Summaries of the (attempt, step)s of `run_id` from the rank rows the database holds
    (steps without rows are left out); read in ranges of steps, a few index range scans."""
    wanted = sorted(set(steps), key=lambda key: (key[1], key[0]))
    if not wanted:
        return []
    per_read = max(1, _READ_ROWS // max(1, len(nodes.of_rank)))
    columns = [getattr(RankStep, column) for column in STEP_COLUMNS]
    summaries = []
    for start in range(0, len(wanted), per_read):
        chunk = wanted[start : start + per_read]
        grouped: dict[tuple[int, int], list[Row]] = {}
        rows = connection.execute(
            select(*columns).where(
                RankStep.run_id == run_id,
                RankStep.step.between(chunk[0][1], chunk[-1][1]),
                tuple_(RankStep.attempt, RankStep.step).in_(chunk),
            )
        )
        for row in rows:
            grouped.setdefault((row[ATTEMPT], row[STEP]), []).append(tuple(row))
        summaries += [
            summarise(run_id, attempt, step, rows_of_step, nodes)
            for (attempt, step), rows_of_step in sorted(grouped.items())
        ]
    return summaries


def missing_steps(connection: Connection, run_id: str) -> list[tuple[int, int]]:
    """The (attempt, step)s of `run_id` that have rank rows but no rollup.

    Reads rank rows only past each attempt's latest rollup (the whole run for a run without any,
    e.g. one recorded before rollups existed), so a healthy service's start reads little.
    """
    rolled = dict(
        connection.execute(
            select(StepRollup.attempt, func.max(StepRollup.step))
            .where(StepRollup.run_id == run_id)
            .group_by(StepRollup.attempt)
        ).all()
    )
    attempts = connection.execute(select(Run.attempt).where(Run.run_id == run_id)).scalar() or 0
    after = min(rolled.get(attempt, -1) for attempt in range(attempts + 1))
    candidates = connection.execute(
        select(RankStep.attempt, RankStep.step)
        .where(RankStep.run_id == run_id, RankStep.step > after)
        .distinct()
    ).all()
    if not candidates:
        return []
    done = set(
        connection.execute(
            select(StepRollup.attempt, StepRollup.step).where(
                StepRollup.run_id == run_id, StepRollup.step > after
            )
        ).all()
    )
    return sorted({(a, s) for a, s in candidates} - {tuple(key) for key in done})


def roll_up_missing(connection: Connection, run_id: str | None = None) -> int:
    """Roll up every step of `run_id` (every run, when None) that has rank rows and no rollup;
    returns how many. The service does it when it starts; a database from before rollups gets
    them from the rows it holds."""
    run_ids = [run_id] if run_id is not None else connection.execute(select(Run.run_id)).scalars()
    count = 0
    for run in list(run_ids):
        steps = missing_steps(connection, run)
        if steps:
            summaries = roll_up_from_database(connection, run, steps, node_map(connection, run))
            write(connection, summaries)
            count += len(summaries)
    return count


def as_datetime(stored: datetime | str) -> datetime:
    """A row's time, stored as text (SQLite) or as an aware datetime (PostgreSQL, the ORM)."""
    if isinstance(stored, datetime):
        return stored
    return datetime.fromisoformat(stored).replace(tzinfo=UTC)


def _value(value: float) -> float | None:
    """A statistic as stored: NULL for NaN (no rank had a value)."""
    return None if np.isnan(value) else float(value)
