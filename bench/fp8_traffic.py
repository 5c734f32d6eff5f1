"""How many bytes do FP8 casts add to a compiled training step? Inductor's own plan, on a CPU.

FP8 products run at about twice bf16's rate, but each cast reads a tensor and writes its FP8
copy (and transposed copies for the backward products): memory-bound kernels, the part of an FP8
step that does not speed up. Where the GPU is not at hand, what those kernels move can still be
read off torch.compile: its scheduler estimates the bytes every kernel it generates reads and
writes (`GraphLowering.count_bytes`, logged under `inductor_metrics`). This script compiles one
transformer block of the trainer's model (forward and backward, compiled as the trainer's
--compile and bench/fp8_gpu.py compile it) per configuration and sums the bytes of the fused,
generated kernels; GEMMs, attention and other library calls are left out, they are the same or
faster in FP8:

  bf16                   no FP8
  naive                  the per-tensor FP8 linear of ../shared/bench/h200_baseline.py (amax,
                         scale, cast per use; fast accumulation forward), which trained an
                         8B-shaped model 1.27x faster than bf16 on an H200
  <recipe>               ours, on a step that counts lost values and on one that does not
                         (a run counts one step in --fp8-count-every, 10 by default)

and prints, for each, the bytes FP8 adds over bf16 as a ratio to what the naive linear adds.
Products are planned as on Hopper: `aten::_scaled_mm` and `_scaled_mm_v2` run on
bench/fp8_hopper.py's stand-ins in this process (what torch accepts on an H200, computed exactly;
their bytes are not counted, and some CPUs run E4M3 per tensor with a reference kernel ~500x
slower), so every recipe's probe picks the path it picks on an H200. A CPU's generated kernels
are not a GPU's, but both come from the same scheduler and fusion rules; the kernel counts are
printed beside the bytes.

    .venv/bin/python bench/fp8_traffic.py [--dims 1024,512,1,8,2,1792,2,512] [--recipes ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import torch._inductor.metrics as inductor_metrics
import torch.nn.functional as F
from torch import nn
from torch._inductor import compile_fx
from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8_hopper
from fp8_gpu import model_args

from trainer.fp8 import convert_to_fp8, make_recipe
from trainer.fp8.recipes import RECIPES
from trainer.model.llama import Transformer
from trainer.parallel.compile import apply_compile

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _NaiveFp8Matmul(torch.autograd.Function):
    """The shared baseline's FP8 linear: each operand scaled by its own amax, cast, multiplied."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xq, xs = _naive_cast(x, E4M3)
        wq, ws = _naive_cast(w, E4M3)
        ctx.save_for_backward(xq, xs, wq, ws)
        return torch._scaled_mm(xq, wq.t(), xs, ws, out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = _naive_cast(grad, E5M2)
        grad_x = torch._scaled_mm(gq, wq.t().contiguous().t(), gs, ws, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(
            gq.t().contiguous(), xq.t().contiguous().t(), gs, xs, out_dtype=grad.dtype
        )
        return grad_x, grad_w


def _naive_cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.finfo(dtype).max
    scale = top / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


class NaiveFp8Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _NaiveFp8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight)
        return y.reshape(*x.shape[:-1], self.out_features)


def use_naive_fp8(model: Transformer) -> None:
    """Every linear of the blocks (not the output head) becomes the baseline's FP8 linear."""
    for block in model.layers.values():
        for name, linear in list(block.named_modules()):
            if type(linear) is nn.Linear:
                parent, _, child = name.rpartition(".")
                naive = NaiveFp8Linear(linear.in_features, linear.out_features, bias=False)
                naive.weight = linear.weight
                block.get_submodule(parent).register_module(child, naive)


def step_traffic(dims: list[int], config: str, counting: bool) -> dict[str, float | int]:
    """Bytes and kernels of one compiled block's forward and backward under `config`."""
    vocab, dim, layers, heads, kv, ffn, batch, seq = dims
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Transformer(model_args(vocab, dim, layers, heads, kv, ffn, seq)).to(torch.bfloat16)
    fp8 = None
    if config == "naive":
        use_naive_fp8(model)
    elif config != "bf16":
        fp8 = convert_to_fp8(model, make_recipe(config))
    tokens = torch.randint(0, vocab, (batch, seq))

    def step() -> None:
        F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()).backward()
        model.zero_grad(set_to_none=True)

    step()  # eager: delayed scaling then plans with a history, as from a run's second step on
    if fp8 is not None:
        fp8.plan.counting = counting
    apply_compile(model)
    inductor_metrics.reset()
    step()
    fused = [
        elements
        for node, elements in inductor_metrics.nodes_num_elem
        if not isinstance(node, ExternKernelSchedulerNode | NopKernelSchedulerNode)
    ]
    return {"mb": round(sum(fused) * 4 / layers / 1e6, 3), "kernels": len(fused) // layers}


def count_inductor_bytes() -> None:
    """Make inductor count every graph's bytes (it does when its metrics log is on), quietly, and
    compile every graph afresh (a cached graph is not counted)."""
    torch._logging.set_logs(inductor_metrics=True)
    compile_fx.inductor_metrics_log.propagate = False
    compile_fx.inductor_metrics_log.handlers = [logging.NullHandler()]
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dims",
        default="1024,512,1,8,2,1792,2,512",
        help="V,d,L,heads,kv_heads,ffn,batch,seq (default: the 8B shape's ratios, smaller)",
    )
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    dims = [int(n) for n in args.dims.split(",")]
    count_inductor_bytes()
    hopper = fp8_hopper.install_on_cpu()  # noqa: F841 (its kernels live as long as it does)
    report: dict[str, dict[str, float | int]] = {}
    for config, counting in [
        ("bf16", False),
        ("naive", False),
        *((r, c) for r in args.recipes.split(",") for c in (True, False)),
    ]:
        name = config if config in ("bf16", "naive") else f"{config} counting={counting}"
        report[name] = step_traffic(dims, config, counting)
        print(f"{name:34s} {report[name]['mb']:9.3f} MB  {report[name]['kernels']:4d} kernels")
    bf16, naive = report["bf16"]["mb"], report["naive"]["mb"]
    for name, figures in report.items():
        if name != "bf16":
            figures["fp8_bytes_over_naive"] = round((figures["mb"] - bf16) / (naive - bf16), 3)
    print("per block, fused kernels of one step (fwd+bwd); fp8_bytes_over_naive: bytes added "
          "over bf16, relative to the naive FP8 linear's")  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
