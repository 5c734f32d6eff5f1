"""Silent data corruption: what must agree across ranks, and what replaying a suspicious step says.

Pure decisions over what every rank saw of a step (gathered to every rank, so all ranks decide the
same). A step is suspicious when
  - values every rank must hold identically differ: the all-reduced loss and gradient norm on every
    rank, the parameters and optimizer state of data-parallel replicas (HSDP) after the step;
  - a rank's FSDP reduce-scatter result does not sum to what the ranks sent it
    (`trainer.health.reduction`);
  - or the loss or the gradient norm spikes (see `trainer.health.stats`).
The step is then replayed from the state before it, on the same batch, with deterministic kernels.
A replay that reproduces every rank's result bit for bit says the data caused it; otherwise the
first quantity, in the order the step computes them, that came out differently names the rank(s)
whose hardware corrupted it.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields

from trainer.health.stats import RollingSignal, Spike


@dataclass(frozen=True)
class RankStats:
    """One rank's view of one step; floats as their float64 bit patterns, compared exactly."""

    # The all-reduced mean loss and the total gradient norm as this rank holds them.
    global_loss: int
    grad_norm: int
    # This rank's own loss before the all-reduce.
    local_loss: int
    # Checksum of this rank's gradient shards before clipping.
    grads: int
    # Checksum of this rank's parameters and optimizer state after the step.
    state: int
    # 0 when this rank's state changed between the previous step's end and this step's start.
    at_rest_ok: int
    # Checksum of the gradients this rank sent to its reduce-scatters (0: none checked).
    reduce_inputs: int = 0
    # 0 when one of this rank's reduce-scatter results did not sum to what the ranks sent it.
    reduce_ok: int = 1

    def row(self) -> list[int]:
        return [getattr(self, field.name) for field in fields(self)]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> RankStats:
        return cls(*row)


def float_bits(value: float) -> int:
    """The float64 bit pattern of `value` as a signed 64-bit integer."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class Suspicion:
    """Why a step looks wrong; `ranks` are those the cross-rank checks single out (maybe none)."""

    reasons: list[str]
    ranks: list[int]
    loss_spike: Spike | None
    grad_spike: Spike | None
    # The value every rank should hold (the most common one): the run's loss and gradient norm.
    loss: float
    grad_norm: float


@dataclass(frozen=True)
class Verdict:
    """What a replay said: data (reproduced exactly) or corruption on `ranks` at `stage`."""

    corrupted: bool
    ranks: list[int]
    # "data", or where the corruption showed first: "forward", "backward" (what a rank sent to
    # its reduce-scatters), "reduce-scatter" (what one received), "gradients", "reduction" (the
    # all-reduced loss or gradient norm), "optimizer" or "replicas".
    stage: str
    # Whether the replay gave the same results (a corruption can reproduce: a deterministic fault).
    reproduced: bool


def check(
    stats: Sequence[RankStats],
    replica_groups: Sequence[Sequence[int]],
    loss: RollingSignal,
    grad_norm: RollingSignal,
) -> Suspicion | None:
    """The suspicion a step raises, or None for a normal step. Reads, never adds to, the signals."""
    reasons: list[str] = []
    suspects: set[int] = set()
    for name in ("global_loss", "grad_norm"):
        odd = minority([getattr(s, name) for s in stats])
        if odd:
            reasons.append(f"the all-reduced {name.replace('_', ' ')} differs on ranks {odd}")
            suspects.update(odd)
    for group in replica_groups:
        odd = [group[i] for i in minority([stats[rank].state for rank in group])]
        if odd:
            reasons.append(f"replicas {list(group)} hold different state after the step: {odd}")
            suspects.update(odd)
    wrong = _unreduced(stats)
    if wrong:
        reasons.append(f"the reduce-scatter results of ranks {wrong} do not sum to their inputs")
        suspects.update(wrong)
    value, norm = consensus_values(stats)
    loss_spike, grad_spike = loss.spike(value), grad_norm.spike(norm)
    for name, observed, spike in (("loss", value, loss_spike), ("gradient norm", norm, grad_spike)):
        if spike is not None:
            reasons.append(
                f"{name} {observed:.4g} spikes above {spike.threshold:.4g}"
                if math.isfinite(observed)
                else f"{name} is {observed}"
            )
    if not reasons:
        return None
    return Suspicion(reasons, sorted(suspects), loss_spike, grad_spike, value, norm)


def classify(
    original: Sequence[RankStats],
    replay: Sequence[RankStats],
    replica_groups: Sequence[Sequence[int]],
) -> Verdict:
    """Compare a step with its replay, in the order the step computes things."""
    for stage, name in (("forward", "local_loss"), ("backward", "reduce_inputs")):
        ranks = _changed(original, replay, name)
        if ranks:
            return Verdict(True, ranks, stage, reproduced=False)
    wrong = _unreduced(original)
    if wrong:
        return Verdict(True, wrong, "reduce-scatter", reproduced=_unreduced(replay) == wrong)
    ranks = _changed(original, replay, "grads")
    if ranks:
        return Verdict(True, ranks, "gradients", reproduced=False)
    for name in ("global_loss", "grad_norm"):
        odd = minority([getattr(s, name) for s in original])
        if odd:
            again = minority([getattr(s, name) for s in replay]) == odd
            return Verdict(True, odd, "reduction", reproduced=again)
    ranks = _changed(original, replay, "state")
    if ranks:
        return Verdict(True, ranks, "optimizer", reproduced=False)
    for group in replica_groups:
        odd = [group[i] for i in minority([original[rank].state for rank in group])]
        if odd:
            return Verdict(True, odd, "replicas", reproduced=True)
    return Verdict(False, [], "data", reproduced=True)


def consensus_values(stats: Sequence[RankStats]) -> tuple[float, float]:
    """The run's mean loss and gradient norm of a step: the values most ranks hold."""
    return (
        bits_float(consensus([s.global_loss for s in stats])),
        bits_float(consensus([s.grad_norm for s in stats])),
    )


def minority(values: Sequence[int]) -> list[int]:
    """Indices of the values that differ from the most common one; all of them on a tie."""
    counts = Counter(values)
    if len(counts) <= 1:
        return []
    (_, top), (_, second) = counts.most_common(2)
    if top == second:
        return list(range(len(values)))
    common = counts.most_common(1)[0][0]
    return [index for index, value in enumerate(values) if value != common]


def consensus(values: Sequence[int]) -> int:
    """The most common value (the lowest rank's among equally common ones)."""
    counts = Counter(values)
    best = max(counts.values())
    return next(value for value in values if counts[value] == best)


def _unreduced(stats: Sequence[RankStats]) -> list[int]:
    """The ranks whose reduce-scatter results did not sum to their inputs."""
    return [rank for rank, view in enumerate(stats) if not view.reduce_ok]


def _changed(original: Sequence[RankStats], replay: Sequence[RankStats], name: str) -> list[int]:
    return [
        rank
        for rank, (before, again) in enumerate(zip(original, replay, strict=True))
        if getattr(before, name) != getattr(again, name)
    ]
