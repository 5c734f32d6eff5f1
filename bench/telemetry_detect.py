"""Does scoring stragglers and rolling a step up cost O(ranks) with a small constant?

For 512 to 65,536 ranks on nodes of 8, in this process, per step (best of a few runs of
`--steps` steps each): the straggler detector's `observe` (every rank's relative and individual
score, the per-node roll-up, the flags), and the step's rollup (`telemetry.rollup.summarise`:
13 metrics' min, median, p99 and max across ranks, the slowest ranks, every node's worst rank),
each beside a baseline run on the same array in the same command: `np.median` of the step's
compute times (one O(n) pass, the least a score relative to the median can cost). It prints
microseconds per step, nanoseconds per rank and the ratio to the baseline; a constant
nanoseconds-per-rank from 512 to 65,536 ranks is O(ranks).

    OMP_NUM_THREADS=1 .venv/bin/python bench/telemetry_detect.py [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime

import numpy as np

from telemetry.detect import StragglerDetector
from telemetry.ingest import STEP_COLUMNS
from telemetry.rollup import NodeMap, summarise


def best_seconds(work: Callable[[int], object], steps: int, runs: int = 3) -> float:
    """Best over `runs` of the mean seconds of `work(step)` over `steps` steps."""
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        for step in range(1, steps + 1):
            work(step)
        best = min(best, (time.perf_counter() - started) / steps)
    return best


def rows_of(ranks: int, compute: np.ndarray) -> list[tuple[object, ...]]:
    """One step's rows in STEP_COLUMNS order (built before the clock starts)."""
    now = datetime(2026, 12, 1, tzinfo=UTC)
    template = dict.fromkeys(STEP_COLUMNS, 0.0)
    template.update(run_id="bench", step=1, attempt=0, time=now, param_checksum="", tokens=8192)
    rows = []
    for rank in range(ranks):
        values = {**template, "rank": rank, "compute_s": float(compute[rank]), "step_s": 2.0,
                  "loss": 2.0 + compute[rank], "grad_norm": 1.0}  # fmt: skip
        rows.append(tuple(values[column] for column in STEP_COLUMNS))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--ranks", default="512,4096,16384,65536")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    report = {}
    for ranks in map(int, args.ranks.split(",")):
        nodes = NodeMap.of_hosts(ranks, {r: f"node-{r // 8:05d}" for r in range(ranks)})
        work = 1.2 * (1 + 0.02 * rng.random(ranks))
        work[ranks // 3] *= 1.6
        work[ranks // 2 : ranks // 2 + 8] *= 1.5
        detector = StragglerDetector(nodes)
        rows = rows_of(ranks, work)
        baseline = best_seconds(lambda _, w=work: np.median(w), args.steps)
        scoring = best_seconds(lambda step, d=detector, w=work: d.observe(step, w), args.steps)
        rollup = best_seconds(
            lambda step, r=rows, n=nodes: summarise("bench", 0, step, r, n), 3, runs=2
        )
        report[f"{ranks} ranks"] = {
            "baseline_np_median_us": round(baseline * 1e6, 1),
            "scoring_us_per_step": round(scoring * 1e6, 1),
            "scoring_ns_per_rank": round(scoring / ranks * 1e9, 1),
            "ratio_scoring_to_baseline": round(scoring / baseline, 2),
            "rollup_ms_per_step": round(rollup * 1e3, 2),
            "rollup_ns_per_rank": round(rollup / ranks * 1e9, 1),
            "ratio_rollup_to_baseline": round(rollup / baseline, 1),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
