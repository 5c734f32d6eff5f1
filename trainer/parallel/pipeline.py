"""Pipeline parallelism on torch.distributed.pipelining: the stage split, the schedule, the bubble.

The layers split evenly into pp·v stages, v per rank. Single-stage schedules (GPipe, 1F1B) put
stage s on rank s; looped ones (Interleaved1F1B, InterleavedZeroBubble) put stage s on rank
s mod pp; V-shaped ones (ZBVZeroBubble, DualPipeV) put stages r and 2·pp-1-r on rank r.

Each stage is a `Transformer` that shares its modules with this rank's model, which keeps only the
layers of its own stages (keys unchanged): the optimizer and the checkpoint see one module with the
unparallelised names, while the schedule runs the stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _PipelineSchedule,
    get_schedule_class,
)

from trainer.model.llama import Transformer

if TYPE_CHECKING:
    from trainer.config import TrainConfig

# Schedule name -> stages per rank it runs by default.
SCHEDULES = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split backward into input and weight parts to fill the bubble.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def evaluates(schedule: str) -> bool:
    """Whether the schedule can run forward only (`Pipeline.step(train=False)`, a validation
    loss): torch 2.13's `eval` keeps the V-shaped schedules' backward actions, which then fail
    on the gradients that never came."""
    return schedule not in V_SHAPED


def resolve_stages_per_rank(schedule: str, requested: int) -> int:
    """`requested`, or the schedule's own default when it is 0."""
    return requested or SCHEDULES[schedule]


def resolve_microbatches(requested: int, local_batch: int) -> int:
    """`requested`, or one micro-batch per sequence of the local batch when it is 0."""
    return requested or local_batch


