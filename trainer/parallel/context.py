"""Context parallelism: ring attention over the cp ranks, with a load-balanced causal split.

The sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp-1-r (a head and a tail),
so under the causal mask every rank does the same work at every ring step. Each rank keeps its
queries; key/value blocks travel around the ring with `batch_isend_irecv`, the next transfer in
flight while the current block is computed, and the partial results merge exactly by their
log-sum-exp. The backward pass runs the ring again: each key/value block travels with the gradient
accumulated for it so far and arrives back at its owner after a full turn.

PyTorch's `context_parallel` has no CPU kernel, so this is written on point-to-point operations,
which run on gloo and NCCL alike. Blocks are computed in fp32 whatever the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.model.llama import Transformer
from trainer.model.moe import MoE


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of the tokens `rank` holds: chunk `rank` then chunk 2·cp-1-rank."""
    size = seq_len // (2 * cp)
    head = torch.arange(rank * size, (rank + 1) * size)
    tail = torch.arange((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)
    return torch.cat([head, tail])


def apply_cp(model: Transformer, cp_mesh: DeviceMesh, seq_len: int) -> torch.Tensor:
    """Make `model` attend across the cp ranks; returns the positions this rank must be fed.

    The rotary tables are cut to this rank's positions, so each token keeps its true position.
    """
    group, rank, size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    positions = chunk_positions(seq_len, size, rank)
    model.set_rope_positions(positions)
    for block in model.layers.values():
        block.attention.core = RingAttention(group)
        if isinstance(block.feed_forward, MoE):
            block.feed_forward.sequence_group = group
    return positions


class RingAttention(nn.Module):
    """Causal attention of this rank's queries over the keys and values of the whole ring."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self.group)


class _Ring:
    """Passes tensors one step around the ring: send to the next rank, receive from the previous."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def start(self, tensor: torch.Tensor, tag: int) -> Callable[[], torch.Tensor]:
        """Begin the transfer; the returned function waits and gives the received tensor."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(
                    dist.isend,
                    tensor,
                    group=self.group,
                    tag=tag,
                    group_peer=(self.rank + 1) % self.size,
                ),
                dist.P2POp(
                    dist.irecv,
                    received,
                    group=self.group,
                    tag=tag,
                    group_peer=(self.rank - 1) % self.size,
                ),
            ]
        )

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return received

        return wait


_KV, _GRAD = 0, 1  # tags: key/value blocks and their gradients travel separately


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ring = _Ring(group)
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            incoming = ring.start(kv, _KV) if step < ring.size - 1 else None
            forward_block(qf, kv, ring.rank, (ring.rank - step) % ring.size, ring.size, out, lse)
            if incoming is not None:
                kv = incoming()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        qf, dout = q.float(), grad_out.float()
        delta = (dout * out).sum(dim=-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        # The gradient for the visiting block so far, from the previous rank (none at step 0).
        grad_in: Callable[[], torch.Tensor] = partial(torch.zeros, ())
        for step in range(ring.size):
            incoming = ring.start(kv, _KV) if step < ring.size - 1 else None
            src = (ring.rank - step) % ring.size
            grad = backward_block(qf, kv, dout, lse, delta, ring.rank, src, ring.size, dq)
            grad_in = ring.start(grad + grad_in(), _GRAD)
            if incoming is not None:
                kv = incoming()
        # After a full turn the accumulated gradient of this rank's own block comes home.
        dkv = grad_in()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def forward_block(
    q: torch.Tensor, kv: torch.Tensor, rank: int, src: int, cp: int, out: torch.Tensor,
    lse: torch.Tensor,
) -> None:  # fmt: skip
    """Fold the attention of `rank`'s queries (fp32) over `src`'s key/value block into out, lse."""
    k, v = _expand(kv.float(), q.shape[1])
    for qs, ks, causal in _pairs(rank, src, cp, q.shape[2]):
        block_out, block_lse = _attend(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal)
        _merge(out, lse, qs, block_out, block_lse)


def backward_block(
    q: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, rank: int, src: int, cp: int, dq: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Add this block's share to dq; return its gradient for src's keys and values (stacked)."""
    k, v = _expand(kv.float(), q.shape[1])
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks, causal in _pairs(rank, src, cp, q.shape[2]):
        _attend_backward(
            q[:, :, qs],
            k[:, :, ks],
            v[:, :, ks],
            dout[:, :, qs],
            lse[:, :, qs],
            delta[:, :, qs],
            causal,
            dq[:, :, qs],
            dk[:, :, ks],
            dv[:, :, ks],
        )
    return torch.stack([_reduce_heads(dk, kv.shape[2]), _reduce_heads(dv, kv.shape[2])])


def _pairs(rank: int, src: int, cp: int, local_seq: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) for every pair of half-blocks with something to attend.

    Local halves hold chunks (rank, 2cp-1-rank); the visiting block holds (src, 2cp-1-src). A query
    chunk sees a key chunk fully if later, causally if the same, not at all if earlier.
    """
    half = local_seq // 2
    halves = (slice(0, half), slice(half, local_seq))
    q_chunks, k_chunks = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    return [
        (halves[a], halves[b], qc == kc)
        for a, qc in enumerate(q_chunks)
        for b, kc in enumerate(k_chunks)
        if qc >= kc
    ]


def _expand(kv: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values repeated from their (grouped) heads to the query heads."""
    repeats = n_heads // kv.shape[2]
    return kv[0].repeat_interleave(repeats, dim=1), kv[1].repeat_interleave(repeats, dim=1)


def _reduce_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradients of the query heads that shared each key/value head."""
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = scores.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and the log-sum-exp of its scores per query."""
    scores = _scores(q, k, causal)
    lse = scores.logsumexp(dim=-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse


def _merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: slice,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> None:
    """Fold one block into the running result: softmax weights rescaled by the new total."""
    total = torch.logaddexp(lse[:, :, rows], block_lse)
    out[:, :, rows] = out[:, :, rows] * (lse[:, :, rows] - total).exp().unsqueeze(
        -1
    ) + block_out * (block_lse - total).exp().unsqueeze(-1)
    lse[:, :, rows] = total


def _attend_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, causal: bool, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
) -> None:  # fmt: skip
    """Accumulate one block's gradients, recomputing its probabilities from the final lse."""
    probs = (_scores(q, k, causal) - lse.unsqueeze(-1)).exp()
    dv += probs.transpose(-1, -2) @ dout
    dscores = probs * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1)) * q.shape[-1] ** -0.5
    dq += dscores @ k
    dk += dscores.transpose(-1, -2) @ q
