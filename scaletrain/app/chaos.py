"""`scaletrain chaos`: a drill that trains on the embedded stack while a schedule of faults strikes.

The schedule is a list of KIND@STEP[:SECONDS], each fault injected once, in order, as soon as the
job has finished step STEP (the job is watched through its `[trainer] step N` lines), and of
KIND@everyNs[:SECONDS], a fault struck every N seconds of the job for as long as it runs, as a
cluster's faults come. Each kind is defined once, in `FAULTS`: what it does, the SECONDS it lasts
when the item does not say, how the drill strikes and which sign shows that the job saw it
(`scaletrain chaos --help` lists them).

Every fault is recorded in telemetry as a `fault` event, and once the job ended as a `recovery`
event with its recovery record (`scaletrain.app.recovery`: injected, detected, first step after,
MTTR, steps lost, what restored the state). The report says how many faults were injected and
survived, how many committed checkpoints were lost (any checkpoint ever seen committed on some
tier must still be committed on one at the end), how many steps were computed again after
restarts, each fault's recovery, the run's goodput from telemetry with what each kind of fault
cost, and the effective training time (the time in steps that were kept over the job's wall time).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TypeVar

from sqlalchemy import Engine

from ckptd.client import CkptdClient
from scaletrain.app.embedded import check_sizes, flag_value, new_run_id
from scaletrain.app.recovery import (
    ATTEMPT_LINE,
    IN_JOB_ATTEMPT,
    STEP_LINE,
    Recovery,
    Timeline,
    recovery_record,
    signs,
)
from scaletrain.app.rendezvous import CAPACITY_WAIT_S
from scaletrain.app.stack import (
    RENDEZVOUS,
    Job,
    Stack,
    Workdir,
    check_nodes,
    ckptd_service,
    node_name,
)
from scaletrain.app.summary import summarize
from scaletrain.cordon import CORDON_AFTER
from scaletrain.errors import ScaletrainError, UserError
from scaletrain.v1 import checkpoint_pb2, common_pb2
from telemetry import queries
from telemetry.client import TelemetryClient, event
from telemetry.db import connect

_COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED
# What has copies on tiers: a checkpoint as one node sees it, or one node's part of it.
_Copies = TypeVar("_Copies", checkpoint_pb2.CheckpointInfo, checkpoint_pb2.NodePart)

# The drill of `scaletrain chaos` without --schedule: every kind but those that need spares
# (NEEDS_SPARES: their drills are in tests/e2e), 16 faults over its 400 steps (`default_schedule`
# leaves out those of MULTI_NODE on one node). The long outages come late: the job trains on
# through them, so they move later faults on.
DEFAULT_SCHEDULE = (
    "sdc@5,kill-rank@10,kill-telemetry@20,stop-rank@30,kill-ckptd@40,corrupt-shard@50,sdc@60,"
    "kill-rank-twice@70,stop-s3@80,partition-node@90,disk-full@100,kill-telemetry@110,"
    "kill-ckptd@120,kill-node@130,kill-node-mid-save@140,kill-rendezvous@150"
)
# A drill's phase without progress this long fails a rank (the trainer's default is for real
# runs; options given to the drill come later and win).
DRILL_WATCHDOG_MIN_S = 10.0
# How long the drill waits for what a fault must cause (a restart, a watchdog, a save).
_WAIT_S = 180.0
# How long a node's ckptd, frozen, leaves a commit that its vote already reached to land.
_COMMIT_SETTLE_S = 1.0
# How fast every ckptd copies parts to peers while kill-node-mid-save waits for its strike (MB/s);
# the rate they had comes back once the node is lost.
MID_SAVE_REPLICA_MB_S = 2
# A repeating fault that restarts the job strikes while this many restarts of the budget are left
# (after the once-only faults' own), and the budget without --max-restarts has this many for it.
_SPARE_RESTARTS = 2
_REPEAT_RESTARTS = 20
# torchrun's agent stopping its ranks (to restart them, or at the end), as it logs it for ranks
# it exec'd and for ranks it forked warm.
AGENT_STOPPED_RANKS = r"closing signal SIG|Closing process \d+ via signal"
# The first signs of a fault (`FaultKind.detected_by`): a rank or its agent failing (a survivor's
# traceback, the agent stopping the others or reporting the exit), a save failing, ...
_RANK_FAILED = (
    rf"\]: Traceback|{AGENT_STOPPED_RANKS}|failed \(exitcode: |error: watchdog:"
    r"|a collective failed: |^\[keeper\] in-job restart"
)
_SAVE_FAILED = r"checkpoint of step \d+ failed|^event checkpoint_failed: "


class _JobEnded(Exception):
    """The job ended while a fault waited for its moment: it is not injected."""


@dataclass(frozen=True)
class Fault:
    kind: str
    # The step after which it strikes once (0 for a repeating fault).
    step: int
    seconds: float = 0.0
    # It strikes every `every_s` seconds of the job instead (0: once, after `step`).
    every_s: float = 0.0


@dataclass(frozen=True)
class FaultKind:
    """A kind of fault, in one place: what it does, how its schedule item is read, how it
    strikes."""

    # What it does, for `scaletrain chaos --help`.
    describe: str
    # Strikes `fault` on the drill's job: (its target, what happened).
    inject: Callable[[Drill, Fault], tuple[str, str]]
    # SECONDS of KIND@STEP[:SECONDS] when the item leaves it out.
    default_seconds: float = 0.0
    # torchrun must restart the job after it.
    restarts: bool = False
    # Nodes a job needs to survive it.
    min_nodes: int = 1
    # Hot spares it needs (--spares).
    min_spares: int = 0
    # Trainer flags that make the trainer itself strike it, on the given rank.
    trainer_args: Callable[[Fault, int], list[str]] | None = None
    # It fills the SSD tier's disk, which must then be a small tmpfs.
    fills_disk: bool = False
    # It resizes the job: an elastic one (--nodes MIN:MAX) only.
    elastic: bool = False
    # The first sign that the job saw it: a regex searched in the job's output lines, telemetry's
    # events ("event KIND: MESSAGE") and ckptd's log ("ckptd: MESSAGE"), from the strike on.
    detected_by: str = _RANK_FAILED


# One item of --schedule: KIND@STEP[:SECONDS] or KIND@everyNs[:SECONDS] (SCHEDULE_FORMS says so).
_ITEM = re.compile(r"([a-z0-9-]+)@(?:(\d+)|every([0-9.]+)s)(?::([0-9.]+))?")
SCHEDULE_FORMS = "KIND@STEP[:SECONDS] or KIND@everyNs[:SECONDS]"


def parse_schedule(text: str) -> list[Fault]:
    """KIND@STEP[:SECONDS] and KIND@everyNs[:SECONDS],... in step order (the repeating ones
    last); ValueError names the bad item in one line."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _ITEM.fullmatch(item)
        if match is None or match[1] not in FAULTS:
            raise ValueError(
                f"--schedule item {item!r}: expected {SCHEDULE_FORMS} with KIND one of "
                f"{', '.join(KINDS)}"
            )
        kind = FAULTS[match[1]]
        try:
            every = float(match[3] or 0)
            seconds = float(match[4] or kind.default_seconds)
        except ValueError:
            raise ValueError(f"--schedule item {item!r}: N and SECONDS must be numbers") from None
        step = int(match[2] or 0)
        if match[2] is not None and step < 1:
            raise ValueError(f"--schedule item {item!r}: the step must be 1 or more")
        if match[3] is not None and every <= 0:
            raise ValueError(f"--schedule item {item!r}: N of everyNs must be more than 0")
        if every and kind.trainer_args is not None:
            raise ValueError(f"--schedule item {item!r}: {match[1]} strikes in its STEP only")
        faults.append(Fault(match[1], step, seconds, every))
    if not faults:
        raise ValueError(f"--schedule is empty: give at least one {SCHEDULE_FORMS}")
    return sorted(faults, key=lambda f: (f.every_s > 0, f.step))


