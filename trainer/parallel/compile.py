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
is compiled. Measured on 2 gloo ranks against eager: cp2, ep2, pp2 and recomputation with bf16
train alike, but tensor-parallel blocks compiled computed wrong gradients (the same first loss, a
first gradient norm of 2.23 against 2.66), so TrainConfig refuses --compile with --tp > 1.
"""

from __future__ import annotations

from trainer.model.llama import Transformer


def apply_compile(model: Transformer) -> None:
    for block in model.layers.values():
        block.compile()
