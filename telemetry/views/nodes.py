"""The run health page's views of nodes and ranks: the nodes x steps heatmap, one node's ranks
x steps and their phases, the slowest ranks and nodes now and over the run, a rank search."""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd
from sqlalchemy import ColumnElement, Connection, Select, exists, func, select, true, union_all
from sqlalchemy.orm import aliased

from telemetry import partitions
from telemetry.models import NodeStep, Rank, RankStep, Run, StepRollup
from telemetry.queries import Bind, connection_of
from telemetry.views.common import (
    chunks,
    last_step_of,
    latest_attempt,
    latest_rollup,
    restarted,
    rollups_at,
    sampled_steps,
)

PHASE_COLUMNS = ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_wait_s")
RANK_STEP_COLUMNS = ["step", "rank", "step_s", "compute_s", *PHASE_COLUMNS]
NODE_STEP_COLUMNS = ["step", "node", "relative", "worst_rank", "worst_compute_s", "ranks"]
SLOWEST_RANK_COLUMNS = ["rank", "node", "compute_s", "relative", "steps"]
SLOWEST_NODE_COLUMNS = ["node", "worst_rank", "relative", "steps"]
FOUND_COLUMNS = ["rank", "node"]
RANK_PHASE_COLUMNS = ["rank", "step_s", "compute_s", *PHASE_COLUMNS, "relative_score"]


def node_steps(
    bind: Bind, run_id: str, *, max_steps: int = 100, max_nodes: int = 48
) -> tuple[pd.DataFrame, int]:
    """The nodes x steps view: NODE_STEP_COLUMNS at up to `max_steps` steps spread over the steps
    whose node rows are kept, for the `max_nodes` nodes whose worst rank was slowest relative to
    its step's median rank there; and how many nodes there are in all.

    The database picks the nodes (one aggregate over the sampled steps' node rows), so a run of
    2,048 nodes sends only the rows drawn.
    """
    steps = sampled_steps(bind, run_id, max_steps, NodeStep)
    if not steps:
        return pd.DataFrame(columns=NODE_STEP_COLUMNS), 0
    at_steps = (NodeStep.run_id == run_id, NodeStep.step.in_(steps))
    with connection_of(bind) as connection:
        latest = _latest_node_attempt(connection, run_id)
        total = connection.execute(
            select(func.count(func.distinct(NodeStep.node))).where(*at_steps)
        ).scalar()
        worst = (
            select(NodeStep.node)
            .where(*at_steps, *latest)
            .group_by(NodeStep.node)
            .order_by(func.max(NodeStep.relative).desc(), NodeStep.node)
            .limit(max_nodes)
        )
        chosen = list(connection.execute(worst).scalars())
        rows = connection.execute(
            select(*(getattr(NodeStep, column) for column in NODE_STEP_COLUMNS)).where(
                *at_steps, *latest, NodeStep.node.in_(chosen)
            )
        ).all()
    frame = pd.DataFrame(rows, columns=NODE_STEP_COLUMNS).astype({"relative": float})
    return frame.sort_values(["step", "node"], ignore_index=True), int(total or 0)


def ranks_of_node(bind: Bind, run_id: str, node: str) -> list[int]:
    """The ranks on `node` (a host the run registered, or "rank<N>" for a rank without one)."""
    with connection_of(bind) as connection:
        ranks = list(
            connection.execute(
                select(Rank.rank)
                .where(Rank.run_id == run_id, Rank.host == node)
                .order_by(Rank.rank)
            ).scalars()
        )
        if ranks or not re.fullmatch(r"rank\d+", node):
            return ranks
        world = connection.execute(select(Run.world_size).where(Run.run_id == run_id)).scalar()
    rank = int(node.removeprefix("rank"))
    return [rank] if world is not None and rank < world else []


def rank_steps(bind: Bind, run_id: str, ranks: list[int], *, max_steps: int = 100) -> pd.DataFrame:
    """Step time, compute time and phases of `ranks` (a node's, a rank) at up to `max_steps`
    steps spread over the latest ones whose node rows are kept: RANK_STEP_COLUMNS, and beside each
    time column `median_<column>`, its median over all ranks of the step (from the rollups), for
    a ranks x steps heatmap of one node coloured relative to the whole job."""
    steps = sampled_steps(bind, run_id, max_steps, NodeStep)
    rows = _rank_rows_at(
        bind,
        select(*(getattr(RankStep, column) for column in RANK_STEP_COLUMNS)).where(
            RankStep.rank.in_(ranks)
        ),
        run_id,
        steps,
    )
    frame = pd.DataFrame(rows, columns=RANK_STEP_COLUMNS)
    medians = rollups_at(
        bind,
        select(
            StepRollup.step,
            *(getattr(StepRollup, f"{c.removesuffix('_s')}_median") for c in _MEASURED),
        ),
        run_id,
        steps,
    )
    of_steps = pd.DataFrame(medians, columns=["step", *(f"median_{c}" for c in _MEASURED)])
    frame = frame.merge(of_steps, on="step", how="left")
    return frame.sort_values(["step", "rank"], ignore_index=True)


