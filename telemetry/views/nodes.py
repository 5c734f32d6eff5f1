"""Read-only views of runs for the run-health UI, built to stay fast on 16,384 ranks x 1M steps.

Kept apart from `telemetry.queries` (which aggregates every record of a run) because the UI must
answer in well under a second on a long run, where one pass over a run's millions of rank records
takes seconds. So every view here reads bounded slices through a primary key: of the step rollups
(one row per step, kept for the whole run: loss, throughput, the slowest ranks), of the node steps
(one row per node and step, for the latest steps: the nodes x steps view) or of the rank rows of
one node's or rank's ranks; the latest `window` steps, or a fixed number of steps spread evenly
("sampled steps"), never the whole run, and never every rank. Sampling can miss a one-step loss
spike between two samples; the spike detector's events are drawn as markers, so a detected spike
always shows.

Where a step was recorded by several attempts, each rank's latest attempt counts, as in
`telemetry.queries`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd
from sqlalchemy import (
    ColumnElement,
    Connection,
    Select,
    and_,
    case,
    exists,
    func,
    select,
    true,
    union_all,
)
from sqlalchemy.orm import aliased

from scaletrain.names import TIER_NAMES
from scaletrain.v1 import common_pb2
from telemetry import partitions
from telemetry.efficiency import EVAL_EVENT, LATEST_ROLLUP, RECOVERY_EVENT, mfu
from telemetry.health import data_spike
from telemetry.models import (
    TRAINER_TIER,
    WHOLE_TIER,
    Checkpoint,
    Event,
    NodeStep,
    Rank,
    RankStep,
    Run,
    StepRollup,
)
from telemetry.queries import LATEST_ATTEMPT, Bind, connection_of

# Storage tiers, fastest first, as telemetry stores them.
TIERS = tuple(TIER_NAMES.values())
# The tiers of one node (its memory and SSD), where its part and its peers' replicas live.
NODE_TIERS = (TIER_NAMES[common_pb2.TIER_MEMORY], TIER_NAMES[common_pb2.TIER_SSD])
# Events that say something is wrong now; counted as a run's open alerts since its latest start.
ALERT_KINDS = ("alert", "straggler", "sdc", "loss_spike")
# Events drawn as markers on the loss curve (besides committed checkpoints).
MARKER_KINDS = ("restart", "loss_spike", "sdc", "replay")
PHASE_COLUMNS = ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_wait_s")

OVERVIEW_COLUMNS = [
    "run_id", "name", "status", "world_size", "attempt", "step", "loss", "tokens_per_s", "mfu",
    "last_checkpoint", "last_checkpoint_at", "open_alerts", "started_at",
]  # fmt: skip
LOSS_POINT_COLUMNS = ["step", "loss", "loss_min", "loss_max", "tokens_per_s", "ranks"]
EVAL_POINT_COLUMNS = ["step", "eval_loss"]
RANK_STEP_COLUMNS = ["step", "rank", "step_s", "compute_s", *PHASE_COLUMNS]
NODE_STEP_COLUMNS = ["step", "node", "relative", "worst_rank", "worst_compute_s", "ranks"]
SLOWEST_RANK_COLUMNS = ["rank", "node", "compute_s", "relative", "steps"]
SLOWEST_NODE_COLUMNS = ["node", "worst_rank", "relative", "steps"]
FOUND_COLUMNS = ["rank", "node"]
RANK_PHASE_COLUMNS = ["rank", "step_s", "compute_s", *PHASE_COLUMNS, "relative_score"]
MARKER_COLUMNS = ["step", "kind", "label"]
# A fault's recovery (a drill's `recovery` event): the table's columns, then the steps its band
# spans on the loss curve (from where the job resumed, or the fault's step, to its first step).
RECOVERY_COLUMNS = [
    "kind", "target", "step", "injected", "detected_s", "first_step", "first_step_s", "mttr_s",
    "steps_lost", "restored_from", "spare", "in_job", "badput_s", "from_step", "to_step",
]  # fmt: skip
TIMELINE_COLUMNS = [
    "step", "started_at", "blocking_s", "background_s", "tiers", "failed_tiers", "nodes",
    *(f"{tier}_bytes" for tier in TIERS),
]  # fmt: skip
PART_COLUMNS = ["step", "tier", "node", "bytes", "committed_at"]
# The most nodes the checkpoint timeline names on one tier; beyond, it counts them.
NAMED_NODES = 8
OFFSET_COLUMNS = ["rank", "global_sample", "rank_sample", "epoch"]
# A checkpoint row that says the checkpoint is restorable: committed on a storage tier.
COMMITTED = (Checkpoint.committed_at.is_not(None), Checkpoint.tier != TRAINER_TIER)


@dataclass(frozen=True)
class Headline:
    """The figures at the top of a run's page: now (the latest `window` steps) and the window
    before, for trends. NaN when unknown; `last_step` None while no step was recorded."""

    status: str
    last_step: int | None
    loss: float
    previous_loss: float
    tokens_per_s: float
    previous_tokens_per_s: float
    mfu: float
    previous_mfu: float
    mfu_label: str
    last_checkpoint: int | None
    last_checkpoint_at: datetime | None


def runs_table(bind: Bind, *, window: int = 20) -> pd.DataFrame:
    """One row per run, newest first: OVERVIEW_COLUMNS.

    status is the stored one, except "restarting" for a running run whose latest attempt has not
    recorded a step yet. loss, tokens_per_s and mfu are over the latest `window` steps;
    last_checkpoint is the latest step committed on any tier; open_alerts counts ALERT_KINDS
    events since the run's latest start (its current attempt).
    """
    with connection_of(bind) as connection:
        runs = connection.execute(
            select(
                Run.run_id, Run.name, Run.status, Run.world_size, Run.attempt, Run.started_at
            ).order_by(Run.started_at.desc())
        ).all()
        # Each run's latest committed step, when it was first committed on any tier of any node.
        latest = (
            select(Checkpoint.run_id, func.max(Checkpoint.step).label("step"))
            .where(*COMMITTED)
            .group_by(Checkpoint.run_id)
            .subquery()
        )
        committed = {
            run_id: (step, time)
            for run_id, step, time in connection.execute(
                select(Checkpoint.run_id, Checkpoint.step, func.min(Checkpoint.committed_at))
                .join(
                    latest,
                    and_(Checkpoint.run_id == latest.c.run_id, Checkpoint.step == latest.c.step),
                )
                .where(*COMMITTED)
                .group_by(Checkpoint.run_id, Checkpoint.step)
            )
        }
        rows = []
        for run in runs:
            last_step = _last_step(connection, run.run_id)
            recent = _recent_steps(connection, run.run_id, last_step, window)
            checkpoint, checkpoint_at = committed.get(run.run_id, (None, None))
            rows.append(
                {
                    "run_id": run.run_id,
                    "name": run.name,
                    "status": _status(connection, run.run_id, run.status, run.attempt),
                    "world_size": run.world_size,
                    "attempt": run.attempt,
                    "step": last_step,
                    "loss": _last_loss(recent),
                    "tokens_per_s": _throughput(recent),
                    "mfu": mfu(connection, run.run_id, last_steps=window).mfu,
                    "last_checkpoint": checkpoint,
                    "last_checkpoint_at": checkpoint_at,
                    "open_alerts": _open_alerts(connection, run.run_id),
                    "started_at": run.started_at,
                }
            )
    return pd.DataFrame(rows, columns=OVERVIEW_COLUMNS)


def headline(bind: Bind, run_id: str, *, window: int = 20) -> Headline:
    """The headline figures of `run_id` (see Headline); NotFound when no such run was registered."""
    with connection_of(bind) as connection:
        now = mfu(connection, run_id, last_steps=window)
        run = connection.execute(select(Run.status, Run.attempt).where(Run.run_id == run_id)).one()
        last_step = _last_step(connection, run_id)
        steps = _recent_steps(connection, run_id, last_step, 2 * window)
        checkpoint = connection.execute(
            select(Checkpoint.step, Checkpoint.committed_at)
            .where(
                Checkpoint.run_id == run_id,
                *COMMITTED,
            )
            .order_by(Checkpoint.step.desc(), Checkpoint.committed_at)
            .limit(1)
        ).first()
        status = _status(connection, run_id, run.status, run.attempt)
    cut = (last_step or 0) - window
    recent, before = steps[steps["step"] > cut], steps[steps["step"] <= cut]
    loss, previous_loss = _last_loss(recent), _last_loss(before)
    tokens_per_s, previous_tokens_per_s = _throughput(recent), _throughput(before)
    # MFU is proportional to tokens/s for a given run: scale the current figure.
    previous_mfu = now.mfu * previous_tokens_per_s / tokens_per_s if tokens_per_s else math.nan
    return Headline(
        status=status,
        last_step=last_step,
        loss=loss,
        previous_loss=previous_loss,
        tokens_per_s=tokens_per_s,
        previous_tokens_per_s=previous_tokens_per_s,
        mfu=now.mfu,
        previous_mfu=previous_mfu,
        mfu_label=now.label,
        last_checkpoint=None if checkpoint is None else checkpoint.step,
        last_checkpoint_at=None if checkpoint is None else checkpoint.committed_at,
    )


def sampled_steps(bind: Bind, run_id: str, max_steps: int, table: Any = StepRollup) -> list[int]:
    """At most `max_steps` steps spread evenly from the run's first to its last step in `table`
    (rolled up, by default; NodeStep: the steps whose node rows are kept), both included; every
    step when there are no more than that. Empty without any."""
    with connection_of(bind) as connection:
        # Two subqueries: SQLite answers a lone MIN or MAX from the index, both at once by a scan.
        of_run = select(table.step).where(table.run_id == run_id)
        first, last = connection.execute(
            select(
                of_run.with_only_columns(func.min(table.step)).scalar_subquery(),
                of_run.with_only_columns(func.max(table.step)).scalar_subquery(),
            )
        ).one()
    return spread(first, last, max_steps)


def spread(first: int | None, last: int | None, max_steps: int) -> list[int]:
    """At most `max_steps` steps spread evenly from `first` to `last`, both included."""
    if first is None or last is None:
        return []
    count = last - first + 1
    if count <= max_steps:
        return list(range(first, last + 1))
    stride = (count - 1) / (max(max_steps, 2) - 1)
    return sorted({first + round(index * stride) for index in range(max(max_steps, 2))})


def loss_points(bind: Bind, run_id: str, *, max_points: int = 1000) -> pd.DataFrame:
    """Mean, min and max loss over ranks, tokens/s (all ranks' tokens over the slowest rank's
    step time) and the ranks that trained it (an elastic job's size changes) at up to
    `max_points` sampled steps, from the rollups: LOSS_POINT_COLUMNS."""
    steps = sampled_steps(bind, run_id, max_points)
    rows = []
    with connection_of(bind) as connection:
        latest = _latest_rollup(connection, run_id)
        for start in range(0, len(steps), 500):
            rows += connection.execute(
                select(
                    StepRollup.step,
                    StepRollup.loss_mean,
                    StepRollup.loss_min,
                    StepRollup.loss_max,
                    StepRollup.tokens / case((StepRollup.step_max > 0, StepRollup.step_max)),
                    StepRollup.ranks,
                ).where(
                    StepRollup.run_id == run_id, StepRollup.step.in_(steps[start : start + 500]),
                    *latest,
                )
            ).all()  # fmt: skip
    frame = pd.DataFrame(rows, columns=LOSS_POINT_COLUMNS)
    return frame.astype({column: float for column in LOSS_POINT_COLUMNS[1:-1]}).sort_values(
        "step", ignore_index=True
    )


def eval_points(bind: Bind, run_id: str, *, limit: int | None = 1000) -> pd.DataFrame:
    """The validation losses of `run_id` (its "eval" events): EVAL_POINT_COLUMNS by step, the
    latest report of a step when a restarted run evaluated it again; at most the `limit` latest
    steps (None: every one)."""
    query = (
        select(Event.step, Event.attributes)
        .where(Event.run_id == run_id, Event.kind == EVAL_EVENT)
        .order_by(Event.time.desc())
    )
    latest: dict[int, float] = {}
    with connection_of(bind) as connection:
        for step, attributes in connection.execute(query):
            if step not in latest and (limit is None or len(latest) < limit):
                latest[step] = float(attributes["loss"])
    frame = pd.DataFrame(sorted(latest.items()), columns=EVAL_POINT_COLUMNS)
    return frame.astype({"step": int, "eval_loss": float})


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
    rows = _at_steps(
        bind,
        select(*(getattr(RankStep, column) for column in RANK_STEP_COLUMNS)).where(
            RankStep.rank.in_(ranks)
        ),
        run_id,
        steps,
    )
    frame = pd.DataFrame(rows, columns=RANK_STEP_COLUMNS)
    medians = []
    with connection_of(bind) as connection:
        latest = _latest_rollup(connection, run_id)
        for start in range(0, len(steps), 500):
            medians += connection.execute(
                select(
                    StepRollup.step,
                    *(getattr(StepRollup, f"{c.removesuffix('_s')}_median") for c in _MEASURED),
                ).where(
                    StepRollup.run_id == run_id,
                    StepRollup.step.in_(steps[start : start + 500]),
                    *latest,
                )
            ).all()
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
        last_step = _last_step(connection, run_id)
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
                _latest_attempt(connection, run_id),
            )
            .group_by(RankStep.rank)
            .order_by(RankStep.rank)
        ).all()
        peers = connection.execute(
            select(func.avg(StepRollup.compute_median)).where(
                StepRollup.run_id == run_id,
                StepRollup.step > last_step - window,
                *_latest_rollup(connection, run_id),
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
    with connection_of(bind) as connection:
        latest = _latest_rollup(connection, run_id)
        for start in range(0, len(steps), 500):
            for slowest, median in connection.execute(
                select(StepRollup.slowest, StepRollup.compute_median).where(
                    StepRollup.run_id == run_id,
                    StepRollup.step.in_(steps[start : start + 500]),
                    *latest,
                )
            ):
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


def markers(bind: Bind, run_id: str, *, limit: int = 2000) -> pd.DataFrame:
    """What to mark on the loss curve: MARKER_COLUMNS, by step. Kind "checkpoint" for a step
    committed on some tier, else one of MARKER_KINDS; at most `limit` of the latest of each."""
    checkpoint_steps = (
        select(Checkpoint.step)
        .where(
            Checkpoint.run_id == run_id,
            *COMMITTED,
        )
        .distinct()
        .order_by(Checkpoint.step.desc())
        .limit(limit)
    )
    marked = (
        select(Event.step, Event.kind, Event.message)
        .where(Event.run_id == run_id, Event.kind.in_(MARKER_KINDS))
        .order_by(Event.time.desc())
        .limit(limit)
    )
    with connection_of(bind) as connection:
        checkpoint_rows = [
            (step, "checkpoint", f"checkpoint of step {step}")
            for (step,) in connection.execute(checkpoint_steps)
        ]
        # Newest first from the database; oldest first within a step on the chart.
        event_rows = [tuple(row) for row in connection.execute(marked)][::-1]
    frame = pd.DataFrame(checkpoint_rows + event_rows, columns=MARKER_COLUMNS)
    return frame.sort_values("step", kind="stable", ignore_index=True)


def recoveries(bind: Bind, run_id: str, *, limit: int = 1000) -> pd.DataFrame:
    """The run's recovery records (one per fault a drill injected), oldest first, at most the
    latest `limit`: RECOVERY_COLUMNS. Times after the fault's strike in seconds (NaN: never);
    `restored_from` the restore's bytes per copy ({"memory@node0": 2100000}; {} without one)."""
    with connection_of(bind) as connection:
        rows = connection.execute(
            select(Event.time, Event.attributes)
            .where(Event.run_id == run_id, Event.kind == RECOVERY_EVENT)
            .order_by(Event.time.desc())
            .limit(limit)
        ).all()
    frame = [_recovery_row(at, attributes or {}) for at, attributes in reversed(rows)]
    return pd.DataFrame(frame, columns=RECOVERY_COLUMNS)


def _recovery_row(at: datetime, attributes: dict[str, str]) -> list[Any]:
    """A `recovery` event's attributes (strings, "" for None) as a row of RECOVERY_COLUMNS."""

    def number(name: str) -> float:
        return _float(attributes.get(name) or None)

    injected, step = number("injected_at"), int(attributes.get("step") or 0)
    first = int(attributes["first_step"]) if attributes.get("first_step") else None
    resumed = int(attributes["resumed_from"]) if attributes.get("resumed_from") else step
    return [
        attributes.get("kind", ""), attributes.get("target", ""), step, at,
        number("detected_at") - injected, first, number("first_step_at") - injected,
        number("mttr_s"), int(attributes.get("steps_lost") or 0),
        json.loads(attributes.get("restored_from") or "{}"), attributes.get("spare") == "true",
        attributes.get("in_job") == "true", number("badput_s"), min(resumed, step),
        max(step, first or step),
    ]  # fmt: skip


def checkpoint_parts(bind: Bind, run_id: str) -> pd.DataFrame:
    """Where each checkpoint of `run_id` is held: PART_COLUMNS, a row per storage tier and node
    holding it, by step, tier (fastest first) and node.

    A memory or SSD row is one node's part of the checkpoint (the files its ranks wrote), `bytes`
    its size; S3 holds the whole checkpoint, with node "" (as has every row recorded before
    telemetry knew nodes).
    """
    with connection_of(bind) as connection:
        rows = connection.execute(
            select(*(getattr(Checkpoint, column) for column in PART_COLUMNS)).where(
                Checkpoint.run_id == run_id,
                Checkpoint.tier.in_(TIERS),
                Checkpoint.part == "",
                *COMMITTED,
            )
        ).all()
    parts = pd.DataFrame(rows, columns=PART_COLUMNS)
    order = {
        "tier": {tier: index for index, tier in enumerate(TIERS)},
        "node": {node: index for index, node in enumerate(_by_name(set(parts["node"])))},
    }
    return parts.sort_values(
        ["step", "tier", "node"],
        key=lambda column: column.map(order[column.name]) if column.name in order else column,
        ignore_index=True,
    )


COPY_COLUMNS = ["step", "copies", "node_loss_safe"]


def checkpoint_copies(bind: Bind, run_id: str) -> pd.DataFrame:
    """For each checkpoint of `run_id` spread over nodes: COPY_COLUMNS, by step.

    `copies` names, for each node's part, the nodes that committed a copy of it on their memory
    or SSD (its own node, and each peer holding a replica): "node0: node0, node1 · node1: node1,
    node0". `node_loss_safe`: every part has copies on 2 nodes or more, so losing any one node
    loses none of it (S3's whole copy aside).
    """
    with connection_of(bind) as connection:
        rows = connection.execute(
            select(Checkpoint.step, Checkpoint.node, Checkpoint.part).where(
                Checkpoint.run_id == run_id,
                Checkpoint.tier.in_(NODE_TIERS),
                Checkpoint.node != "",
                *COMMITTED,
            )
        ).all()
    holders: dict[int, dict[str, set[str]]] = {}
    for step, node, part in rows:
        holders.setdefault(int(step), {}).setdefault(part or node, set()).add(node)
    return pd.DataFrame(
        [
            {
                "step": step,
                "copies": " · ".join(
                    f"{owner}: {', '.join(_by_name(parts[owner]))}"
                    for owner in _by_name(set(parts))
                ),
                "node_loss_safe": all(len(nodes) >= 2 for nodes in parts.values()),
            }
            for step, parts in sorted(holders.items())
        ],
        columns=COPY_COLUMNS,
    )


def checkpoint_timeline(bind: Bind, run_id: str) -> pd.DataFrame:
    """One row per checkpoint of `run_id`, by step: TIMELINE_COLUMNS.

    blocking_s is how long training was blocked (the trainer's staging), background_s how long
    the save streamed afterwards (its checkpoint_saved event); tiers lists the tiers it was
    committed on (on any node), fastest first, with its size on each in <tier>_bytes (the sum of
    the nodes' parts; NaN where not committed). When the run's checkpoints are spread over several
    nodes, nodes says which ones hold their part on each tier ("memory: node0, node1 · ssd: node0,
    node1 · s3", S3 holding the whole; beyond NAMED_NODES nodes on a tier, "ssd: 63 of 64 nodes,
    not node7"); else it is "". Telemetry records commits, not evictions: a tier that dropped the
    checkpoint under its retention policy is still listed.

    The database sums up each step's tiers over their nodes (one row per step and tier, the
    holding nodes' names joined), so a run of many nodes reads no more rows than one of one node.
    """
    held = Checkpoint.committed_at.is_not(None)
    with connection_of(bind) as connection:
        tier_rows = connection.execute(
            select(
                Checkpoint.step,
                Checkpoint.tier,
                func.min(Checkpoint.started_at).label("started_at"),
                func.min(Checkpoint.committed_at).label("committed_at"),
                func.count(Checkpoint.committed_at).label("holding"),
                func.count(Checkpoint.failed_at).label("failed"),
                func.sum(case((held, Checkpoint.bytes), else_=0)).label("bytes"),
                func.max(Checkpoint.seconds).label("seconds"),
                _joined(connection, case((held, Checkpoint.node))).label("nodes"),
            )
            # Each node's own part: peer replicas are `checkpoint_copies`'.
            .where(Checkpoint.run_id == run_id, Checkpoint.part == "")
            .group_by(Checkpoint.step, Checkpoint.tier)
            .order_by(Checkpoint.step)
        ).all()
        background = dict(
            connection.execute(
                select(Event.step, func.max(Event.seconds))
                .where(Event.run_id == run_id, Event.kind == "checkpoint_saved")
                .group_by(Event.step)
            ).all()
        )
    by_step: dict[int, dict[str, Any]] = {}
    for row in tier_rows:
        by_step.setdefault(row.step, {})[row.tier] = row
    holders = {
        (row.step, row.tier): _by_name({node for node in row.nodes.split(_NAMES_SEPARATOR) if node})
        for row in tier_rows
        if row.tier in TIERS and row.nodes
    }
    every_node = _by_name(set().union(*holders.values()))
    rows = []
    for step, by_tier in by_step.items():
        committed = [tier for tier in TIERS if tier in by_tier and by_tier[tier].holding]
        # When it began, or else (no start reported) when it was first committed anywhere.
        started = [row.started_at for row in by_tier.values() if row.started_at is not None] or [
            row.committed_at for row in by_tier.values() if row.committed_at is not None
        ]
        trainer = by_tier.get(TRAINER_TIER)
        rows.append(
            {
                "step": int(step),
                "started_at": min(started, default=None),
                "blocking_s": _float(trainer.seconds if trainer is not None else None),
                "background_s": _float(background.get(step)),
                "tiers": ", ".join(committed),
                "failed_tiers": ", ".join(t for t in TIERS if t in by_tier and by_tier[t].failed),
                "nodes": " · ".join(
                    _held_by(tier, holders.get((step, tier), []), every_node)
                    for tier in committed
                    if len(every_node) > 1
                ),
                **{
                    f"{tier}_bytes": float(by_tier[tier].bytes) if tier in committed else math.nan
                    for tier in TIERS
                },
            }
        )
    return pd.DataFrame(rows, columns=TIMELINE_COLUMNS)


# Joins the node names of a step's tier in SQL: no node name holds it (ckptd's are [A-Za-z0-9._-]).
_NAMES_SEPARATOR = "\n"


def _joined(connection: Any, names: ColumnElement[Any]) -> ColumnElement[str]:
    """The names of a group joined by _NAMES_SEPARATOR, NULLs left out, in no particular order."""
    dialect = (
        connection.dialect if hasattr(connection, "dialect") else connection.get_bind().dialect
    )
    if dialect.name == "postgresql":
        return func.string_agg(names, _NAMES_SEPARATOR)
    return func.group_concat(names, _NAMES_SEPARATOR)


def _by_name(nodes: set[str]) -> list[str]:
    """Node names in order, their numbers as numbers: node2 before node10."""
    return sorted(
        nodes, key=lambda node: [int(p) if p.isdecimal() else p for p in re.split(r"(\d+)", node)]
    )


def _held_by(tier: str, nodes: list[str], every_node: list[str]) -> str:
    """A tier and the nodes holding their part there ("ssd: node0, node1"), counted beyond
    NAMED_NODES with the missing ones named when few are; S3 holds the whole checkpoint."""
    if tier == WHOLE_TIER or not nodes:
        return tier
    if len(nodes) <= NAMED_NODES:
        return f"{tier}: {', '.join(nodes)}"
    holding = set(nodes)
    missing = [node for node in every_node if node not in holding]
    absent = f", not {', '.join(missing)}" if 0 < len(missing) <= NAMED_NODES else ""
    return f"{tier}: {len(nodes)} of {len(every_node)} nodes{absent}"


def resume_offsets(bind: Bind, run_id: str) -> tuple[int | None, pd.DataFrame]:
    """The latest step committed on some tier and each rank's data-loader offset recorded at it
    (where that rank resumes): (step, OFFSET_COLUMNS by rank); (None, empty) without a checkpoint.
    """
    with connection_of(bind) as connection:
        step = connection.execute(
            select(func.max(Checkpoint.step)).where(
                Checkpoint.run_id == run_id,
                *COMMITTED,
            )
        ).scalar()
        if step is None:
            return None, pd.DataFrame(columns=OFFSET_COLUMNS)
        rows = connection.execute(
            select(*(getattr(RankStep, column) for column in OFFSET_COLUMNS))
            .where(
                RankStep.run_id == run_id,
                RankStep.step == step,
                _latest_attempt(connection, run_id),
            )
            .order_by(RankStep.rank)
        ).all()
    return int(step), pd.DataFrame(rows, columns=OFFSET_COLUMNS)


def event_kinds(bind: Bind, run_id: str) -> list[str]:
    """The kinds of event `run_id` has, alphabetically (for a filter)."""
    with connection_of(bind) as connection:
        return list(
            connection.execute(
                select(Event.kind).where(Event.run_id == run_id).distinct().order_by(Event.kind)
            ).scalars()
        )


def _at_steps(bind: Bind, statement: Select[Any], run_id: str, steps: list[int]) -> list[Any]:
    """Rows of `statement` restricted to the run's records at `steps`, in chunks that stay below
    the databases' limits on bound parameters; each chunk is a few index range lookups.

    On PostgreSQL's partitioned rank_steps a chunk is one UNION ALL of a select per range
    partition, each with only that range's steps and their bounds as constants: each is pruned
    to its partition, whose primary key is then searched for its own steps only (PostgreSQL 15
    would otherwise search every partition for every step of the chunk)."""
    rows: list[Any] = []
    with connection_of(bind) as connection:
        latest = _latest_attempt(connection, run_id)
        spans = _step_ranges(connection, run_id)
        for start in range(0, len(steps), 500):
            selects = [
                statement.where(
                    RankStep.run_id == run_id,
                    RankStep.step.between(min(group), max(group)),
                    RankStep.step.in_(group),
                    latest,
                )
                for group in _by_range(steps[start : start + 500], spans)
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


def _latest_attempt(connection: Any, run_id: str) -> ColumnElement[bool]:
    """LATEST_ATTEMPT, or no condition for a run never restarted (attempt 0): then every record
    is its rank's latest, and skipping the per-record check halves the time of a sampled read."""
    attempt = connection.execute(select(Run.attempt).where(Run.run_id == run_id)).scalar()
    return LATEST_ATTEMPT if attempt else true()


def _last_step(connection: Any, run_id: str) -> int | None:
    """The run's latest step with rank rows. Looked for from its latest rollup on (rank rows may
    be ahead of it, never behind while it has any), so that on PostgreSQL one or two range
    partitions are searched, not every one the run has; from the start without a rollup."""
    statement = select(func.max(RankStep.step)).where(RankStep.run_id == run_id)
    rolled = connection.execute(
        select(func.max(StepRollup.step)).where(StepRollup.run_id == run_id)
    ).scalar()
    if rolled is not None:
        last = connection.execute(statement.where(RankStep.step >= rolled)).scalar()
        if last is not None:
            return last
    return connection.execute(statement).scalar()


def _recent_steps(connection: Any, run_id: str, last_step: int | None, count: int) -> pd.DataFrame:
    """The run's latest `count` steps up to `last_step`, from their rollups: step, mean loss over
    ranks, tokens of all ranks and wall time (the slowest rank's step time)."""
    rows: list[Any] = []
    if last_step is not None:
        rows = connection.execute(
            select(
                StepRollup.step, StepRollup.loss_mean, StepRollup.tokens, StepRollup.step_max
            ).where(
                StepRollup.run_id == run_id,
                StepRollup.step > last_step - count,
                *_latest_rollup(connection, run_id),
            )
        ).all()
    return pd.DataFrame(rows, columns=["step", "loss", "tokens", "wall_s"])


def _latest_rollup(connection: Any, run_id: str) -> list[ColumnElement[bool]]:
    """LATEST_ROLLUP, or no condition for a run never restarted."""
    attempt = connection.execute(select(Run.attempt).where(Run.run_id == run_id)).scalar()
    return [LATEST_ROLLUP] if attempt else []


def _latest_node_attempt(connection: Any, run_id: str) -> list[ColumnElement[bool]]:
    """Only each step's latest attempt's node rows, or no condition for a run never restarted."""
    attempt = connection.execute(select(Run.attempt).where(Run.run_id == run_id)).scalar()
    if not attempt:
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


def _last_loss(steps: pd.DataFrame) -> float:
    return _float(steps.loc[steps["step"].idxmax(), "loss"]) if len(steps) else math.nan


def _status(connection: Any, run_id: str, status: str, attempt: int) -> str:
    """The stored status, or "restarting" while a running run's newest attempt has no record."""
    if status != "running" or attempt == 0:
        return status
    stepping = connection.execute(
        select(exists().where(and_(RankStep.run_id == run_id, RankStep.attempt == attempt)))
    ).scalar()
    return status if stepping else "restarting"


def _open_alerts(connection: Any, run_id: str) -> int:
    """ALERT_KINDS events since the run's latest (re)start event, less the loss spikes the step
    guard found to be the data's (`DATA_SPIKE`): their alert closed itself."""
    started = func.coalesce(
        select(func.max(Event.time))
        .where(Event.run_id == run_id, Event.kind.in_(("run_started", "restart")))
        .scalar_subquery(),
        select(Run.started_at).where(Run.run_id == run_id).scalar_subquery(),
    )
    return int(
        connection.execute(
            select(func.count()).where(
                Event.run_id == run_id,
                Event.kind.in_(ALERT_KINDS),
                Event.time >= started,
                ~data_spike(),
            )
        ).scalar()
        or 0
    )


def _throughput(steps: pd.DataFrame) -> float:
    """Tokens of all ranks over the steps' wall time; NaN without time."""
    seconds = float(steps["wall_s"].sum()) if len(steps) else 0.0
    return float(steps["tokens"].sum()) / seconds if seconds > 0 else math.nan


def _float(value: Any) -> float:
    return math.nan if value is None or pd.isna(value) else float(value)


def live(bind: Bind, run_id: str | None = None) -> bool:
    """Whether `run_id` (any run, when None) is still running, so that a page should refresh."""
    statement = select(exists().where(Run.status == "running"))
    if run_id is not None:
        statement = select(exists().where(Run.status == "running", Run.run_id == run_id))
    with connection_of(bind) as connection:
        return bool(connection.execute(statement).scalar())
