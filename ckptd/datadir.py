"""The data dir: one store writes it at a time, and anyone may read its catalog.

A store holds an exclusive flock on `data_dir/ckptd.lock` for its lifetime, so a second ckptd (or
the command line writing offline) cannot open the same data dir while one runs. The command line
uses the same lock to tell whether a ckptd is running, and lists checkpoints from the catalog
read-only either way.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from ckptd.catalog import Catalog
from ckptd.names import check_run
from ckptd.states import ABSENT, MEMORY
from scaletrain.errors import UserError
from scaletrain.v1 import checkpoint_pb2

LOCK_FILE = "ckptd.lock"
NODE_FILE = "node"


def node_of(data_dir: Path, wanted: str | None) -> str:
    """The node a data dir belongs to: named once, when it is new (`wanted`, else the host
    name), since its catalog and markers say which files are this node's by that name."""
    path = data_dir / NODE_FILE
    try:
        named = path.read_text().strip()
    except FileNotFoundError:
        named = ""
    if named:
        if wanted is not None and wanted != named:
            raise UserError(
                f"{data_dir} belongs to node {named!r}, not {wanted!r}: start ckptd with "
                f"--node {named}, or give node {wanted!r} a data dir of its own"
            )
        return named
    node = wanted or socket.gethostname().split(".")[0] or "node0"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as out:
        out.write(node + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    return node


def lock_data_dir(data_dir: Path) -> IO[str]:
    """Hold an exclusive flock on the data dir for this store's lifetime: one writer at a time."""
    lock = open(data_dir / LOCK_FILE, "a+")  # noqa: SIM115 (held open until close)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(
            f"{data_dir} is in use by a running ckptd; stop it, or ask it over gRPC"
        ) from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def ckptd_running(data_dir: Path) -> bool:
    """Whether some process holds `data_dir` open as a store (a running ckptd, usually)."""
    path = Path(data_dir) / LOCK_FILE
    if not path.exists():
        return False
    with open(path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


def list_offline(
    data_dir: Path, run: str = "", include_uncommitted: bool = False
) -> list[checkpoint_pb2.CheckpointInfo]:
    """List checkpoints from a data dir's catalog, read-only, whether or not ckptd runs.

    The memory tier reads ABSENT when no ckptd holds the data dir: its copies died with it.
    """
    running = ckptd_running(data_dir)
    catalog = Catalog(data_dir, readonly=True)
    try:
        infos = catalog.checkpoints(check_run(run) if run else "", include_uncommitted)
    finally:
        catalog.close()
    if not running:
        for info in infos:
            for status in info.tiers:
                if status.tier == MEMORY:
                    status.state = ABSENT
                    status.bytes = 0
    return infos
