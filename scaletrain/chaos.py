"""`scaletrain chaos`: a drill that trains on the embedded stack while a schedule of faults strikes.

The schedule is a list of KIND@STEP[:SECONDS], each fault injected once, in order, as soon as the
job has finished step STEP (the job is watched through its `[trainer] step N` lines):

    kill-rank       SIGKILL a random rank in the middle of the next step; torchrun restarts the
                    job, which resumes from the latest committed checkpoint.
    stop-rank       SIGSTOP a random rank (a hang) until a watchdog fires, then let it go (SIGCONT
                    delivers the agent's SIGTERM); the job restarts.
    kill-ckptd      SIGKILL ckptd right after the next checkpoint was staged (its upload in
                    flight), restart it SECONDS later (default 1) on the same data dir.
    stop-s3         stop the S3 server for SECONDS (default 30), then start it again.
    disk-full       fill the SSD tier's disk (a size-limited tmpfs, which needs root) until a save
                    fails or SECONDS pass (default 60), then free it.
    corrupt-shard   SIGKILL a rank, damage one shard of the latest checkpoint on SSD and restart
                    ckptd (its memory tier gone), so that the resume must find the damage and read
                    the S3 copy.
    kill-telemetry  SIGKILL the telemetry service, restart it SECONDS later (default 3).
    sdc             flip a bit of a random rank's gradients in step STEP (--inject-sdc): the step
                    guard must catch and replay it.

Every fault is recorded in telemetry as a `fault` event. The report says how many faults were
injected and survived, how many committed checkpoints were lost (any checkpoint ever seen
committed on some tier must still be committed on one at the end), how many steps were computed
again after restarts, and the run's goodput from telemetry.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from sqlalchemy import distinct, func, select

from ckptd.client import CkptdClient
from scaletrain.embedded import _summary, check_layout, new_run_id
from scaletrain.errors import ScaletrainError, UserError
from scaletrain.stack import Stack, Workdir
from scaletrain.v1 import checkpoint_pb2, common_pb2
from telemetry.client import TelemetryClient, event
from telemetry.db import connect
from telemetry.models import Event, RankStep

_COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED

KINDS = (
    "kill-rank",
    "stop-rank",
    "kill-ckptd",
    "stop-s3",
    "disk-full",
    "corrupt-shard",
    "kill-telemetry",
    "sdc",
)
# Seconds an outage lasts when the schedule does not say.
DEFAULT_SECONDS = {"kill-ckptd": 1.0, "stop-s3": 30.0, "disk-full": 60.0, "kill-telemetry": 3.0}
# Faults after which torchrun must restart the job.
RESTARTING = frozenset({"kill-rank", "stop-rank", "corrupt-shard"})
# The drill of `scaletrain chaos` without --schedule: every kind, 12 faults over its 400 steps.
# The long outages come late: the job trains on through them, so they move later faults on.
DEFAULT_SCHEDULE = (
    "sdc@5,kill-rank@10,kill-telemetry@20,stop-rank@30,kill-ckptd@40,corrupt-shard@50,sdc@60,"
    "kill-rank@70,stop-s3@80,disk-full@100,kill-telemetry@110,kill-ckptd@120"
)
# A drill's phase without progress this long fails a rank (the trainer's default is for real
# runs; options given to the drill come later and win).
DRILL_WATCHDOG_MIN_S = 10.0
# How long the drill waits for what a fault must cause (a restart, a watchdog, a save).
_WAIT_S = 180.0
_STEP_LINE = re.compile(r"^\[trainer\] step (\d+) ")


class _JobEnded(Exception):
    """The job ended while a fault waited for its moment: it is not injected."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    seconds: float = 0.0