# The rank columns a node's heatmap can show, each beside its step's median over all ranks.
_MEASURED = RANK_STEP_COLUMNS[2:]


def rank_phases(bind: Bind, run_id: str, ranks: list[int], *, window: int = 20) -> pd.DataFrame:
    """Each of `ranks`' mean step time, compute time and phases over the latest `window` steps,
    with its straggler score: RANK_PHASE_COLUMNS, by rank.

    relative_score is the straggler detector's relative score on those means: the mean over the
    steps of the median compute time of all ranks (from the rollups) over the rank's own mean
    (1 typical, 0.5 twice as slow as its peers).
    """
    columns = ["step_s", "compute_s", *PHASE_COLUMNS]
    with connection_of(bind) as connection:
        last_step = last_step_of(connection, run_id)
        if last_step is None or not ranks:
            return pd.DataFrame(columns=RANK_PHASE_COLUMNS)
        world = connection.execute(select(Run.world_size).where(Run.run_id == run_id)).scalar()
        # Every rank (the widest read): no list of 16,384 ranks to match each row against.
        every_rank = world is not None and set(range(world)) <= set(ranks)
        rows = connection.execute(
            select(RankStep.rank, *(func.avg(getattr(RankStep, c)) for c in columns))
            .where(
                RankStep.run_id == run_id,
                # Both bounds constant, and inclusive: PostgreSQL then scans only the range
                # partitions of these steps (with `>` it kept the one below as well).
                RankStep.step.between(last_step - window + 1, last_step),
                true() if every_rank else RankStep.rank.in_(ranks),
                latest_attempt(connection, run_id),
            )
            .group_by(RankStep.rank)
            .order_by(RankStep.rank)
        ).all()
        peers = connection.execute(
            select(func.avg(StepRollup.compute_median)).where(
                StepRollup.run_id == run_id,
                StepRollup.step > last_step - window,
                *latest_rollup(connection, run_id),
            )
        ).scalar()
    frame = pd.DataFrame(rows, columns=["rank", *columns]).astype(dict.fromkeys(columns, float))
    frame["relative_score"] = [
        peers / own if peers and own > 0 else math.nan for own in frame["compute_s"]
    ]
    return frame


