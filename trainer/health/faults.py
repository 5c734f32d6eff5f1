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
    --inject-bad-device rank=R
        make rank R's small matmul of the health check before start come out wrong.
Each flag may be given several times. This module parses them and imports no torch, so that
`scaletrain run` can refuse a bad flag before it starts anything; `trainer.health.inject` injects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


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
class BadDeviceFault:
    rank: int


@dataclass(frozen=True)
class FaultPlan:
    """Every fault to inject in a run; empty for a normal run."""

    sdc: tuple[SdcFault, ...] = ()
    stragglers: tuple[StragglerFault, ...] = ()
    loss_spikes: tuple[LossSpikeFault, ...] = field(default_factory=tuple)
    bad_devices: tuple[BadDeviceFault, ...] = ()

    @classmethod
    def parse(
        cls,
        sdc: Iterable[str] = (),
        stragglers: Iterable[str] = (),
        loss_spikes: Iterable[str] = (),
        bad_devices: Iterable[str] = (),
    ) -> FaultPlan:
        """The plan of the command-line flags; ValueError names the flag and the problem."""
        return cls(
            sdc=tuple(_parse_sdc(text) for text in sdc),
            stragglers=tuple(_parse_straggler(text) for text in stragglers),
            loss_spikes=tuple(
                LossSpikeFault(**_fields("--inject-loss-spike", text, {"step": _step}))
                for text in loss_spikes
            ),
            bad_devices=tuple(
                BadDeviceFault(**_fields("--inject-bad-device", text, {"rank": _rank}))
                for text in bad_devices
            ),
        )

    def check_world(self, world: int) -> None:
        """ValueError when a fault names a rank outside a world of `world` ranks."""
        for flag, faults in (
            ("--inject-sdc", self.sdc),
            ("--inject-straggler", self.stragglers),
            ("--inject-bad-device", self.bad_devices),
        ):
            for fault in faults:
                if fault.rank >= world:
                    raise ValueError(
                        f"{flag} rank={fault.rank} is outside the world of {world} ranks"
                    )


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
