"""`scaletrain ckpt`: list and export checkpoints, from a running ckptd or from a work directory.

Offline, the listing reads ckptd's catalog in the work directory; an export reads the SSD copy, or
starts the work directory's own S3 server for as long as it takes when only S3 holds the
checkpoint.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ckptd.client import CkptdClient
from ckptd.config import CkptdConfig
from ckptd.store import CheckpointStore, ckptd_running, list_offline
from scaletrain.embedded import TIER_NAMES, committed_tiers
from scaletrain.errors import NotFound, UserError
from scaletrain.stack import S3_BUCKET, Workdir, s3_for_reading
from scaletrain.v1 import checkpoint_pb2, common_pb2


def _row(info: checkpoint_pb2.CheckpointInfo) -> dict[str, object]:
    return {
        "run": info.ref.run,
        "step": info.ref.step,
        "world_size": info.world_size,
        "bytes": info.total_bytes,
        "tiers": committed_tiers(info),
    }


def list_checkpoints(workdir: Path, ckptd: str | None, run: str | None) -> list[dict[str, object]]:
    """Committed checkpoints with the tiers holding them, oldest first."""
    if ckptd:
        with CkptdClient(ckptd) as client:
            infos = client.list(run or "")
    else:
        data_dir = Workdir(workdir).ckptd
        infos = list_offline(data_dir, run or "") if (data_dir / "catalog.db").exists() else []
    return [_row(i) for i in sorted(infos, key=lambda i: (i.ref.run, i.ref.step))]


def export(workdir: Path, ckptd: str | None, run: str, step: int, dest: Path) -> list[Path]:
    """Write checkpoint (run, step) as a plain DCP directory at `dest`, checksums verified."""
    ref = checkpoint_pb2.CheckpointRef(run=run, step=step)
    if ckptd:
        with CkptdClient(ckptd) as client:
            return _export_from_client(client, ref, dest)
    wd = Workdir(workdir)
    if ckptd_running(wd.ckptd):
        raise UserError(f"ckptd is running on {wd.ckptd}: pass --ckptd HOST:PORT to export from it")
    rows = {(r["run"], r["step"]): r for r in list_checkpoints(workdir, None, run)}
    row = rows.get((run, step))
    if row is None:
        raise NotFound(f"no committed checkpoint {run}@{step} in {wd.root}")
    needs_s3 = TIER_NAMES[common_pb2.TIER_SSD] not in row["tiers"]
    with s3_for_reading(wd) if needs_s3 else contextlib.nullcontext() as s3:
        config = CkptdConfig(
            data_dir=wd.ckptd,
            memory_budget_bytes=0,
            s3=s3.s3_config(S3_BUCKET) if s3 is not None else None,
        )
        with CheckpointStore(config) as store:
            return store.export(ref, dest)


def _export_from_client(
    client: CkptdClient, ref: checkpoint_pb2.CheckpointRef, dest: Path
) -> list[Path]:
    info = client.get(ref.run, ref.step)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for file in info.files:
        path = dest / file.path
        with path.open("wb") as out:
            for piece in client.read_stream(ref.run, ref.step, file.path):
                out.write(piece)
        written.append(path)
    return written
