"""The drill: one job on the embedded stack, and a thread that strikes its schedule of faults.

`Drill` strikes each fault when due (`FAULTS[kind].inject`, a function given the drill) and records
it (`Injected`, telemetry's `fault` event); it keeps the state the strikes share (the job, the
tap on its output, the step a strike waited for) and, once the job ended, each fault's recovery
record. The strikes themselves are in `scaletrain.app.chaos.strikes` (a rank, a service, a shard),
`scaletrain.app.chaos.machines` (a whole node) and `scaletrain.app.chaos.disk` (disk-full).
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import Engine

from ckptd.client import CkptdClient
from scaletrain.app.chaos.faults import FAULTS, SPARE_RESTARTS, Fault, restart_budget
from scaletrain.app.chaos.watch import WAIT_S, JobEnded, _Tap, intact
from scaletrain.app.recovery import Recovery, Timeline, recovery_record, signs
from scaletrain.app.rendezvous import CAPACITY_WAIT_S
from scaletrain.app.stack import Job, Stack, Workdir
from scaletrain.cordon import CORDON_AFTER
from scaletrain.errors import ScaletrainError, UserError
from scaletrain.security import Role
from telemetry import queries
from telemetry.client import TelemetryClient, event


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
    # TLS and per-run tokens between every part (scaletrain run --secure).
    secure: bool = False
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


class Drill:
    """Injects the schedule into one job on `stack`, from a thread of its own."""

    def __init__(self, stack: Stack, options: ChaosOptions, run_id: str, tap: _Tap) -> None:
        self.stack, self.options, self.run_id, self.tap = stack, options, run_id, tap
        self.injected: list[Injected] = []
        self.fresh_at: float | None = None  # kill-node's fresh ckptd, for its Injected
        self.spare_used = ""  # kill-node with spares: the spare that took the node's place
        # Steps kill-node-mid-save struck before their parts had copies: lost with the node.
        self.lost_with_node: set[int] = set()
        # A fault that waits for its moment inside its injector (kill-node, kill-ckptd) sets
        # `struck_step` when it strikes: (that step, the time then), for its Injected.
        self._strike: tuple[int, float] | None = None
        self.committed: set[int] = set()
        self.job: Job | None = None
        self.done = threading.Event()
        # The job's start and end (time.time()): the wall time of the drill.
        self.started_at = time.time()
        self.ended_at: float | None = None
        # The drill's own calls (listings, replica rates, its events), as an admin of the stack
        # when it is secure (minted now: the services re-read their tokens within a second).
        self.security = stack.client_security(Role.ADMIN)
        self._telemetry = TelemetryClient(stack.telemetry_address, security=self.security)
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
            for arg in flags(fault, self.rank_for(fault))
        ]

    def ckptd(self, address: str = "") -> CkptdClient:
        """A client of the ckptd at `address` (node0's if empty), secured as the stack is."""
        return CkptdClient(address or self.stack.ckptd_address, self.security)

    def random_for(self, fault: Fault) -> random.Random:
        # Fixed by the seed and the fault's place in the schedule.
        return random.Random(f"{self.options.seed}/{self.options.schedule.index(fault)}")

    def rank_for(self, fault: Fault) -> int:
        return self.random_for(fault).randrange(self.options.ranks)

    def node_for(self, fault: Fault, first: int = 0) -> int:
        """A random node from node `first` on."""
        return self.random_for(fault).randrange(first, self.options.nodes)

    @property
    def struck_step(self) -> int | None:
        """The step the job had completed when an injector that waits for its moment struck."""
        return None if self._strike is None else self._strike[0]

    @struck_step.setter
    def struck_step(self, step: int | None) -> None:
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
        self.done.set()
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
            except JobEnded:
                return
            except (OSError, ScaletrainError, UserError) as exc:
                target, detail = "-", f"could not inject: {exc}"
            ended_at, mark = time.time(), self.tap.mark()
            if self._strike is not None:
                step, at = self._strike
            if FAULTS[fault.kind].trainer_args is not None:
                step = fault.step  # the trainer struck it itself, in its STEP
            record = Injected(
                fault.kind,
                step,
                target,
                detail,
                round(at - self.started_at, 2),
                self.fresh_at,
                self.spare_used,
                injected_at=at,
                ended_at=ended_at,
            )
            self.fresh_at, self.spare_used = None, ""
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

        while not self.done.is_set():
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
            wake = max(min(due.values(), default=now + WAIT_S) - now, 0.2)
            self.tap.wait(lambda: self.done.is_set() or step_due(), wake)
        return None

    def _stepped(self, mark: int) -> bool:
        """Whether the job completed a step since the tap's `mark`."""
        return self.tap.seen_since(mark, "[trainer] step ")

    def _may_repeat(self, fault: Fault, once: list[Fault], mark: int) -> bool:
        """Whether repeating `fault` may strike now: the job completed a step since the previous
        fault was over, and one that restarts the job leaves SPARE_RESTARTS of the budget after
        the restarts of the `once` faults still to come."""
        if not self._stepped(mark):
            return False
        if not FAULTS[fault.kind].restarts:
            return True
        to_come = sum(FAULTS[f.kind].restarts for f in once)
        # The keepers' in-job restarts spend none of torchrun's budget.
        cold = self.tap.attempts - self.tap.in_job
        left = restart_budget(self.options) - max(cold - 1, 0) - to_come
        return left > SPARE_RESTARTS

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
                kind=fault.kind,
                target=fault.target,
                step=fault.step,
                injected_at=injected_at,
                ended_at=ended_at,
                restarts=kind.restarts,
                detected_by=re.compile(kind.detected_by),
                timeline=timeline,
                signs=seen,
                restarts_seen=restarts,
                spare=bool(fault.spare),
            )
            records.append(record)
            report = event(
                self.run_id,
                "recovery",
                step=record.step,
                message=_describe(record),
                attributes=record.attributes(),
            )
            report.time.FromDatetime(datetime.fromtimestamp(record.injected_at, UTC))
            self._telemetry.report_event(report)
        return records

    def _report(self, record: Injected) -> None:
        rank = int(record.target.removeprefix("rank ")) if record.target.startswith("rank ") else -1
        # A fault on a node names it in the event's attributes: target "node1"; rank -1.
        self._telemetry.report_event(
            event(
                self.run_id,
                "fault",
                step=record.step,
                rank=rank,
                message=f"chaos: {record.kind}: {record.detail}",
                attributes={"fault": record.kind, "target": record.target},
            )
        )

    # -- what the strikes share -----------------------------------------------------------------

    def victim(self, fault: Fault) -> tuple[int, int]:
        """The rank that `fault` strikes (picked by the seed) and its process id."""
        assert self.job is not None
        rank = self.rank_for(fault)
        pids = self.job.rank_pids()
        if rank not in pids:
            raise UserError(f"rank {rank} has no process (ranks seen: {sorted(pids)})")
        return rank, pids[rank]

    def await_restart(self, attempts_before: int) -> str:
        """Wait for the job's attempt after `attempts_before`: what to add to a strike's detail."""
        restarted = self.tap.wait(lambda: self.done.is_set() or self.tap.attempts > attempts_before)
        return "; the job restarted" if restarted and not self.done.is_set() else ""

    # -- what is committed -----------------------------------------------------------------------

    def _watch_checkpoints(self) -> None:
        """Remember every durable checkpoint seen committed (whole, on some tier) while the job
        runs. A memory-only one (--mem-ckpt-every) is meant to go: ckptd drops it once a newer
        durable step commits, and it never survives its holders."""
        while not self.done.wait(0.5):
            with (
                contextlib.suppress(ScaletrainError),
                self.ckptd() as client,
            ):
                self.committed |= {
                    c.ref.step
                    for c in intact(client.list(self.run_id, nodes=True))
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
