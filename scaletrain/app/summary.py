"""What a run on the embedded stack comes to: the summary `scaletrain run` prints, and the figures
`scaletrain chaos` reports with it.

Read back from telemetry's database (`telemetry.queries`, `telemetry.health`) and from node0's
ckptd listing of the run's checkpoints with every node's part.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from scaletrain.app.stack import Workdir
from scaletrain.names import TIER_NAMES
from scaletrain.v1 import checkpoint_pb2, common_pb2
from telemetry import queries
from telemetry.db import connect
from telemetry.health import run_health


@dataclass(frozen=True)
class Quarantined:
    """A rank the corruption checks named too often (`trainer.health.quarantine`): on machine
    `node`, named at `steps`, and what `policy` did (cordon: its machine taken out)."""

    rank: int
    node: str
    steps: list[int]
    policy: str


@dataclass
class RunSummary:
    run_id: str
    workdir: str
    exit_code: int
    steps: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float | None
    params_sha256: str | None
    wall_s: float
    # Per checkpoint: step, bytes, the tiers holding all of it, and its parts per node (`parts`:
    # node, address, files, bytes, the tiers holding that node's part, reachable, error).
    checkpoints: list[dict[str, object]]
    ui_command: str
    # Run health from telemetry: MFU and what it is relative to, goodput and badput by cause,
    # and how many events of each health kind (straggler, loss_spike, sdc, ...) were recorded.
    mfu: float | None = None
    mfu_label: str = ""
    goodput: float | None = None
    badput_s: dict[str, float] = field(default_factory=dict)
    # What each kind of fault cost (a drill's recovery records), in seconds.
    badput_by_fault_s: dict[str, float] = field(default_factory=dict)
    health_events: dict[str, int] = field(default_factory=dict)
    # Of the loss spikes, those the data caused (their alert closed itself).
    data_spikes: int = 0
    # Ranks the corruption checks quarantined.
    quarantined: list[Quarantined] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def committed_tiers(
    info: checkpoint_pb2.CheckpointInfo | checkpoint_pb2.NodePart | checkpoint_pb2.PartCopy,
) -> list[str]:
    """The tiers on which the answering node (or a node's part) holds a committed copy."""
    return [
        TIER_NAMES[t.tier] for t in info.tiers if t.state == checkpoint_pb2.TIER_STATE_COMMITTED
    ]


def whole_tiers(info: checkpoint_pb2.CheckpointInfo) -> list[str]:
    """The tiers holding the whole checkpoint: memory or SSD when every node's part is there
    (`parts`, from a listing with nodes=True), S3 when its marker is (written once every part
    is). Without parts (a listing of the answering node alone), the answering node's tiers."""
    if not info.parts:
        return committed_tiers(info)
    # A machine that holds no file of it (a spare, a node the run no longer uses) is no part.
    parts = [set(committed_tiers(p)) if p.reachable else set() for p in info.parts if p.files]
    whole = set(committed_tiers(info)) & {TIER_NAMES[common_pb2.TIER_S3]}
    whole |= set.intersection(*parts) if parts else set()
    return [name for name in TIER_NAMES.values() if name in whole]


def checkpoint_row(info: checkpoint_pb2.CheckpointInfo) -> dict[str, object]:
    """A checkpoint as the summaries show it (`RunSummary.checkpoints`)."""
    return {
        "step": info.ref.step,
        "bytes": info.total_bytes,
        "tiers": whole_tiers(info),
        "node_loss_safe": info.node_loss_safe,
        "parts": [
            {
                "node": p.node,
                "address": p.address,
                "files": p.files,
                "bytes": p.bytes,
                "tiers": committed_tiers(p),
                "reachable": p.reachable,
                "error": p.error,
                # Copies of the part on other nodes: node -> its committed tiers.
                "replicas": {c.node: committed_tiers(c) for c in p.replicas},
            }
            for p in info.parts
        ],
    }


def summarize(
    workdir: Workdir, run_id: str, checkpoints: list[checkpoint_pb2.CheckpointInfo], wall: float
) -> RunSummary:
    """The summary of `run_id` after `wall` seconds: its figures and health from telemetry's
    database, and `checkpoints` (from node0's ckptd, with every node's part) as rows."""
    engine = connect(workdir.db_url)
    try:
        stats = queries.run_summary(engine, run_id)
        health = run_health(engine, run_id)
    finally:
        engine.dispose()
    return RunSummary(
        run_id=run_id,
        workdir=str(workdir.root),
        exit_code=0,
        steps=stats.last_step or 0,
        first_loss=_finite(stats.first_loss),
        last_loss=_finite(stats.last_loss),
        tokens_per_s=_finite(stats.tokens_per_s),
        params_sha256=stats.params_sha256 or None,
        wall_s=round(wall, 2),
        checkpoints=[checkpoint_row(c) for c in sorted(checkpoints, key=lambda c: c.ref.step)],
        ui_command=f"scaletrain ui --workdir {workdir.root}",
        mfu=_finite(health.mfu.mfu),
        mfu_label=health.mfu.label,
        goodput=_finite(health.goodput.goodput),
        badput_s={cause: round(s, 3) for cause, s in health.goodput.badput_s.items()},
        badput_by_fault_s={
            kind: round(s, 3) for kind, s in health.goodput.badput_by_fault_s.items()
        },
        health_events=health.event_counts,
        data_spikes=health.data_spikes,
        quarantined=[
            Quarantined(
                rank=f.rank,
                node=f.attributes.get("node", ""),
                steps=[int(s) for s in f.attributes.get("steps", "").split(",") if s],
                policy=f.attributes.get("policy", ""),
            )
            for f in health.quarantined
        ],
    )


def _finite(value: float) -> float | None:
    """None for a figure that is unknown (NaN), so the JSON summary stays valid JSON."""
    return None if math.isnan(value) else value
