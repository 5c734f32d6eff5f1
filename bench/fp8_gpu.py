"""Tokens/s of bf16 and of every FP8 recipe on one GPU, eager and compiled, side by side with the
shared baseline (its bf16 and naive per-tensor FP8 step) run in the same command.

    python bench/fp8_gpu.py                    # 8B-shaped layers: d=4096, ffn 14336, 8 layers,
                                               # seq 8192, and ../shared/bench/h200_baseline.py
    python bench/fp8_gpu.py --device cpu --dims 256,128,2,4,4,384,2,128 --steps 2 --baseline ""
                                               # the tiny check that the script runs on a CPU
    python bench/fp8_gpu.py --profile ...      # and where each step's time goes, by kind of
                                               # kernel: FP8 and bf16 GEMMs, attention, fused
                                               # (quantization, norms) kernels, the rest

DIMS is V,d,L,heads,kv_heads,ffn,batch,seq. Each configuration trains the trainer's own model
(bf16 parameters and AdamW, as the baseline does) for --steps timed steps after three warm-up
steps; compiled runs compile each transformer block, as the baseline does. FP8 runs count lost
values on one step in ten, as the trainer does by default (--fp8-count-every). The GEMM path of
every FP8 product is reported with the figures. Results also go to $OUT/fp8_gpu.json.
With --profile, one more step of each configuration runs under torch.profiler after the timed ones
(the GPU is shared by nothing else, so one step is representative): what separates a recipe from
bf16 then reads off directly, e.g. the milliseconds its casts cost next to what its GEMMs saved.
Targets (issue 4): per-tensor FP8 >= 1.35x bf16 and blockwise >= 1.2x, compiled.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.config import TrainConfig
from trainer.fp8 import convert_to_fp8, make_recipe
from trainer.fp8.recipes import RECIPES
from trainer.model.llama import ModelArgs, Transformer
from trainer.parallel.compile import apply_compile

# Kinds of work a step's kernels are counted under, by the name of the operator that launched
# them; the first pattern found in the (lower-case) name wins.
KINDS = (
    ("fp8 gemm", ("_scaled_mm",)),
    ("attention", ("attention", "flash", "sdpa")),
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")),
    ("fused reduction", ("triton_red", "triton_per")),
    ("fused pointwise", ("triton_poi",)),
    # A compiled graph's own kernels where the profiler does not name them one by one.
    ("fused, unnamed", ("compiledfxgraph", "cpp_fused")),
    ("optimizer", ("adam", "optimizer")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax")),
)
TOP_OPERATORS = 12

BASELINE = Path(__file__).resolve().parents[2] / "shared" / "bench" / "h200_baseline.py"
EIGHT_B = "128256,4096,8,32,8,14336,2,8192"
WARM_UP_STEPS = 3
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s, the baseline's MFU denominator


def model_args(vocab: int, dim: int, layers: int, heads: int, kv: int, ffn: int, seq: int):
    """The trainer's ModelArgs with SwiGLU width exactly `ffn` (at least Llama's 8/3 x dim)."""
    if ffn < int(8 * dim / 3):
        raise ValueError(f"ffn {ffn} is below 8/3 x dim {dim}: ModelArgs cannot make it")
    return ModelArgs(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=vocab,
        ffn_multiple_of=ffn,
        max_seq_len=seq,
    )


def train_speed(
    args: ModelArgs, recipe: str | None, compile_blocks: bool, device: str, batch: int, seq: int,
    steps: int, profile: bool = False,
) -> dict[str, object]:  # fmt: skip
    """Tokens/s of `steps` training steps after the warm-up steps, and what ran."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Transformer(args).to(device, torch.bfloat16)
    # Lost values are counted as a run counts them: one step in TrainConfig.fp8_count_every.
    count_every = TrainConfig.fp8_count_every
    fp8 = convert_to_fp8(model, make_recipe(recipe), count_every=count_every) if recipe else None
    paths = fp8.describe(torch.device(device), torch.bfloat16) if fp8 else "bf16"
    if compile_blocks:
        apply_compile(model)  # as the trainer's --compile does
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    tokens = torch.randint(0, args.vocab_size, (batch, seq), device=device)

    step_number = itertools.count(1)

    def step() -> torch.Tensor:
        if fp8 is not None:
            fp8.begin_step(next(step_number))
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    for _ in range(WARM_UP_STEPS):  # compiled runs compile the backward pass in the first two
        step()
    sync()
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    tok_s = batch * seq / seconds
    # MFU as the baseline counts it: 6 x non-embedding parameters x tokens/s over the bf16 peak.
    dense = sum(p.numel() for n, p in model.named_parameters() if "embeddings" not in n)
    result = {
        "tok_s": round(tok_s),
        "mfu_6n": round(6 * dense * tok_s / H200_BF16_PEAK, 3),
        "step_s": round(seconds, 4),
        "warm_s": round(warm, 1),
        "loss": round(loss.item(), 3),
        "paths": paths,
    }
    if device == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        torch.cuda.reset_peak_memory_stats()
    if fp8 is not None:
        result["fp8_counts"] = fp8.counts()
    if profile:
        result["profile"] = profile_step(step, sync, device)
    return result