def restart_budget(options: ChaosOptions) -> int:
    """The restarts torchrun may do: --max-restarts, else one per once-only fault that restarts,
    _SPARE_RESTARTS more, and _REPEAT_RESTARTS more for repeating ones that restart."""
    if options.max_restarts is not None:
        return options.max_restarts
    once = sum(FAULTS[f.kind].restarts for f in options.schedule if not f.every_s)
    repeating = any(FAULTS[f.kind].restarts for f in options.schedule if f.every_s)
    return once + _SPARE_RESTARTS + (_REPEAT_RESTARTS if repeating else 0)


def default_schedule(nodes: int) -> str:
    """The drill without --schedule on `nodes` nodes: DEFAULT_SCHEDULE, less what one node cannot
    survive."""
    if nodes > 1:
        return DEFAULT_SCHEDULE
    items = DEFAULT_SCHEDULE.split(",")
    return ",".join(item for item in items if item.split("@")[0] not in MULTI_NODE)


@dataclass(frozen=True)
class ChaosOptions:
    workdir: Workdir
    schedule: list[Fault]
    ranks: int = 4
    # Simulated nodes, each with its own ckptd and torchrun agent (scaletrain run --nodes).
    nodes: int = 1
    # Elastic below `nodes` (scaletrain run --nodes MIN:MAX; 0: not): lose-node shrinks the job.
    min_nodes: int = 0
    # Elastic, fewer than `min_nodes` left: how long the job waits for a machine to join.
    capacity_wait_s: float = CAPACITY_WAIT_S
    # Hot spares beside them (scaletrain run --spares): kill-node's lost node is replaced by one.
    spares: int = 0
    # With spares, a node whose ranks failed this many times is cordoned (0: never).
    cordon_after: int = CORDON_AFTER
    steps: int = 400
    ckpt_every: int = 5
    trainer_args: list[str] = field(default_factory=list)
    # Restarts torchrun may do; None: one per restarting fault, plus 2 spare.
    max_restarts: int | None = None
    seed: int = 0
    # Size of the SSD tier's tmpfs when the schedule fills the disk.
    ssd_mb: int = 256


@dataclass
class Injected:
    kind: str
    step: int
    target: str
    detail: str
    # Seconds into the job when it struck.
    injected_at_s: float
    # kill-node: when (time.time()) the replacement machine's fresh ckptd started.
    fresh_ckptd_at: float | None = None
    # kill-node with spares: the spare machine that took the lost node's place.
    spare: str = ""
    # When (time.time()) it struck, and when the drill let it go (a service restarted, a
    # process continued, a restart seen).
    injected_at: float = 0.0
    ended_at: float = 0.0


