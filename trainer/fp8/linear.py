"""An nn.Linear whose three matrix products run in FP8, under any recipe.

    forward      y  = x  @ W^T    x: forward format, blocks along features; W: forward format
    grad input   dx = dy @ W      dy: backward format, blocks along out-features
    grad weight  dW = dy^T @ x    dy and x: blocks along tokens

The parameters are untouched (fp32 master weights, and so fp32 optimizer state): the weight is
cast at each use, and only FP8 copies are saved for the backward pass. Under tensor parallelism
(DTensor parameters, torch's ColwiseParallel / RowwiseParallel) each rank multiplies its local
shards and the output is handed back as a DTensor with the placement the sharding implies.
"""

from __future__ import annotations

import enum

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from trainer.fp8.delayed import AmaxHistory
from trainer.fp8.fsdp import Fp8Weight
from trainer.fp8.gemm import GemmKind, GemmPath, PathChoice, choose_path, run_path
from trainer.fp8.quantize import (
    Quantized,
    QuantStats,
    block_amax,
    check_blocks,
    quantize,
    quantize_with_scale,
    scale_for_amax,
)
from trainer.fp8.recipes import Fp8Recipe, Granularity, Role


class Gemm(enum.StrEnum):
    FORWARD = "forward"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"


# (a, b) operand roles of each product.
_OPERANDS = {
    Gemm.FORWARD: (Role.INPUT, Role.WEIGHT),
    Gemm.GRAD_INPUT: (Role.GRAD_OUTPUT, Role.WEIGHT),
    Gemm.GRAD_WEIGHT: (Role.GRAD_OUTPUT, Role.INPUT),
}


