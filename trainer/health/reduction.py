"""The FSDP reduce-scatters of a step, watched: checked against their inputs, and struck by
--inject-sdc target=reduction.

A reduce-scatter sums (or averages) every rank's gradient buffer and leaves each rank one shard of
the result, which no other rank holds: no replica check can see a fault in it, and under HSDP the
all-reduce across replicas then hands the corrupted shard to every replica alike. Its arithmetic
keeps an invariant all the same: a shard's elements sum to the sum, over the group's ranks, of the
elements each rank sent for that shard (divided by the group's size for an average). Each rank sums
what it sends for every shard and what it received (in float64, one pass over each); after
backward, one all-reduce of those sums over the group, which completes while the optimizer steps,
tells every rank what its shard should have summed to. The reduction rounds each output element at
most `size` times (the sum, then the division of an average), each time by at most half an ulp of a
value no larger than the sum of the magnitudes sent for it: a difference within size x eps x that
sum is rounding, never an alarm, while a flipped sign, exponent or high mantissa bit of all but the
smallest elements is far beyond it (bench/sdc_coverage.py measures both sides).

The watch also takes an exact checksum of the inputs this rank sent, which the step guard compares
with a replay's: a fault in backward, before the reduction, changes this rank's inputs and no
other rank's, and so names the rank, where the reduced shards it spread to would name their owners.

Installed with FSDP2's public `set_custom_reduce_scatter` (its `ReduceScatter` interface lives in
a private module); the collective itself is the one FSDP runs by default, synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from trainer.health.inject import FaultInjector
from trainer.health.snapshot import bit_sum, signed64


@dataclass(frozen=True)
class Reductions:
    """What this rank's reduce-scatters of one run of a step body say."""

    # The exact checksum of every input this rank sent (0: none ran).
    inputs: int = 0
    # Whether every output summed as its inputs say.
    ok: bool = True


@dataclass
class _Sums:
    """The sums of one group's reduce-scatters since the last check."""

    # Per reduce-scatter: the sum and the sum of magnitudes of what this rank sent for each shard.
    sent: list[torch.Tensor] = field(default_factory=list)
    # Per reduce-scatter: the sum of this rank's output, times the group's size for an average.
    received: list[torch.Tensor] = field(default_factory=list)
    # Per reduce-scatter: the float format's epsilon.
    eps: list[float] = field(default_factory=list)


class WatchedReduceScatter(ReduceScatter):
    """The reduce-scatter of every FSDP module of a model: runs the collective, hands its output
    to the injector, and keeps the sums and checksums `settle` checks."""

    def __init__(self, faults: FaultInjector, check: bool) -> None:
        self._faults = faults
        self._check = check
        self._groups: dict[dist.ProcessGroup, _Sums] = {}
        self._input_sums: list[torch.Tensor] = []

    def allocate(
        self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)
        self._faults.flip_reduction(output_tensor)
        if self._check and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            self._record(output_tensor, input_tensor, group, op == dist.ReduceOp.AVG)

    def _record(
        self, output: torch.Tensor, sent: torch.Tensor, group: dist.ProcessGroup, average: bool
    ) -> None:
        size = group.size()
        shards = sent.view(size, -1)
        sums = self._groups.setdefault(group, _Sums())
        sums.sent.append(
            torch.stack(
                [
                    shards.sum(dim=1, dtype=torch.float64),
                    shards.abs().sum(dim=1, dtype=torch.float64),
                ]
            )
        )
        received = output.sum(dtype=torch.float64)
        sums.received.append(received * size if average else received)
        sums.eps.append(torch.finfo(output.dtype).eps)
        self._input_sums.append(bit_sum(sent) * (len(self._input_sums) + 1))

    def settle(self) -> Settling:
        """Start checking the reduce-scatters since the last call (one all-reduce per group,
        every rank of which ran the same ones, launched without waiting: it completes while the
        step goes on) and start over."""
        checks = []
        for group, sums in self._groups.items():
            sent = torch.stack(sums.sent)
            work = dist.all_reduce(sent, group=group, async_op=True)
            checks.append((work, sent, sums, group.rank(), group.size()))
        inputs = signed64(int(torch.stack(self._input_sums).sum())) if self._input_sums else 0
        self._groups = {}
        self._input_sums = []
        return Settling(inputs, checks)


class Settling:
    """A check of reduce-scatters under way: its all-reduces launched, waited for by `result`."""

    def __init__(
        self, inputs: int, checks: list[tuple[dist.Work, torch.Tensor, _Sums, int, int]]
    ) -> None:
        self._inputs = inputs
        self._checks = checks

    def result(self) -> Reductions:
        ok = True
        for work, sent, sums, rank, size in self._checks:
            work.wait()
            mine = sent[:, :, rank]
            tolerance = size * torch.tensor(sums.eps, dtype=torch.float64) * mine[:, 1]
            ok &= bool(((torch.stack(sums.received) - mine[:, 0]).abs() <= tolerance).all())
        return Reductions(self._inputs, ok)


def watch_reductions(
    model: torch.nn.Module, faults: FaultInjector, check: bool
) -> WatchedReduceScatter | None:
    """Install a `WatchedReduceScatter` on every FSDP module of `model` (None: none is FSDP's),
    in place of any a guard built earlier on the same model installed. Unchecked, it only runs
    the collective and hands the output to `faults`.

    Under pipelining the stages' own roots (embeddings, final norm, output) are not modules of
    `model` and keep FSDP's reduce-scatter: their shards go unchecked."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        return None
    watch = WatchedReduceScatter(faults, check)
    for module in modules:
        module.set_custom_reduce_scatter(watch)
    return watch
