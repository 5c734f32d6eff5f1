"""What the service knows about the runs reporting to it now, kept in memory as records arrive.

The servicer passes the rows of every stored batch here (tuples in STEP_COLUMNS order, whatever
form the records came in). Rows are grouped by step; once every rank of a run
has reported a step, the step is complete: it is rolled up (`telemetry.rollup`, which the service
stores), the straggler detector scores its ranks and nodes (and the service stores the flags as
events), and the run's current figures (loss, tokens/s, MFU, per-rank times and scores) are updated
for the Prometheus endpoint. A step that stops waiting without completing (a newer step completed,
the run registered again) is handed back as incomplete, for the service to roll up from the rows
the database holds. Nothing here is durable: the database is the record; after a restart,
detection starts afresh with the next complete step.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scaletrain.errors import NotFound
from scaletrain.v1 import telemetry_pb2
from telemetry import mfu
from telemetry.detect import NodeFlag, Scores, StragglerDetector, StragglerFlag, StragglerPolicy
from telemetry.ingest import (
    ATTEMPT,
    DROPPED,
    GRAD_NORM,
    LOSS,
    MEMORY,
    PEAK_MEMORY,
    PHASE,
    RANK,
    RUN_ID,
    STEP,
    TIME,
    TOKENS,
)
from telemetry.models import Run
from telemetry.rollup import NodeMap, StepSummary, as_datetime, summarise

# A stored rank-step record as a row tuple (telemetry.ingest.STEP_COLUMNS).
Row = tuple[Any, ...]
# Rows of a run's steps awaiting their last rank, at most (about 900 bytes each in memory: some
# 360 MB): after an outage each rank's client sends its backlog at once, so one rank can be
# thousands of steps ahead of another for a while. Beyond this many, the oldest pending step is
# given up, to be rolled up from the database like any incomplete step: memory stays bounded
# whatever the world size and however far the ranks drift apart.
_MAX_PENDING_ROWS = 400_000


@dataclass
class RankView:
    """The latest complete step of one rank."""

    step: int = 0
    loss: float = math.nan
    grad_norm: float = math.nan
    phases: dict[str, float] = field(default_factory=dict)
    memory_bytes: int = 0
    peak_memory_bytes: int = 0
    dropped_records: int = 0
    scores: Scores | None = None


# What a run's registration says that its figures need; RegisterRunRequest and the runs table both
# have these attributes.
_DESCRIPTION = (
    "run_id",
    "world_size",
    "model_params",
    "hardware",
    "precision",
    "peak_flops",
    "peak_flops_source",
    "recompute_fraction",
)


@dataclass
class RunView:
    """A run's current figures, as of its latest complete step."""

    run_id: str
    world_size: int
    model_params: int
    hardware: str
    precision: str
    peak_flops: float
    peak_flops_source: str
    recompute_fraction: float
    attempt: int = 0
    step: int = 0
    loss: float = math.nan
    grad_norm: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    hfu: float = math.nan
    records: int = 0
    events: Counter[str] = field(default_factory=Counter)
    # Filled in by LiveRuns.views.
    ranks: dict[int, RankView] = field(default_factory=dict)

    @classmethod
    def of(cls, description: telemetry_pb2.RegisterRunRequest | Run, attempt: int) -> RunView:
        """The view of a run as registered (a request, or its row in the runs table)."""
        return cls(**{name: getattr(description, name) for name in _DESCRIPTION}, attempt=attempt)


# (run_id, attempt, step) of a step to roll up from the database.
StepKey = tuple[str, int, int]


@dataclass
class Observed:
    """What stored rows completed: detector events, rollups of complete steps, and the steps that
    stopped waiting for their last ranks (to roll up from the database)."""

    flags: list[telemetry_pb2.Event] = field(default_factory=list)
    summaries: list[StepSummary] = field(default_factory=list)
    incomplete: list[StepKey] = field(default_factory=list)


@dataclass
class _RunState:
    view: RunView
    nodes: NodeMap
    detector: StragglerDetector
    pending: dict[tuple[int, int], dict[int, Row]] = field(default_factory=dict)
    pending_rows: int = 0
    # (attempt, step) of the latest complete step: records of it or earlier are resent copies.
    done: tuple[int, int] = (-1, -1)
    # The rows of that step, per rank: the per-rank figures are made from them when asked for.
    latest: dict[int, Row] = field(default_factory=dict)


