"""Straggler detection from per-rank compute times, as NVIDIA's resiliency extension scores ranks,
rolled up per node, with CUSUMs that catch the small slowdowns the scores alone miss.

In synchronous training every rank waits for the slowest at each collective, so step times are all
alike and tell nothing; what differs is each rank's own work (`compute` of PhaseTimes). Each step,
each rank gets two scores:
  - relative: the median compute time of the *other* ranks over its own (1.0 typical, 0.5 twice as
    slow as its peers), which singles out the rank that holds the others back;
  - individual: its own best compute time over its current one, which tells a rank that slowed down
    (a throttled or failing device) from one that was always slower (different hardware).
A rank is slow at a step when its relative score is below `slow_below` (a world of one, with no
peers, uses the individual score). A node is slow at a step when at least `node_share` of its
ranks (two or more) are: then it is one finding, the slow node, not eight stragglers, and its
ranks are not flagged one by one. A rank or node is flagged once it has been slow for `patience`
consecutive steps, and flagged again only after it recovered. Noise on a clean run (one slow step,
a shared machine) does not last `patience` steps.

That rule only sees a rank more than 1/0.7 = 1.43x slower than its peers. Smaller slowdowns hide in
the step-to-step noise, so in a world of `cusum_min_ranks` or more, each rank also runs the CUSUMs
of `cusums` on z = log(own compute / peers' median) / sigma, its excess in units of this step's
noise: sigma is the spread of log compute time across the ranks (interquartile range / 1.349,
taken at least as large as its running mean, and as `noise_floor`). A CUSUM sums the evidence of the
steps, S = max(0, S + clip(z, -clip, clip) - k), and alarms once S reaches h: k is what a step must
exceed to count against the rank, h how much it must add up to, `clip` the most one step adds (so
one step alone never alarms a CUSUM at rest, however slow: a single hiccup is not a straggler). A
rank is flagged when a CUSUM alarms (and its node is not itself slow or flagged), and may be
flagged again once every CUSUM is back to 0 and its score is not slow; `since_step` is where its
CUSUM left 0. When a rank's CUSUM alarms while at least `node_share` of its node's ranks (two or
more) have come a quarter of the way to h, the node is drifting: one finding, flagged instead of
that rank, and its ranks are held back while it stays flagged, that is until fewer than
`node_share` of them are still above 0.

The default CUSUMs are calibrated on the compute-time noise measured on this machine (4-rank CPU
runs, `bench/data/compute_noise.json`: sigma 0.032 robust, 0.041 standard deviation, a right tail
to 1.24x) with a Markov-chain model of each CUSUM, and checked at 16,384 ranks by
`bench/straggler_scale.py`:
  - (k=1.5, h=12, clip=3.5) for small, lasting slowdowns: a 1.1x rank (2.9 sigmas here) in 10
    steps (median; 14 at the 95th percentile), one false alarm in 2e9 rank-steps. h=10 would take
    1.5 steps less, but alarms at runs like one rank of the measured FSDP run 1.15-1.25x slow for
    3 steps of 4: redrawn in runs of 4 steps, that noise gave 2e-3 false flags per rank-hour;
  - (k=5, h=6, clip=10) for medium ones, two steps some 8 sigmas slow: a 1.3x rank (8 sigmas here)
    in 2 steps two times out of three, else 3; one false alarm in 4e8 rank-steps.
Together about 3e-9 false flags per rank-step, 4e-5 per rank-hour at this machine's 0.27 s step
(measured: none in 24,740 rank-hours; 1.2e-4 with the noise redrawn in runs of 4 steps). Counted
in sigmas, they flag as fast and as rarely wherever the noise has this shape; with less noise the
same slowdown is more sigmas. The issue's goal, a 1.1x rank within 5 steps and a 1.3x within 2 at
most 0.001 false flags per rank-hour, takes noise of about 1.6% (standard deviation) or less,
where the large CUSUM flags a 1.1x rank in 3 or 4 steps; at this machine's 4%, a 1.1x rank is
within the noise's own tail, and no threshold flags it within 5 steps without flagging clean ranks
far more often. Below `noise_floor` (1%), the CUSUMs take the noise to be 1%: on a quieter cluster
a rank must be some 3% slower to be flagged (in about 8 steps), not a fraction of a percent.

Scoring costs O(ranks) per step with a small constant: the median of the others is one of three
order statistics of the step (found by one `np.partition`, which also finds the quartiles that
give the noise), and every rank's state is an array, updated by a handful of vector operations
(`bench/telemetry_detect.py` measures it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from telemetry.rollup import NodeMap

# The interquartile range of a normal distribution in standard deviations.
_IQR_PER_SIGMA = 1.349
# How fast the running mean of the noise follows each step's (a mean over ~20 steps).
_NOISE_WEIGHT = 0.05
# How far (of h) the CUSUMs of most of a node's ranks must have come, when one of them alarms, for
# the node to be the finding: far above a clean rank's, well below a slow node's.
_NODE_LEANING = 0.25


@dataclass(frozen=True)
class Cusum:
    """A one-sided CUSUM on a rank's excess compute time z (in noise sigmas): S = max(0, S +
    clip(z, -clip, clip) - k), alarming once S reaches h; one step adds at most clip - k < h."""

    k: float
    h: float
    clip: float

    def __post_init__(self) -> None:
        if not (self.k >= 0 and self.h > 0 and self.clip > self.k):
            raise ValueError(f"a CUSUM needs k >= 0, h > 0 and clip > k, got {self}")
        if self.clip - self.k >= self.h:
            raise ValueError(f"one step alarms a CUSUM with clip - k >= h: {self}")


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank counts as slow, when its node does, and for how long before it is flagged; the
    CUSUMs that flag smaller but lasting slowdowns (none: the scores alone)."""

    slow_below: float = 0.7
    individual_below: float = 0.5
    patience: int = 3
    node_share: float = 0.75
    # Calibrated on this machine's noise: see the module's docstring.
    cusums: tuple[Cusum, ...] = (Cusum(k=1.5, h=12.0, clip=3.5), Cusum(k=5.0, h=6.0, clip=10.0))
    # The least noise (sigma of log compute time) the CUSUMs assume: with less, a rank would be
    # flagged for a difference of a percent or two, rather the hardware's than a straggler's.
    noise_floor: float = 0.01
    # Fewer ranks make a poor median and spread: the scores alone judge them.
    cusum_min_ranks: int = 16

    def __post_init__(self) -> None:
        if not all(0 < value < 1 for value in (self.slow_below, self.individual_below)):
            raise ValueError("slow_below and individual_below must be between 0 and 1")
        if not 0 < self.node_share <= 1:
            raise ValueError(f"node_share must be in (0, 1], got {self.node_share}")
        if self.patience < 1:
            raise ValueError(f"patience must be at least 1, got {self.patience}")
        if not self.noise_floor > 0 or self.cusum_min_ranks < 2:
            raise ValueError("noise_floor must be positive and cusum_min_ranks at least 2")


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
    """A rank that has been slow since `since_step` and still was at `step`, on host `node`."""

    step: int
    rank: int
    since_step: int
    scores: Scores
    node: str