class Fp8Plan:
    """The recipe and the GEMM path of each product, shared by every FP8 linear of a model."""

    def __init__(self, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        # Whether casts count saturated and underflowed values: a pass over each cast tensor
        # and its FP8 bytes, so a run counts on some steps only (Fp8Training.begin_step).
        self.counting = True
        self._paths: dict[tuple[Gemm, str, torch.dtype], GemmPath] = {}

    def kind(self, gemm: Gemm, device: str, out_dtype: torch.dtype) -> GemmKind:
        a, b = _OPERANDS[gemm]
        recipe = self.recipe
        return GemmKind(
            device,
            recipe.format_of(a),
            recipe.format_of(b),
            recipe.scaling(a),
            recipe.scaling(b),
            out_dtype,
            fast_accum=self._fast_accum(gemm),
        )

    def _fast_accum(self, gemm: Gemm) -> bool:
        """Fast (lower-precision) accumulation only where the output, not a gradient, is made:
        what torchao does, and what Hopper refuses for block scaling anyway."""
        return gemm is Gemm.FORWARD and self.recipe.granularity is Granularity.TENSOR

    def resolve(self, gemm: Gemm, device: str, out_dtype: torch.dtype) -> PathChoice:
        """Probe (once) and remember the path of `gemm` producing `out_dtype` on `device`."""
        choice = choose_path(self.kind(gemm, device, out_dtype))
        self._paths[(gemm, device, out_dtype)] = choice.path
        return choice

    def path(self, gemm: Gemm, device: str, out_dtype: torch.dtype) -> GemmPath:
        path = self._paths.get((gemm, device, out_dtype))
        return path if path is not None else self.resolve(gemm, device, out_dtype).path

    def matmul(
        self, gemm: Gemm, a: Quantized, b: Quantized, out_dtype: torch.dtype
    ) -> torch.Tensor:
        path = self.path(gemm, a.data.device.type, out_dtype)
        return run_path(path, a, b, out_dtype, fast_accum=self._fast_accum(gemm))


class Caster:
    """Casts one linear's tensors to FP8: the recipe's blocks, delayed state, and counts."""

    def __init__(
        self,
        name: str,
        plan: Fp8Plan,
        history: AmaxHistory | None,
        row: int,
        device: torch.device,
    ) -> None:
        self.name, self.plan, self.history = name, plan, history
        self.slot = history.slots[row] if history is not None else None
        self.stats = {role: QuantStats(device) for role in Role}
        # With FP8 all-gathers, per tensor: the amax of the whole (sharded) weight this step.
        self.weight_amax: torch.Tensor | None = None

    def check(self, shape: tuple[int, int], role: Role, contract_dims: tuple[int, ...]) -> None:
        """ValueError naming this layer unless `shape` splits into the recipe's blocks."""
        recipe = self.plan.recipe
        for dim in contract_dims:
            what = f"fp8 {recipe.name}: {self.name} {role.name.lower()}"
            check_blocks(shape, recipe.block(shape, role, dim), what)
            if recipe.granularity is Granularity.TENSOR and shape[dim] % recipe.dimension_multiple:
                raise ValueError(
                    f"{what}: contraction dimension {shape[dim]} is not a multiple of "
                    f"{recipe.dimension_multiple}, which FP8 GEMMs need"
                )

    def cast(
        self, t: torch.Tensor, role: Role, contract_dims: tuple[int, ...], record: bool
    ) -> list[Quantized]:
        """`t` quantized for each contraction dimension; one cast serves all when blocks agree."""
        if not torch.compiler.is_compiling():  # compiled, its layer name would guard each graph
            self.check(t.shape, role, contract_dims)
        if isinstance(t, Fp8Weight):  # all-gathered in FP8 by FSDP: its owner cast it
            return [t.quantized] * len(contract_dims)
        recipe = self.plan.recipe
        if recipe.granularity is Granularity.TENSOR:
            return [self._per_tensor(t, role, block_amax(t, t.shape), record)] * len(contract_dims)
        done: dict[tuple[int, int], Quantized] = {}
        for dim in contract_dims:
            block = recipe.block(t.shape, role, dim)
            if block not in done:
                done[block] = quantize(
                    t,
                    recipe.format_of(role),
                    block,
                    power_of_two=recipe.power_of_two_scales,
                    stats=self._stats(role),
                )
        return [done[recipe.block(t.shape, role, dim)] for dim in contract_dims]

    def cast_weight_shard(self, shard: torch.Tensor) -> Quantized:
        """This rank's shard of the weight, cast for an FP8 all-gather: with the scale of the
        whole weight per tensor (`weight_amax`, reduced over the shards before each forward
        pass), with its own scales per block (the shard holds whole blocks)."""
        recipe = self.plan.recipe
        self.check(tuple(shard.shape), Role.WEIGHT, (1,))
        if recipe.granularity is Granularity.TENSOR:
            # FSDP gathers under no_grad; a weight's amax is the same in every gather of a step.
            return self._per_tensor(shard, Role.WEIGHT, self.weight_amax, record=True)
        block = recipe.block(tuple(shard.shape), Role.WEIGHT, 1)
        return quantize(
            shard,
            recipe.forward_format,
            block,
            power_of_two=recipe.power_of_two_scales,
            stats=self._stats(Role.WEIGHT),
        )

    def _stats(self, role: Role) -> QuantStats | None:
        """Where a cast of `role` counts, on the steps that count (a Python bool to torch.compile:
        it compiles one graph that counts and one that does not)."""
        return self.stats[role] if self.plan.counting else None

    def _per_tensor(
        self, t: torch.Tensor, role: Role, amax: torch.Tensor, record: bool
    ) -> Quantized:
        """`t` with one scale: from the delayed amax history, or from `amax` (its own)."""
        recipe = self.plan.recipe
        fmt, stats = recipe.format_of(role), self._stats(role)
        if self.history is None:
            scale = scale_for_amax(amax, fmt, power_of_two=recipe.power_of_two_scales)
            return quantize_with_scale(t, fmt, t.shape, scale, stats, may_saturate=False)
        if record:
            self.slot.record(role, amax)
        scale = self.slot.scale(role, amax, fmt)
        return quantize_with_scale(t, fmt, t.shape, scale, stats)


class _Fp8Matmul(torch.autograd.Function):
    """x (tokens, in) @ weight^T in FP8; saves only FP8 operands for the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, caster: Caster, training: bool):
        with torch.autocast(x.device.type, enabled=False):  # the products' precision is ours
            return _Fp8Matmul._forward(ctx, x, weight, caster, training)

    @staticmethod
    def _forward(ctx, x: torch.Tensor, weight: torch.Tensor, caster: Caster, training: bool):
        x_dims = (1, 0) if training and weight.requires_grad else (1,)
        x_rows, *x_cols = caster.cast(x, Role.INPUT, x_dims, record=training)
        w_dims = (1, 0) if training and x.requires_grad else (1,)
        w_rows, *w_cols = caster.cast(weight, Role.WEIGHT, w_dims, record=training)
        y = caster.plan.matmul(Gemm.FORWARD, x_rows, w_rows.t(), x.dtype)
        # For the gradients: x blocked along tokens, the weight along its output features.
        kept = [q[0] if q else None for q in (x_cols, w_cols)]
        ctx.caster, ctx.dtypes = caster, (x.dtype, weight.dtype)
        ctx.layouts = [None if q is None else (q.block, q.fmt) for q in kept]
        ctx.save_for_backward(*(t for q in kept if q is not None for t in (q.data, q.scale)))
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        with torch.autocast(grad_y.device.type, enabled=False):
            return _Fp8Matmul._backward(ctx, grad_y)

    @staticmethod
    def _backward(ctx, grad_y: torch.Tensor):
        caster: Caster = ctx.caster
        saved = iter(ctx.saved_tensors)
        x_cols, w_cols = (
            None if layout is None else Quantized(next(saved), next(saved), *layout)
            for layout in ctx.layouts
        )
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dims = (1,) * need_x + (0,) * need_w
        casts = caster.cast(grad_y.contiguous(), Role.GRAD_OUTPUT, dims, record=True)
        grad_x = grad_w = None
        if need_x:
            grad_x = caster.plan.matmul(Gemm.GRAD_INPUT, casts[0], w_cols, ctx.dtypes[0])
        if need_w:
            grad_w = caster.plan.matmul(Gemm.GRAD_WEIGHT, casts[-1].t(), x_cols, ctx.dtypes[1])
        return grad_x, grad_w, None, None


class Fp8Linear(nn.Linear):
    """nn.Linear computing in FP8 through a `Caster`; made from a Linear, sharing its parameters."""

    caster: Caster

    @classmethod
    def from_linear(cls, linear: nn.Linear, caster: Caster) -> Fp8Linear:
        with torch.device("meta"):
            fp8 = cls(linear.in_features, linear.out_features, bias=False)
        fp8.weight = linear.weight
        fp8.bias = linear.bias
        fp8.caster = caster
        fits(linear, caster)
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            y = self._forward_tensor_parallel(x)
        else:
            y = self._matmul(x, self.weight)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):  # as nn.Linear would: output in autocast's dtype
            x = x.to(torch.get_autocast_dtype(device))
        flat = x.reshape(-1, x.shape[-1])
        y = _Fp8Matmul.apply(flat, weight, self.caster, torch.is_grad_enabled())
        return y.reshape(*x.shape[:-1], weight.shape[0])

    def _forward_tensor_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Local FP8 product of local shards, as DTensor's own linear would place them.

        Column-wise (weight Shard(0)): x is replicated, each rank's dx is a partial sum, the output
        is sharded on its last dimension. Row-wise (weight Shard(1)): x is sharded on its last
        dimension, the output is a partial sum the module's output hook reduces.
        """
        weight: DTensor = self.weight
        if not isinstance(x, DTensor) or weight.device_mesh.ndim != 1:
            raise ValueError(
                f"fp8: {self.caster.name}: a tensor-parallel weight needs a DTensor input and a "
                f"1-D mesh, got a {type(x).__name__} input and a "
                f"{weight.device_mesh.ndim}-D mesh"
            )
        placement = weight.placements[0]
        if placement == Shard(0) and x.placements == (Replicate(),):
            local_x = x.to_local(grad_placements=[Partial()])
            out = [Shard(x.ndim - 1)]
        elif placement == Shard(1) and x.placements == (Shard(x.ndim - 1),):
            local_x = x.to_local()
            out = [Partial()]
        else:
            raise ValueError(
                f"fp8: {self.caster.name}: unsupported tensor-parallel layout, weight "
                f"{placement}, input {x.placements}"
            )
        local_y = self._matmul(local_x, weight.to_local())
        return DTensor.from_local(local_y, weight.device_mesh, out, run_check=False)


def fits(linear: nn.Linear, caster: Caster) -> None:
    """ValueError naming the layer unless its weight splits into `caster`'s recipe blocks."""
    try:
        caster.check((linear.out_features, linear.in_features), Role.WEIGHT, (1, 0))
    except ValueError as exc:
        raise ValueError(
            f"{exc}; keep the layer in high precision (--fp8-keep-high-precision "
            f"{caster.name}), drop --fp8-strict, or change the model's dimensions"
        ) from None
