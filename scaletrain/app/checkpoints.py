"""`scaletrain ckpt`: list, show, verify, export and remove checkpoints.

Each command works against a running ckptd (`--ckptd HOST:PORT`) or, with no service running, on a
work directory: listing and showing read ckptd's catalog there; verifying, exporting and removing
open the data dir as a store, starting the work directory's own S3 server for as long as it takes
when S3 holds a copy. Long transfers report their progress on stderr (`Progress`).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ckptd.client import CkptdClient
from ckptd.config import CkptdConfig
from ckptd.datadir import ckptd_running, list_offline
from ckptd.manifest import file_crc32c
from ckptd.store import CheckpointStore
from ckptd.tiers import BlockCrcs, CheckpointKey
from scaletrain.app.stack import S3_BUCKET, Workdir, s3_for_reading
from scaletrain.errors import NotFound, ScaletrainError, UserError
from scaletrain.names import TIER_NAMES
from scaletrain.v1 import checkpoint_pb2, common_pb2
from trainer.interop.hf import DEFAULT_SHARD_BYTES

TIER_COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED
# What a run or a step may be called to mean the newest: the last run, the run's newest step.
NEWEST = ("latest", "last")

if TYPE_CHECKING:
    from trainer.interop.hf_export import Exported


class Progress:
    """A byte counter on stderr: redrawn in place on a terminal, a line a second otherwise."""

    def __init__(self, label: str, total: int, out: IO[str] | None = None) -> None:
        self.label, self.total = label, total
        self._out = out or sys.stderr
        self._tty = self._out.isatty()
        self._done = 0
        self._started = time.monotonic()
        self._shown = 0.0

    def __call__(self, nbytes: int) -> None:
        self._done += nbytes
        now = time.monotonic()
        if now - self._shown >= (0.1 if self._tty else 1.0):
            self._shown = now
            self._draw(end="\r" if self._tty else "\n")

    def finish(self) -> None:
        self._draw(end="\n")

    def _draw(self, end: str) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        share = self._done / self.total if self.total else 1.0
        bar = "#" * int(share * 20)
        self._out.write(
            f"{self.label} [{bar:<20}] {self._done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
            f"{share:4.0%} {self._done / elapsed / 1e6:,.0f} MB/s{end}"
        )
        self._out.flush()


def _row(info: checkpoint_pb2.CheckpointInfo) -> dict[str, object]:
    """A checkpoint as `ckpt ls` shows it; `node_loss_safe` and `copies` (node -> the nodes
    holding a copy of its part) only when asked of a running ckptd, which asks its peers."""
    return {
        "run": info.ref.run,
        "step": info.ref.step,
        "world_size": info.world_size,
        "bytes": info.total_bytes,
        "tiers": tier_names(info),
        "node_loss_safe": info.node_loss_safe if info.parts else None,
        "copies": {
            p.node: sorted(
                ([p.node] if _committed(p.tiers) else [])
                + [c.node for c in p.replicas if _committed(c.tiers)]
            )
            for p in info.parts
            if p.files
        },
    }


def tier_names(info: checkpoint_pb2.CheckpointInfo) -> list[str]:
    """The tiers holding a committed copy of the checkpoint, by name."""
    return [TIER_NAMES[t] for t in _tiers_of(info)]


def _committed(tiers: list[checkpoint_pb2.TierStatus]) -> bool:
    return any(t.tier != common_pb2.TIER_S3 and t.state == TIER_COMMITTED for t in tiers)


def list_checkpoints(workdir: Path, ckptd: str | None, run: str | None) -> list[dict[str, object]]:
    """Committed checkpoints with the tiers holding them, oldest first."""
    if run:
        run = resolve_run(workdir, ckptd, run)
    infos = _infos(workdir, ckptd, run or "", nodes=True)
    return [_row(i) for i in sorted(infos, key=lambda i: (i.ref.run, i.ref.step))]


def _infos(
    workdir: Path, ckptd: str | None, run: str, nodes: bool = False
) -> list[checkpoint_pb2.CheckpointInfo]:
    """The committed checkpoints of `run` (every run's if empty), from a running ckptd or the
    work directory's catalog; a work directory that does not exist is an error, not an empty
    list (a mistyped --workdir)."""
    if ckptd:
        with CkptdClient(ckptd) as client:
            return list(client.list(run, nodes=nodes))
    work = Workdir(workdir)
    if not work.root.is_dir():
        raise UserError(f"no work directory {work.root} (--workdir)")
    data_dir = work.ckptd
    return list_offline(data_dir, run) if (data_dir / "catalog.db").exists() else []


def resolve_run(workdir: Path, ckptd: str | None, run: str | None) -> str:
    """The run `run` names: itself, or for none (or NEWEST) the work directory's last run, else
    the run of the checkpoint committed last."""
    if run and run not in NEWEST:
        return run
    infos = _infos(workdir, ckptd, "")
    last = None if ckptd else Workdir(workdir).last_run_id()
    if last:
        return last
    if not infos:
        raise NotFound(f"no checkpoint of any run in {_where(workdir, ckptd)}")
    newest = max(infos, key=lambda i: (i.committed_at.seconds, i.committed_at.nanos))
    return newest.ref.run


def parse_step(text: str) -> int | None:
    """A step as given on a command line: a number, or NEWEST (None: the run's newest)."""
    if text in NEWEST:
        return None
    if not text.isdigit():
        raise ValueError(f"a step is a whole number or one of {', '.join(NEWEST)}, got {text!r}")
    return int(text)


def _where(workdir: Path, ckptd: str | None) -> str:
    return f"ckptd {ckptd}" if ckptd else str(Workdir(workdir).root)


def show(
    workdir: Path,
    ckptd: str | None,
    run: str | None,
    step: int | None,
    node_loss_safe: bool = False,
) -> dict[str, object]:
    """Everything known of one checkpoint (`step` None: the run's latest, or with
    `node_loss_safe` its newest node-loss-safe one): files, tiers, policy."""
    if node_loss_safe:
        if step is not None or not ckptd:
            raise UserError(
                "--node-loss-safe names the run's newest node-loss-safe checkpoint: give no "
                "step, and --ckptd HOST:PORT (only a running ckptd can ask its peers)"
            )
        with CkptdClient(ckptd) as client:
            return _shown(client.get(resolve_run(workdir, ckptd, run), None, node_loss_safe=True))
    return _shown(checkpoint(workdir, ckptd, run, step))


def _shown(info: checkpoint_pb2.CheckpointInfo) -> dict[str, object]:
    """A checkpoint as `ckpt show` prints it."""
    return {
        **_row(info),
        "labels": dict(info.labels),
        "retention": {
            "memory_last": info.retention.memory_last,
            "ssd_last": info.retention.ssd_last,
            "s3_every": info.retention.s3_every,
            "replicas": info.retention.replicas,
        }
        if info.HasField("retention")
        else None,
        "tier_states": {
            TIER_NAMES[t.tier]: {
                "state": checkpoint_pb2.TierState.Name(t.state).removeprefix("TIER_STATE_"),
                "bytes": t.bytes,
                "error": t.error,
            }
            for t in info.tiers
        },
        "files": [
            {"path": f.path, "rank": f.rank, "bytes": f.size, "crc32c": f"{f.crc32c:08x}"}
            for f in info.files
        ],
    }


def checkpoint(
    workdir: Path, ckptd: str | None, run: str | None, step: int | None
) -> checkpoint_pb2.CheckpointInfo:
    """The committed checkpoint `run` and `step` name (either None or NEWEST: the last run, the
    run's newest step). NotFound names the nearest that exist: the runs with checkpoints, or
    the run's steps closest to the one asked for."""
    run = resolve_run(workdir, ckptd, run)
    if ckptd:
        with contextlib.suppress(NotFound), CkptdClient(ckptd) as client:
            return client.get(run, step)
    infos = _infos(workdir, ckptd, run)
    for info in infos:
        if info.ref.step == step or (step is None and info.ref.step == _newest(infos)):
            return info
    if not infos:
        runs = sorted({i.ref.run for i in _infos(workdir, ckptd, "")})
        near = difflib.get_close_matches(run, runs, n=3, cutoff=0.5) or runs[-3:]
        listed = f"; runs with checkpoints: {', '.join(near)}" if runs else "; there are none"
        raise NotFound(f"no committed checkpoint of run {run} in {_where(workdir, ckptd)}{listed}")
    steps = sorted(i.ref.step for i in infos)
    near = sorted(sorted(steps, key=lambda s: abs(s - (step or 0)))[:3])
    raise NotFound(
        f"no committed checkpoint {run}@{step} in {_where(workdir, ckptd)}; the nearest steps: "
        f"{', '.join(map(str, near))} (newest {steps[-1]})"
    )


def steps_after(workdir: Path, run: str, step: int) -> list[int]:
    """The committed steps of `run` newer than `step`, oldest first, from the work directory."""
    return sorted(s for i in _infos(workdir, None, run) if (s := i.ref.step) > step)


def _newest(infos: list[checkpoint_pb2.CheckpointInfo]) -> int:
    return max(i.ref.step for i in infos)


@contextlib.contextmanager
def _offline_store(workdir: Path, needs_s3: bool) -> Iterator[CheckpointStore]:
    """The work directory's data dir as a store, with its S3 server if `needs_s3`."""
    wd = Workdir(workdir)
    if ckptd_running(wd.ckptd):
        raise UserError(f"ckptd is running on {wd.ckptd}: pass --ckptd HOST:PORT to ask it")
    with s3_for_reading(wd) if needs_s3 else contextlib.nullcontext() as s3:
        config = CkptdConfig(
            data_dir=wd.ckptd,
            memory_budget_bytes=0,
            s3=s3.s3_config(S3_BUCKET) if s3 is not None else None,
            maintain=False,
        )
        with CheckpointStore(config) as store:
            yield store


@contextlib.contextmanager
def _reading_store(workdir: Path, info: checkpoint_pb2.CheckpointInfo) -> Iterator[CheckpointStore]:
    """An offline store to read checkpoint `info` from: without S3 while its SSD copy is good as
    the store finds it on opening (a copy deleted or lost since ckptd stopped is not, whatever the
    catalog said), else with the work directory's S3 server."""
    key = CheckpointKey(info.ref.run, info.ref.step)
    if common_pb2.TIER_SSD in _tiers_of(info):
        with _offline_store(workdir, needs_s3=False) as store:
            if store.catalog.tier_state(key, common_pb2.TIER_SSD) == TIER_COMMITTED:
                yield store
                return
    with _offline_store(workdir, needs_s3=True) as store:
        yield store


def _tiers_of(info: checkpoint_pb2.CheckpointInfo) -> list[int]:
    return [t.tier for t in info.tiers if t.state == TIER_COMMITTED]


def verify(
    workdir: Path, ckptd: str | None, run: str, step: int, out: IO[str] | None = None
) -> dict[str, str]:
    """Read every file of the checkpoint from each tier that holds it and check its checksum
    (the CRC-32C of its block CRC-32Cs, `ckptd.manifest.file_crc32c`).

    Returns {tier: "ok" | what is wrong}. ckptd checks every block's CRC-32C as it reads and
    marks a damaged copy FAILED, so a later read falls through to a good tier.
    """
    info = checkpoint(workdir, ckptd, run, step)
    tiers = _tiers_of(info)
    if not tiers:
        raise NotFound(f"{run}@{step} has no committed copy on any tier")
    with _reader(workdir, ckptd, common_pb2.TIER_S3 in tiers) as read:
        return _verify_tiers(info, read, out)


def every_checkpoint(workdir: Path, ckptd: str | None) -> list[checkpoint_pb2.CheckpointInfo]:
    """Every committed checkpoint of every run, by run then step; NotFound when there is none."""
    infos = sorted(_infos(workdir, ckptd, ""), key=lambda i: (i.ref.run, i.ref.step))
    if not infos:
        raise NotFound(f"no checkpoint of any run in {_where(workdir, ckptd)}")
    return infos


def verify_each(
    workdir: Path,
    ckptd: str | None,
    infos: list[checkpoint_pb2.CheckpointInfo],
    out: IO[str] | None = None,
) -> Iterator[tuple[checkpoint_pb2.CheckpointInfo, dict[str, str]]]:
    """`verify` for each of `infos` in turn, the store (and S3 server) or the connection to
    ckptd opened once for them all: (info, {tier: verdict}) as each is done. A checkpoint with
    no committed copy on any tier has nothing to read: its verdicts are the states of the tiers
    that are not ABSENT (a copy found damaged before is FAILED), {} if none."""
    needs_s3 = any(common_pb2.TIER_S3 in _tiers_of(info) for info in infos)
    with _reader(workdir, ckptd, needs_s3) as read:
        for info in infos:
            if not _tiers_of(info):
                yield info, _no_copy(info)
                continue
            yield info, _verify_tiers(info, read, out)


def _no_copy(info: checkpoint_pb2.CheckpointInfo) -> dict[str, str]:
    """The verdicts of a checkpoint with no committed copy: each tier's state and error."""
    return {
        TIER_NAMES[t.tier]: "marked "
        + checkpoint_pb2.TierState.Name(t.state).removeprefix("TIER_STATE_")
        + (f" ({t.error})" if t.error else "")
        for t in info.tiers
        if t.state not in (checkpoint_pb2.TIER_STATE_ABSENT, TIER_COMMITTED)
    }


# Reads one file of a checkpoint from one tier: (run, step, path, tier) -> its bytes in pieces.
Reader = Callable[[str, int, str, int], Iterator[bytes]]


@contextlib.contextmanager
def _reader(workdir: Path, ckptd: str | None, needs_s3: bool) -> Iterator[Reader]:
    """Reads from a running ckptd, else from the work directory's data dir as a store (with its
    S3 server if `needs_s3`)."""
    if ckptd:
        with CkptdClient(ckptd) as client:

            def from_ckptd(run: str, step: int, path: str, tier: int) -> Iterator[bytes]:
                return client.read_stream(run, step, path, tier=tier)

            yield from_ckptd
        return
    with _offline_store(workdir, needs_s3) as store:

        def from_store(run: str, step: int, path: str, tier: int) -> Iterator[bytes]:
            ref = checkpoint_pb2.CheckpointRef(run=run, step=step)
            return (piece.data for piece in store.reader.iter_range(ref, path, tier=tier))

        yield from_store


def _verify_tiers(
    info: checkpoint_pb2.CheckpointInfo, read: Reader, out: IO[str] | None
) -> dict[str, str]:
    run, step = info.ref.run, info.ref.step
    results: dict[str, str] = {}
    for tier in _tiers_of(info):
        name = TIER_NAMES[tier]
        progress = Progress(f"verify {run}@{step} on {name}", info.total_bytes, out)
        results[name] = _verify_tier(info, lambda path, t=tier: read(run, step, path, t), progress)
        progress.finish()
    return results


def _verify_tier(
    info: checkpoint_pb2.CheckpointInfo,
    read: Callable[[str], Iterator[bytes]],
    progress: Progress,
) -> str:
    for file in info.files:
        blocks = BlockCrcs()
        try:
            for piece in read(file.path):
                blocks.update(piece)
                progress(len(piece))
        except ScaletrainError as exc:
            return " ".join(str(exc).split())
        if file_crc32c(blocks.packed()) != file.crc32c:
            return f"{file.path}: checksum mismatch"
    return "ok"


def export(
    workdir: Path,
    ckptd: str | None,
    run: str,
    step: int,
    dest: Path,
    out: IO[str] | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write checkpoint (run, step) as a plain DCP directory at `dest`, checksums verified."""
    info = checkpoint(workdir, ckptd, run, step)
    progress = Progress(f"export {run}@{step}", info.total_bytes, out)
    with _staged(dest, overwrite) as staging:
        if ckptd:
            with CkptdClient(ckptd) as client:
                written = _export_from_client(client, info, staging, progress)
        else:
            with _reading_store(workdir, info) as store:
                written = store.export(info.ref, staging, progress)
    progress.finish()
    return [dest / path.name for path in written]


def export_hf(
    workdir: Path,
    ckptd: str | None,
    run: str,
    step: int,
    dest: Path,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Exported:
    """Write the model of checkpoint (run, step) as a Hugging Face Llama directory at `dest`
    (`trainer.interop.hf_export`), read straight from the fastest tier holding it, every block's
    CRC-32C checked on the way."""
    from ckptd.dcp import CkptdStorageReader
    from trainer.interop.hf_export import export_hf as write_hf

    info = checkpoint(workdir, ckptd, run, step)
    with contextlib.ExitStack() as stack:
        if ckptd:
            reader = CkptdStorageReader(ckptd, run, step)
        else:
            store = stack.enter_context(_reading_store(workdir, info))
            reader = CkptdStorageReader("", run, step, source=_StoreSource(store))
        stack.callback(reader.close)
        with _staged(dest, overwrite) as staging:
            return write_hf(reader, staging, max_shard_bytes)


class _StoreSource:
    """A work directory's store, opened offline, as a DCP reader's source of verified ranges:
    each piece comes from the fastest tier whose copy passes its block CRC-32Cs."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store

    def get(self, run: str, step: int) -> checkpoint_pb2.CheckpointInfo:
        return self.store.member.checkpoint(checkpoint_pb2.CheckpointRef(run=run, step=step))

    def read(self, run: str, step: int, path: str, offset: int = 0, length: int = 0) -> bytes:
        ref = checkpoint_pb2.CheckpointRef(run=run, step=step)
        return b"".join(
            piece.data for piece in self.store.reader.iter_range(ref, path, offset, length)
        )

    def close(self) -> None:
        """The store belongs to the caller's `_offline_store`."""


@contextlib.contextmanager
def _staged(dest: Path, overwrite: bool) -> Iterator[Path]:
    """An empty directory beside `dest` to export into, renamed to `dest` once complete, so a
    failed export leaves nothing partly written there. `dest` must be absent or empty, unless
    `overwrite` (it is replaced only after the export succeeded)."""
    if dest.exists() and not dest.is_dir():
        raise UserError(f"export target {dest} exists and is not a directory")
    if dest.exists() and any(dest.iterdir()) and not overwrite:
        raise UserError(f"export target {dest} is not empty (--overwrite replaces it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    # mkdtemp makes it 0700; the export is made with the user's umask, as any directory.
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        yield staging
        if dest.exists():
            old = staging.with_suffix(".old")
            dest.rename(old)
            staging.rename(dest)
            shutil.rmtree(old)
        else:
            staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _export_from_client(
    client: CkptdClient, info: checkpoint_pb2.CheckpointInfo, dest: Path, progress: Progress
) -> list[Path]:
    written = []
    for file in info.files:
        path = dest / file.path
        partial = path.with_name(f"{path.name}.partial")
        blocks = BlockCrcs()
        with partial.open("wb") as out:
            for piece in client.read_stream(info.ref.run, info.ref.step, file.path):
                out.write(piece)
                blocks.update(piece)
                progress(len(piece))
        if file_crc32c(blocks.packed()) != file.crc32c:
            partial.unlink()
            raise UserError(f"export of {file.path}: checksum mismatch")
        partial.replace(path)
        written.append(path)
    return written


def guard_removal(workdir: Path, ckptd: str | None, info: checkpoint_pb2.CheckpointInfo) -> None:
    """Refuse to remove the run's newest checkpoint, where `--resume` goes on from (`ckpt rm
    --force` skips this)."""
    infos = _infos(workdir, ckptd, info.ref.run)
    if info.ref.step != _newest(infos):
        return
    older = len(infos) - 1
    raise UserError(
        f"refusing to remove {info.ref.run}@{info.ref.step}: it is the run's newest checkpoint, "
        f"where --resume goes on from ({older} older one(s) left); --dry-run shows what would "
        "go, --force removes it"
    )


def remove(workdir: Path, ckptd: str | None, run: str, step: int) -> tuple[list[str], list[str]]:
    """Delete a checkpoint from every tier: (tiers it left, tiers it is still leaving)."""
    if ckptd:
        with CkptdClient(ckptd) as client:
            removed, pending = client.delete(run, step)
    else:
        info = checkpoint(workdir, ckptd, run, step)
        with _offline_store(workdir, common_pb2.TIER_S3 in _tiers_of(info)) as store:
            removed, pending = store.delete(info.ref)
            if pending and store.wait_background(timeout_s=120):
                removed, pending = removed + pending, []
    return [TIER_NAMES[t] for t in removed], [TIER_NAMES[t] for t in pending]
