"""`chaos`: the drill run from start to end, and what it reports (`ChaosReport`).

It checks the schedule against the job (nodes, spares, an elastic job, the last step), starts the
embedded stack (on a small tmpfs for the SSD tier when a fault fills the disk), trains with the
drill striking its schedule, and reports what survived: the faults, the committed checkpoints
(lost or not), the restarts and steps replayed, each fault's recovery and the run's goodput.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import IO

from scaletrain.app.chaos.disk import small_disk, ssd_dir
from scaletrain.app.chaos.drill import ChaosOptions, Drill
from scaletrain.app.chaos.faults import FAULTS, restart_budget
from scaletrain.app.chaos.watch import _Tap, intact, wait_on_s3
from scaletrain.app.embedded import check_sizes, new_run_id
from scaletrain.app.recovery import Timeline
from scaletrain.app.stack import Stack, check_nodes
from scaletrain.app.summary import summarize
from scaletrain.errors import UserError
from telemetry import queries
from telemetry.db import connect

# A drill's phase without progress this long fails a rank (the trainer's default is for real
# runs; options given to the drill come later and win).
DRILL_WATCHDOG_MIN_S = 10.0


@dataclass
class ChaosReport:
    run_id: str
    workdir: str
    completed: bool
    exit_code: int
    faults_scheduled: int
    faults_injected: int
    faults_survived: int
    checkpoints_committed: int
    # Checkpoints seen committed that can no longer be restored (a fault lost them); those
    # kill-node-mid-save struck before their parts had copies are `lost_with_node` instead.
    checkpoints_lost: list[int]
    restarts: int
    steps_replayed: int
    steps_replayed_in_place: int
    goodput: float | None
    badput_s: dict[str, float]
    last_loss: float | None
    params_sha256: str | None
    wall_s: float
    faults: list[dict[str, object]]
    # The run's checkpoints at the end: step, bytes, the tiers that hold it.
    checkpoints: list[dict[str, object]]
    # Each restart's restore: the step it resumed from and the bytes it read from each copy
    # ("memory@node0", "SSD@node1" (a node's own part or a replica it holds), "S3").
    recoveries: list[dict[str, object]] = field(default_factory=list)
    lost_with_node: list[int] = field(default_factory=list)
    # Each injected fault's recovery record (`scaletrain.app.recovery.Recovery`), in order.
    fault_recoveries: list[dict[str, object]] = field(default_factory=list)
    # What each kind of fault cost, from telemetry's goodput (the sum of its records' badput_s).
    badput_by_fault_s: dict[str, float] = field(default_factory=dict)
    # The time in steps that were kept over the job's wall time (None: no wall time).
    effective_training: float | None = None
    # Ranks the corruption checks quarantined (`scaletrain.app.summary.Quarantined`).
    quarantined: list[dict[str, object]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def chaos(options: ChaosOptions, out: IO[str]) -> ChaosReport:
    """Run the drill; the job's output goes to `out`."""
    if options.ranks < 2:
        raise UserError(f"--ranks must be at least 2 for a drill, got {options.ranks}")
    check_nodes(options.ranks, options.nodes, options.spares, min_nodes=options.min_nodes)
    elastic = sorted({f.kind for f in options.schedule if FAULTS[f.kind].elastic})
    if elastic and not options.min_nodes < options.nodes:
        raise UserError(
            f"--schedule: {', '.join(elastic)} needs an elastic job, --nodes MIN:MAX with MIN "
            "below MAX"
        )
    lonely = sorted({f.kind for f in options.schedule if FAULTS[f.kind].min_nodes > options.nodes})
    if lonely:
        raise UserError(f"--schedule: {', '.join(lonely)} needs --nodes 2 or more")
    spared = sorted(
        {f.kind for f in options.schedule if FAULTS[f.kind].min_spares > options.spares}
    )
    if spared:
        raise UserError(f"--schedule: {', '.join(spared)} needs --spares 1 or more")
    if any(f.kind == "flaky-node" for f in options.schedule) and not options.cordon_after:
        raise UserError("--schedule: flaky-node needs --cordon-after 1 or more (0 never cordons)")
    late = [f"{f.kind}@{f.step}" for f in options.schedule if f.step >= options.steps]
    if late:
        raise UserError(f"--schedule: {', '.join(late)} at or after the last step {options.steps}")
    workdir = options.workdir
    run_id = new_run_id()
    max_restarts = restart_budget(options)
    trainer_args = [
        "--steps", str(options.steps), "--ckpt-every", str(options.ckpt_every),
        "--log-every", "1", "--watchdog-min-s", str(DRILL_WATCHDOG_MIN_S),
        "--heartbeat-s", "2", *options.trainer_args,
    ]  # fmt: skip
    check_sizes(trainer_args, options.ranks, options.nodes, options.min_nodes)
    started = time.monotonic()
    workdir.create()
    disk = (
        small_disk(ssd_dir(workdir), options.ssd_mb)
        if any(FAULTS[f.kind].fills_disk for f in options.schedule)
        else contextlib.nullcontext()
    )
    # ckptd retries S3 soon after an outage ends; S3 keeps every checkpoint, so none may vanish.
    ckptd_args = ("--s3-backoff-max-s", "2", "--s3-every", "1")
    stack = Stack(
        workdir,
        ckptd_args=ckptd_args,
        nodes=options.nodes,
        spares=options.spares,
        cordon_after=options.cordon_after,
        min_nodes=options.min_nodes,
        capacity_wait_s=options.capacity_wait_s,
        secure=options.secure,
    )
    with disk, stack:
        workdir.remember_run(run_id)
        print(
            f"[chaos] run {run_id}: {len(options.schedule)} faults scheduled, up to "
            f"{max_restarts} restarts; logs in {workdir.logs}"
            + (f"; {options.nodes} nodes" if options.nodes > 1 else "")
            + (f" and {options.spares} spare(s)" if options.spares else ""),
            file=out,
            flush=True,
        )
        tap = _Tap(out)
        drill = Drill(stack, options, run_id, tap)
        try:
            try:
                code = stack.train(
                    run_id,
                    options.ranks,
                    trainer_args + drill.trainer_args(),
                    tap,
                    max_restarts,
                    on_start=drill.start,
                )
            finally:
                drill.finish()
            # After a failure, only what is committed now: nothing will upload any more.
            checkpoints = wait_on_s3(
                stack.ckptd_address, run_id, 120.0 if code == 0 else 0.0, drill.security
            )
            final = {c.ref.step for c in intact(checkpoints)}
            engine = connect(workdir.db_url)
            try:
                records = drill.recovery_records(engine)
            finally:
                engine.dispose()
        finally:
            drill.close()
    summary = summarize(workdir, run_id, checkpoints, time.monotonic() - started)
    engine = connect(workdir.db_url)
    try:
        replays = queries.replays(engine, run_id)
        recoveries = [asdict(r) for r in queries.restarts(engine, run_id)]
    finally:
        engine.dispose()
    effective = Timeline(tap.stamped()).effective_training(
        drill.started_at, drill.ended_at or time.time()
    )
    completed = code == 0
    return ChaosReport(
        run_id=run_id,
        workdir=str(workdir.root),
        completed=completed,
        exit_code=code,
        faults_scheduled=len(options.schedule),
        faults_injected=len(drill.injected),
        faults_survived=len(drill.injected) if completed else 0,
        checkpoints_committed=len(drill.committed | final),
        checkpoints_lost=sorted(drill.committed - final - drill.lost_with_node),
        lost_with_node=sorted(drill.lost_with_node - final),
        restarts=replays.restarts,
        steps_replayed=replays.steps_after_restarts,
        steps_replayed_in_place=replays.steps_in_place,
        goodput=summary.goodput,
        badput_s=summary.badput_s,
        last_loss=summary.last_loss,
        params_sha256=summary.params_sha256,
        wall_s=round(time.monotonic() - started, 2),
        faults=[asdict(i) for i in drill.injected],
        checkpoints=summary.checkpoints,
        recoveries=recoveries,
        fault_recoveries=[asdict(r) for r in records],
        badput_by_fault_s=summary.badput_by_fault_s,
        effective_training=None if effective is None else round(effective, 4),
        quarantined=[asdict(q) for q in summary.quarantined],
    )
