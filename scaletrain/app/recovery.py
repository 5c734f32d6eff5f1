"""A recovery record per fault a drill injected: when it struck, when the job saw it, when the job
trained again, what it computed again and where its state came back from.

Measured, not guessed (ARCHITECTURE.md, "Recovery"): the times are wall-clock (time.time()) from
three sources the drill reads after the job, the job's own output stamped as each line arrived
(`Timeline`), telemetry's events and every node's ckptd log (`Sign`s), and telemetry's restarts
(`queries.Restart`: where each restart resumed from and what its restore read).

What a record says, for a fault that struck at `injected_at` when the job had completed step
`step`:
- detected_at: the first sign after it that matches its kind's pattern (the fault table of
  `scaletrain.app.chaos` says which sign per kind); None when the job showed none.
- first_step_at: for a fault that restarts the job, the first `[trainer] step N` line after the
  job started again (the first attempt after the fault that completed a step); for one it rides
  through, the first step completed after the fault ended.
- mttr_s = first_step_at - injected_at.
- steps_lost: the steps computed again, `step` minus the step the job resumed from (0 without a
  restart); restored_from, the bytes of that restore per copy ("memory@node0", "SSD@node1",
  "S3"), and bytes_per_tier, the same summed per tier.
- in_job: the attempt that trained again was an in-job restart (every rank forked again by its
  keeper, `trainer.keeper`), not torchrun's restart of every process.
- badput_s: what the fault cost, the window from injected_at to first_step_at less the work kept
  in it (each step completed in it and never computed again, counted at most one typical step),
  plus the lost steps' compute (their first computation's step time).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import Engine

from telemetry import queries

# The job's lines the timeline reads: a completed step, and the start of an attempt.
STEP_LINE = re.compile(r"^\[trainer\] step (\d+) ")
ATTEMPT_LINE = re.compile(r"^\[trainer\] run \S+: \d+ ranks, ")
# How ATTEMPT_LINE ends when the attempt's ranks were forked again inside the job (trainer.keeper).
IN_JOB_ATTEMPT = re.compile(r", in-job restart \d+$")
# Telemetry events that may be a fault's first sign.
SIGN_EVENTS = ("sdc", "hang", "checkpoint_failed")


@dataclass(frozen=True)
class Sign:
    """Something the job showed at `at` (time.time()): one of its output lines as printed,
    a telemetry event as "event KIND: MESSAGE", or a ckptd log line as "ckptd: MESSAGE"."""

    at: float
    text: str


@dataclass(frozen=True)
class StepDone:
    """A `[trainer] step N` line: when it arrived, its step, the attempt that printed it (0: the
    first), and its step time (the time since the attempt's previous step line; None for an
    attempt's first step, whose time since the attempt's start includes the start)."""

    at: float
    step: int
    attempt: int
    seconds: float | None


class Timeline:
    """The job's output as it arrived: its steps and the starts of its attempts."""

    def __init__(self, lines: list[tuple[float, str]]) -> None:
        self.steps: list[StepDone] = []
        self.attempt_starts: list[float] = []
        previous: float | None = None
        for at, line in lines:
            if ATTEMPT_LINE.match(line):
                self.attempt_starts.append(at)
                previous = None
            elif match := STEP_LINE.match(line):
                attempt = max(len(self.attempt_starts) - 1, 0)
                seconds = None if previous is None else at - previous
                self.steps.append(StepDone(at, int(match[1]), attempt, seconds))
                previous = at
        known = [s.seconds for s in self.steps if s.seconds is not None]
        # A step's usual time, for the steps whose own time is unknown.
        self.typical_s = statistics.median(known) if known else 0.0
        last = {s.step: i for i, s in enumerate(self.steps)}
        # Kept: the last completion of each step; the earlier ones were computed again.
        self.kept = [s for i, s in enumerate(self.steps) if last[s.step] == i]

    def seconds(self, done: StepDone) -> float:
        return self.typical_s if done.seconds is None else done.seconds

    def step_started(self, step: int) -> float | None:
        """When the first attempt that completed `step` began it: its previous step line (its
        start line for the attempt's first step). A fault the trainer strikes itself strikes a
        step once, the first time it is computed (`trainer.health.inject`)."""
        done = next((s for s in self.steps if s.step == step), None)
        if done is None:
            return None
        if done.seconds is not None:
            return done.at - done.seconds
        return max((at for at in self.attempt_starts if at <= done.at), default=None)

    def first_step_after(self, at: float, restarted: bool) -> StepDone | None:
        """The first step completed after `at`; with `restarted`, after the first attempt that
        started after `at`."""
        if restarted:
            start = next((s for s in self.attempt_starts if s > at), None)
            if start is None:
                return None
            at = start
        return next((s for s in self.steps if s.at > at), None)

    def kept_seconds(self, start: float, end: float) -> float:
        """The kept steps' time completed in (start, end], each counted at most one typical step
        (the rest of a slow step is what the window cost)."""
        return sum(
            min(self.seconds(s), self.typical_s) if self.typical_s else self.seconds(s)
            for s in self.kept
            if start < s.at <= end
        )

    def computed_before(self, first: int, last: int, before: float) -> float:
        """The step time of steps `first`..`last` as computed before `before` (the work a restart
        threw away), each its latest computation then."""
        latest: dict[int, StepDone] = {}
        for s in self.steps:
            if s.at <= before and first <= s.step <= last:
                latest[s.step] = s
        return sum(self.seconds(s) for s in latest.values()) + self.typical_s * (
            max(last - first + 1, 0) - len(latest)
        )

    def effective_training(self, start: float, end: float) -> float | None:
        """Time spent in steps that were kept / the wall time from `start` to `end` (None
        without wall time)."""
        if end <= start:
            return None
        return sum(self.seconds(s) for s in self.kept if start <= s.at <= end) / (end - start)


