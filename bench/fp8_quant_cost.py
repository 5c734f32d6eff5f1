"""What does casting to FP8 cost, next to the matrix product it feeds? One run, on the CPU.

For each recipe, on one linear layer's forward product y = x @ W^T (x: tokens x d, W: d_out x d):
  cast x         what the FP8 linear pays for the activation: amax, scale (from the amax history
                 for delayed scaling), cast, saturation/underflow counts, shape checks
  bare x         the cast alone: dynamic scale, no counts
  cast W         the same for the weight (once per step, amortized over the tokens)
  fp8 product    the product on the path the recipe runs here (scaled_mm, row-wise per block,
                 or emulated), from the FP8 operands
  fp32 product   torch.matmul of the unquantized operands: the product being replaced
and prints the ratios cast/product. Best of --runs each, measured in the same process.

    .venv/bin/python bench/fp8_quant_cost.py [--tokens 4096 --dim 1024 --out-dim 4096]
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from functools import partial

import torch

from trainer.fp8.delayed import AmaxHistory
from trainer.fp8.linear import Caster, Fp8Plan, Gemm
from trainer.fp8.quantize import quantize
from trainer.fp8.recipes import RECIPES, Fp8Recipe, Role


def best_seconds(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up
    return min(timeit.repeat(fn, number=1, repeat=runs))


def measure(
    recipe: Fp8Recipe, x: torch.Tensor, w: torch.Tensor, fp32: float, runs: int
) -> dict[str, object]:
    """Seconds to cast x and W as the FP8 linear does under `recipe`, to multiply them, and the
    ratios; also the bare cast (no delayed history, no counts) for comparison."""
    plan = Fp8Plan(recipe)
    history = AmaxHistory(["bench"], recipe, x.device) if recipe.delayed else None
    caster = Caster("bench", plan, history, 0, x.device)
    cast_x = best_seconds(partial(caster.cast, x, Role.INPUT, (1,), record=True), runs)
    cast_w = best_seconds(partial(caster.cast, w, Role.WEIGHT, (1,), record=True), runs)
    x_block = recipe.block(tuple(x.shape), Role.INPUT, 1)
    bare = partial(
        quantize, x, recipe.forward_format, x_block, power_of_two=recipe.power_of_two_scales
    )
    bare_x = best_seconds(bare, runs)
    (qx,), (qw,) = caster.cast(x, Role.INPUT, (1,), True), caster.cast(w, Role.WEIGHT, (1,), True)
    path = plan.resolve(Gemm.FORWARD, "cpu", torch.float32).path
    product = best_seconds(partial(plan.matmul, Gemm.FORWARD, qx, qw.t(), torch.float32), runs)
    return {
        "path": str(path),
        "cast_x_s": cast_x,
        "bare_quantize_x_s": bare_x,
        "cast_w_s": cast_w,
        "fp8_product_s": product,
        "cast_x_over_fp8_product": round(cast_x / product, 3),
        "cast_x_over_fp32_product": round(cast_x / fp32, 3),
        "cast_w_over_fp32_product": round(cast_w / fp32, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--out-dim", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=5, help="best of this many runs each")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.dim, generator=gen)
    w = torch.randn(args.out_dim, args.dim, generator=gen) * 0.02
    fp32 = best_seconds(lambda: x @ w.t(), args.runs)
    report: dict[str, object] = {
        "shape": f"({args.tokens} x {args.dim}) @ ({args.dim} x {args.out_dim})",
        "threads": torch.get_num_threads(),
        "fp32_product_s": fp32,
    }
    for name, recipe in RECIPES.items():
        report[name] = measure(recipe, x, w, fp32, args.runs)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