@dataclass
class ChaosReport:
    run_id: str
    workdir: str
    completed: bool
    exit_code: int
    faults_scheduled: int
    faults_injected: int
    faults_survived: int
    checkpoints_committed: int
    # Checkpoints seen committed that can no longer be restored (a fault lost them); those
    # kill-node-mid-save struck before their parts had copies are `lost_with_node` instead.
    checkpoints_lost: list[int]
    restarts: int
    steps_replayed: int
    steps_replayed_in_place: int
    goodput: float | None
    badput_s: dict[str, float]
    last_loss: float | None
    params_sha256: str | None
    wall_s: float
    faults: list[dict[str, object]]
    # The run's checkpoints at the end: step, bytes, the tiers that hold it.
    checkpoints: list[dict[str, object]]
    # Each restart's restore: the step it resumed from and the bytes it read from each copy
    # ("memory@node0", "SSD@node1" (a node's own part or a replica it holds), "S3").
    recoveries: list[dict[str, object]] = field(default_factory=list)
    lost_with_node: list[int] = field(default_factory=list)
    # Each injected fault's recovery record (`scaletrain.app.recovery.Recovery`), in order.
    fault_recoveries: list[dict[str, object]] = field(default_factory=list)
    # What each kind of fault cost, from telemetry's goodput (the sum of its records' badput_s).
    badput_by_fault_s: dict[str, float] = field(default_factory=dict)
    # The time in steps that were kept over the job's wall time (None: no wall time).
    effective_training: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class _Tap:
    """The job's output: passed on, and watched for the lines the drill waits for."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self.cond = threading.Condition()
        self.step = 0
        self.attempts = 0
        # Of the attempts, those the keepers started (an in-job restart, trainer.keeper).
        self.in_job = 0
        self.lines: list[str] = []
        # When (time.time()) each of `lines` arrived: the recovery records' clock.
        self.stamps: list[float] = []

    def write(self, text: str) -> None:
        now = time.time()
        self._out.write(text)
        with self.cond:
            for line in text.splitlines():
                self.lines.append(line)
                self.stamps.append(now)
                match = STEP_LINE.match(line)
                if match:
                    self.step = int(match[1])
                elif ATTEMPT_LINE.match(line):
                    self.attempts += 1
                    self.in_job += bool(IN_JOB_ATTEMPT.search(line))
            self.cond.notify_all()

    def flush(self) -> None:
        self._out.flush()

    def wait(self, predicate: Callable[[], bool], timeout_s: float | None = _WAIT_S) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout_s)

    def mark(self) -> int:
        """The number of lines seen so far, to wait for a line that comes after now."""
        with self.cond:
            return len(self.lines)

    def seen_since(self, mark: int, text: str) -> bool:
        return any(text in line for line in self.lines[mark:])

    def stamped(self) -> list[tuple[float, str]]:
        """Every line so far with the time it arrived."""
        with self.cond:
            return list(zip(self.stamps, self.lines, strict=True))


class Drill:
    """Injects the schedule into one job on `stack`, from a thread of its own."""

    def __init__(self, stack: Stack, options: ChaosOptions, run_id: str, tap: _Tap) -> None:
        self.stack, self.options, self.run_id, self.tap = stack, options, run_id, tap
        self.injected: list[Injected] = []
        self._fresh_at: float | None = None  # kill-node's fresh ckptd, for its Injected
        self.spare_used = ""  # kill-node with spares: the spare that took the node's place
        # Steps kill-node-mid-save struck before their parts had copies: lost with the node.
        self.lost_with_node: set[int] = set()
        # A fault that waits for its moment inside its injector (kill-node, kill-ckptd) sets
        # `_struck_step` when it strikes: (that step, the time then), for its Injected.
        self._strike: tuple[int, float] | None = None
        self.committed: set[int] = set()
        self.job: Job | None = None
        self._done = threading.Event()
        # The job's start and end (time.time()): the wall time of the drill.
        self.started_at = time.time()
        self.ended_at: float | None = None
        self._telemetry = TelemetryClient(stack.telemetry_address)
        self._threads = [
            threading.Thread(target=self._inject_all, name="chaos"),
            threading.Thread(target=self._watch_checkpoints, name="chaos-ckpt", daemon=True),
        ]

    def trainer_args(self) -> list[str]:
        """Trainer flags for the schedule's faults that the trainer strikes itself."""
        return [
            arg
            for fault in self.options.schedule
            if (flags := FAULTS[fault.kind].trainer_args) is not None
            for arg in flags(fault, self._rank_for(fault))
        ]

    def _random(self, fault: Fault) -> random.Random:
        # Fixed by the seed and the fault's place in the schedule.
        return random.Random(f"{self.options.seed}/{self.options.schedule.index(fault)}")

    def _rank_for(self, fault: Fault) -> int:
        return self._random(fault).randrange(self.options.ranks)

    def _node_for(self, fault: Fault, first: int = 0) -> int:
        """A random node from node `first` on."""
        return self._random(fault).randrange(first, self.options.nodes)

    @property
    def _struck_step(self) -> int | None:
        """The step the job had completed when an injector that waits for its moment struck."""
        return None if self._strike is None else self._strike[0]

    @_struck_step.setter
    def _struck_step(self, step: int | None) -> None:
        # Stamped here, as the injector strikes: not when `_inject_all` gets round to it.
        self._strike = None if step is None else (step, time.time())

    def start(self, job: Job) -> None:
        self.job = job
        self.started_at = time.time()
        for thread in self._threads:
            thread.start()

    def finish(self) -> None:
        """After the job ended: stop injecting, wait for outages in progress to end."""
        self.ended_at = time.time()
        self._done.set()
        with self.tap.cond:
            self.tap.cond.notify_all()
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()

    def close(self) -> None:
        """Deliver what was reported to telemetry (the recovery records too), and let go."""
        self._telemetry.flush(timeout_s=10)
        self._telemetry.close()

    # -- injection -------------------------------------------------------------------------------

    def _inject_all(self) -> None:
        """Each fault when due, one after the other: a KIND@STEP once the job finished its step,
        a KIND@everyNs every N seconds from the job's start. A fault never overlaps the previous
        one (a restart while telemetry is down would fail again) and waits for a step completed
        after it (so that each recovery is its own, its first step after before the next
        strike), so the job trains on during an outage and a later fault may strike later than
        scheduled."""
        once = [f for f in self.options.schedule if not f.every_s]
        due = {f: self.started_at + f.every_s for f in self.options.schedule if f.every_s}
        mark = 0
        while (fault := self._next_due(once, due, mark)) is not None:
            self._strike = None
            at, step = time.time(), self.tap.step
            try:
                target, detail = FAULTS[fault.kind].inject(self, fault)
            except _JobEnded:
                return
            except (OSError, ScaletrainError, UserError) as exc:
                target, detail = "-", f"could not inject: {exc}"
            ended_at, mark = time.time(), self.tap.mark()
            if self._strike is not None:
                step, at = self._strike
            if FAULTS[fault.kind].trainer_args is not None:
                step = fault.step  # the trainer struck it itself, in its STEP
            record = Injected(
                fault.kind, step, target, detail, round(at - self.started_at, 2),
                self._fresh_at, self.spare_used, injected_at=at, ended_at=ended_at,
            )  # fmt: skip
            self._fresh_at, self.spare_used = None, ""
            self.injected.append(record)
            self._report(record)

    def _next_due(self, once: list[Fault], due: dict[Fault, float], mark: int) -> Fault | None:
        """The next fault to strike, taken from `once` (in step order) or moved on in `due` (its
        next time), waiting until one is due and the job completed a step since `mark` (where
        the tap stood when the previous fault was over); None once the job ended or none is
        left."""

        def step_due() -> bool:
            if once and once[0].kind == "return-node" and self.job and self.job.short_of_nodes:
                return True  # the job waits for a machine: it would never reach the step
            return bool(once) and self.tap.step >= once[0].step and self._stepped(mark)

        while not self._done.is_set():
            if step_due():
                return once.pop(0)
            now = time.time()
            ready = [f for f, at in due.items() if at <= now and self._may_repeat(f, once, mark)]
            if ready:
                fault = min(ready, key=due.__getitem__)
                due[fault] += fault.every_s
                return fault
            if not once and not due:
                return None
            wake = max(min(due.values(), default=now + _WAIT_S) - now, 0.2)
            self.tap.wait(lambda: self._done.is_set() or step_due(), wake)
        return None

    def _stepped(self, mark: int) -> bool:
        """Whether the job completed a step since the tap's `mark`."""
        return self.tap.seen_since(mark, "[trainer] step ")

    def _may_repeat(self, fault: Fault, once: list[Fault], mark: int) -> bool:
        """Whether repeating `fault` may strike now: the job completed a step since the previous
        fault was over, and one that restarts the job leaves _SPARE_RESTARTS of the budget after
        the restarts of the `once` faults still to come."""
        if not self._stepped(mark):
            return False
        if not FAULTS[fault.kind].restarts:
            return True
        to_come = sum(FAULTS[f.kind].restarts for f in once)
        # The keepers' in-job restarts spend none of torchrun's budget.
        cold = self.tap.attempts - self.tap.in_job
        left = restart_budget(self.options) - max(cold - 1, 0) - to_come
        return left > _SPARE_RESTARTS

    def recovery_records(self, engine: Engine) -> list[Recovery]:
        """Each injected fault's recovery record, from the job's output, telemetry (its events
        and restarts, in `engine`) and the ckptd logs; each also reported to telemetry as a
        `recovery` event stamped at its strike."""
        lines = self.tap.stamped()
        timeline = Timeline(lines)
        seen = signs(engine, self.run_id, self.stack.workdir.logs, lines)
        restarts = queries.restarts(engine, self.run_id)
        records = []
        for fault in self.injected:
            kind = FAULTS[fault.kind]
            injected_at, ended_at = fault.injected_at, fault.ended_at
            if kind.trainer_args is not None:
                # The trainer strikes it itself, inside step STEP: from that step's start.
                injected_at = ended_at = timeline.step_started(fault.step) or injected_at
            record = recovery_record(
                kind=fault.kind, target=fault.target, step=fault.step, injected_at=injected_at,
                ended_at=ended_at, restarts=kind.restarts, detected_by=re.compile(kind.detected_by),
                timeline=timeline, signs=seen, restarts_seen=restarts, spare=bool(fault.spare),
            )  # fmt: skip
            records.append(record)
            report = event(
                self.run_id, "recovery", step=record.step, message=_describe(record),
                attributes=record.attributes(),
            )  # fmt: skip
            report.time.FromDatetime(datetime.fromtimestamp(record.injected_at, UTC))
            self._telemetry.report_event(report)
        return records

    def _report(self, record: Injected) -> None:
        rank = int(record.target.removeprefix("rank ")) if record.target.startswith("rank ") else -1
        # A fault on a node names it in the event's attributes: target "node1"; rank -1.
        self._telemetry.report_event(
            event(
                self.run_id, "fault", step=record.step, rank=rank,
                message=f"chaos: {record.kind}: {record.detail}",
                attributes={"fault": record.kind, "target": record.target},
            )
        )  # fmt: skip

    def _victim(self, fault: Fault) -> tuple[int, int]:
        assert self.job is not None
        rank = self._rank_for(fault)
        pids = self.job.rank_pids()
        if rank not in pids:
            raise UserError(f"rank {rank} has no process (ranks seen: {sorted(pids)})")
        return rank, pids[rank]

    def _await_restart(self, attempts_before: int) -> str:
        restarted = self.tap.wait(
            lambda: self._done.is_set() or self.tap.attempts > attempts_before
        )
        return "; the job restarted" if restarted and not self._done.is_set() else ""

    def _kill_rank(self, fault: Fault) -> tuple[str, str]:
        attempts = self.tap.attempts
        rank, pid = self._victim(fault)
        os.kill(pid, signal.SIGKILL)
        return f"rank {rank}", f"SIGKILL to pid {pid} during step {self.tap.step + 1}" + (
            self._await_restart(attempts)
        )

    def _kill_rank_twice(self, fault: Fault) -> tuple[str, str]:
        """Kill a rank, then another rank of the job started again, before it trained a step:
        two failures inside one recovery."""
        assert self.job is not None
        attempts, mark = self.tap.attempts, self.tap.mark()
        rank, pid = self._victim(fault)
        before = set(self.job.rank_pids().values())
        os.kill(pid, signal.SIGKILL)
        ranks, pick = self.options.ranks, self._random(fault)
        again = rank if ranks == 1 else (rank + 1 + pick.randrange(ranks - 1)) % ranks
        deadline = time.monotonic() + _WAIT_S
        while not self._done.is_set() and time.monotonic() < deadline:
            started = self.job.rank_pids().get(again)
            if started is not None and started not in before:
                break
            time.sleep(0.05)  # a scan of /proc each time; the restart takes a second
        else:
            raise _JobEnded
        with contextlib.suppress(ProcessLookupError):
            os.kill(started, signal.SIGKILL)
        when = (
            "after it trained again"
            if self.tap.seen_since(mark, "[trainer] step ")
            else "before it trained a step"
        )
        return f"rank {rank}", (
            f"SIGKILL to pid {pid} during step {self.tap.step + 1}, then to rank {again}'s new "
            f"pid {started} {when}" + self._await_restart(attempts)
        )

    def _stop_rank(self, fault: Fault) -> tuple[str, str]:
        attempts, mark = self.tap.attempts, self.tap.mark()
        rank, pid = self._victim(fault)
        os.kill(pid, signal.SIGSTOP)
        fired = self.tap.wait(
            lambda: self._done.is_set() or self.tap.seen_since(mark, "error: watchdog:")
        )
        with contextlib.suppress(ProcessLookupError):  # its keeper may have replaced it
            os.kill(pid, signal.SIGCONT)
        verdict = "a watchdog fired" if fired else "no watchdog fired"
        return f"rank {rank}", f"SIGSTOP to pid {pid}: {verdict}" + self._await_restart(attempts)

    def _kill_ckptd(self, fault: Fault) -> tuple[str, str]:
        mark = self.tap.mark()
        self.tap.wait(lambda: self._done.is_set() or self.tap.seen_since(mark, "checkpoint staged"))
        if self._done.is_set():
            raise _JobEnded
        self._struck_step = self.tap.step
        self.stack.service("ckptd").kill()
        time.sleep(fault.seconds)
        self.stack.restart_service("ckptd")
        return "ckptd", f"SIGKILL with an upload in flight, restarted {fault.seconds}s later"

    def _stop_s3(self, fault: Fault) -> tuple[str, str]:
        assert self.stack.s3 is not None
        self.stack.s3.stop()
        time.sleep(fault.seconds)
        self.stack.s3.start()
        return "s3", f"stopped for {fault.seconds}s"

    def _disk_full(self, fault: Fault) -> tuple[str, str]:
        mark, deadline = self.tap.mark(), time.monotonic() + fault.seconds
        filler = ssd_dir(self.stack.workdir) / "chaos-filler"
        failed = False
        try:
            # Topped up every half second: ckptd frees space as retention drops old copies.
            while not failed and time.monotonic() < deadline:
                _fill(filler)
                failed = self.tap.wait(
                    lambda: self._done.is_set() or self.tap.seen_since(mark, "failed:"), 0.5
                )
        finally:
            filler.unlink(missing_ok=True)
        what = "a save failed" if failed and not self._done.is_set() else "no save failed"
        return "ssd", f"SSD tier's disk filled ({what}), then freed"

    def _corrupt_shard(self, fault: Fault) -> tuple[str, str]:
        attempts = self.tap.attempts
        rank, pid = self._victim(fault)
        # Frozen, the job saves nothing newer and restarts nothing before the damage is done
        # (an in-job restart would resume within a second).
        frozen = list(self.job.rank_pids().values()) if self.job is not None else [pid]
        for other in frozen:
            os.kill(other, signal.SIGSTOP)
        try:
            # The checkpoint the job will resume from, once S3 holds the good copy to fall
            # back on.
            latest = _committed(wait_on_s3(self.stack.ckptd_address, self.run_id))
            step = max(c.ref.step for c in latest)
            # node0's first shard: rank 0's, which node0's ranks wrote.
            shard = min((ssd_dir(self.stack.workdir) / self.run_id / str(step)).glob("__*.distcp"))
            with shard.open("r+b") as f:
                f.seek(shard.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            self.stack.service("ckptd").kill()
            self.stack.restart_service("ckptd")
            # The ranks' own copies of their last step would spare the restore any read of
            # ckptd.
            from trainer.checkpoint.own_copy import remove_copies  # it loads torch; chaos not

            remove_copies(self.run_id)
        finally:
            os.kill(pid, signal.SIGKILL)
            for other in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGCONT)
        detail = (
            f"damaged {shard.name} of step {step} on SSD, ckptd restarted, the ranks' own "
            f"copies dropped, rank {rank} killed"
        )
        return "ssd", detail + self._await_restart(attempts)

    def _kill_telemetry(self, fault: Fault) -> tuple[str, str]:
        self.stack.service("telemetry").kill()
        time.sleep(fault.seconds)
        self.stack.restart_service("telemetry")
        return "telemetry", f"SIGKILL, restarted {fault.seconds}s later"

    def _sdc(self, fault: Fault) -> tuple[str, str]:
        rank = self._rank_for(fault)
        return f"rank {rank}", f"a gradient bit flipped in step {fault.step} (--inject-sdc)"

    def _kill_node(self, fault: Fault) -> tuple[str, str]:
        node, held, attempts, serving = self._freeze_and_kill(fault)
        return self._lose_node(node, held, attempts, serving)

    def _lose_node_for_good(self, fault: Fault) -> tuple[str, str]:
        """kill-node with no machine in its place: a spare if one waits, else the elastic job
        re-forms on the nodes that remain (`Job._shrink`)."""
        assert self.job is not None
        spare = bool(self.options.spares)
        node, held, attempts, serving = self._freeze_and_kill(fault, replaced=spare)
        if spare:
            return self._lose_node(node, held, attempts, serving)
        left = len(serving - {node})
        lost = (
            f"agent, ranks and ckptd SIGKILLed ({held}), data dir deleted; no machine takes its "
            "place"
        )
        if left < self.options.min_nodes:
            # The job cannot train until a machine joins: the next fault (a return-node) strikes
            # as soon as the stack has taken the loss in, not at its step.
            self.tap.wait(lambda: self._done.is_set() or node in self.job.left)  # type: ignore[union-attr]
            return node_name(node), (
                f"{lost}: {left} node(s) left, fewer than {self.options.min_nodes}; the job waits "
                f"up to {self.options.capacity_wait_s:g}s for a machine to join"
            )
        return node_name(node), f"{lost}: the job re-forms on {left} node(s)" + (
            self._await_restart(attempts)
        )

    def _return_node(self, fault: Fault) -> tuple[str, str]:
        """A machine lost for good comes back (a fresh one at its address): the elastic job
        takes it in at its next rendezvous round and grows."""
        assert self.job is not None
        attempts = self.tap.attempts
        if not self.job.left:
            return "none", "no node had been lost for good: nothing came back"
        node = min(self.job.left)
        learned = self._fresh_machine(node)
        grown = len(self.job.serving() | {node})
        return node_name(node), (
            f"a fresh machine at {self.stack.ckptd_addresses[node]} {learned}; the job grows to "
            f"{grown} node(s)" + self._await_restart(attempts)
        )

    def _freeze_and_kill(
        self, fault: Fault, replaced: bool = True
    ) -> tuple[int, str, int, set[int]]:
        """Kill a node (`_node_to_kill`) once no committed checkpoint needs it: (the node, what
        held the checkpoints then, the attempts and the serving nodes before it)."""
        assert self.job is not None
        if self.options.spares:
            self._wait_for_spare()
        attempts, serving = self.tap.attempts, self.job.serving()
        node = self._node_to_kill(fault, serving)
        ckptd = self.stack.service(ckptd_service(node))
        # The job must have a checkpoint to resume from before its ranks are frozen; with
        # replicas, one on 2 nodes (copied in the background after its commit). Not the newest:
        # on a loaded machine a copy can take longer than the steps between two saves, and the
        # newest is then never safe while the job trains; frozen, it catches up (below).
        self._wait_committed(bool, time.monotonic() + _WAIT_S)
        if flag_value(self.options.trainer_args, "--replicas") != "1":
            self._wait_committed(_some_node_loss_safe, time.monotonic() + _WAIT_S)
        if self._done.is_set():
            raise _JobEnded
        # Frozen, the node's ranks can complete no save, so no checkpoint commits with a part
        # that only this machine holds; its ckptd goes on uploading to S3, and copying its part
        # to its peers, until every committed checkpoint is on S3 or on 2 nodes.
        frozen = self.job.machine_pids(node)
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):  # it ended: nothing to freeze
                os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + _WAIT_S
        while True:
            # Checked while the node's ckptd answers: node0 asks it for its part's copies.
            on_s3 = self._wait_committed(_all_safe, deadline)
            before = self._committed_steps()
            ckptd.signal(signal.SIGSTOP)  # a commit in flight needs its vote: none from now on
            if self._done.is_set():
                ckptd.signal(signal.SIGCONT)
                for pid in frozen:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                raise _JobEnded
            # A commit whose vote left before the freeze may still land: give it a moment, then
            # check again with the node thawed. node0 lists its own catalog here, never asking
            # the frozen node (that call would wait out the peer timeout every time round).
            time.sleep(_COMMIT_SETTLE_S)
            if not on_s3 or (before is not None and self._committed_steps() == before):
                break
            ckptd.signal(signal.SIGCONT)
        held = (
            "every committed checkpoint was on S3 or on 2 nodes"
            if on_s3
            else "a committed checkpoint was NEITHER on S3 NOR on 2 nodes"
        )
        self._kill_machine(node, replaced)
        return node, held, attempts, serving

    def _kill_node_mid_save(self, fault: Fault) -> tuple[str, str]:
        """Lose a node in the instant after a save committed, before its part has its copies:
        the step may go with it, and the job must resume from the newest step it can restore
        (never start over). A step lost so was never node-loss safe (`lost_with_node`)."""
        assert self.job is not None
        if self.options.spares:
            self._wait_for_spare()
        attempts, serving = self.tap.attempts, self.job.serving()
        node = self._node_to_kill(fault, serving)
        # Copies slow enough that "committed, its part not yet on a peer" lasts seconds, until
        # the strike: the recovery and the rest of the drill copy at the usual rate.
        with self._replica_rate(MID_SAVE_REPLICA_MB_S * (1 << 20)):
            before = max(self._committed_steps() or {0})
            deadline = time.monotonic() + _WAIT_S
            while not self._done.is_set() and time.monotonic() < deadline:
                steps = self._committed_steps() or set()
                if steps and max(steps) > before:
                    break
                time.sleep(0.02)
            else:
                raise _JobEnded
            newest = max(steps)
            if newest >= self.options.steps:  # the job's last save: it ends, nothing to recover
                raise _JobEnded
            self._struck_step = self.tap.step
            state = "already node-loss safe"
            with contextlib.suppress(ScaletrainError), CkptdClient(self.stack.ckptd_address) as c:
                info = c.get(self.run_id, newest)
                on_s3 = common_pb2.TIER_S3 in {t.tier for t in info.tiers if t.state == _COMMITTED}
                if not info.node_loss_safe and on_s3:
                    # Its upload outran its copy: the lost part's only other home is S3.
                    state = "not yet node-loss safe but already on S3"
                elif not info.node_loss_safe:
                    self.lost_with_node.add(newest)
                    state = "not yet node-loss safe"
            self._kill_machine(node)
        return self._lose_node(node, f"step {newest} committed, {state}", attempts, serving)

    @contextlib.contextmanager
    def _replica_rate(self, bytes_s: float) -> Iterator[None]:
        """Every ckptd copies parts to its peers at `bytes_s` for the span (ckptd's
        SetReplicaRate); each that still answers gets its own rate back after it."""
        before: dict[str, float] = {}
        for address in self.stack.ckptd_addresses:
            with contextlib.suppress(ScaletrainError), CkptdClient(address) as client:
                before[address] = client.set_replica_rate(bytes_s)
        try:
            yield
        finally:
            for address, rate in before.items():
                with contextlib.suppress(ScaletrainError), CkptdClient(address) as client:
                    client.set_replica_rate(rate)

    def _wait_for_spare(self) -> set[int]:
        """The spares waiting in the rendezvous, once there is one (a machine lost earlier comes
        back as one in seconds): a node fault of a drill with --spares strikes the spare path."""
        assert self.job is not None
        deadline = time.monotonic() + _WAIT_S
        while not (waiting := set(self.job.waiting_spares())):
            if self._done.is_set() or time.monotonic() > deadline:
                raise _JobEnded
            time.sleep(0.2)
        return waiting

    def _kill_spare_taking_over(self, fault: Fault) -> tuple[str, str]:
        """kill-node, and the spare that takes the lost node's place too, as soon as it runs
        ranks, before the job trains on it: the job must find it lost and go on with the next
        machine (the first lost one, coming back)."""
        waiting = self._wait_for_spare()  # a spare must be there to lose
        struck: list[str] = []

        def strike_the_spare() -> None:
            deadline = time.monotonic() + _WAIT_S
            while not self._done.is_set() and time.monotonic() < deadline:
                taking = sorted(waiting & self.job.serving())  # type: ignore[union-attr]
                if taking:
                    self._kill_machine(taking[0], replaced=False)
                    struck.append(node_name(taking[0]))
                    self._spare_machine(taking[0])  # it comes back later, as a spare
                    return
                time.sleep(0.05)

        striker = threading.Thread(target=strike_the_spare, name="chaos-spare", daemon=True)
        striker.start()
        target, detail = self._kill_node(fault)
        striker.join(_WAIT_S)
        spare = struck[0] if struck else "NONE"
        return target, f"{detail}; then the spare {spare} lost as it took over"

    def _kill_rendezvous(self, fault: Fault) -> tuple[str, str]:
        attempts = self.tap.attempts
        self.stack.service(RENDEZVOUS).kill()
        return RENDEZVOUS, "SIGKILL" + self._await_restart(attempts)

    def _flaky_node(self, fault: Fault) -> tuple[str, str]:
        """Kill a rank of one node, again each time the job trains after its restart, until the
        stack cordons the node (`Job._count_failure`) and a spare takes its place."""
        assert self.job is not None
        serving = self.job.serving()
        node = self._node_to_kill(fault, serving)
        kills, deadline = 0, time.monotonic() + _WAIT_S
        while node not in self.job.cordoned:
            pids = self.job.rank_pids(node)
            if self._done.is_set() or time.monotonic() > deadline:
                raise _JobEnded
            if not pids:  # its ranks are being forked again
                time.sleep(0.05)
                continue
            attempts, mark = self.tap.attempts, self.tap.mark()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[min(pids)], signal.SIGKILL)
                kills += 1
            self.tap.wait(lambda a=attempts, m=mark: self._trains_again(node, a, m))
        attempts = self.tap.attempts
        restarted = self._await_restart(attempts)
        self.spare_used = ", ".join(map(node_name, sorted(self.job.serving() - serving)))
        return node_name(node), (
            f"a rank of it SIGKILLed {kills} times; cordoned, spare "
            f"{self.spare_used or 'NONE'} took its place{restarted}"
        )

    def _trains_again(self, node: int, attempts: int, mark: int) -> bool:
        """Whether the job trained again since `mark` in an attempt after `attempts`, or ended,
        or cordoned `node`."""
        assert self.job is not None
        again = self.tap.attempts > attempts and self.tap.seen_since(mark, "[trainer] step ")
        return again or self._done.is_set() or node in self.job.cordoned

    def _node_to_kill(self, fault: Fault, serving: set[int]) -> int:
        """A node picked by the seed: never node0 (whose ckptd the drill and the summary ask);
        with spares, one that runs ranks now (a spare may have taken a node's place). The
        machine an earlier kill lost may still be coming back: until it is, the job waits for
        it as for a replaced machine. An elastic job's machine lost for good is never picked
        again."""
        assert self.job is not None
        nodes = sorted(serving - {0}) if self.options.spares else []
        if self.job.left:
            nodes = sorted((set(nodes) or set(range(1, self.options.nodes))) - self.job.left)
        if not nodes:
            return self._node_for(fault, first=1)
        return nodes[self._random(fault).randrange(len(nodes))]

    def _kill_machine(self, node: int, replaced: bool = True) -> None:
        """SIGKILL node `node`'s agent, ranks and ckptd and delete its data dir (its SSD); the
        job is told it is being `replaced`, or finds out itself."""
        assert self.job is not None
        self._struck_step = self._struck_step or self.tap.step
        if replaced:
            self.job.kill_agent(node)
        else:
            self.job.lose(node)
        self.stack.service(ckptd_service(node)).kill()
        data_dir = self.stack.workdir.ckptd_dir(node)
        shutil.rmtree(data_dir)
        data_dir.mkdir()

    def _lose_node(self, node: int, held: str, attempts: int, serving: set[int]) -> tuple[str, str]:
        """After `_kill_machine(node)`: a spare takes its place, or the machine comes back empty
        at the same address."""
        assert self.job is not None
        name, address = node_name(node), self.stack.ckptd_addresses[node]
        killed = f"agent, ranks and ckptd SIGKILLed ({held}), data dir deleted"
        if self.options.spares:
            # A warm spare takes the node's place in the next round: the job goes on without
            # waiting for a new machine, which joins as the next spare while the drill goes on.
            restarted = self._await_restart(attempts)
            self.spare_used = ", ".join(map(node_name, sorted(self.job.serving() - serving)))
            threading.Thread(
                target=self._spare_machine, args=(node,), name="chaos-fresh-machine", daemon=True
            ).start()
            return name, (
                f"{killed}; spare {self.spare_used or 'NONE'} took its place; a fresh machine "
                f"comes up at {address} as the next spare{restarted}"
            )
        self._fresh_at = time.time()
        detail = f"{killed}; a fresh ckptd at {address} {self._fresh_machine(node)}, agent "
        return name, detail + "started again" + self._await_restart(attempts)

    def _fresh_machine(self, node: int) -> str:
        """Start node `node` again as a new machine: its ckptd with the empty data dir, once it
        has learned the newest checkpoint, then its agent. Returns what the ckptd learned."""
        assert self.job is not None
        self.stack.restart_service(ckptd_service(node))
        learned = self._wait_knows_newest(self.stack.ckptd_addresses[node])
        if not self.job.start_agent(node):
            raise _JobEnded
        return learned

    def _spare_machine(self, node: int) -> None:
        """A new machine in node `node`'s place, as the next spare (a thread of its own)."""
        with contextlib.suppress(_JobEnded, ScaletrainError, UserError):
            learned = self._fresh_machine(node)
            self.tap.write(f"[chaos] a fresh machine {node_name(node)} {learned}, the next spare\n")

    def _wait_committed(
        self, enough: Callable[[list[checkpoint_pb2.CheckpointInfo]], bool], deadline: float = 0
    ) -> bool:
        """Whether the run's committed checkpoints are `enough` (given node0's view of them),
        waiting for it until `deadline` (time.monotonic(); 0: asks once)."""
        while True:
            with contextlib.suppress(ScaletrainError), CkptdClient(self.stack.ckptd_address) as c:
                if enough(_committed(c.list(self.run_id, nodes=True))):
                    return True
            if self._done.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def _committed_steps(self, address: str = "") -> set[int] | None:
        """The steps the ckptd at `address` (node0's if empty) lists as committed in its own
        catalog, asking no peer (None: it did not answer)."""
        address = address or self.stack.ckptd_address
        with contextlib.suppress(ScaletrainError), CkptdClient(address) as c:
            return {info.ref.step for info in _committed(c.list(self.run_id))}
        return None

    def _wait_knows_newest(self, address: str) -> str:
        """Wait until the ckptd at `address` lists node0's newest committed checkpoint that can
        be restored (one lost with a node mid-save is committed, but gone)."""
        deadline = time.monotonic() + _WAIT_S
        newest = -1
        with contextlib.suppress(ScaletrainError), CkptdClient(self.stack.ckptd_address) as c:
            newest = c.get(self.run_id).ref.step
        while time.monotonic() < deadline and not self._done.is_set():
            if newest in (self._committed_steps(address) or ()):
                return f"lists step {newest}"
            time.sleep(0.2)
        return f"does not list step {newest}"

    def _partition_node(self, fault: Fault) -> tuple[str, str]:
        node = self._node_for(fault)
        ckptd = self.stack.service(ckptd_service(node))
        ckptd.signal(signal.SIGSTOP)
        try:
            time.sleep(fault.seconds)
        finally:
            ckptd.signal(signal.SIGCONT)
        return node_name(node), f"ckptd frozen (SIGSTOP) for {fault.seconds}s, then SIGCONT"

    # -- what is committed -----------------------------------------------------------------------

    def _watch_checkpoints(self) -> None:
        """Remember every durable checkpoint seen committed (whole, on some tier) while the job
        runs. A memory-only one (--mem-ckpt-every) is meant to go: ckptd drops it once a newer
        durable step commits, and it never survives its holders."""
        while not self._done.wait(0.5):
            with (
                contextlib.suppress(ScaletrainError),
                CkptdClient(self.stack.ckptd_address) as client,
            ):
                self.committed |= {
                    c.ref.step
                    for c in _intact(client.list(self.run_id, nodes=True))
                    if not c.memory_only
                }