def parse_schedule(text: str) -> list[Fault]:
    """KIND@STEP[:SECONDS],... in step order; ValueError names the bad item."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"([a-z0-9-]+)@(\d+)(?::([0-9.]+))?", item)
        if match is None or match[1] not in KINDS:
            raise ValueError(
                f"--schedule item {item!r}: expected KIND@STEP[:SECONDS] with KIND one of "
                f"{', '.join(KINDS)}"
            )
        step, seconds = int(match[2]), float(match[3] or DEFAULT_SECONDS.get(match[1], 0.0))
        if step < 1:
            raise ValueError(f"--schedule item {item!r}: the step must be 1 or more")
        faults.append(Fault(match[1], step, seconds))
    if not faults:
        raise ValueError("--schedule is empty: give at least one KIND@STEP")
    return sorted(faults, key=lambda f: f.step)


@dataclass(frozen=True)
class ChaosOptions:
    workdir: Workdir
    schedule: list[Fault]
    ranks: int = 4
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
    injected_at_s: float


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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def rank_pids(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of the workers torchrun's agent `agent_pid` started."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for item in env:
            if item.startswith(b"RANK="):
                pids[int(item[5:])] = int(proc.name)
    return pids


class _Tap:
    """The job's output: passed on, and watched for the lines the drill waits for."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self.cond = threading.Condition()
        self.step = 0
        self.attempts = 0
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self._out.write(text)
        with self.cond:
            for line in text.splitlines():
                self.lines.append(line)
                match = _STEP_LINE.match(line)
                if match:
                    self.step = int(match[1])
                elif line.startswith("[trainer] run ") and " ranks, " in line:
                    self.attempts += 1
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


