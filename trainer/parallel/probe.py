"""Train a few steps of several layouts in one job, and of no layout at all in one process.

What the layout tests compare and the parallel benchmarks time. Under torchrun, every layout in
turn builds its own mesh over the same world, trains from the same seed on the same data, and rank
0 writes per layout: every parameter gathered in full after the build, the loss and gradient norm
of each step, every parameter gathered in full after the last, each step's expert loads and wall
time. With --ckptd, layouts marked "checkpoint" are then saved
to ckptd with the trainer's Checkpointer and restored into a fresh copy of the layout, whose
parameters must come back equal. `reference` computes the same numbers in one process with a
plain model, a plain loss and torch's own clipping: the single-process run layouts must match.
Both train with the trainer's own step (`trainer.step.train_step`).

    torchrun --nproc-per-node 4 -m trainer.parallel.probe --layouts layouts.json --out out.pt

A layout is a JSON object: {"name": ..., "parallel": {ParallelConfig fields}, "model": {ModelArgs
fields, "moe": {MoEArgs fields}}, any of seq_len, global_batch, lr, seed, grad_accum_steps,
init_from_hf (a Hugging Face directory the layout's weights are loaded from), and
"checkpoint": true}.
The name is also the checkpoint's run id.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import ParallelConfig, TrainConfig
from trainer.data.corpus import stdlib_corpus
from trainer.data.loader import DeterministicLoader
from trainer.interop.hf_import import load_hf_weights
from trainer.model.llama import ModelArgs, Transformer, next_token_loss
from trainer.model.moe import MoEArgs
from trainer.optim import build_optimizer
from trainer.parallel.dims import ParallelMesh, validate_layout
from trainer.parallel.expert import ExpertLoad, balance_experts
from trainer.parallel.parallelize import ParallelModel, build_model
from trainer.parallel.pipeline import evaluates, scheduled_bubble
from trainer.step import StepModel, train_step
from trainer.train import evaluate

CORPUS_BYTES = 1 << 18
# Global batches of the validation loss taken after the last step (the held-out order: another
# seed's permutation of the same corpus).
EVAL_BATCHES = 2


@dataclass
class ProbeResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    expert_loads: list[ExpertLoad | None] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    # Every parameter gathered in full right after the build, before the first step.
    initial_state: dict[str, torch.Tensor] = field(default_factory=dict)
    # Set when the layout was checkpointed: whether a fresh copy restored every parameter.
    restored_equal: bool | None = None
    # Pipelined layouts: each step's idle fraction, averaged over the pipeline ranks, and the
    # idle fraction of the schedule's own action table (multi-stage schedules).
    bubbles: list[float] = field(default_factory=list)
    scheduled_bubble: float | None = None
    # The validation loss after the last step (`ParallelModel.evaluate`); NaN for a schedule
    # that cannot evaluate (`pipeline.evaluates`).
    eval_loss: float = float("nan")


def config_from_layout(layout: dict[str, Any]) -> TrainConfig:
    """The TrainConfig a layout object describes (see the module docstring)."""
    model = dict(layout.get("model", {}))
    moe = model.pop("moe", None)
    args = ModelArgs(**model, moe=MoEArgs(**moe) if moe else None)
    known = ("seq_len", "global_batch", "lr", "seed", "grad_accum_steps", "init_from_hf")
    extra = {k: layout[k] for k in known if k in layout}
    return TrainConfig(
        run_id=layout["name"],
        parallel=ParallelConfig(**layout.get("parallel", {})),
        model=args,
        corpus_bytes=CORPUS_BYTES,
        **extra,
    )


@dataclass
class OneProcess:
    """The plain model as a step sees it, for the reference: the whole model in this process, the
    plain loss, torch's own gradient clipping, and no collective."""

    model: Transformer
    mean_of = staticmethod(ParallelModel.mean_of)

    def micro_batches(
        self, inputs: torch.Tensor, targets: torch.Tensor, count: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return zip(inputs.chunk(count), targets.chunk(count), strict=True)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.model(inputs), targets)

    def backward(self, loss: torch.Tensor | None, micro_batches: int = 1) -> None:
        assert loss is not None
        (loss / micro_batches).backward()

    def clip_grad_norm_(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def mean_loss(self, loss: torch.Tensor | None) -> float:
        assert loss is not None
        return loss.item()

    def after_optimizer_step(self) -> ExpertLoad | None:
        return balance_experts(self.model, None)


def reference(cfg: TrainConfig, steps: int) -> ProbeResult:
    """The same steps in this process on the whole global batch, with no parallelism."""
    model = Transformer(cfg.model)
    model.init_weights(cfg.seed)
    optimizer = build_optimizer(model, cfg)
    loader = DeterministicLoader(stdlib_corpus(cfg.corpus_bytes), cfg.seq_len, cfg.global_batch,
                                 0, 1, seed=cfg.seed)  # fmt: skip
    result = ProbeResult(initial_state=_copy(model.state_dict()))
    for _ in range(steps):
        # The whole global batch in one pass, with no accumulation: what accumulation must equal.
        _train_step(result, OneProcess(model), optimizer, loader, cfg, torch.device("cpu"), 1)
    result.state = _copy(model.state_dict())
    model.eval()
    with torch.no_grad():
        eval_loader = _eval_loader(cfg, 0, 1)
        result.eval_loss = (
            sum(
                next_token_loss(model(x), y).item()
                for x, y in (eval_loader.next_batch() for _ in range(EVAL_BATCHES))
            )
            / EVAL_BATCHES
        )
    return result


def _train_step(
    result: ProbeResult,
    model: StepModel,
    optimizer: torch.optim.Optimizer,
    loader: DeterministicLoader,
    cfg: TrainConfig,
    device: torch.device,
    grad_accum_steps: int,
) -> None:
    """Train one step on the loader's next batch with the trainer's step; record it in `result`."""
    start = time.perf_counter()
    inputs, targets = (x.to(device) for x in loader.next_batch())
    step = train_step(model, optimizer, (inputs, targets), max_grad_norm=cfg.max_grad_norm,
                      grad_accum_steps=grad_accum_steps)  # fmt: skip
    result.losses.append(step.global_loss)
    result.grad_norms.append(step.grad_norm)
    result.expert_loads.append(step.expert_load)
    result.step_seconds.append(time.perf_counter() - start)


def _eval_loader(cfg: TrainConfig, dp_rank: int, dp_size: int) -> DeterministicLoader:
    return DeterministicLoader(stdlib_corpus(cfg.corpus_bytes), cfg.seq_len, cfg.global_batch,
                               dp_rank, dp_size, seed=cfg.seed + 1)  # fmt: skip


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


@dataclass
class _Job:
    """One layout built on this rank: what a training step and a checkpoint need."""

    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    loader: DeterministicLoader


def _build(cfg: TrainConfig, mesh: ParallelMesh, device: torch.device, seed: int) -> _Job:
    parallel, _ = build_model(dataclasses.replace(cfg, seed=seed), mesh, device)
    model = parallel.model
    if cfg.init_from_hf:
        load_hf_weights(model, Path(cfg.init_from_hf), cfg.model)
    loader = DeterministicLoader(stdlib_corpus(cfg.corpus_bytes), cfg.seq_len, cfg.global_batch,
                                 mesh.dp_rank, mesh.dims.dp_size, seed=cfg.seed)  # fmt: skip
    return _Job(parallel, build_optimizer(model, cfg), loader)


def run_layout(
    cfg: TrainConfig, steps: int, device: torch.device, ckptd: str | None = None
) -> ProbeResult:
    """The same steps under cfg.parallel, on the world's ranks (the process group must exist).

    With `ckptd`, the trained state is saved under run id `cfg.run_id`, then loaded into a fresh
    copy of the layout (built from another seed) and compared with what was saved.
    """
    mesh = validate_layout(cfg, dist.get_world_size()).build_mesh(device.type)
    job = _build(cfg, mesh, device, cfg.seed)
    # A copy: a gathered tensor may share storage with a parameter the steps then change.
    result = ProbeResult(initial_state=_copy(job.parallel.full_state()))
    for _ in range(steps):
        dist.barrier()
        _train_step(
            result, job.parallel, job.optimizer, job.loader, cfg, device, cfg.grad_accum_steps
        )
        if (pipeline := job.parallel.pipeline) is not None:
            bubble = torch.tensor(pipeline.last_bubble)
            dist.all_reduce(bubble, group=mesh.pp.get_group())
            result.bubbles.append(bubble.item() / mesh.dims.pp)
    result.state = job.parallel.full_state()
    if mesh.dims.pp == 1 or evaluates(cfg.parallel.pp_schedule):
        eval_loader = _eval_loader(cfg, mesh.dp_rank, mesh.dims.dp_size)
        result.eval_loss = evaluate(job.parallel, eval_loader, EVAL_BATCHES, device).loss
    if job.parallel.pipeline is not None:
        result.scheduled_bubble = scheduled_bubble(job.parallel.pipeline.schedule)
    if ckptd is not None:
        saver = _checkpointer(ckptd, cfg.run_id, job)
        saver.save(steps, labels={})
        (saved,) = saver.finish()  # saves stream in the background: wait for the commit
        saver.close()
        if saved.error is not None:
            raise saved.error
        fresh = _build(cfg, mesh, device, cfg.seed + 1)
        restorer = _checkpointer(ckptd, cfg.run_id, fresh)
        restorer.load(steps)
        restorer.close()
        restored = fresh.parallel.full_state()
        result.restored_equal = restored.keys() == result.state.keys() and all(
            torch.equal(restored[k], v) for k, v in result.state.items()
        )
    return result


def _checkpointer(address: str, run_id: str, job: _Job) -> Checkpointer:
    schedule = torch.optim.lr_scheduler.LambdaLR(job.optimizer, lambda _: 1.0)
    return Checkpointer(address, run_id, job.parallel.model, job.optimizer, schedule, job.loader)


def launch(
    world: int, layouts: list[dict[str, Any]], steps: int, ckptd: str | None = None
) -> dict[str, dict[str, Any]]:
    """Run the probe on `world` local ranks under torchrun; rank 0's results by layout name.

    For a parent process (tests, benchmarks): one job for all layouts, since each job pays the
    start-up of `world` Python processes importing torch.
    """
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        spec, out = Path(tmp) / "layouts.json", Path(tmp) / "results.pt"
        spec.write_text(json.dumps(layouts))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(world), "-m", "trainer.parallel.probe",
                "--layouts", str(spec), "--steps", str(steps), "--out", str(out),
                *(["--ckptd", ckptd] if ckptd else [])]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"probe job on {world} ranks failed:\n{proc.stderr[-6000:]}")
        return torch.load(out, weights_only=False)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.parallel.probe", description=__doc__)
    p.add_argument("--layouts", required=True, help="JSON file: a list of layout objects")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True, help="where rank 0 writes {name: result} (torch.save)")
    p.add_argument("--ckptd", help="HOST:PORT of ckptd, for the layouts marked checkpoint")
    args = p.parse_args(argv)
    with open(args.layouts) as f:
        layouts = json.load(f)
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    device = torch.device("cpu")
    results = {}
    for layout in layouts:
        ckptd = args.ckptd if layout.get("checkpoint") else None
        result = run_layout(config_from_layout(layout), args.steps, device, ckptd)
        results[layout["name"]] = dataclasses.asdict(result)
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