def _describe(record: Recovery) -> str:
    """A recovery record in one line, for the `recovery` event's message."""
    back = "no step after it"
    if record.mttr_s is not None:
        back = f"trained again {record.mttr_s:.1f}s after it struck"
    restore = (
        f", resumed from step {record.resumed_from} ({record.steps_lost} steps lost)"
        if record.resumed_from is not None
        else ""
    )
    return f"recovery from {record.kind} on {record.target}: {back}{restore}"


def _sdc_flags(fault: Fault, rank: int) -> list[str]:
    return ["--inject-sdc", f"step={fault.step},rank={rank}"]


FAULTS: dict[str, FaultKind] = {
    "kill-rank": FaultKind(
        "SIGKILL a random rank in the middle of the next step; the keepers fork every rank "
        "again in-job (torchrun's agent restarts the job when they cannot), which resumes from "
        "the latest committed checkpoint.",
        Drill._kill_rank,
        restarts=True,
    ),
    "kill-rank-twice": FaultKind(
        "SIGKILL a random rank, then another as soon as the job's ranks were started again, "
        "before the job trained a step: two failures inside one recovery, which the keepers "
        "(or torchrun's agent) mend again; it resumes from the same checkpoint.",
        Drill._kill_rank_twice,
        restarts=True,
    ),
    "stop-rank": FaultKind(
        "SIGSTOP a random rank (a hang) until a watchdog fires, then SIGCONT it (if its keeper "
        "has not replaced it yet); the job restarts.",
        Drill._stop_rank,
        restarts=True,
        detected_by=r"error: watchdog:",
    ),
    "kill-ckptd": FaultKind(
        "SIGKILL ckptd right after the next checkpoint was staged (its upload in flight), restart "
        "it SECONDS later (default 1) on the same data dir.",
        Drill._kill_ckptd,
        default_seconds=1.0,
        detected_by=_SAVE_FAILED,
    ),
    "stop-s3": FaultKind(
        "stop the S3 server for SECONDS (default 30), then start it again.",
        Drill._stop_s3,
        default_seconds=30.0,
        detected_by=r"^ckptd: S3 job .* failed",
    ),
    "disk-full": FaultKind(
        "fill the SSD tier's disk (a size-limited tmpfs, which needs root) until a save fails or "
        "SECONDS pass (default 60), then free it.",
        Drill._disk_full,
        default_seconds=60.0,
        fills_disk=True,
        detected_by=_SAVE_FAILED,
    ),
    "corrupt-shard": FaultKind(
        "Freeze the ranks, damage one shard of the latest checkpoint on SSD, restart ckptd (its "
        "memory tier gone), drop the ranks' own copies, then SIGKILL a rank, so that the resume "
        "must find the damage and read the S3 copy.",
        Drill._corrupt_shard,
        restarts=True,
    ),
    "kill-telemetry": FaultKind(
        "SIGKILL the telemetry service, restart it SECONDS later (default 3).",
        Drill._kill_telemetry,
        default_seconds=3.0,
        detected_by=r"^telemetry: keeping \d+ records",
    ),
    "sdc": FaultKind(
        "flip a bit of a random rank's gradients in step STEP (--inject-sdc): the step guard must "
        "catch and replay it.",
        Drill._sdc,
        trainer_args=_sdc_flags,
        detected_by=r"^event sdc: ",
    ),
    "kill-node": FaultKind(
        "(--nodes 2 or more) a machine replaced: SIGKILL a random node's torchrun agent, its ranks "
        "and its ckptd, delete its ckptd's data dir (its SSD), start a fresh ckptd with an empty "
        "one at the same address, then the node's agent again (with --spares, a warm spare takes "
        "its place first and the fresh machine becomes a spare); the other agents restart their "
        "ranks and the job re-forms with it. Never node0: the drill asks its ckptd. The node's "
        "ranks are frozen first, until every committed checkpoint is on S3 or node-loss safe: "
        "a part that only the dead machine held could not survive it, so the drill strikes "
        "when none is (kill-node-mid-save strikes when one is).",
        Drill._kill_node,
        restarts=True,
        min_nodes=2,
    ),
    "lose-node": FaultKind(
        "(--nodes MIN:MAX) a machine lost for good: kill-node, but no machine comes in its place "
        "(with --spares a waiting spare still does): the job re-forms on the nodes that remain, "
        "resharding its state, with the same global batch and data order.",
        Drill._lose_node_for_good,
        restarts=True,
        min_nodes=2,
        elastic=True,
    ),
    "return-node": FaultKind(
        "(--nodes MIN:MAX) a machine lost for good comes back: a fresh ckptd and agent at its "
        "address; the job takes it in at its next rendezvous round and grows, resharding again.",
        Drill._return_node,
        restarts=True,
        min_nodes=2,
        elastic=True,
    ),
    "kill-node-mid-save": FaultKind(
        "(--nodes 2 or more) as kill-node, but in the instant after the next save commits, "
        "before its part is copied to a peer (the drill slows copies to 2 MB/s until then): that "
        "step may be lost with the node, having never been node-loss safe; the job must resume "
        "from the newest step it can still restore.",
        Drill._kill_node_mid_save,
        restarts=True,
        min_nodes=2,
    ),
    "flaky-node": FaultKind(
        "(--spares 1 or more) SIGKILL a rank of a random node again and again, each time once "
        "the job trains again, until the node is cordoned (--cordon-after failures of its ranks) "
        "and a waiting spare takes its place; the cordoned machine does not come back.",
        Drill._flaky_node,
        restarts=True,
        min_nodes=2,
        min_spares=1,
    ),
    "kill-spare-taking-over": FaultKind(
        "(--spares 1 or more) as kill-node, then SIGKILL the spare taking the node's place as "
        "soon as it runs ranks: the job finds it lost and goes on with the next machine (the "
        "one lost first, back as a spare).",
        Drill._kill_spare_taking_over,
        restarts=True,
        min_nodes=2,
        min_spares=1,
    ),
    "kill-rendezvous": FaultKind(
        "(--nodes 2 or more) SIGKILL the rendezvous service the agents meet in: torch's agents "
        "cannot reconnect to its store, so the stack starts it again at its address, then "
        "every agent; the job resumes from its newest checkpoint.",
        Drill._kill_rendezvous,
        restarts=True,
        min_nodes=2,
        detected_by=r"^\[scaletrain\] the rendezvous at \S+ was lost",
    ),
    "partition-node": FaultKind(
        "freeze a random node's ckptd (SIGSTOP) for SECONDS (default 5), then SIGCONT: its ranks "
        "and its peers cannot reach it meanwhile.",
        Drill._partition_node,
        default_seconds=5.0,
        detected_by=_SAVE_FAILED,
    ),
}
KINDS = tuple(FAULTS)
# Faults that need another node to survive them, and those that need a spare.
MULTI_NODE = frozenset(kind for kind, fault in FAULTS.items() if fault.min_nodes > 1)
NEEDS_SPARES = frozenset(kind for kind, fault in FAULTS.items() if fault.min_spares > 0)
# Faults that resize the job: an elastic one only (--nodes MIN:MAX).
NEEDS_ELASTIC = frozenset(kind for kind, fault in FAULTS.items() if fault.elastic)


