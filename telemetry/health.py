"""The health of one run in one call, for the UI, `scaletrain run`'s summary and users' scripts.

Everything comes from the database (`telemetry.queries` and `telemetry.efficiency`): efficiency
(MFU, goodput), what the detectors found (stragglers, loss spikes, silent data corruption, replays)
and whether telemetry itself lost records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, and_, func, select

from scaletrain.errors import NotFound
from telemetry.efficiency import OTHER_BADPUT, Goodput, Mfu, goodput, mfu
from telemetry.models import Event, RankStep, Run
from telemetry.queries import Bind, connection_of

# A rank the corruption checks named too often (`trainer.health.quarantine`).
QUARANTINE_KIND = "quarantine"
# Kinds of events that say something went wrong with the run's health.
HEALTH_EVENT_KINDS = (
    "straggler",
    "loss_spike",
    "sdc",
    "replay",
    "alert",
    "restart",
    QUARANTINE_KIND,
)
# A loss spike the step guard replayed and found reproduced by the same batch: the data's, not
# the hardware's (its event's `verdict` attribute); reported, never an open alert.
SPIKE_KIND, DATA_VERDICT = "loss_spike", "data"


def data_spike() -> ColumnElement[bool]:
    """Whether an event is a loss spike the data caused (`DATA_VERDICT`)."""
    verdict = func.coalesce(Event.attributes["verdict"].as_string(), "")
    return and_(Event.kind == SPIKE_KIND, verdict == DATA_VERDICT)


@dataclass(frozen=True)
class Finding:
    """One event a detector recorded: at `step`, on `rank` (-1: the whole run)."""

    step: int
    rank: int
    kind: str
    message: str
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunHealth:
    """How run `run_id` is doing, as of its latest records."""

    run_id: str
    status: str
    attempt: int
    # None while no step was recorded.
    last_step: int | None
    mfu: Mfu
    goodput: Goodput
    # Events per kind, for every kind in HEALTH_EVENT_KINDS (0 when none).
    event_counts: dict[str, int]
    # Of the loss spikes, those the data caused (closed as soon as found).
    data_spikes: int
    # Ranks ever flagged as stragglers, nodes ever flagged as slow nodes (their hosts), and the
    # detectors' findings in step order.
    straggler_ranks: list[int]
    slow_nodes: list[str]
    findings: list[Finding]
    # The ranks quarantined (`QUARANTINE_KIND` findings: node, steps and policy attributes).
    quarantined: list[Finding]
    # Records the ranks' telemetry clients dropped (their queues overflowed) and so never arrived.
    dropped_records: int


def run_health(bind: Bind, run_id: str, *, max_findings: int = 200) -> RunHealth:
    """The health of `run_id`; NotFound when no such run was registered."""
    with connection_of(bind) as connection:
        run = connection.execute(
            select(Run.status, Run.attempt).where(Run.run_id == run_id)
        ).first()
        if run is None:
            raise NotFound(f"run {run_id!r} is not registered")
        last_step = connection.execute(
            select(func.max(RankStep.step)).where(RankStep.run_id == run_id)
        ).scalar()
        counts = dict(
            connection.execute(
                select(Event.kind, func.count())
                .where(Event.run_id == run_id, Event.kind.in_(HEALTH_EVENT_KINDS))
                .group_by(Event.kind)
            ).all()
        )
        data_spikes = connection.execute(
            select(func.count()).where(Event.run_id == run_id, data_spike())
        ).scalar()
        rows = connection.execute(
            select(Event.step, Event.rank, Event.kind, Event.message, Event.attributes)
            .where(Event.run_id == run_id, Event.kind.in_(HEALTH_EVENT_KINDS))
            .order_by(Event.step, Event.time, Event.id)
            .limit(max_findings)
        ).all()
        # Each client's count only grows: its latest record per rank and attempt has its total.
        per_client = (
            select(func.max(RankStep.dropped_records).label("dropped"))
            .where(RankStep.run_id == run_id)
            .group_by(RankStep.attempt, RankStep.rank)
            .subquery()
        )
        dropped = connection.execute(select(func.sum(per_client.c.dropped))).scalar() or 0
        efficiency = mfu(connection, run_id)
        time_use = goodput(connection, run_id)
    findings = [
        Finding(step, rank, kind, message, dict(attributes or {}))
        for step, rank, kind, message, attributes in rows
    ]
    return RunHealth(
        run_id=run_id,
        status=run.status,
        attempt=run.attempt,
        last_step=last_step,
        mfu=efficiency,
        goodput=time_use,
        event_counts={kind: counts.get(kind, 0) for kind in HEALTH_EVENT_KINDS},
        data_spikes=int(data_spikes or 0),
        straggler_ranks=sorted({f.rank for f in findings if f.kind == "straggler" and f.rank >= 0}),
        slow_nodes=sorted(
            {f.attributes["node"] for f in findings if f.kind == "straggler" and f.rank < 0}
        ),
        findings=findings,
        quarantined=[f for f in findings if f.kind == QUARANTINE_KIND],
        dropped_records=int(dropped),
    )


def render(health: RunHealth) -> str:
    """A run's health as `telemetry health` prints it: one line a subject, the detectors'
    findings last."""
    g, m = health.goodput, health.mfu
    badput = sorted(((s, c) for c, s in g.badput_s.items() if s >= 0.05), reverse=True)
    lines = [
        f"run          {health.run_id}: {health.status}, attempt {health.attempt}, last step "
        f"{health.last_step if health.last_step is not None else '-'}",
        f"mfu          {m.label}; {m.tokens_per_s:,.0f} tokens/s over {m.steps} steps",
        f"goodput      {g.goodput:.1%} of {g.wall_s:,.1f} s wall ({g.productive_s:,.1f} s "
        "productive)",
        "badput       "
        + (", ".join(f"{cause} {seconds:,.1f} s" for seconds, cause in badput) or "none"),
    ]
    if g.badput_s.get("other", 0.0) > 0:
        lines.append(f"  other      {OTHER_BADPUT}")
    if g.badput_by_fault_s:
        lines.append(
            "faults       "
            + ", ".join(f"{k} {v:,.1f} s" for k, v in sorted(g.badput_by_fault_s.items()))
        )
    counts = health.event_counts
    lines += [
        f"stragglers   {counts['straggler']} event(s); ranks {health.straggler_ranks or 'none'}"
        f", slow nodes {health.slow_nodes or 'none'}",
        f"sdc          {counts['sdc']} event(s); loss spikes {counts['loss_spike']} (of which "
        f"{health.data_spikes} the data's, closed), replays {counts['replay']}, alerts "
        f"{counts['alert']}",
        "quarantine   "
        + (
            "; ".join(
                f"rank {f.rank} ({f.attributes.get('node') or 'host unknown'}) at steps "
                f"{f.attributes.get('steps', '')}: {f.attributes.get('policy', '')}"
                for f in health.quarantined
            )
            or "none"
        ),
        f"recoveries   {counts['restart']} restart(s)"
        + (f"; {len(g.badput_by_fault_s)} fault kind(s) drilled" if g.badput_by_fault_s else ""),
        f"telemetry    {health.dropped_records} record(s) dropped by the ranks' clients",
    ]
    lines += [
        f"  step {f.step:>6} {'rank ' + str(f.rank) if f.rank >= 0 else 'run':>8}  {f.kind}: "
        f"{f.message}"
        for f in health.findings
    ]
    return "\n".join(lines)
