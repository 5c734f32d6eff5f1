"""Mixture of experts: a top-k router in fp32, grouped SwiGLU experts, an optional shared expert.

Where the experts live is the dispatcher's business. The default keeps every expert on this rank,
so routing is a permutation of the tokens; expert parallelism (trainer/parallel/expert.py) swaps in
a dispatcher that sends each token to the rank holding its expert and brings the results back. The
block computes the same function either way, which is what lets tests compare layouts.

Load balancing, as an option:
- "aux_free" (DeepSeek-V3): a per-expert bias, added to the scores only to choose experts, is
  nudged after every optimizer step towards equal load (`trainer/parallel/expert.py`).
- "aux_loss": a sequence-wise auxiliary loss alpha * sum_i f_i * P_i per sequence (f_i: fraction
  of the sequence's assignments to expert i times E, P_i: mean router probability), added to the
  gradient without changing the reported loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

BALANCE_MODES = ("aux_free", "aux_loss", "none")


@dataclass(frozen=True)
class MoEArgs:
    n_experts: int = 8
    top_k: int = 2
    # Hidden size of each expert's SwiGLU; 0 takes the dense feed-forward's.
    hidden: int = 0
    # Experts every token goes through besides its routed ones (DeepSeek's shared experts).
    n_shared: int = 0
    # 0 never drops. Otherwise each expert takes at most ceil(factor * T * top_k / E) of the T
    # tokens a rank routes in one forward, first come first served; the rest skip the expert.
    capacity_factor: float = 0.0
    balance: str = "aux_free"
    aux_loss_coef: float = 1e-2
    bias_update_rate: float = 1e-3
    # Node-limited routing: experts form n_groups consecutive groups (under expert parallelism,
    # groups of consecutive expert ranks, e.g. nodes); each token picks its top_k experts from its
    # best topk_groups groups, ranked by the sum of each group's two best scores.
    n_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        e = self.n_experts
        if e < 1:
            raise ValueError(f"n_experts must be at least 1, got {e}")
        if not 1 <= self.top_k <= e:
            raise ValueError(f"top_k {self.top_k} must be between 1 and n_experts {e}")
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"moe balance {self.balance!r} is not one of {BALANCE_MODES}")
        if self.capacity_factor < 0:
            raise ValueError(
                f"capacity_factor must be 0 (no dropping) or more, got {self.capacity_factor}"
            )
        if self.n_groups < 1 or e % self.n_groups:
            valid = [g for g in range(1, e + 1) if e % g == 0]
            raise ValueError(
                f"n_expert_groups {self.n_groups} does not divide n_experts {e}; valid: {valid}"
            )
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(
                f"topk_groups {self.topk_groups} must be between 1 and n_expert_groups "
                f"{self.n_groups}"
            )
        reachable = self.topk_groups * (e // self.n_groups)
        if self.top_k > reachable:
            raise ValueError(
                f"top_k {self.top_k} exceeds the {reachable} experts of {self.topk_groups} "
                f"groups of {e // self.n_groups}; raise topk_groups or lower top_k"
            )


class Dispatcher(Protocol):
    """Moves routed tokens to the experts that process them, and the results back."""

    def dispatch(
        self, x: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], Any]:
        """x: token copies sorted by expert; counts: copies per expert (all experts).

        Returns the rows this rank's experts process, sorted by local expert, the number of rows
        per local expert, and whatever `combine` needs to undo the move.
        """
        ...

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' outputs, back in the order `dispatch` received them."""
        ...


class LocalDispatcher:
    """Every expert lives on this rank: nothing moves."""

    def dispatch(
        self, x: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], Any]:
        return x, counts.tolist(), None

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        return y


