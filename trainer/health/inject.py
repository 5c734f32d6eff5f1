"""Injects the faults of a FaultPlan (see `trainer.health.faults`) at the points the trainer calls.

A replay of a step never injects again: a real transient fault does not strike twice in the same
place.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from trainer.health.faults import FaultPlan
from trainer.health.snapshot import local

# The highest exponent bit of each float width: flipping it scales a value by 2^+-(half the range).
_TOP_EXPONENT_BIT = {2: 14, 4: 30, 8: 62}
_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class FaultInjector:
    """Injects the faults of a plan that concern this rank, at the points the trainer calls."""

    def __init__(self, plan: FaultPlan, rank: int, vocab_size: int, device: torch.device) -> None:
        # A busy CPU rank burns CPU time (what it is scored on), an accelerator rank wall time.
        self._clock = time.thread_time if device.type == "cpu" else time.perf_counter
        self._vocab_size = vocab_size
        self._spike_steps = {fault.step for fault in plan.loss_spikes}
        self._delay = sum(fault.delay for fault in plan.stragglers if fault.rank == rank)
        self._flips = {
            (fault.step, fault.target): fault for fault in plan.sdc if fault.rank == rank
        }

    def corrupt_batch(
        self, step: int, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch to train step `step` on: the real one, or bad data for --inject-loss-spike."""
        if step not in self._spike_steps:
            return inputs, targets
        return inputs, (targets + self._vocab_size // 2) % self._vocab_size

    def slow_down(self) -> None:
        """Busy for this rank's --inject-straggler delay: CPU time on a CPU rank, else wall time."""
        if self._delay <= 0:
            return
        started = self._clock()
        while self._clock() - started < self._delay:
            pass

    def flip_gradient(self, step: int, params: Iterable[torch.nn.Parameter]) -> None:
        """--inject-sdc target=grad: corrupt a gradient of step `step` on this rank."""
        fault = self._flips.get((step, "grad"))
        if fault is not None:
            _flip_largest([local(p.grad) for p in params if p.grad is not None], fault.bit)

    def flip_parameter(self, step: int, params: Iterable[torch.nn.Parameter]) -> None:
        """--inject-sdc target=param: corrupt a parameter in memory after step `step`."""
        fault = self._flips.get((step, "param"))
        if fault is not None:
            _flip_largest([local(p) for p in params], fault.bit)


def _flip_largest(tensors: list[torch.Tensor], bit: int | None) -> None:
    """Flip one bit of the largest element, among `tensors`, whose bit is 0: the flip then adds
    to its magnitude and shows (a gradient shard can be all zeros: bytes no text contains)."""
    best: tuple[float, torch.Tensor, int] | None = None
    with torch.no_grad():
        for tensor in tensors:
            width = tensor.element_size()
            flip = _TOP_EXPONENT_BIT[width] if bit is None else bit
            if not 0 <= flip < 8 * width:
                raise ValueError(f"--inject-sdc bit={flip} is outside a {8 * width}-bit value")
            if not tensor.numel():
                continue
            bits = tensor.view(-1).view(_INT_OF_WIDTH[width])
            clear = (bits >> flip) & 1 == 0
            magnitude = torch.where(clear, tensor.view(-1).abs().float(), -1.0)
            index = int(magnitude.argmax())
            if best is None or float(magnitude[index]) > best[0]:
                best = (float(magnitude[index]), bits, index)
        if best is None:
            raise ValueError("--inject-sdc: this rank holds no element to corrupt")
        _, bits, index = best
        flip = _TOP_EXPONENT_BIT[bits.element_size()] if bit is None else bit
        bits[index] ^= torch.tensor(1, dtype=bits.dtype, device=bits.device) << flip
