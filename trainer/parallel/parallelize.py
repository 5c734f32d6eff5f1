"""Applies the job's parallelisms to the model, in the one order that composes, and runs its steps.

The model is built on the meta device (shapes, no storage), FP8 linears swapped in, and laid out
there in the one order that composes: tensor parallelism (DTensor plans on the whole model),
context parallelism (ring attention, rotary tables for this rank's positions), expert parallelism
(experts sharded, all-to-all dispatch), activation checkpointing, torch.compile per block, the
pipeline split (this rank keeps its stages), and FSDP last, over whatever each part then holds.
Only then does each rank allocate its own shards on its device (`to_empty`, as TorchTitan) and
initialise them with the counter-based scheme of trainer.model.init, which gives every element
the value one process gives it: no rank ever holds the whole model, whatever its size, and every
layout starts from the same weights, bit for bit.

The training loop sees one object: `forward` gives this rank's loss (under pipelining the whole
forward-backward schedule runs there), `backward`, `clip_grad_norm_`, `mean_loss`, and
`after_optimizer_step` (expert balancing). `model` is what the optimizer and the checkpointer use:
this rank's parameters under their unparallelised names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from trainer.config import TrainConfig
from trainer.data.shards import data_tokenizer
from trainer.fp8 import Fp8Training, convert_to_fp8, make_recipe
from trainer.model.llama import Transformer, next_token_loss
from trainer.parallel.compile import apply_compile
from trainer.parallel.context import apply_cp
from trainer.parallel.dims import ParallelDims, ParallelMesh
from trainer.parallel.expert import ExpertLoad, apply_ep, balance_experts
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.grad_norm import clip_grad_norm_
from trainer.parallel.pipeline import (
    Pipeline,
    StageShapes,
    build_pipeline,
    job_stage_sizes,
    resolve_microbatches,
    resolve_stages_per_rank,
    split_into_stages,
)
from trainer.parallel.recompute import apply_activation_checkpointing
from trainer.parallel.tensor import apply_tp, loss_context


@dataclass
class ParallelModel:
    model: Transformer
    dims: ParallelDims
    mesh: ParallelMesh
    device: torch.device
    # Context parallelism: the sequence positions this rank is fed.
    positions: torch.Tensor | None
    pipeline: Pipeline | None

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, train: bool = True
    ) -> torch.Tensor | None:
        """This rank's mean loss over its tokens; None on pipeline ranks without the last stage.

        `inputs` and `targets` are this data-parallel rank's whole sequences. Not `train`: the
        forward pass alone (a pipeline schedule's eval), for `evaluate`.
        """
        if self.positions is not None:
            inputs, targets = inputs[:, self.positions], targets[:, self.positions]
        with loss_context(self.dims.tp):
            if self.pipeline is not None:
                loss = self.pipeline.step(inputs, targets, train)
            else:
                loss = next_token_loss(self.model(inputs), targets)
        return None if loss is None else _full(loss)

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The mean loss over held-out `batches` (this data-parallel rank's slices of each
        global batch), with no gradient and no optimizer step, over the ranks as `mean_loss`
        takes it: the validation loss, the same on every layout.

        In eval mode, so that experts count no load and evaluating never changes what training
        computes next."""
        self.model.eval()
        try:
            with torch.no_grad():
                losses = [self.forward(x, y, train=False) for x, y in batches]
        finally:
            self.model.train()
        return self.mean_loss(self.mean_of(losses))

    def micro_batches(
        self, inputs: torch.Tensor, targets: torch.Tensor, count: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batch in `count` equal micro-batches, for gradient accumulation: FSDP
        reduces the gradients only in the last one's backward (the others accumulate locally)."""
        sync = getattr(self.model, "set_requires_gradient_sync", None)
        for i, (x, y) in enumerate(zip(inputs.chunk(count), targets.chunk(count), strict=True)):
            if sync is not None and count > 1:
                sync(i == count - 1)
            yield x, y

    def backward(self, loss: torch.Tensor | None, micro_batches: int = 1) -> None:
        """Backward of `forward`'s loss (already done by the pipeline schedule under pp); with
        accumulation, of its share of the step's mean loss."""
        if self.pipeline is None and loss is not None:
            with loss_context(self.dims.tp):
                (loss / micro_batches if micro_batches > 1 else loss).backward()

    @staticmethod
    def mean_of(losses: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The step's loss from its micro-batches' (equal sizes: their mean), detached: every
        backward has run, and what is left is reporting."""
        if losses[0] is None:
            return None
        if len(losses) == 1:
            return losses[0].detach()
        return torch.stack([loss.detach() for loss in losses]).mean()

    def clip_grad_norm_(self, max_norm: float) -> float:
        pp_group = self.mesh.pp.get_group() if self.dims.pp > 1 else None
        return float(clip_grad_norm_(self.model.parameters(), max_norm, pp_group))

    def mean_loss(self, loss: torch.Tensor | None) -> float:
        """The loss over the global batch: the mean over the ranks that computed one."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if loss is not None:
            total += loss.detach().float()
        dist.all_reduce(total)
        return total.item() / (self.dims.world_size // self.dims.pp)

    def after_optimizer_step(self) -> ExpertLoad | None:
        """Balance the experts by this step's load and return it for every MoE layer."""
        load = balance_experts(self.model, self.mesh.dp_cp)
        if load is None or self.dims.pp == 1:
            return load
        stages: list[ExpertLoad | None] = [None] * self.dims.pp
        dist.all_gather_object(stages, load, group=self.mesh.pp.get_group())
        return ExpertLoad.merge([stage for stage in stages if stage is not None])

    def param_bytes(self) -> int:
        """Bytes of the parameters this rank holds: its shards, of its pipeline stages."""
        return sum(_local(p).numel() * p.element_size() for p in self.model.parameters())

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered in full, on every rank (pipeline stages merged)."""
        options = StateDictOptions(full_state_dict=True)
        state = get_model_state_dict(self.model, options=options)
        if self.dims.pp == 1:
            return state
        stages: list[dict[str, torch.Tensor] | None] = [None] * self.dims.pp
        dist.all_gather_object(stages, state, group=self.mesh.pp.get_group())
        return {k: v for stage in stages if stage for k, v in stage.items()}


def build_model(
    cfg: TrainConfig, mesh: ParallelMesh, device: torch.device
) -> tuple[ParallelModel, Fp8Training | None]:
    """`cfg`'s model laid out over `mesh`, this rank's shards allocated on `device` and
    initialised from `cfg.seed`; and its FP8 side when `cfg.fp8` asks for FP8 linears."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if cfg.document_masking:
        model.document_eos = int(data_tokenizer(cfg.data)["eos_id"])
    fp8 = None
    # FP8 swaps the linears before the layout wraps them (TP shards them, FSDP2 shards them).
    if cfg.fp8 != "none":
        fp8 = convert_to_fp8(
            model,
            make_recipe(cfg.fp8, cfg.fp8_options),
            cfg.fp8_keep_high_precision,
            all_gather=cfg.fp8_all_gather,
            strict=cfg.fp8_strict,
            count_every=cfg.fp8_count_every,
            device=device,
        )
    parallel, parts = parallelize(model, mesh, cfg, device)
    for part in parts:
        part.to_empty(device=device)
        part.init_weights(cfg.seed)
    if parts != [model]:  # pipeline stages: the model shares their modules, not their buffers
        model.init_buffers(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"left on the meta device after the build: {left}"
    return parallel, fp8


def parallelize(
    model: Transformer, mesh: ParallelMesh, cfg: TrainConfig, device: torch.device
) -> tuple[ParallelModel, list[Transformer]]:
    """Lay `model` out over `mesh` as `cfg.parallel` says; also the parts FSDP made roots of
    (the model, or this rank's pipeline stages)."""
    dims, par = mesh.dims, cfg.parallel
    if dims.tp > 1:
        apply_tp(model, mesh.tp)
    positions = apply_cp(model, mesh.cp, cfg.seq_len) if dims.cp > 1 else None
    if dims.ep > 1:
        apply_ep(model, mesh.ep)
    if par.activation_checkpointing:
        apply_activation_checkpointing(model)
    if par.compile:
        apply_compile(model)

    parts, stages = [model], []
    v = resolve_stages_per_rank(par.pp_schedule, par.pp_stages_per_rank)
    if dims.pp > 1:
        sizes = job_stage_sizes(cfg, dims.pp)
        rank = mesh.pp.get_local_rank()
        stages = split_into_stages(model, par.pp_schedule, rank, dims.pp, v, sizes)
        parts = [stage for _, stage in stages]
    param_dtype = torch.bfloat16 if par.mixed_precision else None
    apply_fsdp(
        parts,
        mesh.fsdp,
        param_dtype=param_dtype,
        expert_mesh=mesh.expert_fsdp,
        expert_grad_divisor=dims.dp_size * dims.cp,
        reshard_after_forward=dims.pp == 1,
    )

    pipeline = None
    if dims.pp > 1:
        local_batch = cfg.global_batch // dims.dp_size
        microbatches = resolve_microbatches(par.pp_microbatches, local_batch)
        shapes = StageShapes(
            microbatch=local_batch // microbatches,
            seq=cfg.seq_len // dims.cp,
            tp=dims.tp,
            dim=cfg.model.dim,
            vocab=cfg.model.vocab_size,
            dtype=param_dtype or torch.float32,
        )
        pipeline = build_pipeline(
            stages,
            par.pp_schedule,
            dims.pp * v,
            microbatches,
            mesh.pp.get_group(),
            shapes,
            next_token_loss,
            device,
        )
    return ParallelModel(model, dims, mesh, device, positions, pipeline), parts


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard, or the tensor itself."""
    return param.to_local() if isinstance(param, DTensor) else param


def _full(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (the loss is one under loss_parallel), or the tensor itself.

    Differentiable, and free for the replicated loss, so backward still runs through it."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