def stage_indices(schedule: str, rank: int, pp: int, v: int) -> list[int]:
    """The stages rank `rank` runs, in the order the schedule expects them."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(v)]


def stage_sizes(
    n_layers: int,
    n_stages: int,
    first_less: int = 0,
    last_less: int = 0,
    explicit: tuple[str, ...] = (),
) -> list[int]:
    """The blocks of each stage, in order: `explicit`, else an even split of n_layers plus the
    blocks the first and last stage have fewer (the embedding and the head each weigh as much,
    TorchTitan's rule). ValueError in one line naming what would fit."""
    if explicit:
        if not all(x.strip().isdigit() for x in explicit):
            raise ValueError(f"pp_layers_per_stage {','.join(explicit)}: expected whole numbers")
        sizes = [int(x) for x in explicit]
        if len(sizes) != n_stages or sum(sizes) != n_layers or min(sizes) < 1:
            raise ValueError(
                f"pp_layers_per_stage {','.join(explicit)} must give each of the {n_stages} "
                f"stages at least one block, {n_layers} (n_layers) in all"
            )
        return sizes
    total = n_layers + first_less + last_less
    if total % n_stages:
        below = total - total % n_stages
        fewer = first_less + last_less
        near = " or ".join(str(n - fewer) for n in (below, below + n_stages) if n > fewer)
        raise ValueError(
            f"n_layers {n_layers} does not split into {n_stages} equal stages"
            + (
                f" with {first_less} fewer on the first and {last_less} on the last"
                if first_less or last_less
                else ""
            )
            + f"; nearest valid n_layers: {near}; or set --pp-first-stage-less-layers and "
            "--pp-last-stage-less-layers so that n_layers plus both is a multiple of the "
            "stages, or --pp-layers-per-stage"
        )
    sizes = [total // n_stages] * n_stages
    sizes[0] -= first_less
    sizes[-1] -= last_less
    if min(sizes) < 1:
        raise ValueError(
            f"with {first_less} fewer blocks on the first stage and {last_less} on the last, "
            f"a stage of {n_layers} blocks over {n_stages} stages would have none"
        )
    return sizes


def job_stage_sizes(cfg: TrainConfig, pp: int) -> list[int]:
    """The blocks of each of the job's pp x stages-per-rank stages, from its pipeline options:
    the one reading of those options that the layout check, the trainer and the planner share."""
    par = cfg.parallel
    return stage_sizes(
        cfg.model.n_layers,
        pp * resolve_stages_per_rank(par.pp_schedule, par.pp_stages_per_rank),
        par.pp_first_stage_less_layers,
        par.pp_last_stage_less_layers,
        par.pp_layers_per_stage,
    )


def stage_layers(stage: int, sizes: list[int]) -> list[str]:
    """Keys of the blocks of `stage`: a contiguous run, `sizes` blocks a stage."""
    start = sum(sizes[:stage])
    return [str(i) for i in range(start, start + sizes[stage])]


def split_into_stages(
    model: Transformer, schedule: str, rank: int, pp: int, v: int, sizes: list[int]
) -> list[tuple[int, Transformer]]:
    """Keep only this rank's stages in `model` (`sizes`: blocks of each stage, `stage_sizes`)
    and return (index, module) for each stage."""
    n_stages = pp * v
    indices = stage_indices(schedule, rank, pp, v)
    stages = [
        (
            s,
            Transformer.sharing(
                model, stage_layers(s, sizes), first=s == 0, last=s == n_stages - 1
            ),
        )
        for s in indices
    ]
    mine = {key for _, stage in stages for key in stage.layers}
    for key in [k for k in model.layers if k not in mine]:
        del model.layers[key]
    if 0 not in indices:
        model.tok_embeddings = None
    if n_stages - 1 not in indices:
        model.norm, model.output = None, None
    return stages


def _timed(name: str) -> Callable[..., Any]:
    """PipelineStage's method `name`, adding the seconds it runs to the stage's `busy_s`."""
    method = getattr(PipelineStage, name)

    def timed(self: TimedStage, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start

    return timed


class TimedStage(PipelineStage):
    """A stage that adds up the seconds it computes (forward, backward, weight backward).

    What is left of a step's wall time is the rank's bubble: waiting for its neighbours.
    """

    busy_s = 0.0
    forward_one_chunk = _timed("forward_one_chunk")
    backward_one_chunk = _timed("backward_one_chunk")
    backward_weight_one_chunk = _timed("backward_weight_one_chunk")


@dataclass
class Pipeline:
    """The schedule over this rank's stages, and which ends of the pipeline it holds."""

    schedule: _PipelineSchedule
    stages: list[TimedStage]
    has_first: bool
    has_last: bool
    # (p-1)/(v·m+p-1) for the schedules it describes; None for the zero-bubble ones.
    formula: float | None
    # This rank's idle fraction of the last step: 1 - compute seconds / schedule seconds.
    last_bubble: float = 0.0

    def bubble_report(self) -> str:
        """The last step's measured bubble on this rank, beside what the formula predicts."""
        expected = "zero-bubble schedule" if self.formula is None else f"formula {self.formula:.2f}"
        return f"{self.last_bubble:.2f} ({expected})"

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, train: bool = True
    ) -> torch.Tensor | None:
        """Forward and backward over all micro-batches (not `train`: forward only, the
        schedule's eval); the mean loss where the last stage is."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        run = self.schedule.step if train else self.schedule.eval
        busy, start = sum(s.busy_s for s in self.stages), time.perf_counter()
        if self.has_last:
            run(*args, target=targets, losses=losses)
        else:
            run(*args)
        if train:
            busy = sum(s.busy_s for s in self.stages) - busy
            self.last_bubble = 1 - busy / (time.perf_counter() - start)
        return torch.stack(losses).mean() if self.has_last else None


def build_pipeline(
    stages: list[tuple[int, Transformer]],
    schedule: str,
    n_stages: int,
    microbatches: int,
    group: dist.ProcessGroup,
    shapes: StageShapes,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> Pipeline:
    """The schedule over `stages`, with static shapes.

    Without them the first step would run an extra real forward and backward to infer shapes,
    which costs time and would count its tokens into the expert loads.
    """
    pipeline_stages = [
        TimedStage(
            module,
            index,
            n_stages,
            device,
            input_args=shapes.inputs(first=index == 0),
            output_args=shapes.outputs(last=index == n_stages - 1),
            group=group,
        )
        for index, module in stages
    ]
    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleMulti):
        runner = cls(pipeline_stages, n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        (only,) = pipeline_stages
        runner = cls(only, n_microbatches=microbatches, loss_fn=loss_fn)
    indices = [index for index, _ in stages]
    formula = expected_bubble(schedule, n_stages // len(stages), microbatches, len(stages))
    return Pipeline(runner, pipeline_stages, 0 in indices, n_stages - 1 in indices, formula)


@dataclass(frozen=True)
class StageShapes:
    """This rank's local shapes of what flows between stages, for one micro-batch."""

    microbatch: int
    seq: int  # this rank's tokens per sequence (after context parallelism)
    tp: int  # the hidden states between stages are sequence-sharded over tp
    dim: int
    vocab: int
    dtype: torch.dtype

    def inputs(self, first: bool) -> torch.Tensor:
        if first:
            return torch.empty(self.microbatch, self.seq, dtype=torch.long, device="meta")
        return self._hidden()

    def outputs(self, last: bool) -> torch.Tensor:
        if last:
            shape = (self.microbatch, self.seq, self.vocab)
            return torch.empty(shape, dtype=self.dtype, device="meta", requires_grad=True)
        return self._hidden()

    def _hidden(self) -> torch.Tensor:
        # requires_grad tells the stage that gradients flow back across this boundary.
        shape = (self.microbatch, self.seq // self.tp, self.dim)
        return torch.empty(shape, dtype=self.dtype, device="meta", requires_grad=True)


def bubble_formula(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of an ideal pipeline: (p-1)/(m+p-1), or (p-1)/(v·m+p-1) when interleaved."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def expected_bubble(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int
) -> float | None:
    """The formula's bubble for `schedule`; None for zero-bubble schedules, which aim at 0."""
    if schedule in ZERO_BUBBLE:
        return None
    return bubble_formula(pp, microbatches, stages_per_rank)


def scheduled_bubble(runner: _PipelineSchedule) -> float | None:
    """Idle fraction of a multi-stage schedule's own action table, one slot per action.

    The table is the schedule's idealised plan (a full backward takes one slot, like a forward);
    None for the single-stage schedules, whose tables are drawings rather than what they run.
    """
    if not isinstance(runner, PipelineScheduleMulti):
        return None
    order = runner.pipeline_order
    length = max(len(actions) for actions in order.values())
    busy = sum(sum(a is not None for a in actions) for actions in order.values())
    return 1 - busy / (length * len(order))
