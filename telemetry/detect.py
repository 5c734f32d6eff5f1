"""Straggler detection from per-rank compute times, as NVIDIA's resiliency extension scores ranks,
rolled up per node.

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

Scoring costs O(ranks) per step with a small constant: the median of the others is one of three
order statistics of the step (found by one `np.partition`), and every rank's state is an array,
updated by a handful of vector operations (`bench/telemetry_detect.py` measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from telemetry.rollup import NodeMap


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank counts as slow, when its node does, and for how long before it is flagged."""

    slow_below: float = 0.7
    individual_below: float = 0.5
    patience: int = 3
    node_share: float = 0.75

    def __post_init__(self) -> None:
        if not all(0 < value < 1 for value in (self.slow_below, self.individual_below)):
            raise ValueError("slow_below and individual_below must be between 0 and 1")
        if not 0 < self.node_share <= 1:
            raise ValueError(f"node_share must be in (0, 1], got {self.node_share}")
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
    """A rank that has been slow since `since_step` and still was at `step`, on host `node`."""

    step: int
    rank: int
    since_step: int
    scores: Scores
    node: str


@dataclass(frozen=True)
class NodeFlag:
    """A node most of whose ranks have been slow since `since_step` and still were at `step`;
    `relative` is the mean relative score of its slow ranks."""

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
        if len(measured) > 1:
            peers = medians_without(seconds)
            relative = peers / seconds
            slow = relative < policy.slow_below
        else:
            peers, relative = seconds, np.ones(len(measured))
            slow = individual < policy.individual_below
        self._scores[measured] = np.stack([relative, individual, seconds, peers], axis=1)
        # Nodes first: the ranks of a slow node are that node's finding, not their own.
        count = len(self.nodes.names)
        on_node = np.bincount(of_rank[measured], minlength=count)
        slow_on_node = np.bincount(of_rank[measured[slow]], minlength=count)
        node_slow = (on_node >= 2) & (slow_on_node >= policy.node_share * on_node)
        node_flags = self._advance(
            step, node_slow, np.arange(count), self._node_slow_steps, self._node_since,
            self._node_flagged,
        )  # fmt: skip
        rank_slow = slow & ~node_slow[of_rank[measured]]
        rank_flags = self._advance(
            step, rank_slow, measured, self._slow_steps, self._slow_since, self._flagged
        )
        flags: list[StragglerFlag | NodeFlag] = []
        if len(node_flags):
            mean_relative = np.bincount(
                of_rank[measured[slow]], weights=relative[slow], minlength=count
            ) / np.maximum(slow_on_node, 1)
            for node in node_flags:
                ranks = measured[of_rank[measured] == node]
                flags.append(
                    NodeFlag(
                        step, self.nodes.names[node], [int(r) for r in ranks],
                        int(self._node_since[node]), float(mean_relative[node]),
                    )
                )  # fmt: skip
        for rank in rank_flags:
            flags.append(
                StragglerFlag(
                    step, int(rank), int(self._slow_since[rank]),
                    Scores(*map(float, self._scores[rank])), self.nodes.names[of_rank[rank]],
                )
            )  # fmt: skip
        return flags

    def _advance(
        self,
        step: int,
        slow: np.ndarray,
        which: np.ndarray,
        slow_steps: np.ndarray,
        since: np.ndarray,
        flagged: np.ndarray,
    ) -> np.ndarray:
        """Count consecutive slow steps of `which` (ranks or nodes); return those to flag now."""
        recovered = which[~slow]
        slow_steps[recovered] = 0
        flagged[recovered] = False
        slowed = which[slow]
        since[slowed[slow_steps[slowed] == 0]] = step
        slow_steps[slowed] += 1
        due = slowed[(slow_steps[slowed] >= self.policy.patience) & ~flagged[slowed]]
        flagged[due] = True
        return due


def medians_without(values: np.ndarray) -> np.ndarray:
    """For each value, the median of the others (at least two values), in O(n).

    With the values sorted as s, leaving out v keeps s[j] at position j when s[j] < v and s[j+1]
    otherwise, and the median of the rest needs positions h-1 and h only (h = (n-1)//2): so three
    order statistics, from one partition, answer for every value.
    """
    rest = len(values) - 1
    middle = rest // 2
    needed = [middle, middle + 1] if rest % 2 else [middle - 1, middle, middle + 1]
    ordered = np.partition(values, needed)

    def kept(position: int) -> np.ndarray:
        return np.where(ordered[position] < values, ordered[position], ordered[position + 1])

    return kept(middle) if rest % 2 else (kept(middle - 1) + kept(middle)) / 2
