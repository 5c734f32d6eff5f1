"""Straggler detection from per-rank compute times, as NVIDIA's resiliency extension scores ranks.

In synchronous training every rank waits for the slowest at each collective, so step times are all
alike and tell nothing; what differs is each rank's own work (`compute` of PhaseTimes). Each step,
each rank gets two scores:
  - relative: the median compute time of the *other* ranks over its own (1.0 typical, 0.5 twice as
    slow as its peers), which singles out the rank that holds the others back;
  - individual: its own best compute time over its current one, which tells a rank that slowed down
    (a throttled or failing device) from one that was always slower (different hardware).
A rank is slow at a step when its relative score is below `slow_below` (a world of one, with no
peers, uses the individual score); it is flagged as a straggler once it has been slow for
`patience` consecutive steps, and flagged again only after it recovered. Noise on a clean run (one
slow step, a shared machine) does not last `patience` steps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank counts as slow, and for how long before it is flagged."""

    slow_below: float = 0.7
    individual_below: float = 0.5
    patience: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.slow_below < 1 or not 0 < self.individual_below < 1:
            raise ValueError("slow_below and individual_below must be between 0 and 1")
        if self.patience < 1:
            raise ValueError(f"patience must be at least 1, got {self.patience}")


@dataclass(frozen=True)
class Scores:
    """A rank's scores at one step (1.0 = as fast as its peers / as its own best)."""

    relative: float
    individual: float
    compute_s: float
    # Median compute time of the other ranks (the rank's own time in a world of one).
    peers_s: float


@dataclass(frozen=True)
class StragglerFlag:
    """A rank that has been slow since `since_step` and still was at `step`."""

    step: int
    rank: int
    since_step: int
    scores: Scores


class StragglerDetector:
    """Scores the ranks of one run step by step and flags those that stay slow; not thread-safe."""

    def __init__(self, policy: StragglerPolicy | None = None) -> None:
        self.policy = policy or StragglerPolicy()
        self.latest: dict[int, Scores] = {}
        self._best: dict[int, float] = {}
        self._slow_since: dict[int, int] = {}
        self._slow_steps: dict[int, int] = {}
        self._flagged: set[int] = set()

    def observe(self, step: int, compute_s: dict[int, float]) -> list[StragglerFlag]:
        """Score one complete step (compute seconds of every rank); return the newly flagged ranks.

        Steps must come in order; a rank whose time is not positive (not measured) is not scored.
        """
        measured = {rank: seconds for rank, seconds in compute_s.items() if seconds > 0}
        ordered = sorted(measured.values())
        flags = []
        for rank, seconds in sorted(measured.items()):
            scores = self._score(rank, seconds, ordered)
            self.latest[rank] = scores
            slow = (
                scores.relative < self.policy.slow_below
                if len(measured) > 1
                else scores.individual < self.policy.individual_below
            )
            if not slow:
                self._slow_steps[rank] = 0
                self._flagged.discard(rank)
                continue
            if self._slow_steps.get(rank, 0) == 0:
                self._slow_since[rank] = step
            self._slow_steps[rank] = self._slow_steps.get(rank, 0) + 1
            if self._slow_steps[rank] >= self.policy.patience and rank not in self._flagged:
                self._flagged.add(rank)
                flags.append(StragglerFlag(step, rank, self._slow_since[rank], scores))
        return flags

    def _score(self, rank: int, seconds: float, ordered: list[float]) -> Scores:
        best = min(self._best.get(rank, seconds), seconds)
        self._best[rank] = best
        peers_s = median_without(ordered, seconds) if len(ordered) > 1 else seconds
        return Scores(
            relative=peers_s / seconds,
            individual=best / seconds,
            compute_s=seconds,
            peers_s=peers_s,
        )


def median_without(ordered: list[float], value: float) -> float:
    """The median of sorted `ordered` with one occurrence of `value` left out, in O(log n).

    Scoring every rank against the median of the others must not cost O(world²) on a large job.
    """
    removed = bisect.bisect_left(ordered, value)
    count = len(ordered) - 1

    def kept(index: int) -> float:
        return ordered[index if index < removed else index + 1]

    middle = count // 2
    return kept(middle) if count % 2 else (kept(middle - 1) + kept(middle)) / 2