def kinds_help() -> str:
    """Every kind and what it does, for `scaletrain chaos --help`."""
    lines = [
        f"fault kinds ({SCHEDULE_FORMS}: once after step STEP,",
        "or every N seconds of the job; SECONDS: how long the fault lasts):",
    ]
    width = max(map(len, FAULTS)) + 2
    for kind, fault in FAULTS.items():
        lines += textwrap.wrap(
            fault.describe,
            79,
            initial_indent=f"  {kind:<{width}}",
            subsequent_indent=" " * (width + 2),
        )
    return "\n".join(lines)


def _fill(path: Path) -> None:
    """Append zeros to `path` until its file system is full."""
    block = bytes(1 << 16)
    with contextlib.suppress(OSError), path.open("ab", buffering=0) as out:
        while True:
            out.write(block)


def _committed(checkpoints: list[_Copies], tier: int | None = None) -> list[_Copies]:
    """The checkpoints (or nodes' parts) committed on `tier` (None: on some tier), as the
    answering node sees them."""
    return [
        c
        for c in checkpoints
        if any(t.state == _COMMITTED and tier in (None, t.tier) for t in c.tiers)
    ]


def _some_node_loss_safe(committed: list[checkpoint_pb2.CheckpointInfo]) -> bool:
    """Whether one of the `committed` checkpoints has every part on 2 nodes."""
    return any(c.node_loss_safe for c in committed)


