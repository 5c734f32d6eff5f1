"""Injects the faults of a FaultPlan (see `trainer.health.faults`) at the points the trainer calls.

A replay of a step never injects again, nor does a restarted job computing again a step the run
computed before: a real transient fault does not strike twice in the same place (and a drill
whose corrupted rank was taken out must not find the machine in its place corrupt too). Bad data
(--inject-loss-spike) is the batch's: it comes back with the batch.

Where the trainer offers no call of its own, the injector hooks the live computation: a forward
hook on a transformer block corrupts its output (target=activation) or, through a hook on that
output's gradient, what backward sends into it (target=backward); the FSDP reduce-scatter that
`trainer.health.reduction` installs hands it each collective's output (target=reduction). Each
hook strikes once, in the first run of its step (`begin_step`), never in the replay.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from trainer.health.faults import FaultPlan, SdcFault
from trainer.health.snapshot import local

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# The targets struck from hooks in the live computation (the others, from the guard's calls).
_BLOCK_TARGETS = ("activation", "backward")
_HOOKED = (*_BLOCK_TARGETS, "reduction")


class FaultInjector:
    """Injects the faults of a plan that concern this rank, at the points the trainer calls."""

    def __init__(
        self,
        plan: FaultPlan,
        rank: int,
        vocab_size: int,
        device: torch.device,
        computed_before: int = -1,
    ) -> None:
        """`computed_before`: the newest step the run computed before this job started (-1:
        none); no bit is flipped in a step up to it."""
        # A busy CPU rank burns CPU time (what it is scored on), an accelerator rank wall time.
        self._clock = time.thread_time if device.type == "cpu" else time.perf_counter
        self._vocab_size = vocab_size
        self._spike_steps = {fault.step for fault in plan.loss_spikes}
        self._delay = sum(fault.delay for fault in plan.stragglers if fault.rank == rank)
        self._flips = {
            (fault.step, fault.target): fault
            for fault in plan.sdc
            if fault.rank == rank and fault.step > computed_before
        }
        # The faults the hooks strike in the step under way (`begin_step`), by target.
        self._armed: dict[str, SdcFault] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def strikes(self, target: str) -> bool:
        """Whether any fault of this rank strikes `target`."""
        return any(t == target for _, t in self._flips)

    def attach(self, model: torch.nn.Module) -> None:
        """Hook this rank's transformer blocks (`model.layers`) when a fault strikes their
        outputs or gradients; the block of each fault is drawn among them."""
        if not any(self.strikes(target) for target in _BLOCK_TARGETS):
            return
        blocks = list(getattr(model, "layers", {}).values())
        if not blocks:
            raise ValueError("--inject-sdc target=activation|backward: this rank holds no block")
        for (_, target), fault in self._flips.items():
            if target in _BLOCK_TARGETS:
                block = _draw(fault, "block").choice(blocks)
                self._hooks.append(block.register_forward_hook(self._block_hook(target)))

    def detach(self) -> None:
        """Remove the hooks `attach` put on the model."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def begin_step(self, step: int) -> None:
        """Arm the hooks for the first run of `step` (not its replay: see the module doc)."""
        self._armed = {t: f for (s, t), f in self._flips.items() if s == step and t in _HOOKED}

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
        self._flip(step, "grad", [local(p.grad) for p in params if p.grad is not None])

    def flip_parameter(self, step: int, params: Iterable[torch.nn.Parameter]) -> None:
        """--inject-sdc target=param: corrupt a parameter in memory after step `step`."""
        self._flip(step, "param", [local(p) for p in params])

    def flip_optimizer_state(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """--inject-sdc target=optim: corrupt the optimizer state in memory after step `step`."""
        if (step, "optim") in self._flips:
            values = [v for state in optimizer.state.values() for v in state.values()]
            tensors = [local(v) for v in values if isinstance(v, torch.Tensor)]
            self._flip(step, "optim", [t for t in tensors if t.is_floating_point()])

    def flip_reduction(self, output: torch.Tensor) -> None:
        """--inject-sdc target=reduction: corrupt the output of this step's first reduce-scatter
        (called by `trainer.health.reduction` after each one)."""
        fault = self._armed.pop("reduction", None)
        if fault is not None:
            flip_one([output], fault, _draw(fault))

    def _flip(self, step: int, target: str, tensors: list[torch.Tensor]) -> None:
        fault = self._flips.get((step, target))
        if fault is not None:
            flip_one(tensors, fault, _draw(fault))

    def _block_hook(self, target: str) -> Callable[[torch.nn.Module, object, torch.Tensor], None]:
        """A forward hook striking the armed fault of `target` into a block's output, once."""

        def hook(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> None:
            fault = self._armed.pop(target, None)
            if fault is None:
                return
            draw = _draw(fault)
            if target == "activation":
                flip_one([local(output)], fault, draw)
                return

            def corrupt(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                flip_one([local(grad)], fault, draw)
                return grad

            output.register_hook(corrupt)

        return hook


@dataclass(frozen=True)
class FloatBits:
    """Where the fields of a floating-point format lie: sign, exponent, mantissa bit ranges."""

    width: int
    mantissa: int

    @classmethod
    def of(cls, dtype: torch.dtype) -> FloatBits:
        info = torch.finfo(dtype)
        return cls(info.bits, round(-math.log2(info.eps)))

    def bit_range(self, bits: str) -> range:
        """The bits of class `bits` (trainer.health.faults.BIT_CLASSES)."""
        half = self.mantissa // 2
        return {
            "sign": range(self.width - 1, self.width),
            "exponent": range(self.mantissa, self.width - 1),
            "mantissa-high": range(half, self.mantissa),
            "mantissa-low": range(0, half),
        }[bits]


def flip_one(tensors: list[torch.Tensor], fault: SdcFault, draw: random.Random) -> None:
    """Flip one bit of one element among `tensors` (floating point), as `fault` says: bit
    `fault.bit`, or one drawn from class `fault.bits`, else the top exponent bit (the flip then
    scales a value by 2^+-(half the range)); of the largest element whose bit is 0, or of an
    element drawn uniformly over all of them (`fault.element`)."""
    sized = [t for t in tensors if t.numel()]
    if not sized:
        raise ValueError("--inject-sdc: this rank holds no element to corrupt")
    floats = FloatBits.of(sized[0].dtype)
    if fault.bit is not None:
        bit = fault.bit
    elif fault.bits is not None:
        bit = draw.choice(floats.bit_range(fault.bits))
    else:
        bit = floats.width - 2
    if not 0 <= bit < floats.width:
        raise ValueError(f"--inject-sdc bit={bit} is outside a {floats.width}-bit value")
    with torch.no_grad():
        views = [t.view(-1).view(_INT_OF_WIDTH[t.element_size()]) for t in sized]
        if fault.element == "random":
            index = draw.randrange(sum(v.numel() for v in views))
            for bits in views:
                if index < bits.numel():
                    break
                index -= bits.numel()
        else:
            bits, index = _largest_clear(sized, views, bit)
        bits[index] ^= torch.tensor(1, dtype=bits.dtype, device=bits.device) << bit


def _largest_clear(
    tensors: list[torch.Tensor], views: list[torch.Tensor], bit: int
) -> tuple[torch.Tensor, int]:
    """The integer view and index of the largest element whose `bit` is 0 (a gradient shard can
    be all zeros: bytes no text contains, so the element's size, not its tensor, decides)."""
    best: tuple[float, torch.Tensor, int] | None = None
    for tensor, bits in zip(tensors, views, strict=True):
        clear = (bits >> bit) & 1 == 0
        magnitude = torch.where(clear, tensor.view(-1).abs().float(), -1.0)
        index = int(magnitude.argmax())
        if best is None or float(magnitude[index]) > best[0]:
            best = (float(magnitude[index]), bits, index)
    assert best is not None
    return best[1], best[2]


def _draw(fault: SdcFault, what: str = "flip") -> random.Random:
    """The random draws of `fault` for `what` (its block; its bit and element): seeded by its
    seed, step, rank and target, so that a run with the same flags strikes the same place."""
    return random.Random(f"{fault.seed}/{fault.step}/{fault.rank}/{fault.target}/{what}")
