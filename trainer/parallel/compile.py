"""torch.compile per transformer block: where FP8 pays off, its casts fused into their neighbours.

An FP8 cast is a memory-bound pass over its tensor; eager, each one is a handful of kernels of its
own (amax, scale, scale-and-clamp, cast), compiled one or two fused with their neighbours, and
FP8's speed-ups over bf16 are measured compiled (bench/fp8_gpu.py). As TorchTitan does, each
block is compiled on its own (whole-model graphs take long to build and break at pipeline and
FSDP boundaries anyway), in place with `nn.Module.compile`, so parameter names, hooks and
checkpoints stay as they are. Every block runs the same code, and dynamo treats module parameters
as graph inputs, so a deep model compiles one graph (per FP8 counting mode and dtype), not one
per layer.

Applied after tensor, context and expert parallelism and activation checkpointing (the
recomputation is traced with the block), before the pipeline split and FSDP2: FSDP2's
all-gathers and reduce-scatters run in its hooks around each compiled block. Ring attention's
point-to-point transfers and MoE's token routing break a block's graph; each part between breaks
is compiled.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from trainer.model.llama import Transformer


def apply_compile(model: Transformer) -> None:
    for block in model.layers.values():
        block.compile()
    model.tok_embeddings.register_forward_hook(_settled)


def _settled(module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a plain tensor. Under tensor parallelism it is the result of a
    reduce-scatter still in flight (an AsyncCollectiveTensor); a compiled block took its values
    but not its autograd link, and the embedding got no gradient (torch 2.13, gloo: dp2 and tp2
    agreed to 1e-7 on every other gradient). A copy, made eagerly, costs one activation. It is
    made here, where the embedding runs eagerly: a pre-hook on the block would run inside the
    compiled call, after the link is lost."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output