def kind_of(operator: str) -> str:
    name = operator.lower()
    return next((kind for kind, patterns in KINDS if any(p in name for p in patterns)), "other")


def profile_step(step, sync, device: str) -> dict[str, object]:
    """Milliseconds of one step by kind of work, and the operators that took longest.

    On a GPU the time is each operator's own kernels' device time; on a CPU (the script's tiny
    check) it is the operator's own CPU time.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync()
    by_kind: dict[str, float] = {}
    by_operator: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CPU:  # kernels count under the operator launching them
            continue
        us = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if us <= 0:
            continue
        kind = kind_of(event.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3
        calls_ms = by_operator.setdefault(event.name, [0, 0.0])
        calls_ms[0] += 1
        calls_ms[1] += us / 1e3
    top = sorted(by_operator.items(), key=lambda item: -item[1][1])[:TOP_OPERATORS]
    return {
        "ms_by_kind": {kind: round(ms, 2) for kind, ms in sorted(by_kind.items())},
        "ms_total": round(sum(by_kind.values()), 2),
        "top_operators": [[name[:90], calls, round(ms, 2)] for name, (calls, ms) in top],
    }


def run_baseline(script: str, dims: list[int]) -> dict[str, object]:
    """The shared baseline's compiled training step (bf16 and naive FP8) on the same shape."""
    vocab, dim, layers, heads, _kv, ffn, batch, seq = dims
    with tempfile.TemporaryDirectory() as out:
        env = os.environ | {
            "ONLY_TRAIN": "1",
            "DIMS": f"{vocab},{dim},{layers},{heads},{ffn},{batch},{seq}",
            "OUT": out,
        }
        subprocess.run([sys.executable, script], env=env, check=True, stdout=sys.stderr)
        return json.loads((Path(out) / "anchor.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default=EIGHT_B, help="V,d,L,heads,kv_heads,ffn,batch,seq")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--baseline", default=str(BASELINE), help='its path; "" to skip it')
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--modes", default="eager,compile", help="in this order")
    parser.add_argument(
        "--profile", action="store_true", help="also profile one step of each configuration"
    )
    args = parser.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    vocab, dim, layers, heads, kv, ffn, batch, seq = dims
    margs = model_args(vocab, dim, layers, heads, kv, ffn, seq)
    out = Path(os.environ.get("OUT", tempfile.gettempdir())) / "fp8_gpu.json"
    report: dict[str, object] = {"torch": torch.__version__, "device": args.device, "dims": dims}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    if args.baseline:
        try:
            report["baseline"] = run_baseline(args.baseline, dims)
        except (OSError, subprocess.CalledProcessError) as exc:  # still measure our own
            report["baseline"] = {"error": str(exc)[:400]}
    for mode in args.modes.split(","):
        compile_blocks = mode == "compile"
        for recipe in (None, *args.recipes.split(",")):
            name = f"{recipe or 'bf16'} {mode}"
            try:
                report[name] = train_speed(
                    margs,
                    recipe,
                    compile_blocks,
                    args.device,
                    batch,
                    seq,
                    args.steps,
                    args.profile,
                )
            except Exception as exc:  # one failing configuration must not hide the others
                report[name] = {"error": str(exc)[:400]}
            bf16 = report.get(f"bf16 {mode}", {})
            if "tok_s" in report[name] and "tok_s" in bf16:
                report[name]["x_bf16"] = round(report[name]["tok_s"] / bf16["tok_s"], 3)
            print(name, json.dumps(report[name]), flush=True)
            out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