@dataclass(frozen=True)
class NodeFlag:
    """A node most of whose ranks have been slow since `since_step` and still were at `step`;
    `relative` is the mean relative score of its slow ranks (by either rule)."""

    step: int
    node: str
    ranks: list[int]
    since_step: int
    relative: float


class StragglerDetector:
    """Scores the ranks of one run step by step and flags the ranks and nodes that stay slow; not
    thread-safe. `nodes` says which node each rank is on (default: each rank its own)."""

    def __init__(self, nodes: NodeMap, policy: StragglerPolicy | None = None) -> None:
        self.policy = policy or StragglerPolicy()
        self.nodes = nodes
        world, count = len(nodes.of_rank), len(nodes.names)
        self._best = np.full(world, np.inf)
        self._slow_steps = np.zeros(world, dtype=np.int64)
        self._slow_since = np.zeros(world, dtype=np.int64)
        self._flagged = np.zeros(world, dtype=bool)
        self._node_slow_steps = np.zeros(count, dtype=np.int64)
        self._node_since = np.zeros(count, dtype=np.int64)
        self._node_flagged = np.zeros(count, dtype=bool)
        self._scores = np.full((world, 4), np.nan)
        cusums = self.policy.cusums
        self._k = np.array([[c.k] for c in cusums])
        self._h = np.array([[c.h] for c in cusums])
        self._clip = np.array([[c.clip] for c in cusums])
        # Each CUSUM's sum over its h (1: alarm) per rank, the highest, and the step it last left 0.
        self._drift = np.zeros((len(cusums), world))
        self._highest = np.zeros(world)
        self._drift_since = np.zeros(world, dtype=np.int64)
        self._noise = math.nan

    def latest(self) -> dict[int, Scores]:
        """Every scored rank's scores at its latest scored step."""
        scored = np.flatnonzero(~np.isnan(self._scores[:, 0]))
        return {int(rank): Scores(*map(float, self._scores[rank])) for rank in scored}

    def observe(self, step: int, work: np.ndarray) -> list[StragglerFlag | NodeFlag]:
        """Score one step from every rank's compute seconds (`work[rank]`; NaN or not positive:
        not measured, not scored); return the newly flagged ranks and nodes. Steps come in order."""
        policy, of_rank = self.policy, self.nodes.of_rank
        measured = np.flatnonzero(work > 0)
        seconds = work[measured]
        self._best[measured] = np.minimum(self._best[measured], seconds)
        individual = self._best[measured] / seconds
        cusums_on = len(self._k) > 0 and len(measured) >= policy.cusum_min_ranks
        if len(measured) > 1:
            # The quartiles too, for the CUSUMs' noise, from the same partition.
            last = len(measured) - 1
            quartiles = [last // 4, (3 * last + 3) // 4] if cusums_on else []
            peers, ordered = _medians_without(seconds, quartiles)
            relative = peers / seconds
            slow = relative < policy.slow_below
        else:
            peers, relative, ordered = seconds, np.ones(len(measured)), seconds
            slow = individual < policy.individual_below
        self._scores[measured] = np.stack([relative, individual, seconds, peers], axis=1)
        # Nodes first: the ranks of a slow node are that node's finding, not their own.
        count = len(self.nodes.names)
        nodes_of = of_rank[measured]
        on_node = np.bincount(nodes_of, minlength=count)
        share = np.where(on_node >= 2, policy.node_share * on_node, np.inf)
        node_slow = np.bincount(nodes_of[slow], minlength=count) >= share
        drift = None
        if cusums_on:
            spread = math.log(ordered[quartiles[1]] / ordered[quartiles[0]]) / _IQR_PER_SIGMA
            drift = self._cusums(step, measured, relative, spread)
        # (What no rank or node needs this step is left None: an alarm, how far its node's ranks
        # have come, whether a flagged rank or node is still drifting.)
        alarm = leaning = active = node_drifting = node_active = None
        if drift is not None:
            alarmed = drift >= 1
            if alarmed.any():
                alarm, leaning = alarmed, drift >= _NODE_LEANING
                node_drifting = (np.bincount(nodes_of[alarm], minlength=count) > 0) & (
                    np.bincount(nodes_of[leaning], minlength=count) >= share
                )
            if self._flagged.any():
                active = drift > 0
            if self._node_flagged.any():
                node_active = np.bincount(nodes_of[drift > 0], minlength=count) >= share
        node_flags = self._advance(
            step,
            node_slow,
            np.arange(count),
            self._node_slow_steps,
            self._node_since,
            self._node_flagged,
            node_drifting,
            node_active,
        )
        held = node_slow | self._node_flagged
        if node_drifting is not None:
            held |= node_drifting
        held_rank = held[nodes_of]
        rank_flags = self._advance(
            step,
            slow & ~held_rank,
            measured,
            self._slow_steps,
            self._slow_since,
            self._flagged,
            None if alarm is None else alarm & ~held_rank,
            active,
        )
        flags: list[StragglerFlag | NodeFlag] = []
        lagging = slow if leaning is None else slow | leaning
        for node in node_flags:
            here = np.flatnonzero(nodes_of == node)
            ranks = measured[here]
            since = int(self._node_since[node])
            if self._node_slow_steps[node] < policy.patience:  # flagged by its CUSUMs
                since = int(self._drift_since[ranks[leaning[here]]].min())
            lag = lagging[here]
            flags.append(
                NodeFlag(
                    step,
                    self.nodes.names[node],
                    [int(r) for r in ranks],
                    since,
                    float(relative[here][lag].mean()),
                )
            )
        for rank in rank_flags:
            since = self._slow_since[rank]
            if self._slow_steps[rank] < policy.patience:  # flagged by its CUSUMs
                since = self._drift_since[rank]
            flags.append(
                StragglerFlag(
                    step,
                    int(rank),
                    int(since),
                    Scores(*map(float, self._scores[rank])),
                    self.nodes.names[of_rank[rank]],
                )
            )
        return flags

    def _cusums(
        self, step: int, measured: np.ndarray, relative: np.ndarray, spread: float
    ) -> np.ndarray:
        """Advance every measured rank's CUSUMs, `spread` the sigma of this step's log compute
        times across ranks; return the highest of each rank's sums over its h (1: alarm)."""
        excess = np.log(relative)
        np.negative(excess, out=excess)
        mean = spread if math.isnan(self._noise) else self._noise
        self._noise = mean + _NOISE_WEIGHT * (spread - mean)
        excess /= max(self.policy.noise_floor, spread, self._noise)
        # Each CUSUM's sum over its h: S/h + (clip(z) - k)/h, kept in [0, 1].
        every = len(measured) == self._drift.shape[1]
        drift = np.clip(excess, -self._clip, self._clip)
        drift -= self._k
        drift /= self._h
        drift += self._drift if every else self._drift[:, measured]
        np.clip(drift, 0, 1, out=drift)
        highest = drift.max(axis=0)
        was = self._highest if every else self._highest[measured]
        started = np.flatnonzero((highest > 0) & (was == 0))
        if every:
            self._drift, self._highest = drift, highest
        else:
            self._drift[:, measured], self._highest[measured] = drift, highest
        self._drift_since[measured[started]] = step
        return highest

    def _advance(
        self,
        step: int,
        slow: np.ndarray,
        which: np.ndarray,
        slow_steps: np.ndarray,
        since: np.ndarray,
        flagged: np.ndarray,
        alarm: np.ndarray | None = None,
        active: np.ndarray | None = None,
    ) -> np.ndarray:
        """Count consecutive slow steps of `which` (ranks or nodes); return those to flag now: slow
        for `patience` steps or alarmed by their CUSUMs, and not flagged since they last
        recovered (neither slow nor `active`, their CUSUMs above 0)."""
        recovered = which[~slow]
        slow_steps[recovered] = 0
        flagged[recovered if active is None else which[~(slow | active)]] = False
        slowed = which[slow]
        since[slowed[slow_steps[slowed] == 0]] = step
        slow_steps[slowed] += 1
        due = slowed[slow_steps[slowed] >= self.policy.patience]
        if alarm is not None:
            due = np.union1d(due, which[alarm])
        due = due[~flagged[due]]
        flagged[due] = True
        return due


def medians_without(values: np.ndarray) -> np.ndarray:
    """For each value, the median of the others (at least two values), in O(n).

    With the values sorted as s, leaving out v keeps s[j] at position j when s[j] < v and s[j+1]
    otherwise, and the median of the rest needs positions h-1 and h only (h = (n-1)//2): so three
    order statistics, from one partition, answer for every value.
    """
    return _medians_without(values, [])[0]


def _medians_without(values: np.ndarray, also: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """`medians_without(values)`, and the values partitioned at positions `also` too."""
    rest = len(values) - 1
    middle = rest // 2
    needed = [middle, middle + 1] if rest % 2 else [middle - 1, middle, middle + 1]
    ordered = np.partition(values, sorted({*needed, *also}))

    def kept(position: int) -> np.ndarray:
        return np.where(ordered[position] < values, ordered[position], ordered[position + 1])

    medians = kept(middle) if rest % 2 else (kept(middle - 1) + kept(middle)) / 2
    return medians, ordered
