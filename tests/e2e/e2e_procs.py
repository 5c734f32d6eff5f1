"""Finding the processes of a run, for tests that kill one or check that none is left."""

from __future__ import annotations

from pathlib import Path


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


def trainer_pids(run_id: str) -> dict[int, int]:
    """RANK -> pid of the process that trains as that rank in `run_id`: torchrun's worker, or
    under a keeper (`--in-job-restarts`, trainer.keeper) the worker's fork."""
    pids: dict[int, int] = {}
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = _argv(proc)
            if b"trainer" not in argv or run_id.encode() not in argv:
                continue
            if any(b"torch.distributed.run" in a or b"scaletrain.app.agent" in a for a in argv):
                continue
            env = dict(
                item.split(b"=", 1)
                for item in (proc / "environ").read_bytes().split(b"\0")
                if b"=" in item
            )
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"RANK" in env:
            rank, pid = int(env[b"RANK"]), int(proc.name)
            # The keeper and its fork share a command line: the fork is the keeper's child.
            if rank not in pids or parents[rank] != pid:
                pids[rank], parents[rank] = pid, parent
    return pids
