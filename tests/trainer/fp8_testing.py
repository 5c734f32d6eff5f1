"""Helpers shared by the FP8 tests: test tensors, error bounds, and the tiny training run."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainer.config import TrainConfig
from trainer.data.corpus import Corpus, stdlib_corpus
from trainer.data.loader import DeterministicLoader
from trainer.fp8 import Fp8Training, convert_to_fp8, make_recipe
from trainer.fp8.formats import Fp8Format
from trainer.fp8.fsdp import Fp8Weight
from trainer.fp8.quantize import Quantized
from trainer.fp8.recipes import RECIPES
from trainer.model.llama import ModelArgs, Transformer
from trainer.optim import build_optimizer, build_scheduler


def varied(rows: int = 256, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Normal values whose magnitude changes by up to 2^±6 from one 8x8 tile to the next."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-6, 7, (rows // 8, cols // 8), generator=gen).float()
    magnitude = torch.exp2(exponents).repeat_interleave(8, 0).repeat_interleave(8, 1)
    return torch.randn(rows, cols, generator=gen) * magnitude


def error_bound(x: torch.Tensor, q: Quantized, fmt: Fp8Format) -> torch.Tensor:
    """Worst round-to-nearest error per element of `x` cast as `q`: half a step relative in the
    normal range, half the smallest subnormal (in the block's units) below it."""
    br, bc = q.block
    inverse = q.scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return torch.maximum(x.abs() * fmt.relative_step / 2, inverse * fmt.min_subnormal / 2)


# The tiny model every FP8 training test uses: every linear but the head splits into 128x128
# blocks (4 heads of 32 without grouped-query attention, SwiGLU width 384).
TINY = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_multiple_of=128)
# Under tensor parallelism of 2 the local shards must still split into 128x128 blocks.
TINY_TP2 = ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, ffn_multiple_of=256)
SEQ_LEN, GLOBAL_BATCH = 64, 8


@functools.cache
def corpus() -> Corpus:
    return stdlib_corpus(1 << 20)


def tiny_model(
    recipe: str | None, args: ModelArgs = TINY, seed: int = 1234, all_gather: bool = False
) -> tuple[Transformer, Fp8Training | None]:
    """The tiny model, its linears in FP8 under `recipe` (None: left as they are)."""
    model = Transformer(args)
    model.init_weights(seed)
    fp8 = convert_to_fp8(model, make_recipe(recipe), all_gather=all_gather) if recipe else None
    return model, fp8


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> None:
    """clip_grad_norm_ that also takes gradients on different meshes (FSDP2 x TP mixes 1-D and
    2-D DTensors, which torch's own refuses to stack)."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [(g.full_tensor() if isinstance(g, DTensor) else g).norm() for g in grads]
    coef = max_norm / (float(torch.stack(norms).norm()) + 1e-6)
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef)


class TinyTrainer:
    """The trainer's own step (AdamW, its warm-up and cosine schedule over `steps`, clipping) in
    bf16 autocast like a GPU run, over the stdlib corpus; this rank's slice of each global batch
    when data parallel."""

    def __init__(self, model: nn.Module, steps: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.model = model
        cfg = TrainConfig(run_id="tiny", steps=steps)
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.loader = DeterministicLoader(
            corpus(), SEQ_LEN, GLOBAL_BATCH, dp_rank=dp_rank, dp_size=dp_size, seed=1234
        )

    def step(self) -> float:
        """One step; the loss averaged over every rank when distributed."""
        inputs, targets = self.loader.next_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        clip_grad_norm(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        loss = loss.detach()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return loss.item()

    def losses(self, steps: int) -> list[float]:
        return [self.step() for _ in range(steps)]


DISTRIBUTED_STEPS = 4


def tensor_parallel(model: Transformer, mesh: DeviceMesh) -> None:
    """Megatron-style TP with torch's stock plans: q/k/v and w1/w3 by columns, wo and w2 by rows."""
    plan = {}
    for index in model.layers:
        block = f"layers.{index}"
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                     "feed_forward.w3"):  # fmt: skip
            plan[f"{block}.{name}"] = ColwiseParallel()
        plan[f"{block}.attention.wo"] = RowwiseParallel()
        plan[f"{block}.feed_forward.w2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


# (dp_replicate, dp_shard, tp) of each layout the 4-rank job trains under.
LAYOUTS = {"dp2·tp2": (1, 2, 2), "fsdp dp4": (1, 4, 1), "hsdp 2x2": (2, 2, 1)}


# (layout, recipe, FP8 all-gather) of each run of the 4-rank job.
DISTRIBUTED_RUNS = [
    *(("dp2·tp2", name, False) for name in ("bf16", *RECIPES)),
    ("fsdp dp4", "tensorwise-delayed", False),
    ("hsdp 2x2", "tensorwise-delayed", False),
    ("hsdp 2x2", "tensorwise-delayed", True),
    ("hsdp 2x2", "blockwise", False),
    ("hsdp 2x2", "blockwise", True),
]


def run_key(layout: str, name: str, all_gather: bool) -> str:
    return f"{layout} {name}" + (" fp8-all-gather" if all_gather else "")


def distributed_job(rank: int, world: int, port: int, out: str) -> None:
    """Train each of DISTRIBUTED_RUNS; rank 0 writes {run: losses, run + " histories agree":
    bool, run + " gathered fp8": bool} as JSON to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.use_deterministic_algorithms(True)
    # clip_grad_norm's full gradients over two mesh dimensions take two all-gathers: fine here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results: dict[str, object] = {}
    try:
        for layout, name, all_gather in DISTRIBUTED_RUNS:
            results |= _distributed_run(rank, layout, name, all_gather)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _distributed_run(rank: int, layout: str, name: str, all_gather: bool) -> dict[str, object]:
    key = run_key(layout, name, all_gather)
    replicate, shard, tp = LAYOUTS[layout]
    mesh = init_device_mesh(
        "cpu", (replicate, shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    model = Transformer(TINY_TP2)
    model.init_weights(1234)
    fp8 = (
        None if name == "bf16" else convert_to_fp8(model, make_recipe(name), all_gather=all_gather)
    )
    if tp > 1:
        tensor_parallel(model, mesh["tp"])
    dp_mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    gathered: list[bool] = []
    if fp8 is not None:
        first = next(iter(fp8.layers.values()))
        first.register_forward_pre_hook(
            lambda layer, _: gathered.append(isinstance(layer.weight, Fp8Weight))
        )
    trainer = TinyTrainer(model, DISTRIBUTED_STEPS, rank // tp, replicate * shard)
    results: dict[str, object] = {key: trainer.losses(DISTRIBUTED_STEPS)}
    results[f"{key} gathered fp8"] = bool(gathered) and all(gathered)
    if fp8 is not None and fp8.history is not None:
        results[f"{key} histories agree"] = _same_on_every_rank(fp8.history.history)
    return results


def _same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)
