"""FSDP2 all-gathers of FP8 weights: one byte per value on the wire instead of four (or two).

FSDP2 lets the local tensor of a sharded parameter choose what is all-gathered
(`fsdp_pre_all_gather`) and what the gathered bytes become (`fsdp_post_all_gather`).
`Fp8ShardedWeight` wraps each rank's high-precision shard of an FP8 linear's weight and casts it
just before the all-gather, with the layer's own weight scaling:

- per tensor, every shard needs the same scale: delayed scaling takes it from the amax history
  (replicated on every rank) once it has one; otherwise from the weight's amax, reduced over the
  ranks before each forward pass for all weights in one all-reduce (`reduce_weight_amax`);
- 128x128 blocks: a shard of whole blocks owns its scales, which are all-gathered with the data.

`Fp8Weight`, the gathered parameter, carries the FP8 matrix and its scales and the FP8 linear
multiplies with them as they are: a weight is cast once per all-gather, by its owner, and never
exists in high precision on the ranks that gather it. MXFP8 casts a weight along each dimension
for a different product, so its weights are gathered in high precision (refused here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.fp8.quantize import Quantized, block_amax
from trainer.fp8.recipes import Fp8Recipe, Granularity

# What FSDP2 does to a parameter while sharding it (pad, chunk, copy, move): the result must stay
# an Fp8ShardedWeight. Every other op sees the plain shard.
_KEEP_WRAPPED = {
    torch.ops.aten.detach.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


def check_all_gather(recipe: Fp8Recipe) -> None:
    """ValueError unless `recipe`'s weights can be all-gathered in FP8."""
    if recipe.granularity is Granularity.MX:
        raise ValueError(
            "fp8 mxfp8: weights are cast along each dimension for a different product, so they "
            "cannot be all-gathered in FP8; drop --fp8-all-gather"
        )


class Fp8ShardedWeight(torch.Tensor):
    """A high-precision weight (shard) that FSDP2 all-gathers in FP8 under its layer's caster."""

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, caster: Any) -> Fp8ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, caster: Any) -> None:
        self._tensor = tensor
        self._caster = caster

    def __repr__(self) -> str:
        return f"Fp8ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        casters = []

        def unwrap(t: Fp8ShardedWeight) -> torch.Tensor:
            casters.append(t._caster)
            return t._tensor

        args, kwargs = pytree.tree_map_only(Fp8ShardedWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, casters[0]), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._caster

    @staticmethod
    def __tensor_unflatten__(inner, caster, outer_size, outer_stride):
        return Fp8ShardedWeight(inner["_tensor"], caster)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Cast this shard; all-gather its FP8 bytes (and block scales, which are its own)."""
        q = self._caster.cast_weight_shard(self._tensor)
        shape = (outer_size[0], outer_size[1])
        if q.block == tuple(self._tensor.shape):  # per tensor: the same scale on every rank
            return (q.data,), (shape, q.fmt, q.scale)
        return (q.data, q.scale), (shape, q.fmt, q.block)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        shape, fmt, scale_or_block = metadata
        data = outputs[0].view(shape)
        if len(outputs) == 1:
            q = Quantized(data, scale_or_block.reshape(1, 1), shape, fmt)
        else:
            block = scale_or_block
            scale = outputs[1].view(shape[0] // block[0], shape[1] // block[1])
            q = Quantized(data, scale, block, fmt)
        if out is not None:  # the gathered parameter exists: its storage was just refilled
            out.quantized = q
            return None
        return Fp8Weight(q, param_dtype), tuple(outputs)


class Fp8Weight(torch.Tensor):
    """A gathered weight held as FP8 with scales; looks like a `dtype` matrix of its shape.

    The FP8 linear reads `quantized` directly. Any other use sees the dequantized matrix.
    """

    quantized: Quantized

    @staticmethod
    def __new__(cls, quantized: Quantized, dtype: torch.dtype) -> Fp8Weight:
        data = quantized.data
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(self, quantized: Quantized, dtype: torch.dtype) -> None:
        self.quantized = quantized

    def __repr__(self) -> str:
        return f"Fp8Weight({tuple(self.shape)}, {self.quantized.fmt.name})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in pytree.tree_leaves(args) if isinstance(a, Fp8Weight))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) or (
            func in (torch.ops.aten.view.default, torch.ops.aten.as_strided.default)
            and tuple(args[1]) == tuple(first.shape)
        ):
            return cls(first.quantized, first.dtype)

        def dequantize(t: Fp8Weight) -> torch.Tensor:
            return t.quantized.dequantize().to(t.dtype)

        args, kwargs = pytree.tree_map_only(Fp8Weight, dequantize, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        q = self.quantized
        return ["_data", "_scale"], (q.block, q.fmt, self.dtype)

    @property
    def _data(self) -> torch.Tensor:
        return self.quantized.data

    @property
    def _scale(self) -> torch.Tensor:
        return self.quantized.scale

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        block, fmt, dtype = meta
        return Fp8Weight(Quantized(inner["_data"], inner["_scale"], block, fmt), dtype)


def shard_weights_in_fp8(layers: dict[str, nn.Module]) -> None:
    """Make each FP8 linear's weight an Fp8ShardedWeight (before `fully_shard`)."""
    for layer in layers.values():
        weight = layer.weight
        layer.weight = nn.Parameter(
            Fp8ShardedWeight(weight.data, layer.caster), requires_grad=weight.requires_grad
        )


@torch.no_grad()
def reduce_weight_amax(layers: dict[str, nn.Module], group: dist.ProcessGroup | None) -> None:
    """Set every layer's `caster.weight_amax` to the amax of its whole weight: the max over the
    shards, for all layers in one all-reduce, so every rank casts its shard with one scale."""
    shards = [_shard(layer.weight) for layer in layers.values()]
    amax = torch.stack([block_amax(s, tuple(s.shape)).reshape(()) for s in shards])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for layer, value in zip(layers.values(), amax, strict=True):
        layer.caster.weight_amax = value.reshape(1, 1)


def _shard(weight: torch.Tensor) -> torch.Tensor:
    """The plain high-precision tensor under a (possibly FSDP-sharded) Fp8ShardedWeight."""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return local._tensor