def _all_safe(committed: list[checkpoint_pb2.CheckpointInfo]) -> bool:
    """Whether each of the `committed` checkpoints (there is one) survives the loss of any one
    node: S3 holds it whole, or it is node-loss safe (each part on 2 nodes)."""
    on_s3 = _committed(committed, common_pb2.TIER_S3)
    return bool(committed) and all(c in on_s3 or c.node_loss_safe for c in committed)


def _intact(
    checkpoints: list[checkpoint_pb2.CheckpointInfo],
) -> list[checkpoint_pb2.CheckpointInfo]:
    """The checkpoints that can still be restored: committed on S3 (whole), or every node's part
    (`parts`, from a listing with nodes=True) committed on one of that node's tiers. Without
    parts, committed on some tier of the answering node."""
    return [
        c
        for c in _committed(checkpoints)
        if not c.parts
        or _committed([c], common_pb2.TIER_S3)
        or all((p.reachable and _committed([p])) or p.copies for p in c.parts if p.files)
    ]


def wait_on_s3(
    address: str, run_id: str, timeout_s: float = _WAIT_S
) -> list[checkpoint_pb2.CheckpointInfo]:
    """The run's checkpoints with every node's part, once the newest committed one is on S3 too
    (or the time is up).

    Not every tier: a ckptd restarted by the drill lost its memory tier for good.
    """
    deadline = time.monotonic() + timeout_s
    with CkptdClient(address) as client:
        while True:
            checkpoints = client.list(run_id, nodes=True)
            newest = max(_committed(checkpoints), key=lambda c: c.ref.step, default=None)
            if newest is None or _committed([newest], common_pb2.TIER_S3):
                return checkpoints
            if time.monotonic() > deadline:
                return checkpoints
            time.sleep(0.2)


