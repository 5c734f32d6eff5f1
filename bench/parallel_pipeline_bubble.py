"""The pipeline bubble of each schedule, measured on CPU, next to the formula (p-1)/(m+p-1).

Every pipeline rank adds up the seconds its stages spend computing (forward, backward, weight
backward) during a step's schedule; the rest of the schedule's wall time is its bubble: waiting
for a neighbour's activations or gradients, sends included. The figure is the median over steps of
the mean over ranks. Next to it: the formula, (p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v·m+p-1)
with v stages per rank for Interleaved1F1B (zero-bubble schedules aim at 0 when forward,
input-backward and weight-backward cost the same), and the idle fraction of each multi-stage
schedule's own action table (one slot per action).

Meaningful when every rank has a core of its own (p = 2 on a 2-core machine) and nothing else
runs: other processes stretch both compute and waits.
Run: `.venv/bin/python bench/parallel_pipeline_bubble.py [--pp 2] [--microbatches 4 8]`
"""

from __future__ import annotations

import argparse
import statistics

from trainer.parallel.pipeline import SCHEDULES, expected_bubble
from trainer.parallel.probe import launch

MODEL = {"dim": 128, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4}
MICROBATCH = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    layouts = [
        {"name": f"{schedule} m={m}", "seq_len": args.seq_len, "global_batch": m * MICROBATCH,
         "model": MODEL, "parallel": {"pp": args.pp, "pp_schedule": schedule,
                                      "pp_microbatches": m}}
        for m in args.microbatches
        for schedule in SCHEDULES
    ]  # fmt: skip
    results = launch(args.pp, layouts, args.steps)
    print(f"pp {args.pp}, micro-batches of {MICROBATCH}x{args.seq_len} tokens, {MODEL}")
    print(f"{'schedule':28} {'formula':>8} {'table':>8} {'measured':>9}")
    for layout in layouts:
        r, m = results[layout["name"]], layout["parallel"]["pp_microbatches"]
        schedule = layout["parallel"]["pp_schedule"]
        expected = expected_bubble(schedule, args.pp, m, SCHEDULES[schedule])
        formula = f"{'~0':>8}" if expected is None else f"{expected:8.3f}"
        table = "-" if r["scheduled_bubble"] is None else f"{r['scheduled_bubble']:.3f}"
        measured = statistics.median(r["bubbles"][args.warmup :])
        print(f"{layout['name']:28} {formula} {table:>8} {measured:9.3f}")


if __name__ == "__main__":
    main()
