"""Tensor parallelism with sequence parallelism, as DTensor plans over the tp mesh.

Between blocks the residual stream is sharded along the sequence (Shard(1)): norms run on their
shard (SequenceParallel), attention and the feed-forward all-gather the sequence on entry and
reduce-scatter on exit (Megatron's sequence parallelism), their projections split column-wise
(q, k, v, w1, w3: whole heads / hidden units per rank) then row-wise (wo, w2). The embedding is
vocabulary-parallel (row-wise over the vocabulary) and so are the logits, which stay sharded over
the vocabulary into a vocabulary-parallel cross-entropy (`loss_parallel`).

A mixture-of-experts block is not split: it sees the whole (all-gathered) sequence and every tp
rank computes it identically, so its weights and gradients agree across tp without a collective
(expert tensor parallelism is not implemented).
"""

from __future__ import annotations

import contextlib

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from trainer.model.llama import Transformer
from trainer.model.moe import MoE


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shard `model` in place over `tp_mesh` (every rank holds the same full model beforehand)."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
        src_data_rank=None,
    )
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
                use_local_output=True,
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if isinstance(block.feed_forward, MoE):
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
            )
        else:
            plan |= {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            }
        parallelize_module(block, tp_mesh, plan, src_data_rank=None)


def loss_context(tp: int) -> contextlib.AbstractContextManager[None]:
    """Where the loss and its backward run: vocabulary-parallel cross-entropy under tp."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
