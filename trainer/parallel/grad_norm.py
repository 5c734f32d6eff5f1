"""The global gradient norm, and clipping by it, over parameters on several meshes and stages.

torch's clip_grad_norm_ assumes every gradient lives on one mesh. Here dense weights may be 2-D
DTensors (FSDP x TP), experts DTensors on the expert mesh, and each pipeline rank holds only its
stages' gradients. Each group of same-mesh gradients gives its full norm; their squares add up,
then add up over the pipeline ranks, so every rank clips by the norm one process would compute.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    params: Iterable[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Scale gradients in place so their global 2-norm is at most `max_norm`; returns that norm."""
    groups: dict[object, list[nn.Parameter]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups[key].append(p)
    squares = torch.zeros((), dtype=torch.float32)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares.to(norm.device) + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    total = squares.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