class Drill:
    """Injects the schedule into one job on `stack`, from a thread of its own."""

    def __init__(self, stack: Stack, options: ChaosOptions, run_id: str, tap: _Tap) -> None:
        self.stack, self.options, self.run_id, self.tap = stack, options, run_id, tap
        self.injected: list[Injected] = []
        self.committed: set[int] = set()
        self.agent: subprocess.Popen[str] | None = None
        self._done = threading.Event()
        self._started = time.monotonic()
        self._telemetry = TelemetryClient(stack.telemetry_address)
        self._threads = [
            threading.Thread(target=self._inject_all, name="chaos"),
            threading.Thread(target=self._watch_checkpoints, name="chaos-ckpt", daemon=True),
        ]

    def sdc_args(self) -> list[str]:
        """Trainer flags for the schedule's silent data corruptions (injected by the trainer)."""
        return [
            arg
            for fault in self.options.schedule
            if fault.kind == "sdc"
            for arg in ("--inject-sdc", f"step={fault.step},rank={self._rank_for(fault)}")
        ]

    def _rank_for(self, fault: Fault) -> int:
        # One random rank per fault, fixed by the seed and the fault's place in the schedule.
        index = self.options.schedule.index(fault)
        return random.Random(f"{self.options.seed}/{index}").randrange(self.options.ranks)

    def start(self, agent: subprocess.Popen[str]) -> None:
        self.agent = agent
        for thread in self._threads:
            thread.start()

    def finish(self) -> None:
        """After the job ended: stop injecting, wait for outages in progress to end."""
        self._done.set()
        with self.tap.cond:
            self.tap.cond.notify_all()
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()
        self._telemetry.flush(timeout_s=10)
        self._telemetry.close()

    # -- injection -------------------------------------------------------------------------------

    def _inject_all(self) -> None:
        """Each fault once the job finished its step, one after the other: a fault never
        overlaps the previous one (a restart while telemetry is down would fail again), so the
        job trains on during an outage and a later fault may strike a later step than scheduled."""
        for fault in self.options.schedule:
            self.tap.wait(lambda f=fault: self._done.is_set() or self.tap.step >= f.step, None)
            if self._done.is_set():
                return
            at, step = round(time.monotonic() - self._started, 2), self.tap.step
            try:
                target, detail = getattr(self, "_" + fault.kind.replace("-", "_"))(fault)
            except _JobEnded:
                return
            except (OSError, ScaletrainError, UserError) as exc:
                target, detail = "-", f"could not inject: {exc}"
            record = Injected(fault.kind, step, target, detail, at)
            self.injected.append(record)
            self._report(record)

    def _report(self, record: Injected) -> None:
        rank = int(record.target.removeprefix("rank ")) if record.target.startswith("rank ") else -1
        self._telemetry.report_event(
            event(
                self.run_id, "fault", step=record.step, rank=rank,
                message=f"chaos: {record.kind}: {record.detail}",
                attributes={"fault": record.kind, "target": record.target},
            )
        )  # fmt: skip

    def _victim(self, fault: Fault) -> tuple[int, int]:
        assert self.agent is not None
        rank = self._rank_for(fault)
        pids = rank_pids(self.agent.pid)
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

    def _stop_rank(self, fault: Fault) -> tuple[str, str]:
        attempts, mark = self.tap.attempts, self.tap.mark()
        rank, pid = self._victim(fault)
        os.kill(pid, signal.SIGSTOP)
        fired = self.tap.wait(
            lambda: self._done.is_set() or self.tap.seen_since(mark, "error: watchdog:")
        )
        os.kill(pid, signal.SIGCONT)
        verdict = "a watchdog fired" if fired else "no watchdog fired"
        return f"rank {rank}", f"SIGSTOP to pid {pid}: {verdict}" + self._await_restart(attempts)

    def _kill_ckptd(self, fault: Fault) -> tuple[str, str]:
        mark = self.tap.mark()
        self.tap.wait(lambda: self._done.is_set() or self.tap.seen_since(mark, "checkpoint staged"))
        if self._done.is_set():
            raise _JobEnded
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
        os.kill(pid, signal.SIGKILL)
        # The checkpoint the job will resume from, once S3 holds the good copy to fall back on.
        latest = _committed(wait_on_s3(self.stack.ckptd_address, self.run_id))
        step = max(c.ref.step for c in latest)
        shard = ssd_dir(self.stack.workdir) / self.run_id / str(step) / "__0_0.distcp"
        with shard.open("r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        self.stack.service("ckptd").kill()
        self.stack.restart_service("ckptd")
        detail = f"damaged {shard.name} of step {step} on SSD, ckptd restarted, rank {rank} killed"
        return "ssd", detail + self._await_restart(attempts)

    def _kill_telemetry(self, fault: Fault) -> tuple[str, str]:
        self.stack.service("telemetry").kill()
        time.sleep(fault.seconds)
        self.stack.restart_service("telemetry")
        return "telemetry", f"SIGKILL, restarted {fault.seconds}s later"

    def _sdc(self, fault: Fault) -> tuple[str, str]:
        rank = self._rank_for(fault)
        return f"rank {rank}", f"a gradient bit flipped in step {fault.step} (--inject-sdc)"

    # -- what is committed -----------------------------------------------------------------------

    def _watch_checkpoints(self) -> None:
        """Remember every checkpoint seen committed on some tier while the job runs."""
        while not self._done.wait(0.5):
            with (
                contextlib.suppress(ScaletrainError),
                CkptdClient(self.stack.ckptd_address) as client,
            ):
                self.committed |= {c.ref.step for c in _committed(client.list(self.run_id))}


def _fill(path: Path) -> None:
    """Append zeros to `path` until its file system is full."""
    block = bytes(1 << 16)
    with contextlib.suppress(OSError), path.open("ab", buffering=0) as out:
        while True:
            out.write(block)


def _committed(
    checkpoints: list[checkpoint_pb2.CheckpointInfo], tier: int | None = None
) -> list[checkpoint_pb2.CheckpointInfo]:
    """The checkpoints committed on `tier` (None: on some tier)."""
    return [
        c
        for c in checkpoints
        if any(t.state == _COMMITTED and tier in (None, t.tier) for t in c.tiers)
    ]


def wait_on_s3(
    address: str, run_id: str, timeout_s: float = _WAIT_S
) -> list[checkpoint_pb2.CheckpointInfo]:
    """The run's checkpoints, once the newest committed one is on S3 too (or the time is up).

    Not every tier: a ckptd restarted by the drill lost its memory tier for good.
    """
    deadline = time.monotonic() + timeout_s
    with CkptdClient(address) as client:
        while True:
            checkpoints = client.list(run_id)
            newest = max(_committed(checkpoints), key=lambda c: c.ref.step, default=None)
            if newest is None or _committed([newest], common_pb2.TIER_S3):
                return checkpoints
            if time.monotonic() > deadline:
                return checkpoints
            time.sleep(0.2)


def ssd_dir(workdir: Workdir) -> Path:
    """Where ckptd keeps its SSD tier in the embedded stack."""
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
    late = [f"{f.kind}@{f.step}" for f in options.schedule if f.step >= options.steps]
    if late:
        raise UserError(f"--schedule: {', '.join(late)} at or after the last step {options.steps}")
    workdir = options.workdir
    run_id = new_run_id()
    restarting = sum(f.kind in RESTARTING for f in options.schedule)
    max_restarts = restarting + 2 if options.max_restarts is None else options.max_restarts
    trainer_args = [
        "--steps", str(options.steps), "--ckpt-every", str(options.ckpt_every),
        "--log-every", "1", "--watchdog-min-s", str(DRILL_WATCHDOG_MIN_S),
        "--heartbeat-s", "2", *options.trainer_args,
    ]  # fmt: skip
    check_layout(trainer_args, options.ranks)
    started = time.monotonic()
    workdir.create()
    disk = (
        small_disk(ssd_dir(workdir), options.ssd_mb)
        if any(f.kind == "disk-full" for f in options.schedule)
        else contextlib.nullcontext()
    )
    # ckptd retries S3 soon after an outage ends; S3 keeps every checkpoint, so none may vanish.
    ckptd_args = ("--s3-backoff-max-s", "2", "--s3-every", "1")
    with disk, Stack(workdir, ckptd_args=ckptd_args) as stack:
        workdir.remember_run(run_id)
        print(
            f"[chaos] run {run_id}: {len(options.schedule)} faults scheduled, up to "
            f"{max_restarts} restarts; logs in {workdir.logs}",
            file=out,
            flush=True,
        )
        tap = _Tap(out)
        drill = Drill(stack, options, run_id, tap)
        try:
            code = stack.train(
                run_id, options.ranks, trainer_args + drill.sdc_args(), tap, max_restarts,
                on_start=drill.start,
            )  # fmt: skip
        finally:
            drill.finish()
        # After a failure, only what is committed now: nothing will upload any more.
        checkpoints = wait_on_s3(stack.ckptd_address, run_id, 120.0 if code == 0 else 0.0)
        final = {c.ref.step for c in _committed(checkpoints)}
    summary = _summary(workdir, run_id, checkpoints, time.monotonic() - started)
    restarts, replayed, in_place = _replays(workdir, run_id)
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
        checkpoints_lost=sorted(drill.committed - final),
        restarts=restarts,
        steps_replayed=replayed,
        steps_replayed_in_place=in_place,
        goodput=summary.goodput,
        badput_s=summary.badput_s,
        last_loss=summary.last_loss,
        params_sha256=summary.params_sha256,
        wall_s=round(time.monotonic() - started, 2),
        faults=[asdict(i) for i in drill.injected],
        checkpoints=summary.checkpoints,
    )


def _replays(workdir: Workdir, run_id: str) -> tuple[int, int, int]:
    """(restarts, steps computed again after a restart, steps replayed by the step guard)."""
    engine = connect(workdir.db_url)
    try:
        with engine.connect() as db:
            rows, steps = db.execute(
                select(func.count(), func.count(distinct(RankStep.step))).where(
                    RankStep.run_id == run_id, RankStep.rank == 0
                )
            ).one()
            counts = dict(
                db.execute(
                    select(Event.kind, func.count())
                    .where(Event.run_id == run_id, Event.kind.in_(("restart", "replay")))
                    .group_by(Event.kind)
                ).all()
            )
    finally:
        engine.dispose()
    return counts.get("restart", 0), rows - steps, counts.get("replay", 0)
