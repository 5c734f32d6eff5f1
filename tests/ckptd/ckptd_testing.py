"""Helpers shared by the ckptd tests (a uniquely named module: `conftest` is not importable)."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Mapping

import google_crc32c
import pytest

from ckptd.store import CheckpointStore
from scaletrain.v1 import checkpoint_pb2

SHARD = checkpoint_pb2.FILE_KIND_SHARD
METADATA = checkpoint_pb2.FILE_KIND_METADATA


def payload(size: int, seed: int) -> bytes:
    """Deterministic random bytes (incompressible, so nothing can pass by accident)."""
    return random.Random(seed).randbytes(size)


def ref(run: str, step: int) -> checkpoint_pb2.CheckpointRef:
    return checkpoint_pb2.CheckpointRef(run=run, step=step)


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    """Poll `condition` until true; fail the test with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def chunk(offset: int, data: bytes, crc: int | None = None) -> checkpoint_pb2.FileChunk:
    crc = google_crc32c.value(data) if crc is None else crc
    return checkpoint_pb2.FileChunk(offset=offset, data=data, crc32c=crc)


def trailer(data: bytes) -> checkpoint_pb2.FileTrailer:
    return checkpoint_pb2.FileTrailer(size=len(data), sha256=hashlib.sha256(data).hexdigest())


def store_write(
    store: CheckpointStore,
    save_id: str,
    path: str,
    rank: int,
    kind: int,
    data: bytes,
    chunk_bytes: int = 1 << 20,
) -> None:
    """Write one file through the store in chunks, as the servicer would."""
    header = checkpoint_pb2.FileHeader(save_id=save_id, path=path, rank=rank, kind=kind)
    chunks = [chunk(i, data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]
    store.write_file(header, chunks, trailer(data))


def checkpoint_files(
    world_size: int, shard_bytes: int, seed: int = 0
) -> dict[str, tuple[int, int, bytes]]:
    """DCP-like files of a checkpoint: path -> (rank, kind, bytes), one shard per rank."""
    files = {
        f"__{rank}_0.distcp": (rank, SHARD, payload(shard_bytes + rank, seed + rank))
        for rank in range(world_size)
    }
    files[".metadata"] = (0, METADATA, payload(1000, seed + 1000))
    return files


def store_save(
    store: CheckpointStore,
    run: str,
    step: int,
    files: Mapping[str, tuple[int, int, bytes]],
    world_size: int | None = None,
) -> checkpoint_pb2.CheckpointInfo:
    """Open, write every file and commit through the store; returns the commit's info."""
    ranks = {rank for rank, kind, _ in files.values() if kind == SHARD}
    save_id = store.open_save(ref(run, step), world_size or len(ranks))
    for path, (rank, kind, data) in files.items():
        store_write(store, save_id, path, rank, kind, data)
    return store.commit(save_id)


def tier_states(info: checkpoint_pb2.CheckpointInfo) -> dict[str, str]:
    """{"memory": "COMMITTED", ...} of a CheckpointInfo, readable in assertion messages."""
    names = {1: "memory", 2: "ssd", 3: "s3"}
    return {
        names[t.tier]: checkpoint_pb2.TierState.Name(t.state).removeprefix("TIER_STATE_")
        for t in info.tiers
    }
