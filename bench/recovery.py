"""Today's cold restart, measured from the recovery records: the baseline later recovery work is
compared against.

One short `scaletrain chaos --nodes 2` drill per fault kind that restarts the job (kill-rank,
stop-rank, kill-node; the debug model on 4 ranks over 2 simulated nodes, one fault each), then
the default chaos schedule (`DEFAULT_SCHEDULE`, every kind of fault over 400 steps, with one hot
spare as the issue's setup has it), and with `--node-every-90s STEPS` a job that loses a node
every 90 s with one spare. Each figure
comes from the drill's recovery record of its fault (`scaletrain.app.recovery`): the time from
the strike to the first completed step after it (MTTR), when the job saw it, the steps computed
again, the bytes its restore read from each tier (memory, SSD, S3); and, for the default
schedule, its goodput, its effective training time and what each kind of fault cost.

The first table is the cold restart as it was before this work (`--in-job-restarts 0` and
torchrun's `PET_START_METHOD=spawn`: torchrun restarts every rank, a new interpreter each, which
imports the trainer again and reads its state back; a lost node waits for a new machine).
The second runs kill-rank and stop-rank again with the in-job restart (the default: each rank's
keeper forks it again, `trainer.keeper`), with its MTTR's ratio to the cold one's. The third runs
kill-node and kill-node-mid-save with one hot spare (`--spares 1`: a warm machine takes the lost
node's place), in the same command, with its MTTR's ratio to the cold kill-node's.
`--mem-ckpt-every K` runs every drill but the baseline with a memory checkpoint every K steps
(each rank's own memory and a peer node's: at most K steps lost).
Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/recovery.py [--steps 30] [--no-default]
[--mem-ckpt-every K] [--workdir DIR]`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletrain.app.chaos import DEFAULT_SCHEDULE, ChaosOptions, ChaosReport, chaos, parse_schedule
from scaletrain.app.stack import Workdir

KINDS = ("kill-rank", "stop-rank", "kill-node")
# The rank faults again, restarted in-job.
IN_JOB_KINDS = ("kill-rank", "stop-rank")
# The trainer flag of the cold restart: torchrun restarts every rank.
COLD = ["--in-job-restarts", "0"]
# The node faults again, with a hot spare.
SPARE_KINDS = ("kill-node", "kill-node-mid-save")
# A cluster's failures: a node lost every 90 seconds for as long as the job runs.
NODE_EVERY_90S = "kill-node@every90s"
# What a restore reads from, as the recovery records name it: the ranks' own copies, then
# ckptd's tiers.
TIERS = ("own memory", "peer memory", "memory", "SSD", "S3")


def drill(
    root: Path,
    schedule: str,
    args: argparse.Namespace,
    steps: int,
    spares: int = 0,
    cold: bool = False,
) -> ChaosReport:
    """The drill of `schedule` on the debug model (with `spares` hot spares; `cold`: without
    in-job restarts), which must complete."""
    options = ChaosOptions(
        workdir=Workdir(root),
        schedule=parse_schedule(schedule),
        ranks=args.ranks,
        nodes=2,
        spares=spares,
        steps=steps,
        ckpt_every=args.ckpt_every,
        trainer_args=args.trainer
        + (COLD if cold else ["--mem-ckpt-every", str(args.mem_ckpt_every)]),
    )
    with _cold_start(cold):
        report = chaos(options, io.StringIO())
    if not report.completed:
        raise SystemExit(f"the drill {schedule!r} failed; logs in {report.workdir}")
    return report


@contextlib.contextmanager
def _cold_start(cold: bool) -> Iterator[None]:
    """With `cold`, every rank a new interpreter (torchrun's start method `spawn`, which the
    launchers' agents otherwise replace with forks of a warm process)."""
    if not cold:
        yield
        return
    os.environ["PET_START_METHOD"] = "spawn"
    try:
        yield
    finally:
        del os.environ["PET_START_METHOD"]


def figures(report: ChaosReport) -> dict[str, Any]:
    """The drill's one fault's recovery, as the table shows it."""
    (record,) = report.fault_recoveries
    tiers: dict[str, int] = record["bytes_per_tier"]
    detected = record["detected_at"]
    return {
        "mttr_s": record["mttr_s"],
        "detected_s": None if detected is None else round(detected - record["injected_at"], 2),
        "steps_lost": record["steps_lost"],
        "badput_s": record["badput_s"],
        "spare": record["spare"],
        "in_job": record["in_job"],
        **{f"{tier}_mb": round(tiers.get(tier, 0) / 1e6, 3) for tier in TIERS},
    }


def whole(report: ChaosReport) -> dict[str, Any]:
    """A whole drill's figures: goodput, effective training time, and the cost of each kind."""
    return {
        "goodput": report.goodput,
        "effective_training": report.effective_training,
        "wall_s": report.wall_s,
        "faults": report.faults_injected,
        "badput_by_fault_s": report.badput_by_fault_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="steps of each one-fault drill")
    parser.add_argument("--fault-step", type=int, default=12)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--no-default", action="store_true", help="skip the default schedule")
    parser.add_argument(
        "--mem-ckpt-every",
        type=int,
        default=0,
        metavar="K",
        help="a memory checkpoint every K steps in every drill but the cold baseline (0: none)",
    )
    parser.add_argument(
        "--node-every-90s",
        type=int,
        default=0,
        metavar="STEPS",
        help="also a job of STEPS steps that loses a node every 90 s, with one spare (0: none)",
    )
    parser.add_argument(
        "--workdir", type=Path, help="keep each drill's workdir (logs, telemetry) under this"
    )
    parser.add_argument(
        "--trainer", nargs=argparse.REMAINDER, default=[], help="trainer flags (default: debug)"
    )
    args = parser.parse_args()
    rows: dict[str, dict[str, Any]] = {}
    in_job: dict[str, dict[str, Any]] = {}
    spared: dict[str, dict[str, Any]] = {}
    result: dict[str, Any] = {"cold_restart": rows, "in_job_restart": in_job, "one_spare": spared}
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        root = args.workdir or Path(tmp)
        for kind in KINDS:
            report = drill(root / kind, f"{kind}@{args.fault_step}", args, args.steps, cold=True)
            rows[kind] = figures(report)
        for kind in IN_JOB_KINDS:
            report = drill(root / f"{kind}-in-job", f"{kind}@{args.fault_step}", args, args.steps)
            in_job[kind] = figures(report)
            in_job[kind]["mttr_vs_cold"] = round(in_job[kind]["mttr_s"] / rows[kind]["mttr_s"], 3)
        for kind in SPARE_KINDS:
            report = drill(root / f"{kind}-spare", f"{kind}@{args.fault_step}", args, args.steps, 1)
            spared[kind] = figures(report)
            spared[kind]["mttr_vs_cold"] = round(
                spared[kind]["mttr_s"] / rows["kill-node"]["mttr_s"], 3
            )
        if not args.no_default:
            report = drill(root / "default", DEFAULT_SCHEDULE, args, 400, 1)
            result["default_schedule"] = whole(report)
        if args.node_every_90s:
            report = drill(root / "every-90s", NODE_EVERY_90S, args, args.node_every_90s, 1)
            result["node_every_90s"] = whole(report)
    columns = (
        "MTTR s", "seen s", "lost", "cost s", "spare", "in-job", *(f"{tier} MB" for tier in TIERS)
    )  # fmt: skip
    tables = (
        ("cold restart (baseline)", rows), ("in-job restart", in_job), ("one hot spare", spared)
    )  # fmt: skip
    for title, table in tables:
        extra = ("÷ cold",) if table is not rows else ()
        print(f"{title:<24}" + "".join(f"{c:>10}" for c in (*columns, *extra)))
        for kind, row in table.items():
            print(f"{kind:<24}" + "".join(f"{v!s:>10}" for v in row.values()))
    for name in ("default_schedule", "node_every_90s"):
        if name in result:
            drilled = result[name]
            print(
                f"{name.replace('_', ' ')}, 1 spare: goodput {drilled['goodput']:.3f}, effective "
                f"training {drilled['effective_training']}, {drilled['faults']} faults in "
                f"{drilled['wall_s']} s"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
