"""Elastic jobs: what shrinking costs against a spare taking over, and what a smaller job trains.

In one command, on the debug model with 2 ranks per simulated node:
- the spare path: `scaletrain chaos --nodes 3 --spares 1 --schedule kill-node@S` (a warm spare
  takes the lost node's place);
- the shrink: `scaletrain chaos --nodes 2:3 --schedule lose-node@S` (no spare: the job re-forms
  on the 2 nodes left), and its ratio to the spare path's time from the kill to the first step
  after it (MTTR, from the drills' recovery records; the issue's bound: 1.5);
- throughput: fault-free `scaletrain run` on 3 nodes and on 2 (the same global batch), and
  their ratio, against the ideal 2/3.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/elastic.py [--steps 60] [--mem-ckpt-every 1]`.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.app.chaos import ChaosOptions, chaos, parse_schedule
from scaletrain.app.embedded import RunOptions, run
from scaletrain.app.stack import Workdir

PER_NODE = 2
# Divisible by 4 and 6 ranks.
GLOBAL_BATCH = 24


def _recovery(root: Path, schedule: str, args: argparse.Namespace, **nodes: int) -> dict:
    """The one fault's recovery record of a drill on the debug model."""
    report = chaos(
        ChaosOptions(
            workdir=Workdir(root),
            schedule=parse_schedule(schedule),
            ranks=3 * PER_NODE,
            steps=args.steps,
            ckpt_every=args.ckpt_every,
            trainer_args=args.trainer,
            **nodes,
        ),
        io.StringIO(),
    )
    if not report.completed:
        raise SystemExit(f"the drill {schedule!r} failed; logs in {report.workdir}")
    (record,) = report.fault_recoveries
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--mem-ckpt-every", type=int, default=1)
    args = parser.parse_args()
    args.trainer = ["--global-batch", str(GLOBAL_BATCH)]
    args.trainer += ["--mem-ckpt-every", str(args.mem_ckpt_every)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        root = Path(tmp)
        at = args.fault_step
        spare = _recovery(root / "spare", f"kill-node@{at}", args, nodes=3, spares=1)
        shrink = _recovery(root / "shrink", f"lose-node@{at}", args, nodes=3, min_nodes=2)
        results["spare_mttr_s"], results["shrink_mttr_s"] = spare["mttr_s"], shrink["mttr_s"]
        results["shrink_steps_lost"] = shrink["steps_lost"]
        results["shrink_over_spare"] = round(shrink["mttr_s"] / spare["mttr_s"], 2)
        three = _tokens_s(root / "three", 3, args)
        two = _tokens_s(root / "two", 2, args)
        results["tokens_s_3_nodes"], results["tokens_s_2_nodes"] = round(three), round(two)
        results["throughput_2_over_3"] = round(two / three, 3)
    print(f"kill-node, a spare takes over      MTTR {results['spare_mttr_s']:.2f} s")
    print(
        f"lose-node, the job shrinks to 2/3  MTTR {results['shrink_mttr_s']:.2f} s "
        f"({results['shrink_over_spare']}x the spare path; bound 1.5), "
        f"{results['shrink_steps_lost']} steps lost"
    )
    print(
        f"throughput on 2 nodes / on 3       {results['throughput_2_over_3']} "
        f"({results['tokens_s_2_nodes']:,} / {results['tokens_s_3_nodes']:,} tokens/s; ideal 0.667)"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
