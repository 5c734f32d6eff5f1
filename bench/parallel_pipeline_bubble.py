"""The pipeline bubble of each schedule, measured on CPU, next to the formula (p-1)/(m+p-1).

For p pipeline ranks and m micro-batches, a perfectly filled pipeline would take m·t/p per step,
t being one micro-batch's forward and backward through the whole model, timed here in one process.
The measured bubble is 1 - (m·t/p) / (the pipelined step's median time): idle time plus every
overhead the pipeline adds (sends, the optimizer step). Also printed: the idle fraction of each
multi-stage schedule's own action table (one time unit per action). The formula is
(p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v·m+p-1) with v stages per rank for interleaving;
zero-bubble schedules aim at 0 when forward, input-backward and weight-backward cost the same.

Meaningful only when every rank has a core of its own: p = 2 on a 2-core machine.
Run: `.venv/bin/python bench/parallel_pipeline_bubble.py [--pp 2] [--microbatches 4 8]`
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainer.model.llama import ModelArgs, Transformer, next_token_loss
from trainer.parallel.pipeline import SCHEDULES, bubble_formula
from trainer.parallel.probe import launch

MODEL = {"dim": 128, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4}
MICROBATCH = 2


def microbatch_seconds(seq_len: int, repeats: int = 5) -> float:
    """Median time of one micro-batch's forward and backward through the whole model."""
    torch.set_num_threads(1)
    model = Transformer(ModelArgs(**MODEL))
    model.init_weights(0)
    tokens = torch.randint(0, 256, (MICROBATCH, seq_len + 1))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


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
    t = microbatch_seconds(args.seq_len)
    print(f"pp {args.pp}, micro-batch of {MICROBATCH}x{args.seq_len} tokens: {t * 1e3:.1f} ms "
          "forward+backward through the whole model in one process")  # fmt: skip
    print(f"{'schedule':28} {'formula':>8} {'table':>8} {'measured':>9}")
    for layout in layouts:
        r, m = results[layout["name"]], layout["parallel"]["pp_microbatches"]
        schedule = layout["parallel"]["pp_schedule"]
        measured = 1 - (m * t / args.pp) / statistics.median(r["step_seconds"][args.warmup :])
        formula = (
            f"{bubble_formula(args.pp, m, SCHEDULES[schedule]):8.3f}"
            if "ZeroBubble" not in schedule and schedule != "DualPipeV"
            else f"{'~0':>8}"
        )
        table = "-" if r["scheduled_bubble"] is None else f"{r['scheduled_bubble']:.3f}"
        print(f"{layout['name']:28} {formula} {table:>8} {measured:9.3f}")


if __name__ == "__main__":
    main()
