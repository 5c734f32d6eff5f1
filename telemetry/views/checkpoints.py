"""The run health page's views of checkpoints: their timeline, where each node's part and its
peers' copies are held, and where each rank resumes."""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd
from sqlalchemy import ColumnElement, case, func, select

from scaletrain.names import TIER_NAMES
from scaletrain.v1 import common_pb2
from telemetry.models import TRAINER_TIER, WHOLE_TIER, Checkpoint, Event, RankStep
from telemetry.queries import Bind, connection_of
from telemetry.views.common import COMMITTED, as_float, latest_attempt

# Storage tiers, fastest first, as telemetry stores them.
TIERS = tuple(TIER_NAMES.values())
# The tiers of one node (its memory and SSD), where its part and its peers' replicas live.
NODE_TIERS = (TIER_NAMES[common_pb2.TIER_MEMORY], TIER_NAMES[common_pb2.TIER_SSD])
TIMELINE_COLUMNS = [
    "step", "started_at", "blocking_s", "background_s", "tiers", "failed_tiers", "nodes",
    *(f"{tier}_bytes" for tier in TIERS),
]  # fmt: skip
PART_COLUMNS = ["step", "tier", "node", "bytes", "committed_at"]
COPY_COLUMNS = ["step", "copies", "node_loss_safe"]
OFFSET_COLUMNS = ["rank", "global_sample", "rank_sample", "epoch"]
# The most nodes the checkpoint timeline names on one tier; beyond, it counts them.
NAMED_NODES = 8


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
                "blocking_s": as_float(trainer.seconds if trainer is not None else None),
                "background_s": as_float(background.get(step)),
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
                latest_attempt(connection, run_id),
            )
            .order_by(RankStep.rank)
        ).all()
    return int(step), pd.DataFrame(rows, columns=OFFSET_COLUMNS)
