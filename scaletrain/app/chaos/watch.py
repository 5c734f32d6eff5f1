"""What the drill watches: the job's output lines (`_Tap`) and what ckptd lists as committed.

How long the drill waits for either (WAIT_S) is here too, and `JobEnded`, which a strike raises
when the job ended while it waited.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import IO, TypeVar

from ckptd.client import CkptdClient
from ckptd.states import TIER_COMMITTED
from scaletrain.app.recovery import ATTEMPT_LINE, IN_JOB_ATTEMPT, STEP_LINE
from scaletrain.security import ClientSecurity
from scaletrain.v1 import checkpoint_pb2, common_pb2

# What has copies on tiers: a checkpoint as one node sees it, or one node's part of it.
_Copies = TypeVar("_Copies", checkpoint_pb2.CheckpointInfo, checkpoint_pb2.NodePart)

# How long the drill waits for what a fault must cause (a restart, a watchdog, a save).
WAIT_S = 180.0


class JobEnded(Exception):
    """The job ended while a fault waited for its moment: it is not injected."""


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

    def wait(self, predicate: Callable[[], bool], timeout_s: float | None = WAIT_S) -> bool:
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


def committed_on(checkpoints: list[_Copies], tier: int | None = None) -> list[_Copies]:
    """The checkpoints (or nodes' parts) committed on `tier` (None: on some tier), as the
    answering node sees them."""
    return [
        c
        for c in checkpoints
        if any(t.state == TIER_COMMITTED and tier in (None, t.tier) for t in c.tiers)
    ]


def intact(
    checkpoints: list[checkpoint_pb2.CheckpointInfo],
) -> list[checkpoint_pb2.CheckpointInfo]:
    """The checkpoints that can still be restored: committed on S3 (whole), or every node's part
    (`parts`, from a listing with nodes=True) committed on one of that node's tiers. Without
    parts, committed on some tier of the answering node."""
    return [
        c
        for c in committed_on(checkpoints)
        if not c.parts
        or committed_on([c], common_pb2.TIER_S3)
        or all((p.reachable and committed_on([p])) or p.copies for p in c.parts if p.files)
    ]


def wait_on_s3(
    address: str, run_id: str, timeout_s: float = WAIT_S, security: ClientSecurity | None = None
) -> list[checkpoint_pb2.CheckpointInfo]:
    """The run's checkpoints with every node's part, once the newest committed one is on S3 too
    (or the time is up).

    Not every tier: a ckptd restarted by the drill lost its memory tier for good.
    """
    deadline = time.monotonic() + timeout_s
    with CkptdClient(address, security) as client:
        while True:
            checkpoints = client.list(run_id, nodes=True)
            newest = max(committed_on(checkpoints), key=lambda c: c.ref.step, default=None)
            if newest is None or committed_on([newest], common_pb2.TIER_S3):
                return checkpoints
            if time.monotonic() > deadline:
                return checkpoints
            time.sleep(0.2)
