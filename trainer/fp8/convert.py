"""Turn a model's linear layers into FP8 linears, and hold what the run needs of them afterwards.

Only `nn.Linear` layers are converted, so embeddings, normalization and attention's softmax stay
in their own precision by construction; the layers named in `keep_high_precision` (by default
the output head and any MoE router) stay `nn.Linear`. A name matches a layer when its dotted
parts appear in the layer's name in a row: "output" keeps `output`, "router" keeps
`layers.3.moe.router.gate`, "layers.0" keeps every linear of the first block.

Convert before sharding the model (FSDP2, tensor parallel), on its device or on the meta device:
parameters are shared, not copied, so checkpoint keys and the optimizer see the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainer.fp8.delayed import AmaxHistory
from trainer.fp8.fsdp import check_all_gather, reduce_weight_amax, shard_weights_in_fp8
from trainer.fp8.linear import Caster, Fp8Linear, Fp8Plan, Gemm, fits
from trainer.fp8.quantize import COUNTS
from trainer.fp8.recipes import Fp8Recipe, Granularity

DEFAULT_KEEP_HIGH_PRECISION = ("output", "router")


@dataclass
class Fp8Training:
    """The FP8 side of a training run: its layers, delayed-scaling state and counters."""

    recipe: Fp8Recipe
    plan: Fp8Plan
    layers: dict[str, Fp8Linear]
    kept: list[str]
    history: AmaxHistory | None
    all_gather: bool = False
    group: dist.ProcessGroup | None = None
    count_every: int = 1  # steps between those whose casts count saturation and underflow
    # Linears left in high precision because the recipe cannot split their shape.
    unfit: list[str] = field(default_factory=list)

    def begin_step(self, step: int) -> None:
        """Count saturated and underflowed values in this step's casts if it is the first of
        every `count_every` (steps 1, 1 + count_every, ...): counting reads each cast tensor and
        its FP8 bytes once more, a fifth to a third of what the casts move (bench/fp8_traffic.py).
        """
        self.plan.counting = (step - 1) % self.count_every == 0

    def update(self) -> None:
        """Fold the last step's amax values into the delayed-scaling history, and with per-tensor
        FP8 all-gathers reduce the weights' amax over their shards (collectives).

        Runs by itself before each forward pass of the converted model; a loop that never calls
        that model's forward (a pipeline schedule) calls it once per step on every rank instead.
        """
        if self.history is not None:
            self.history.update()
        if self.all_gather and self.recipe.granularity is Granularity.TENSOR:
            reduce_weight_amax(self.layers, self.group)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must keep for a bit-identical resume: the amax histories, if any."""
        return {} if self.history is None else self.history.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.history is not None:
            self.history.load_state_dict(state)

    def counts(self) -> dict[str, int]:
        """Values cast to FP8 on the counted steps so far on this rank, and how many of them
        saturated or underflowed."""
        every = [
            stats.totals for layer in self.layers.values() for stats in layer.caster.stats.values()
        ]
        return dict(zip(COUNTS, torch.stack(every).sum(0).tolist(), strict=True))

    def summary(self) -> str:
        """The counts as the run's log line shows them (reads them back from the device)."""
        counts = self.counts()
        values = max(counts["values"], 1)
        sampled = f" (counted every {self.count_every} steps)" if self.count_every > 1 else ""
        return (
            f"saturated {counts['saturated'] / values:.4%}, underflow "
            f"{counts['underflow'] / values:.4%} of {counts['values']:,} values cast{sampled}"
        )

    def describe(self, device: torch.device, dtype: torch.dtype) -> str:
        """One paragraph for the run's log: recipe, layers, and the path each product takes."""
        paths = []
        for gemm in Gemm:
            choice = self.plan.resolve(gemm, device.type, dtype)
            why = "".join(
                f"; {path} refused: {reason}" for path, reason in choice.passed_over.items()
            )
            paths.append(f"{gemm} {choice.path}{why}")
        kept = ", ".join(self.kept) or "none"
        if self.unfit:
            kept += f"; kept because the recipe cannot split their shape: {', '.join(self.unfit)}"
        gathered = "; FSDP all-gathers their weights in FP8" if self.all_gather else ""
        return (
            f"fp8 {self.recipe.describe()}; {len(self.layers)} linears in FP8, "
            f"kept in high precision: {kept}{gathered}; GEMM paths ({device.type}, "
            f"{str(dtype).removeprefix('torch.')} out): {', '.join(paths)}"
        )


def matches(name: str, pattern: str) -> bool:
    """Whether `pattern`'s dotted parts appear in a row among `name`'s."""
    parts, wanted = name.split("."), pattern.split(".")
    return any(parts[i : i + len(wanted)] == wanted for i in range(len(parts) - len(wanted) + 1))


def convert_to_fp8(
    model: nn.Module,
    recipe: Fp8Recipe,
    keep_high_precision: tuple[str, ...] | list[str] = DEFAULT_KEEP_HIGH_PRECISION,
    group: dist.ProcessGroup | None = None,
    all_gather: bool = False,
    count_every: int = 1,
    device: torch.device | None = None,
    strict: bool = False,
) -> Fp8Training:
    """Replace `model`'s linears by FP8 linears in place; ValueError naming a layer that cannot.

    `group` is what amax values are reduced over (default: every rank): all ranks holding a
    replica or a shard of the same layers. `all_gather` makes FSDP2 (applied next) all-gather
    the FP8 linears' weights in FP8 (trainer.fp8.fsdp). `count_every`: see `begin_step`.
    `device` holds the delayed-scaling state and counts (default: where the parameters are; a
    model built on the meta device names the device it will run on).
    """
    if count_every < 1:
        raise ValueError(f"fp8 count_every must be at least 1, got {count_every}")
    if all_gather:
        check_all_gather(recipe)
    linears = {name: module for name, module in model.named_modules() if type(module) is nn.Linear}
    kept = [n for n in linears if any(matches(n, p) for p in keep_high_precision)]
    device = device or next(model.parameters()).device
    plan = Fp8Plan(recipe)
    # As TorchTitan's float8 filter, a linear whose shape the recipe cannot split stays in high
    # precision (`unfit`); `strict` refuses it instead, naming it.
    unfit = {}
    for name in (n for n in linears if n not in kept):
        try:
            fits(linears[name], Caster(name, plan, None, 0, device))
        except ValueError as exc:
            if strict:
                raise
            unfit[name] = str(exc)
    names = [n for n in linears if n not in kept and n not in unfit]
    history = AmaxHistory(names, recipe, device, group) if recipe.delayed else None
    layers = {
        name: Fp8Linear.from_linear(linears[name], Caster(name, plan, history, row, device))
        for row, name in enumerate(names)
    }
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, layer)
    if all_gather:
        shard_weights_in_fp8(layers)
    training = Fp8Training(
        recipe, plan, layers, kept, history, all_gather, group, count_every, unfit=list(unfit)
    )
    if history is not None or all_gather:
        model.register_forward_pre_hook(lambda _module, _args: training.update())
    return training
