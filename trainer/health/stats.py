"""Robust rolling statistics of a training signal (loss, gradient norm), for spotting spikes.

A value is compared with the median of the last few values (where the signal is now: the loss falls
fast early in training), and its rise with the noise of the signal, estimated as the MAD of the
step-to-step changes over a longer window: medians and MADs, not means and standard deviations, so
that one spike neither moves the reference nor widens the spread that decides the next.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass

# MAD x 1.4826 estimates the standard deviation of normally distributed values.
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class SpikeRule:
    """A value spikes when it exceeds the median of the last `recent` values by `z` robust standard
    deviations of the step-to-step changes and by `min_rise` times that median (whichever is more),
    or is not finite. Only rises count."""

    z: float = 6.0
    min_rise: float = 0.15
    recent: int = 5
    window: int = 50
    # Values needed before anything counts as a spike.
    min_history: int = 10


@dataclass(frozen=True)
class Spike:
    value: float
    median: float
    threshold: float


class RollingSignal:
    """The recent values of one signal and the spike test against them."""

    def __init__(self, rule: SpikeRule) -> None:
        self.rule = rule
        self._values: deque[float] = deque(maxlen=rule.window)
        self._excused = False

    def spike(self, value: float) -> Spike | None:
        """The spike `value` would be against the recent values, or None; does not add it."""
        if not math.isfinite(value):
            return Spike(value, self._median(), math.nan)
        excused, self._excused = self._excused, False
        if excused or len(self._values) < self.rule.min_history:
            return None
        median = self._median()
        values = list(self._values)
        changes = [after - before for before, after in itertools.pairwise(values)]
        center = statistics.median(changes)
        noise = _MAD_TO_SIGMA * statistics.median(abs(c - center) for c in changes)
        threshold = median + max(self.rule.z * noise, self.rule.min_rise * abs(median))
        return Spike(value, median, threshold) if value > threshold else None

    def excuse_next(self) -> None:
        """Let the next value rise without counting as a spike (a non-finite one still does):
        the step after a spike the data caused carries that large update's aftermath, and
        judging it against the calm before replays a step for nothing (bench/false_alarms.py:
        the two replays of each clean 1,000 steps were such a pair)."""
        self._excused = True

    def add(self, value: float) -> None:
        """Take a value that belongs to normal training (never a spike: it would widen the MAD)."""
        if math.isfinite(value):
            self._values.append(value)

    def _median(self) -> float:
        """The median of the most recent values: where the signal is now."""
        recent = list(self._values)[-self.rule.recent :]
        return statistics.median(recent) if recent else math.nan
