"""Finding the processes of a run, for tests that kill one or check that none is left."""

from __future__ import annotations

import time
from pathlib import Path

from scaletrain.app.stack import worker_pids
from scaletrain.process import KEEPER_PROCESS, RANK_PROCESS, STORE_PROCESS

# What a rank's processes name themselves: the rank, its keeper, rank 0's keeper's job store.
_NAMES = (RANK_PROCESS.format(rank=""), KEEPER_PROCESS.format(rank=""), STORE_PROCESS)


def _argv(proc: Path) -> list[bytes]:
    return (proc / "cmdline").read_bytes().split(b"\0")


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes with `text` in their arguments (a work dir, a run id)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = b" ".join(_argv(proc)).decode(errors="replace")
        except OSError:
            continue
        if text in argv:
            found.append(f"{proc.name}: {argv}")
    return found


def rank_processes() -> list[str]:
    """The live processes of any run's ranks that name no run in their command line: the ranks,
    keepers and job stores (by their names) and the forkservers torchrun forks them from."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            name = (proc / "comm").read_text().strip()
            argv = b" ".join(_argv(proc)).decode(errors="replace")
        except OSError:
            continue
        if name.startswith(_NAMES) or "multiprocessing.forkserver" in argv:
            found.append(f"{proc.name} ({name}): {argv}")
    return found


def left_behind(mentioning: list[str], others: set[str], within_s: float = 5.0) -> list[str]:
    """What still runs of a run that ended, after up to `within_s` seconds for processes still
    exiting: processes whose command line mentions one of `mentioning` (its work dir, its run id)
    and rank processes not among `others` (what `rank_processes` listed before it started)."""
    deadline = time.monotonic() + within_s
    while True:
        left = [found for text in mentioning for found in processes_mentioning(text)]
        left += sorted(set(rank_processes()) - others)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def trainer_pids(run_id: str) -> dict[int, int]:
    """RANK -> pid of the process that trains as that rank in `run_id`, under any of the run's
    torchrun agents (forked warm or exec'd; under a keeper, the keeper's fork)."""
    pids: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = _argv(proc)
        except OSError:
            continue
        agent = any(b"torch.distributed.run" in a or b"scaletrain.app.agent" in a for a in argv)
        if agent and run_id.encode() in argv:
            pids |= worker_pids(int(proc.name))
    return pids
