"""Expert parallelism: experts split over the ep ranks, tokens moved by two all-to-alls.

The ep ranks are borrowed from dp_shard·cp (see dims.py): every layer but the experts stays data
parallel over them. Each rank routes its own tokens, sends each copy to the rank holding its expert
(first all-to-all, uneven splits, preceded by an exchange of the split sizes), runs its local
experts on what it received, and sends the results back (second all-to-all). Both exchanges are
autograd-aware, so the backward pass moves gradients the same way in reverse.

Also here: the per-expert load of each step, reduced over every rank that saw different tokens,
which drives the auxiliary-loss-free bias update and is reported per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.model.llama import Transformer
from trainer.model.moe import MoE


class AllToAllDispatcher:
    """Sends routed token copies to the ep rank of their expert and the results back."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.local_experts = n_experts // self.ranks

    def dispatch(
        self, x: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], Any]:
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        # received_counts[p, e]: copies rank p sends to our local expert e.
        received_counts = received_counts.view(self.ranks, self.local_experts)
        send_splits = counts.view(self.ranks, self.local_experts).sum(dim=1).tolist()
        recv_splits = received_counts.sum(dim=1).tolist()
        received = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        by_expert = _source_major_to_expert_major(received_counts)
        state = (by_expert, send_splits, recv_splits)
        return received[by_expert], received_counts.sum(dim=0).tolist(), state

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        by_expert, send_splits, recv_splits = state
        source_major = torch.empty_like(by_expert)
        source_major[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        return all_to_all_single_autograd(y[source_major], send_splits, recv_splits, self.group)


def _source_major_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Row order that regroups rows received as (source, expert) blocks into (expert, source)."""
    flat = counts.flatten()
    starts = torch.cumsum(flat, 0) - flat
    blocks = torch.arange(flat.numel(), device=counts.device).view(counts.shape).t().flatten()
    lengths = flat[blocks]
    first = torch.repeat_interleave(starts[blocks], lengths)
    offset = torch.arange(int(lengths.sum()), device=counts.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    return first + offset


def apply_ep(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's share of every MoE block's experts and route through all-to-all.

    The expert weights become DTensors sharded on the expert dimension, so checkpoints keep the
    full (n_experts, ...) tensors under their usual names.
    """
    for block in model.layers.values():
        moe = block.feed_forward
        if not isinstance(moe, MoE):
            continue
        for name, param in list(moe.experts.named_parameters(recurse=False)):
            shard = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            moe.experts.register_parameter(name, nn.Parameter(shard))
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), moe.args.n_experts)


@dataclass(frozen=True)
class ExpertLoad:
    """Routed token copies per expert in one step, for each MoE layer of the model."""

    per_layer: dict[str, list[int]]
    dropped: int

    @staticmethod
    def merge(parts: list[ExpertLoad]) -> ExpertLoad:
        """One load out of the pipeline stages' loads, each over its own layers."""
        per_layer = {k: v for part in parts for k, v in part.per_layer.items()}
        return ExpertLoad(
            per_layer=dict(sorted(per_layer.items(), key=lambda item: int(item[0]))),
            dropped=sum(part.dropped for part in parts),
        )

    @property
    def imbalance(self) -> float:
        """The busiest expert's load over the mean load, worst layer (1.0 is perfect)."""
        ratios = [max(load) * len(load) / max(1, sum(load)) for load in self.per_layer.values()]
        return max(ratios, default=1.0)


def balance_experts(model: Transformer, data_mesh: DeviceMesh | None) -> ExpertLoad | None:
    """Read and reset the step's expert loads; nudge the aux-free biases towards balance.

    `data_mesh` spans the ranks that saw different tokens (None in one process). Every such rank
    gets the same global loads, so the biases stay identical on all replicas. None for a model
    without MoE layers.
    """
    layers = {k: b.feed_forward for k, b in model.layers.items() if isinstance(b.feed_forward, MoE)}
    if not layers:
        return None
    loads = torch.stack([moe.tokens_per_expert for moe in layers.values()])
    dropped = torch.stack([moe.tokens_dropped for moe in layers.values()]).sum().reshape(1)
    totals = torch.cat([loads.flatten(), dropped])
    if data_mesh is not None:
        dist.all_reduce(totals, group=data_mesh.get_group())
    loads = totals[:-1].view_as(loads)
    with torch.no_grad():
        for moe, load in zip(layers.values(), loads, strict=True):
            if moe.args.balance == "aux_free":
                moe.router.expert_bias += moe.args.bias_update_rate * torch.sign(load.mean() - load)
            moe.tokens_per_expert.zero_()
            moe.tokens_dropped.zero_()
    per_layer = {k: [int(x) for x in load.tolist()] for k, load in zip(layers, loads, strict=True)}
    return ExpertLoad(per_layer=per_layer, dropped=int(totals[-1]))