class LiveRuns:
    """The live state of the runs one service receives; thread-safe.

    `describe` returns a run's registered row (for runs registered before this service started);
    it raises NotFound for unknown runs. `nodes_of` says which node each rank of a run is on.
    """

    def __init__(
        self,
        describe: Callable[[str], Run],
        nodes_of: Callable[[str], NodeMap],
        policy: StragglerPolicy | None = None,
        max_runs: int = 16,
    ) -> None:
        self._describe = describe
        self._nodes_of = nodes_of
        self._policy = policy or StragglerPolicy()
        self._max_runs = max_runs
        self._lock = threading.Lock()
        self._runs: dict[str, _RunState] = {}

    def registered(self, request: telemetry_pb2.RegisterRunRequest, attempt: int) -> list[StepKey]:
        """A run (re)registered: start its view afresh with the new description; return the steps
        the old view still waited for, to roll up from the database."""
        with self._lock:
            old = self._runs.get(request.run_id)
            self._add(RunView.of(request, attempt))
        if old is None:
            return []
        return [(request.run_id, attempt, step) for attempt, step in old.pending]

    def observe_steps(self, rows: Sequence[Row]) -> Observed:
        """Take stored rows; return what the steps they completed gave (see Observed)."""
        observed = Observed()
        with self._lock:
            run_id, state = None, None
            for row in rows:
                # A batch comes from one rank's client: nearly always one run throughout.
                if row[RUN_ID] != run_id:
                    run_id = row[RUN_ID]
                    state = self._state(run_id)
                if state is None:
                    continue
                state.view.records += 1
                key = (row[ATTEMPT], row[STEP])
                if key <= state.done:
                    continue
                ranks = state.pending.get(key)
                if ranks is None:
                    ranks = state.pending[key] = {}
                state.pending_rows += row[RANK] not in ranks
                ranks[row[RANK]] = row
                if len(ranks) == state.view.world_size:
                    self._complete(state, key, observed)
                elif state.pending_rows > max(_MAX_PENDING_ROWS, 2 * state.view.world_size):
                    oldest = next(iter(state.pending))
                    _forget(state, oldest)
                    observed.incomplete.append((run_id, *oldest))
        return observed

    def observe_events(self, events: Sequence[telemetry_pb2.Event]) -> None:
        """Count stored events by kind, per run."""
        with self._lock:
            for event in events:
                state = self._state(event.run_id)
                if state is not None:
                    kind = telemetry_pb2.EventKind.Name(event.kind).removeprefix("EVENT_KIND_")
                    state.view.events[kind.lower()] += 1

    def views(self) -> list[RunView]:
        """The current figures of every run this service follows (copies, safe to keep)."""
        with self._lock:
            return [
                RunView(
                    **{
                        **vars(state.view),
                        "events": Counter(state.view.events),
                        "ranks": _rank_views(state),
                    }
                )
                for state in self._runs.values()
            ]

    def _state(self, run_id: str) -> _RunState | None:
        state = self._runs.get(run_id)
        if state is not None:
            return state
        try:
            run = self._describe(run_id)
        except NotFound:
            return None
        return self._add(RunView.of(run, run.attempt))

    def _add(self, view: RunView) -> _RunState:
        nodes = self._nodes_of(view.run_id)
        if len(nodes.of_rank) != view.world_size:
            nodes = NodeMap.of_hosts(view.world_size, {})
        state = _RunState(view=view, nodes=nodes, detector=StragglerDetector(nodes, self._policy))
        self._runs.pop(view.run_id, None)
        self._runs[view.run_id] = state
        while len(self._runs) > self._max_runs:
            # Dicts keep insertion order: the first is the run registered or seen longest ago.
            self._runs.pop(next(iter(self._runs)))
        return state

    def _complete(self, state: _RunState, key: tuple[int, int], observed: Observed) -> None:
        """Roll up and score the complete step `key`, update the run's figures, and give up on
        the older pending steps (incomplete)."""
        rows = _forget(state, key)
        run_id = state.view.run_id
        # Steps arrive in order from each rank, so the pending ones are (nearly) in insertion order:
        # the incomplete steps older than this one are at the front.
        for older in list(itertools.takewhile(lambda pending: pending < key, state.pending)):
            _forget(state, older)
            observed.incomplete.append((run_id, *older))
        attempt, step = key
        if attempt != state.done[0]:
            # A restarted job may run on other machines: its ranks' best times start afresh.
            state.detector = StragglerDetector(state.nodes, self._policy)
        state.done = key
        summary = summarise(run_id, attempt, step, list(rows.values()), state.nodes)
        observed.summaries.append(summary)
        flags = state.detector.observe(step, summary.work)
        self._update_view(state, step, attempt, rows)
        observed.flags += [_straggler_event(rows, flag) for flag in flags]

    @staticmethod
    def _update_view(state: _RunState, step: int, attempt: int, rows: dict[int, Row]) -> None:
        view = state.view
        losses = [row[LOSS] for row in rows.values() if row[LOSS] is not None]
        wall = max(row[PHASE["step"]] for row in rows.values())
        tokens = sum(row[TOKENS] for row in rows.values())
        view.step, view.attempt = step, attempt
        view.loss = sum(losses) / len(losses) if losses else math.nan
        view.grad_norm = _float(rows[min(rows)][GRAD_NORM])
        view.tokens_per_s = tokens / wall if wall > 0 else math.nan
        view.mfu = mfu.utilization(
            mfu.model_flops_per_token(view.model_params),
            view.tokens_per_s,
            view.world_size,
            view.peak_flops,
        )
        view.hfu = mfu.utilization(
            mfu.hardware_flops_per_token(view.model_params, view.recompute_fraction),
            view.tokens_per_s,
            view.world_size,
            view.peak_flops,
        )
        state.latest = rows


