"""Expert load imbalance per step, for each balancing option of the MoE block.

Trains the same MoE model in one process (routing does not depend on the layout: the layout tests
prove every expert-parallel layout routes each token as one process does) and prints, per step,
the imbalance: the busiest expert's routed tokens over the mean, worst layer (1.0 is perfect).
Aux-loss-free balancing nudges a per-expert bias by --bias-update-rate after every step; the
auxiliary loss pushes the router itself.

Run: `.venv/bin/python bench/parallel_expert_load.py [--steps 30] [--bias-update-rate 0.01]`
"""

from __future__ import annotations

import argparse

import torch

from trainer.parallel.probe import config_from_layout, reference

MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--bias-update-rate", type=float, default=1e-2)
    parser.add_argument("--aux-loss-coef", type=float, default=1e-2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    curves = {}
    for balance in ("none", "aux_free", "aux_loss"):
        moe = {
            "n_experts": args.experts,
            "top_k": args.top_k,
            "balance": balance,
            "bias_update_rate": args.bias_update_rate,
            "aux_loss_coef": args.aux_loss_coef,
        }
        cfg = config_from_layout(
            {"name": balance, "model": MODEL | {"moe": moe}, "seq_len": 64, "global_batch": 8}
        )
        curves[balance] = [load.imbalance for load in reference(cfg, args.steps).expert_loads]
    print(f"{args.experts} experts, top-{args.top_k}, {64 * 8} tokens a step: max/mean load")
    print(f"{'step':>5} " + " ".join(f"{b:>9}" for b in curves))
    for step in range(args.steps):
        if step < 3 or (step + 1) % 5 == 0:
            print(f"{step + 1:5d} " + " ".join(f"{c[step]:9.2f}" for c in curves.values()))
    tail = max(1, args.steps // 3)
    print("mean, last third: " + ", ".join(
        f"{b} {sum(c[-tail:]) / tail:.2f}" for b, c in curves.items()
    ))  # fmt: skip


if __name__ == "__main__":
    main()
