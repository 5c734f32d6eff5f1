"""FSDP2: shard each transformer block, then the root, over the data-parallel mesh."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.model.llama import Transformer


def apply_fsdp(
    model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype | None = None
) -> None:
    """Shard `model` in place with `fully_shard`: per block, then at the root.

    With a 2-D mesh (dp_replicate, dp_shard) this is HSDP: parameters are sharded within a
    dp_shard group and replicated across groups. `param_dtype` (e.g. bf16) enables mixed precision
    with fp32 gradient reductions; None keeps everything in fp32, bitwise comparable to one process.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    dp_mesh = mesh if mesh.ndim == 1 or mesh.shape[0] > 1 else mesh["dp_shard"]
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(
            block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=index < len(blocks) - 1
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
