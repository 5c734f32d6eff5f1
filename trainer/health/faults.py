"""Faults injected on purpose, to prove that the health checks catch them.

    --inject-sdc step=K,rank=R[,target=T][,bit=B|bits=CLASS][,element=largest|random][,seed=S]
        flip one bit of one element on rank R, in step K, where target T says:
          grad        its gradient shards right after backward (what the optimizer reads: the
                      reductions' result as it lies in memory; the default),
          param       its parameter shards after step K (corruption in memory, at rest),
          optim       its optimizer state after step K (at rest),
          activation  the output of one of its transformer blocks in step K's forward,
          backward    the gradient arriving at one of its blocks' output in step K's backward
                      (compute, before any reduction),
          reduction   the output of one of its FSDP reduce-scatters in step K (the collective's
                      result, before HSDP's all-reduce across replicas).
        The bit: B, or one drawn from CLASS (sign, exponent, mantissa-high: the upper half of the
        mantissa, mantissa-low: its lower half), else the top exponent bit. The element: the
        largest whose bit is 0 (the flip then adds to its magnitude and shows: the default), or
        one drawn uniformly; the block too is drawn. Draws are seeded by S, K, R and T.
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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Where --inject-sdc can strike (see the module docstring); bit classes; element choices.
SDC_TARGETS = ("grad", "param", "optim", "activation", "backward", "reduction")
BIT_CLASSES = ("sign", "exponent", "mantissa-high", "mantissa-low")
ELEMENTS = ("largest", "random")


@dataclass(frozen=True)
class SdcFault:
    step: int
    rank: int
    target: str = "grad"
    # None: a bit of class `bits`, or the top exponent bit of the tensor's float width.
    bit: int | None = None
    element: str = "largest"
    bits: str | None = None
    seed: int = 0


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
                BadDeviceFault(**_fields("--inject-bad-device", text, {"rank": _non_negative}))
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
        {"step": _step, "rank": _non_negative},
        {
            "target": _choice(SDC_TARGETS),
            "bit": _bit,
            "element": _choice(ELEMENTS),
            "bits": _choice(BIT_CLASSES),
            "seed": _non_negative,
        },
    )
    if "bit" in values and "bits" in values:
        raise ValueError(f"--inject-sdc {text!r}: give bit or bits, not both")
    return SdcFault(**values)


def _parse_straggler(text: str) -> StragglerFault:
    fields = {"rank": _non_negative, "delay": _seconds}
    return StragglerFault(**_fields("--inject-straggler", text, fields))


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


def _non_negative(raw: str) -> int:
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


def _choice(allowed: tuple[str, ...]) -> Callable[[str], str]:
    """A converter that accepts only the names `allowed`."""

    def convert(raw: str) -> str:
        if raw not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {raw!r}")
        return raw

    return convert
