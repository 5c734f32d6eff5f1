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
    """RANK -> pid of the trainer processes of `run_id` (torchrun's workers, not its agent)."""
    pids = {}
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
        except OSError:
            continue
        if b"RANK" in env:
            pids[int(env[b"RANK"])] = int(proc.name)
    return pids
