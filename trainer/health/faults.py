"""Faults injected on purpose, to prove that the health checks catch them.

    --inject-sdc step=K,rank=R[,target=grad|param][,bit=B]
        flip bit B (default: the top exponent bit) of the largest element of rank R's first
        gradient shard right after step K's backward pass (target=grad: corruption in compute),
        or of its first parameter shard after step K (target=param: corruption in memory).
    --inject-straggler rank=R,delay=SECONDS
        make rank R do SECONDS more work in every step (a busy loop: a slow device computes, it
        does not sleep).
    --inject-loss-spike step=K
        replace the targets of step K's batch by bytes no text contains: bad data, which a replay
        reproduces.
Each flag may be given several times. A replay of a step never injects again: a real transient
fault does not strike twice in the same place.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from trainer.health.snapshot import local

# The highest exponent bit of each float width: flipping it scales a value by 2^+-(half the range).
_TOP_EXPONENT_BIT = {2: 14, 4: 30, 8: 62}
_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class SdcFault:
    step: int
    rank: int
    target: str = "grad"
    # None: the top exponent bit of the tensor's float width.
    bit: int | None = None


@dataclass(frozen=True)
class StragglerFault:
    rank: int
    delay: float


@dataclass(frozen=True)
class LossSpikeFault:
    step: int


@dataclass(frozen=True)
class FaultPlan:
    """Every fault to inject in a run; empty for a normal run."""

    sdc: tuple[SdcFault, ...] = ()
    stragglers: tuple[StragglerFault, ...] = ()
    loss_spikes: tuple[LossSpikeFault, ...] = field(default_factory=tuple)

    @classmethod
    def parse(
        cls,
        sdc: Iterable[str] = (),
        stragglers: Iterable[str] = (),
        loss_spikes: Iterable[str] = (),
    ) -> FaultPlan:
        """The plan of the command-line flags; ValueError names the flag and the problem."""
        return cls(
            sdc=tuple(_parse_sdc(text) for text in sdc),
            stragglers=tuple(_parse_straggler(text) for text in stragglers),
            loss_spikes=tuple(
                LossSpikeFault(**_fields("--inject-loss-spike", text, {"step": _step}))
                for text in loss_spikes
            ),
        )

    def check_world(self, world: int) -> None:
        """ValueError when a fault names a rank outside a world of `world` ranks."""
        for flag, faults in (("--inject-sdc", self.sdc), ("--inject-straggler", self.stragglers)):
            for fault in faults:
                if fault.rank >= world:
                    raise ValueError(
                        f"{flag} rank={fault.rank} is outside the world of {world} ranks"
                    )


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


def _parse_sdc(text: str) -> SdcFault:
    values = _fields(
        "--inject-sdc",
        text,
        {"step": _step, "rank": _rank},
        {"target": _target, "bit": _bit},
    )
    return SdcFault(**values)


def _parse_straggler(text: str) -> StragglerFault:
    return StragglerFault(**_fields("--inject-straggler", text, {"rank": _rank, "delay": _seconds}))


def _fields(flag: str, text: str, required: dict, optional: dict | None = None) -> dict:
    """KEY=VALUE pairs separated by commas, each converted by its function."""
    optional = optional or {}
    known = {**required, **optional}
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, raw = item.partition("=")
        if not equals or key not in known:
            raise ValueError(
                f"{flag} {text!r}: expected {','.join(f'{k}=...' for k in known)}, got {item!r}"
            )
        try:
            values[key] = known[key](raw)
        except ValueError as exc:
            raise ValueError(f"{flag} {text!r}: {key}: {exc}") from None
    missing = [key for key in required if key not in values]
    if missing:
        raise ValueError(f"{flag} {text!r}: missing {', '.join(missing)}")
    return values


def _step(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(f"must be a step number of 1 or more, got {value}")
    return value


def _rank(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


def _bit(raw: str) -> int:
    value = int(raw)
    if not 0 <= value < 64:
        raise ValueError(f"must be between 0 and 63, got {value}")
    return value


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError(f"must be a positive number of seconds, got {raw}")
    return value


def _target(raw: str) -> str:
    if raw not in ("grad", "param"):
        raise ValueError(f"must be grad or param, got {raw!r}")
    return raw