def slowest_now(bind: Bind, run_id: str, *, k: int = 8) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The slowest ranks (SLOWEST_RANK_COLUMNS, from the latest rollup) and nodes
    (SLOWEST_NODE_COLUMNS, from its node rows) at the run's latest rolled-up step, slowest first;
    `relative` is own compute time over the step's median rank's, `steps` is 1."""
    with connection_of(bind) as connection:
        latest = connection.execute(
            select(
                StepRollup.step, StepRollup.attempt, StepRollup.slowest, StepRollup.compute_median
            )
            .where(StepRollup.run_id == run_id)
            .order_by(StepRollup.step.desc(), StepRollup.attempt.desc())
            .limit(1)
        ).first()
        if latest is None:
            return _empty(SLOWEST_RANK_COLUMNS), _empty(SLOWEST_NODE_COLUMNS)
        nodes = connection.execute(
            select(NodeStep.node, NodeStep.worst_rank, NodeStep.relative)
            .where(
                NodeStep.run_id == run_id,
                NodeStep.step == latest.step,
                NodeStep.attempt == latest.attempt,
            )
            .order_by(NodeStep.relative.desc(), NodeStep.node)
            .limit(k)
        ).all()
    median = latest.compute_median
    ranks = [
        (rank, node, seconds, seconds / median if median else math.nan, 1)
        for rank, node, seconds in (latest.slowest or [])[:k]
    ]
    return (
        pd.DataFrame(ranks, columns=SLOWEST_RANK_COLUMNS),
        pd.DataFrame([(*row, 1) for row in nodes], columns=SLOWEST_NODE_COLUMNS),
    )


def slowest_over_run(
    bind: Bind, run_id: str, *, k: int = 8, max_steps: int = 1000
) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """The ranks and nodes most often among each step's slowest ranks over the whole run, at up to
    `max_steps` sampled steps of its rollups: SLOWEST_RANK_COLUMNS and SLOWEST_NODE_COLUMNS, the
    k most frequent first (`steps`: at how many sampled steps; compute_s and relative: their
    worst), and how many steps were read."""
    steps = sampled_steps(bind, run_id, max_steps)
    rank_seen: dict[int, list[Any]] = {}
    node_seen: dict[str, list[Any]] = {}
    rollups = rollups_at(bind, select(StepRollup.slowest, StepRollup.compute_median), run_id, steps)
    for slowest, median in rollups:
        counted: set[str] = set()
        for rank, node, seconds in slowest or []:
            relative = seconds / median if median else math.nan
            seen = rank_seen.setdefault(rank, [node, 0.0, 0.0, 0])
            seen[1], seen[2] = max(seen[1], seconds), max(seen[2], relative)
            seen[3] += 1
            by_node = node_seen.setdefault(node, [rank, relative, 0])
            if relative > by_node[1]:
                by_node[0], by_node[1] = rank, relative
            if node not in counted:
                counted.add(node)
                by_node[2] += 1
    ranks = sorted(rank_seen.items(), key=lambda item: (-item[1][3], -item[1][1], item[0]))[:k]
    nodes = sorted(node_seen.items(), key=lambda item: (-item[1][2], -item[1][1], item[0]))[:k]
    return (
        pd.DataFrame([(rank, *seen) for rank, seen in ranks], columns=SLOWEST_RANK_COLUMNS),
        pd.DataFrame([(node, *seen) for node, seen in nodes], columns=SLOWEST_NODE_COLUMNS),
        len(steps),
    )


def find_ranks(bind: Bind, run_id: str, text: str, *, limit: int = 50) -> pd.DataFrame:
    """Ranks whose number is `text` or whose host contains it: FOUND_COLUMNS, by rank, at most
    `limit`; a rank without a registered host is on node "rank<N>"."""
    text = text.strip()
    with connection_of(bind) as connection:
        world = connection.execute(select(Run.world_size).where(Run.run_id == run_id)).scalar()
        if text.isdecimal():
            rank = int(text)
            if world is None or rank >= world:
                return _empty(FOUND_COLUMNS)
            host = connection.execute(
                select(Rank.host).where(Rank.run_id == run_id, Rank.rank == rank)
            ).scalar()
            return pd.DataFrame([(rank, host or f"rank{rank}")], columns=FOUND_COLUMNS)
        pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = connection.execute(
            select(Rank.rank, Rank.host)
            .where(Rank.run_id == run_id, Rank.host.ilike(pattern, escape="\\"))
            .order_by(Rank.rank)
            .limit(limit)
        ).all()
    return pd.DataFrame(rows, columns=FOUND_COLUMNS)


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame(columns=columns)


def _latest_node_attempt(connection: Any, run_id: str) -> list[ColumnElement[bool]]:
    """Only each step's latest attempt's node rows, or no condition for a run never restarted."""
    if not restarted(connection, run_id):
        return []
    newer = aliased(NodeStep)
    return [
        ~exists().where(
            newer.run_id == NodeStep.run_id,
            newer.step == NodeStep.step,
            newer.node == NodeStep.node,
            newer.attempt > NodeStep.attempt,
        )
    ]


def _rank_rows_at(bind: Bind, statement: Select[Any], run_id: str, steps: list[int]) -> list[Any]:
    """Rows of `statement` restricted to the run's records at `steps`, each rank's latest
    attempt's, in chunks that stay below the databases' limits on bound parameters; each chunk
    is a few index range lookups.

    On PostgreSQL's partitioned rank_steps a chunk is one UNION ALL of a select per range
    partition, each with only that range's steps and their bounds as constants: each is pruned
    to its partition, whose primary key is then searched for its own steps only (PostgreSQL 15
    would otherwise search every partition for every step of the chunk)."""
    rows: list[Any] = []
    with connection_of(bind) as connection:
        latest = latest_attempt(connection, run_id)
        spans = _step_ranges(connection, run_id)
        for chunk in chunks(steps):
            selects = [
                statement.where(
                    RankStep.run_id == run_id,
                    RankStep.step.between(min(group), max(group)),
                    RankStep.step.in_(group),
                    latest,
                )
                for group in _by_range(chunk, spans)
            ]
            rows.extend(connection.execute(union_all(*selects) if len(selects) > 1 else selects[0]))
    return rows


def _step_ranges(connection: Any, run_id: str) -> list[tuple[int, int]]:
    """(first, end) of each range partition of the run (PostgreSQL); none on SQLite."""
    bind = connection if isinstance(connection, Connection) else connection.get_bind()
    if bind.dialect.name != "postgresql":
        return []
    return [(span.first, span.end) for span in partitions.ranges(connection, run_id)]


def _by_range(steps: list[int], spans: list[tuple[int, int]]) -> list[list[int]]:
    """`steps` (ascending) grouped by the range holding them; those in none, one group."""
    groups: dict[int | None, list[int]] = {}
    for step in steps:
        key = next((first for first, end in spans if first <= step < end), None)
        groups.setdefault(key, []).append(step)
    return list(groups.values())