class Router(nn.Module):
    """Top-k routing computed in fp32 whatever the compute dtype, for stable choices."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.n_experts, bias=False)
        # Aux-loss-free balancing state; persistent so a resumed run keeps its balance.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gate weights (T, k), chosen experts (T, k), all probabilities (T, E) of x (T, dim)."""
        scores = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)
        choice = scores.detach()
        if self.args.balance == "aux_free":
            choice = choice + self.expert_bias
        if self.args.n_groups > 1:
            choice = self._limit_groups(choice)
        experts = choice.topk(self.args.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.args.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, scores

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask every expert outside each token's best `topk_groups` groups."""
        grouped = choice.view(choice.shape[0], self.args.n_groups, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = best.topk(self.args.topk_groups, dim=-1).indices
        masked = torch.ones_like(best, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(masked.unsqueeze(-1), float("-inf")).flatten(1)


class GroupedExperts(nn.Module):
    """n SwiGLU experts stored as three (n, ...) tensors, so expert parallelism shards dim 0."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden).normal_(0.0, 0.02))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim).normal_(0.0, 0.02))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden).normal_(0.0, 0.02))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows sorted by expert, counts[e] of them for local expert e."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        chunks = x.split(counts)
        outs = [(F.silu(c @ w1[e]) * (c @ w3[e])) @ w2[e] for e, c in enumerate(chunks)]
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, dim: int, dense_hidden: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        hidden = args.hidden or dense_hidden
        self.router = Router(dim, args)
        self.experts = GroupedExperts(args.n_experts, dim, hidden)
        self.shared = GroupedExperts(1, dim, hidden * args.n_shared) if args.n_shared else None
        self.dispatcher: Dispatcher = LocalDispatcher()
        # Under context parallelism a sequence spans these ranks (for the sequence-wise aux loss).
        self.sequence_group: dist.ProcessGroup | None = None
        # Routed copies per expert and dropped copies since the last optimizer step.
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("tokens_dropped", torch.zeros(()), persistent=False)

    def init_buffers(self) -> None:
        """Zero the balancing state and the load counters, in place on their device."""
        for buffer in (self.router.expert_bias, self.tokens_per_expert, self.tokens_dropped):
            buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, experts, scores = self.router(flat)
        expert_of = experts.flatten()
        token_of = torch.arange(flat.shape[0], device=x.device).repeat_interleave(self.args.top_k)
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=self.args.n_experts)
        routed = counts.sum()
        if self.args.capacity_factor:
            order, counts = self._drop_over_capacity(order, counts, expert_of, flat.shape[0])
        self._record(counts, routed - counts.sum())

        rows, local_counts, state = self.dispatcher.dispatch(flat[token_of[order]], counts)
        out_sorted = self.dispatcher.combine(self.experts(rows, local_counts), state)
        gate = weights.flatten()[order].unsqueeze(-1).to(out_sorted.dtype)
        out = torch.zeros_like(flat).index_add(0, token_of[order], out_sorted * gate)
        if self.shared is not None:
            out = out + self.shared(flat, [flat.shape[0]])
        out = out.view(bsz, seq, dim)
        if self.args.balance == "aux_loss" and torch.is_grad_enabled():
            out = _AttachAuxLoss.apply(out, self._aux_loss(scores, experts, bsz, seq))
        return out

    def _drop_over_capacity(
        self, order: torch.Tensor, counts: torch.Tensor, expert_of: torch.Tensor, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = math.ceil(
            self.args.capacity_factor * tokens * self.args.top_k / self.args.n_experts
        )
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[expert_of[order]]
        return order[position < capacity], counts.clamp(max=capacity)

    def _record(self, counts: torch.Tensor, dropped: torch.Tensor) -> None:
        # Activation checkpointing re-runs forward inside backward: count each token once. A
        # forward in eval mode (a validation loss) is no load to balance.
        if torch._C._current_graph_task_id() != -1 or not self.training:
            return
        with torch.no_grad():
            self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
            self.tokens_dropped += dropped.to(self.tokens_dropped.dtype)

    def _aux_loss(
        self, scores: torch.Tensor, experts: torch.Tensor, bsz: int, seq: int
    ) -> torch.Tensor:
        e, k = self.args.n_experts, self.args.top_k
        chosen = F.one_hot(experts, e).sum(dim=1).view(bsz, seq, e).sum(dim=1).float()
        stats = torch.cat([chosen, scores.view(bsz, seq, e).sum(dim=1)], dim=-1)
        tokens = seq
        if self.sequence_group is not None:
            stats = dist_fn.all_reduce(stats, group=self.sequence_group)
            tokens = seq * dist.get_world_size(self.sequence_group)
        chosen, probs = stats.split(e, dim=-1)
        f = chosen * e / (k * tokens)
        return self.args.aux_loss_coef * (f * probs / tokens).sum(dim=-1).mean()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on x whose backward also sends gradient 1 into the auxiliary loss.

    This adds the loss's gradient without threading a second output through every block and
    pipeline stage (Megatron-Core's MoEAuxLossAutoScaler does the same).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an expert-parallel weight (a DTensor), or the weight itself."""
    return w.to_local() if isinstance(w, DTensor) else w
