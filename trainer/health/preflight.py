"""Health checks before a job (re)starts: a quick collective and a small matmul on every rank.

A device that computes wrong results, or a rank that cannot reach its peers, is better found before
training than by a corrupted step or a hung collective. Each rank multiplies two small integer
matrices (exact in float32, so the result is known bit for bit from a float64 product on the CPU)
and takes part in an all-reduce whose sum is known; every rank learns every rank's verdict through
one all_gather, so all ranks refuse to start together and name the failing ranks.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from scaletrain.errors import ScaletrainError

_SIZE = 64


def _operands(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.arange(_SIZE, dtype=torch.float64)
    a = (index[:, None] + index[None, :]) % 7
    b = (index[:, None] * index[None, :]) % 5
    return a.to(device, torch.float32), b.to(device, torch.float32)


def matmul_ok(device: torch.device, corrupt: bool = False) -> bool:
    """Whether this device multiplies two small integer matrices exactly.

    `corrupt` flips one element of the result, as a faulty device would (--inject-bad-device).
    """
    a, b = _operands(device)
    got = a @ b
    if corrupt:
        got[0, 0] += 1.0
    expected = a.double().cpu() @ b.double().cpu()
    return bool(torch.equal(got.double().cpu(), expected))


def check_ranks(device: torch.device, corrupt: bool = False) -> None:
    """Run the checks on every rank; ScaletrainError on every rank names the failing ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = matmul_ok(device, corrupt)
    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)
    summed = float(total.item()) == world * (world + 1) / 2
    verdict = torch.tensor([int(ok), int(summed)], device=device)
    verdicts = [torch.empty_like(verdict) for _ in range(world)]
    dist.all_gather(verdicts, verdict)
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    failing = []
    for peer, (matmul, collective) in enumerate(torch.stack(verdicts).tolist()):
        what = [w for w, good in (("matmul", matmul), ("all-reduce", collective)) if not good]
        if what:
            failing.append(f"rank {peer} on {hosts[peer]} ({' and '.join(what)} wrong)")
    if failing:
        raise ScaletrainError(f"health check before start failed: {'; '.join(failing)}")
