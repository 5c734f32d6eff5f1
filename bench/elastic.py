"""Elastic jobs: what shrinking costs against a spare taking over, and what a smaller job trains.

In one command, on the debug model with 2 ranks per simulated node:
- the spare path: `scaletrain chaos --nodes 3 --spares 1 --schedule kill-node@S` (a warm spare
  takes the lost node's place);
- the shrink: `scaletrain chaos --nodes 2:3 --schedule lose-node@S` (no spare: the job re-forms
  on the 2 nodes left), and its ratio to the spare path's time from the kill to the first step
  after it (MTTR, from the drills' recovery records; the issue's bound: 1.5);
- throughput: fault-free `scaletrain run` on 3 nodes and on 2 (the same global batch), and
  their ratio, against the ideal 2/3;
- resizes: 4 nodes of one rank with MIN 1, `lose-node` three times and `return-node` twice (4,
  3, 2, 1, 2, 3 ranks), and how many samples of the global order the steps the run kept read
  twice or never (telemetry's per-rank data offsets; the issue's bound: 0 and 0).

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/elastic.py [--steps 60] [--mem-ckpt-every 1]
[--part mttr|throughput|resizes]`.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.app.chaos import ChaosOptions, ChaosReport, chaos, parse_schedule
from scaletrain.app.embedded import RunOptions, run
from scaletrain.app.stack import Workdir
from telemetry import queries
from telemetry.db import reading

PER_NODE = 2
# Divisible by 4 and 6 ranks.
GLOBAL_BATCH = 24


def _drill(
    root: Path, schedule: str, args: argparse.Namespace, ranks: int, **nodes: int
) -> ChaosReport:
    """A drill on the debug model, which must complete."""
    report = chaos(
        ChaosOptions(
            workdir=Workdir(root),
            schedule=parse_schedule(schedule),
            ranks=ranks,
            steps=args.steps,
            ckpt_every=args.ckpt_every,
            trainer_args=args.trainer,
            **nodes,
        ),
        io.StringIO(),
    )
    if not report.completed:
        raise SystemExit(f"the drill {schedule!r} failed; logs in {report.workdir}")
    return report


def _recovery(root: Path, schedule: str, args: argparse.Namespace, **nodes: int) -> dict:
    """The one fault's recovery record of a drill of 2 ranks a node."""
    (record,) = _drill(root, schedule, args, 3 * PER_NODE, **nodes).fault_recoveries
    return record


def _tokens_s(root: Path, nodes: int, args: argparse.Namespace) -> float:
    summary = run(
        RunOptions(
            workdir=Workdir(root),
            ranks=nodes * PER_NODE,
            nodes=nodes,
            steps=args.steps,
            ckpt_every=args.ckpt_every,
            trainer_args=args.trainer,
            upload_wait_s=0,
        ),
        io.StringIO(),
    )
    assert summary.tokens_per_s is not None
    return summary.tokens_per_s


def _resizes(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Three shrinks and two grows: the sizes the kept steps ran at, and the samples read twice
    or never."""
    at = args.fault_step // 4
    schedule = ",".join(
        [f"lose-node@{at * k}" for k in (1, 2, 3)] + [f"return-node@{at * k}" for k in (4, 5)]
    )
    report = _drill(root, schedule, args, 4, nodes=4, min_nodes=1)
    with reading(Workdir(root).db_url) as engine:
        kept = queries.kept_steps(engine, report.run_id)
    consumed = queries.consumed_samples(kept, GLOBAL_BATCH)
    sizes = [len(ranks) for ranks in kept.values()]
    return {
        "schedule": schedule,
        "sizes": [n for i, n in enumerate(sizes) if sizes[i - 1 : i] != [n]],
        "samples_repeated": len(consumed) - len(set(consumed)),
        "samples_skipped": len(set(range(args.steps * GLOBAL_BATCH)) - set(consumed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--mem-ckpt-every", type=int, default=1)
    parser.add_argument("--part", choices=("mttr", "throughput", "resizes"), action="append")
    args = parser.parse_args()
    parts = set(args.part or ("mttr", "throughput", "resizes"))
    args.trainer = ["--global-batch", str(GLOBAL_BATCH)]
    args.trainer += ["--mem-ckpt-every", str(args.mem_ckpt_every)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        root = Path(tmp)
        if "mttr" in parts:
            at = args.fault_step
            spare = _recovery(root / "spare", f"kill-node@{at}", args, nodes=3, spares=1)
            shrink = _recovery(root / "shrink", f"lose-node@{at}", args, nodes=3, min_nodes=2)
            results["spare_mttr_s"], results["shrink_mttr_s"] = spare["mttr_s"], shrink["mttr_s"]
            results["shrink_steps_lost"] = shrink["steps_lost"]
            results["shrink_over_spare"] = round(shrink["mttr_s"] / spare["mttr_s"], 2)
            print(f"kill-node, a spare takes over      MTTR {results['spare_mttr_s']:.2f} s")
            print(
                f"lose-node, the job shrinks to 2/3  MTTR {results['shrink_mttr_s']:.2f} s "
                f"({results['shrink_over_spare']}x the spare path; bound 1.5), "
                f"{results['shrink_steps_lost']} steps lost"
            )
        if "throughput" in parts:
            three = _tokens_s(root / "three", 3, args)
            two = _tokens_s(root / "two", 2, args)
            results["tokens_s_3_nodes"], results["tokens_s_2_nodes"] = round(three), round(two)
            results["throughput_2_over_3"] = round(two / three, 3)
            print(
                f"throughput on 2 nodes / on 3       {results['throughput_2_over_3']} "
                f"({results['tokens_s_2_nodes']:,} / {results['tokens_s_3_nodes']:,} tokens/s; "
                "ideal 0.667)"
            )
        if "resizes" in parts:
            resizes = results["resizes"] = _resizes(root / "resizes", args)
            print(
                f"3 shrinks, 2 grows ({resizes['schedule']}): ranks "
                f"{' -> '.join(map(str, resizes['sizes']))}; samples read twice "
                f"{resizes['samples_repeated']}, never {resizes['samples_skipped']} (bound 0, 0)"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
