"""What the service knows about the runs reporting to it now, kept in memory as records arrive.

The servicer passes every stored batch here. Records are grouped by step; once every rank of a run
has reported a step, the step is complete: the straggler detector scores its ranks (and the service
stores the flags as events), and the run's current figures (loss, tokens/s, MFU, per-rank times and
scores) are updated for the Prometheus endpoint. Nothing here is durable: the database is the
record; after a restart, detection starts afresh with the next complete step.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scaletrain.errors import NotFound
from scaletrain.v1 import telemetry_pb2
from telemetry import mfu
from telemetry.detect import Scores, StragglerDetector, StragglerFlag, StragglerPolicy
from telemetry.ingest import PHASES
from telemetry.models import Run

# Steps of a run awaiting their last rank; older incomplete steps are dropped beyond this many
# (records lost to a full client queue never arrive).
_MAX_PENDING_STEPS = 64


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
    "run_id", "world_size", "model_params", "hardware", "precision", "peak_flops",
    "peak_flops_source", "recompute_fraction",
)  # fmt: skip


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
    ranks: dict[int, RankView] = field(default_factory=dict)

    @classmethod
    def of(cls, description: telemetry_pb2.RegisterRunRequest | Run, attempt: int) -> RunView:
        """The view of a run as registered (a request, or its row in the runs table)."""
        return cls(**{name: getattr(description, name) for name in _DESCRIPTION}, attempt=attempt)


@dataclass
class _RunState:
    view: RunView
    detector: StragglerDetector
    pending: dict[tuple[int, int], dict[int, telemetry_pb2.RankStep]] = field(default_factory=dict)
    # (attempt, step) of the latest complete step: records of it or earlier are resent copies.
    done: tuple[int, int] = (-1, -1)


class LiveRuns:
    """The live state of the runs one service receives; thread-safe.

    `describe` returns a run's registered row (for runs registered before this service started);
    it raises NotFound for unknown runs.
    """

    def __init__(
        self,
        describe: Callable[[str], Run],
        policy: StragglerPolicy | None = None,
        max_runs: int = 16,
    ) -> None:
        self._describe = describe
        self._policy = policy or StragglerPolicy()
        self._max_runs = max_runs
        self._lock = threading.Lock()
        self._runs: dict[str, _RunState] = {}

    def registered(self, request: telemetry_pb2.RegisterRunRequest, attempt: int) -> None:
        """A run (re)registered: start its view afresh with the new description."""
        with self._lock:
            self._add(RunView.of(request, attempt))

    def observe_steps(self, records: Sequence[telemetry_pb2.RankStep]) -> list[telemetry_pb2.Event]:
        """Take stored records; return the straggler events of the steps they completed."""
        flagged: list[telemetry_pb2.Event] = []
        with self._lock:
            run_id, state = None, None
            for record in records:
                # A batch comes from one rank's client: nearly always one run throughout.
                if record.run_id != run_id:
                    run_id = record.run_id
                    state = self._state(run_id)
                if state is None:
                    continue
                state.view.records += 1
                key = (record.attempt, record.step)
                if key <= state.done:
                    continue
                ranks = state.pending.setdefault(key, {})
                ranks[record.rank] = record
                if len(ranks) == state.view.world_size:
                    flagged.extend(self._complete(state, key))
        return flagged

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
                        "ranks": dict(state.view.ranks),
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
        state = _RunState(view=view, detector=StragglerDetector(self._policy))
        self._runs.pop(view.run_id, None)
        self._runs[view.run_id] = state
        while len(self._runs) > self._max_runs:
            # Dicts keep insertion order: the first is the run registered or seen longest ago.
            self._runs.pop(next(iter(self._runs)))
        return state

    def _complete(self, state: _RunState, key: tuple[int, int]) -> list[telemetry_pb2.Event]:
        """Score the complete step `key`, update the run's figures, forget older pending steps."""
        records = state.pending.pop(key)
        for older in [pending for pending in state.pending if pending < key]:
            del state.pending[older]
        while len(state.pending) > _MAX_PENDING_STEPS:
            del state.pending[min(state.pending)]
        attempt, step = key
        if attempt != state.done[0]:
            # A restarted job may run on other machines: its ranks' best times start afresh.
            state.detector = StragglerDetector(self._policy)
        state.done = key
        flags = state.detector.observe(
            step, {rank: _compute_seconds(record) for rank, record in records.items()}
        )
        self._update_view(state, step, attempt, records)
        return [_straggler_event(records[flag.rank], flag) for flag in flags]

    @staticmethod
    def _update_view(
        state: _RunState, step: int, attempt: int, records: dict[int, telemetry_pb2.RankStep]
    ) -> None:
        view = state.view
        losses = [record.loss for record in records.values() if math.isfinite(record.loss)]
        wall = max(record.times.step for record in records.values())
        tokens = sum(record.tokens for record in records.values())
        view.step, view.attempt = step, attempt
        view.loss = sum(losses) / len(losses) if losses else math.nan
        view.grad_norm = records[min(records)].grad_norm
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
        for rank, record in records.items():
            view.ranks[rank] = RankView(
                step=step,
                loss=record.loss,
                grad_norm=record.grad_norm,
                phases={phase: getattr(record.times, phase) for phase in PHASES},
                memory_bytes=record.memory_bytes,
                peak_memory_bytes=record.peak_memory_bytes,
                dropped_records=record.dropped_records,
                scores=state.detector.latest.get(rank),
            )


def _compute_seconds(record: telemetry_pb2.RankStep) -> float:
    """The rank's own work in the step: `compute` when the reporter measured it, else the step
    time without the phases that are not the rank's own work (waits, data, checkpoint, replay)."""
    times = record.times
    if times.compute > 0:
        return times.compute
    return times.step - times.comm_wait - times.data - times.checkpoint - times.replay


def _straggler_event(record: telemetry_pb2.RankStep, flag: StragglerFlag) -> telemetry_pb2.Event:
    """The event of a flag, stamped with the time of the rank's record that completed the flag, so
    a flag raised again from resent records is recognised as the same event."""
    scores = flag.scores
    event = telemetry_pb2.Event(
        run_id=record.run_id,
        step=flag.step,
        rank=flag.rank,
        kind=telemetry_pb2.EVENT_KIND_STRAGGLER,
        message=(
            f"rank {flag.rank} computes {1 / scores.relative:.1f}x slower than the median of the "
            f"other ranks since step {flag.since_step}"
        ),
        attributes={
            "since_step": str(flag.since_step),
            "relative_score": f"{scores.relative:.3f}",
            "individual_score": f"{scores.individual:.3f}",
            "compute_s": f"{scores.compute_s:.6f}",
            "peers_s": f"{scores.peers_s:.6f}",
            "attempt": str(record.attempt),
        },
    )
    event.time.CopyFrom(record.time)
    return event
