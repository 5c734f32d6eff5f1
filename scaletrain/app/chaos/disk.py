"""The SSD tier's disk in a drill: the small tmpfs that disk-full needs, and its strike."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.app.stack import Workdir
from scaletrain.errors import UserError

if TYPE_CHECKING:
    from scaletrain.app.chaos.drill import Drill
    from scaletrain.app.chaos.faults import Fault


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


def _fill(path: Path) -> None:
    """Append zeros to `path` until its file system is full."""
    block = bytes(1 << 16)
    with contextlib.suppress(OSError), path.open("ab", buffering=0) as out:
        while True:
            out.write(block)


def disk_full(drill: Drill, fault: Fault) -> tuple[str, str]:
    mark, deadline = drill.tap.mark(), time.monotonic() + fault.seconds
    filler = ssd_dir(drill.stack.workdir) / "chaos-filler"
    failed = False
    try:
        # Topped up every half second: ckptd frees space as retention drops old copies.
        while not failed and time.monotonic() < deadline:
            _fill(filler)
            failed = drill.tap.wait(
                lambda: drill.done.is_set() or drill.tap.seen_since(mark, "failed:"), 0.5
            )
    finally:
        filler.unlink(missing_ok=True)
    what = "a save failed" if failed and not drill.done.is_set() else "no save failed"
    return "ssd", f"SSD tier's disk filled ({what}), then freed"
