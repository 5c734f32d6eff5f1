"""How our command-line processes end (at once, once their work is done) and are named."""

from __future__ import annotations

import atexit
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End the process with `code` once its main function has returned, skipping the
    interpreter's teardown.

    By then everything the process owes was finished explicitly (a rank's telemetry handed over,
    saves committed or failed, threads stopped, the process group destroyed; a command's services
    stopped and its summary printed), and the atexit handlers (logging, multiprocessing's
    children, torch's) still run here. What is skipped is freeing every module's objects one by
    one: with torch, dynamo and sympy loaded that costs a process about a second of CPU, which on
    a host shared by many ranks delays the others, and an elastic agent waits for its slowest
    rank to exit before a job is over.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The name a process that trains as rank R carries (/proc/PID/comm): how the launchers and the
# drills find it, whether torchrun exec'd it or forked it from a warm process (a fork keeps its
# parent's command line and environment, so neither can say which rank it is).
RANK_PROCESS = "st-rank-{rank}"
KEEPER_PROCESS = "st-keeper-{rank}"
# Rank 0's keeper's fork that hosts the job's store (trainer.keeper).
STORE_PROCESS = "st-job-store"
# How a rank's keeper names the failure of a rank that ended because a collective failed (a peer
# died or hung up), not through a fault of its own: the stack does not count it against the
# rank's node when it decides whether to cordon it (`scaletrain.app.stack.Job`).
PEER_LOST = "lost a peer (a collective failed)"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def rank_named(name: str) -> int | None:
    """The rank a process named `name` (`RANK_PROCESS`) trains as; None for any other name."""
    prefix = RANK_PROCESS.format(rank="")
    rank = name.removeprefix(prefix)
    return int(rank) if name.startswith(prefix) and rank.isdigit() else None


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (an agent's ranks, their keepers and what those started)."""
    children, found, queue = children_by_parent(), [], [pid]
    while queue:
        below = [int(c.name) for c in children.get(queue.pop(), [])]
        found += below
        queue += below
    return found


def children_by_parent() -> dict[int, list[Path]]:
    """Parent pid -> its children's /proc entries, oldest first."""
    children: dict[int, list[Path]] = {}
    for proc in sorted(
        Path("/proc").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0
    ):
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(proc)
    return children


def name_process(name: str) -> None:
    """Set this process's name (/proc/PID/comm, 15 bytes at most)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies, so nothing outlives a lost keeper or agent."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _prctl(option: int, value: object) -> None:
    """Linux's prctl(2); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