def _rank_views(state: _RunState) -> dict[int, RankView]:
    """Each rank's figures at the run's latest complete step."""
    scores = state.detector.latest()
    return {
        rank: RankView(
            step=row[STEP],
            loss=_float(row[LOSS]),
            grad_norm=_float(row[GRAD_NORM]),
            phases={phase: row[index] for phase, index in PHASE.items()},
            memory_bytes=row[MEMORY],
            peak_memory_bytes=row[PEAK_MEMORY],
            dropped_records=row[DROPPED],
            scores=scores.get(rank),
        )
        for rank, row in state.latest.items()
    }


def _float(value: float | None) -> float:
    """A stored loss or gradient norm: None (NULL) stands for NaN."""
    return math.nan if value is None else value


def _straggler_event(rows: dict[int, Row], flag: StragglerFlag | NodeFlag) -> telemetry_pb2.Event:
    """The event of a flag, naming the host, stamped with the time of the record that completed
    the flag (the flagged rank's, a slow node's first rank's), so a flag raised again from resent
    records is recognised as the same event. A slow node's event concerns no single rank (-1)."""
    if isinstance(flag, NodeFlag):
        row = rows[flag.ranks[0]]
        event = telemetry_pb2.Event(
            run_id=row[RUN_ID],
            step=flag.step,
            rank=-1,
            kind=telemetry_pb2.EVENT_KIND_STRAGGLER,
            message=(
                f"node {flag.node} ({len(flag.ranks)} ranks: {_ranges(flag.ranks)}) computes "
                f"{1 / flag.relative:.1f}x slower than the median of the other ranks since step "
                f"{flag.since_step}: a slow node"
            ),
            attributes={
                "node": flag.node,
                "ranks": _ranges(flag.ranks),
                "since_step": str(flag.since_step),
                "relative_score": f"{flag.relative:.3f}",
                "attempt": str(row[ATTEMPT]),
            },
        )
    else:
        row, scores = rows[flag.rank], flag.scores
        event = telemetry_pb2.Event(
            run_id=row[RUN_ID],
            step=flag.step,
            rank=flag.rank,
            kind=telemetry_pb2.EVENT_KIND_STRAGGLER,
            message=(
                f"rank {flag.rank} on {flag.node} computes {1 / scores.relative:.1f}x slower than "
                f"the median of the other ranks since step {flag.since_step}"
            ),
            attributes={
                "node": flag.node,
                "since_step": str(flag.since_step),
                "relative_score": f"{scores.relative:.3f}",
                "individual_score": f"{scores.individual:.3f}",
                "compute_s": f"{scores.compute_s:.6f}",
                "peers_s": f"{scores.peers_s:.6f}",
                "attempt": str(row[ATTEMPT]),
            },
        )
    event.time.FromDatetime(as_datetime(row[TIME]))
    return event


def _ranges(ranks: list[int]) -> str:
    """Ranks as ranges: "8-15", "3, 5-6"."""
    parts = []
    for _, group in itertools.groupby(enumerate(ranks), lambda item: item[1] - item[0]):
        run = [rank for _, rank in group]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(parts)


def _forget(state: _RunState, key: tuple[int, int]) -> dict[int, Row]:
    """Take the pending rows of step `key` out of the run's state."""
    rows = state.pending.pop(key)
    state.pending_rows -= len(rows)
    return rows
