"""Tokens/s of each parallel layout on CPU, relative to pure data parallelism at equal world size.

One torchrun job per world size runs every layout on the same model, global batch and data
(`trainer.parallel.probe`); a layout's figure is its median step time after warm-up. MoE layouts
are compared with pure data parallelism of the same MoE model. On CPU (gloo, every rank sharing
the machine's cores) the ratios measure what each parallelism's communication and bookkeeping
cost, not the speed-ups they bring on GPUs, where TP, CP, PP and EP exist to fit models and
sequences that data parallelism alone cannot.

Run: `.venv/bin/python bench/parallel_layouts.py [--world 4|8] [--steps 8] [--warmup 3]`
"""

from __future__ import annotations

import argparse
import statistics

from trainer.parallel.probe import launch

DENSE = {"dim": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4}
MOE = DENSE | {"moe": {"n_experts": 8, "top_k": 2, "n_shared": 1}}
LAYOUTS = {
    4: {
        "dp4": ({}, DENSE),
        "hsdp 2x2": ({"dp_replicate": 2}, DENSE),
        "dp2.tp2": ({"tp": 2}, DENSE),
        "pp2.dp2 1F1B": ({"pp": 2}, DENSE),
        "cp2.tp2": ({"cp": 2, "tp": 2}, DENSE),
        "dp4 + activation checkpointing": ({"activation_checkpointing": True}, DENSE),
        "dp4 MoE": ({}, MOE),
        "ep2-in-dp4 MoE": ({"ep": 2}, MOE),
    },
    8: {
        "dp8": ({}, DENSE),
        "dp2.tp2.pp2": ({"tp": 2, "pp": 2}, DENSE),
        "dp2.cp2.tp2": ({"cp": 2, "tp": 2}, DENSE),
        "dp8 MoE": ({}, MOE),
        "ep2-in-dp2.tp2.pp2 MoE": ({"tp": 2, "pp": 2, "ep": 2}, MOE),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=sorted(LAYOUTS), default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    table = LAYOUTS[args.world]
    layouts = [
        {"name": name, "parallel": parallel, "model": model, "seq_len": args.seq_len,
         "global_batch": args.global_batch}
        for name, (parallel, model) in table.items()
    ]  # fmt: skip
    results = launch(args.world, layouts, args.steps)
    tokens = args.seq_len * args.global_batch
    rates = {
        name: tokens / statistics.median(r["step_seconds"][args.warmup :])
        for name, r in results.items()
    }
    dense_dp, moe_dp = next(iter(table)), next(n for n in table if n.endswith("MoE"))
    print(f"world {args.world}, {tokens} tokens a step, median of {args.steps - args.warmup} steps")
    print(f"{'layout':34} {'tokens/s':>10} {'vs pure DP':>10}")
    for name, rate in rates.items():
        base = rates[moe_dp if name.endswith("MoE") else dense_dp]
        print(f"{name:34} {rate:10,.0f} {rate / base:10.2f}")


if __name__ == "__main__":
    main()