@dataclass
class Recovery:
    """One fault's recovery record (the module docstring says what each figure means)."""

    kind: str
    target: str
    step: int
    injected_at: float
    detected_at: float | None
    # The sign that detected it, as `Sign.text` (at most 200 characters); "" when none.
    detected_by: str
    first_step: int | None
    first_step_at: float | None
    mttr_s: float | None
    restarted: bool
    resumed_from: int | None
    steps_lost: int
    restored_from: dict[str, int] = field(default_factory=dict)
    bytes_per_tier: dict[str, int] = field(default_factory=dict)
    badput_s: float = 0.0
    # A spare node took the failed one's place (kill-node with --spares).
    spare: bool = False
    # The ranks were forked again by their keepers (trainer.keeper), not restarted by torchrun.
    in_job: bool = False

    def attributes(self) -> dict[str, str]:
        """The record as a telemetry `recovery` event's attributes (strings; "" for None)."""
        return {
            name: json.dumps(value) if isinstance(value, dict | bool) else _text(value)
            for name, value in vars(self).items()
        }


def recovery_record(
    *,
    kind: str,
    target: str,
    step: int,
    injected_at: float,
    ended_at: float,
    restarts: bool,
    detected_by: re.Pattern[str],
    timeline: Timeline,
    signs: list[Sign],
    restarts_seen: list[queries.Restart],
    spare: bool = False,
) -> Recovery:
    """The record of a fault of `kind` on `target`, struck at `injected_at` (time.time()) when the
    job had completed `step`, and over at `ended_at` (when the drill let it go: a service
    restarted, a process continued). `restarts`: the job must restart after it; its restart is
    the first of `restarts_seen` whose attempt completed a step after `injected_at`."""
    detected = next((s for s in signs if s.at >= injected_at and detected_by.search(s.text)), None)
    first = timeline.first_step_after(injected_at if restarts else ended_at, restarts)
    restart = None
    if restarts:
        restart = next(
            (r for r in restarts_seen if r.first_step_at and r.first_step_at >= injected_at), None
        )
    steps_lost = max(step - restart.step, 0) if restart is not None else 0
    restored = dict(restart.restored_from) if restart is not None else {}
    badput = 0.0
    if first is not None:
        window = first.at - injected_at
        badput = max(window - timeline.kept_seconds(injected_at, first.at), 0.0)
        if restart is not None:
            badput += timeline.computed_before(restart.step + 1, step, injected_at)
    return Recovery(
        kind=kind,
        target=target,
        step=step,
        injected_at=injected_at,
        detected_at=detected.at if detected is not None else None,
        detected_by=detected.text[:200] if detected is not None else "",
        first_step=first.step if first is not None else None,
        first_step_at=first.at if first is not None else None,
        mttr_s=round(first.at - injected_at, 3) if first is not None else None,
        restarted=restart is not None,
        resumed_from=restart.step if restart is not None else None,
        steps_lost=steps_lost,
        restored_from=restored,
        bytes_per_tier=bytes_per_tier(restored),
        badput_s=round(badput, 3),
        spare=spare,
        in_job=restart is not None and first is not None and _in_job(signs, first.at),
    )


def _in_job(signs: list[Sign], first_step_at: float) -> bool:
    """Whether the attempt that trained the first step after a fault was an in-job restart."""
    started = [s.text for s in signs if s.at <= first_step_at and ATTEMPT_LINE.match(s.text)]
    return bool(started) and IN_JOB_ATTEMPT.search(started[-1]) is not None


def bytes_per_tier(restored_from: dict[str, int]) -> dict[str, int]:
    """Bytes per copy ("memory@node0", "SSD@node1", "S3") summed per tier ("memory", "SSD",
    "S3")."""
    tiers: dict[str, int] = {}
    for copy, size in restored_from.items():
        tier = copy.split("@")[0]
        tiers[tier] = tiers.get(tier, 0) + size
    return tiers


def signs(engine: Engine, run_id: str, logs: Path, lines: list[tuple[float, str]]) -> list[Sign]:
    """Every sign a fault may be detected by, in time order: the job's `lines` (time.time(),
    line), telemetry's SIGN_EVENTS of `run_id`, and the lines of every node's ckptd log in
    `logs` (JSON lines with an ISO `time`)."""
    found = [Sign(at, line) for at, line in lines]
    events = queries.events(engine, run_id, kinds=SIGN_EVENTS, limit=100_000)
    found += [
        Sign(_timestamp(row.time), f"event {row.kind}: {row.message}")
        for row in events.itertuples()
    ]
    for log in sorted(logs.glob("ckptd*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
                at = datetime.fromisoformat(doc["time"]).timestamp()
                found.append(Sign(at, f"ckptd: {doc['message']}"))
            except (ValueError, KeyError, TypeError):
                continue  # not a JSON log line (e.g. a traceback's)
    return sorted(found, key=lambda s: s.at)


def _timestamp(value: object) -> float:
    """A pandas or datetime time (UTC when naive, as telemetry stores it) as time.time() does."""
    stamp = value.to_pydatetime() if hasattr(value, "to_pydatetime") else value
    assert isinstance(stamp, datetime)
    return (stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)).timestamp()


def _text(value: object) -> str:
    return "" if value is None else str(value)