def ssd_dir(workdir: Workdir) -> Path:
    """Where node0's ckptd keeps its SSD tier in the embedded stack."""
    return workdir.ckptd / "ssd"


def _mount_tmpfs(path: Path, size_mb: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )


def can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN), which disk-full needs."""
    with tempfile.TemporaryDirectory() as probe:
        if _mount_tmpfs(Path(probe), 1).returncode != 0:
            return False
        subprocess.run(["umount", probe], check=False)
    return True


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int):
    """A tmpfs of `size_mb` mounted at `path` (root only), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = _mount_tmpfs(path, size_mb)
    if mounted.returncode != 0:
        raise UserError(
            f"disk-full needs a {size_mb} MiB tmpfs at {path}, which needs root: "
            f"{mounted.stderr.strip() or mounted.returncode}"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def chaos(options: ChaosOptions, out: IO[str]) -> ChaosReport:
    """Run the drill; the job's output goes to `out`."""
    if options.ranks < 2:
        raise UserError(f"--ranks must be at least 2 for a drill, got {options.ranks}")
    check_nodes(options.ranks, options.nodes, options.spares, min_nodes=options.min_nodes)
    elastic = sorted({f.kind for f in options.schedule if FAULTS[f.kind].elastic})
    if elastic and not options.min_nodes < options.nodes:
        raise UserError(
            f"--schedule: {', '.join(elastic)} needs an elastic job, --nodes MIN:MAX with MIN "
            "below MAX"
        )
    lonely = sorted({f.kind for f in options.schedule if FAULTS[f.kind].min_nodes > options.nodes})
    if lonely:
        raise UserError(f"--schedule: {', '.join(lonely)} needs --nodes 2 or more")
    spared = sorted(
        {f.kind for f in options.schedule if FAULTS[f.kind].min_spares > options.spares}
    )
    if spared:
        raise UserError(f"--schedule: {', '.join(spared)} needs --spares 1 or more")
    if any(f.kind == "flaky-node" for f in options.schedule) and not options.cordon_after:
        raise UserError("--schedule: flaky-node needs --cordon-after 1 or more (0 never cordons)")
    late = [f"{f.kind}@{f.step}" for f in options.schedule if f.step >= options.steps]
    if late:
        raise UserError(f"--schedule: {', '.join(late)} at or after the last step {options.steps}")
    workdir = options.workdir
    run_id = new_run_id()
    max_restarts = restart_budget(options)
    trainer_args = [
        "--steps", str(options.steps), "--ckpt-every", str(options.ckpt_every),
        "--log-every", "1", "--watchdog-min-s", str(DRILL_WATCHDOG_MIN_S),
        "--heartbeat-s", "2", *options.trainer_args,
    ]  # fmt: skip
    check_sizes(trainer_args, options.ranks, options.nodes, options.min_nodes)
    started = time.monotonic()
    workdir.create()
    disk = (
        small_disk(ssd_dir(workdir), options.ssd_mb)
        if any(FAULTS[f.kind].fills_disk for f in options.schedule)
        else contextlib.nullcontext()
    )
    # ckptd retries S3 soon after an outage ends; S3 keeps every checkpoint, so none may vanish.
    ckptd_args = ("--s3-backoff-max-s", "2", "--s3-every", "1")
    stack = Stack(
        workdir,
        ckptd_args=ckptd_args,
        nodes=options.nodes,
        spares=options.spares,
        cordon_after=options.cordon_after,
        min_nodes=options.min_nodes,
        capacity_wait_s=options.capacity_wait_s,
    )
    with disk, stack:
        workdir.remember_run(run_id)
        print(
            f"[chaos] run {run_id}: {len(options.schedule)} faults scheduled, up to "
            f"{max_restarts} restarts; logs in {workdir.logs}"
            + (f"; {options.nodes} nodes" if options.nodes > 1 else "")
            + (f" and {options.spares} spare(s)" if options.spares else ""),
            file=out,
            flush=True,
        )
        tap = _Tap(out)
        drill = Drill(stack, options, run_id, tap)
        try:
            try:
                code = stack.train(
                    run_id, options.ranks, trainer_args + drill.trainer_args(), tap, max_restarts,
                    on_start=drill.start,
                )  # fmt: skip
            finally:
                drill.finish()
            # After a failure, only what is committed now: nothing will upload any more.
            checkpoints = wait_on_s3(stack.ckptd_address, run_id, 120.0 if code == 0 else 0.0)
            final = {c.ref.step for c in _intact(checkpoints)}
            engine = connect(workdir.db_url)
            try:
                records = drill.recovery_records(engine)
            finally:
                engine.dispose()
        finally:
            drill.close()
    summary = summarize(workdir, run_id, checkpoints, time.monotonic() - started)
    engine = connect(workdir.db_url)
    try:
        replays = queries.replays(engine, run_id)
        recoveries = [asdict(r) for r in queries.restarts(engine, run_id)]
    finally:
        engine.dispose()
    effective = Timeline(tap.stamped()).effective_training(
        drill.started_at, drill.ended_at or time.time()
    )
    completed = code == 0
    return ChaosReport(
        run_id=run_id,
        workdir=str(workdir.root),
        completed=completed,
        exit_code=code,
        faults_scheduled=len(options.schedule),
        faults_injected=len(drill.injected),
        faults_survived=len(drill.injected) if completed else 0,
        checkpoints_committed=len(drill.committed | final),
        checkpoints_lost=sorted(drill.committed - final - drill.lost_with_node),
        lost_with_node=sorted(drill.lost_with_node - final),
        restarts=replays.restarts,
        steps_replayed=replays.steps_after_restarts,
        steps_replayed_in_place=replays.steps_in_place,
        goodput=summary.goodput,
        badput_s=summary.badput_s,
        last_loss=summary.last_loss,
        params_sha256=summary.params_sha256,
        wall_s=round(time.monotonic() - started, 2),
        faults=[asdict(i) for i in drill.injected],
        checkpoints=summary.checkpoints,
        recoveries=recoveries,
        fault_recoveries=[asdict(r) for r in records],
        badput_by_fault_s=summary.badput_by_fault_s,
        effective_training=None if effective is None else round(effective, 4),
    )
