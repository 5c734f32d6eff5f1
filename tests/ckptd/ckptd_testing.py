"""Helpers shared by the ckptd tests (a uniquely named module: `conftest` is not importable)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import google_crc32c
import pytest

from ckptd.config import S3Config
from ckptd.crash import ENV as CRASH_ENV
from ckptd.manifest import data_crc32c
from ckptd.store import CheckpointStore
from scaletrain.names import TIER_NAMES
from scaletrain.v1 import checkpoint_pb2

ROOT = Path(__file__).resolve().parents[2]

# Retries that give up (and retry again) within a fraction of a second, so tests see failures.
FAST_RETRIES = {"attempts": 2, "backoff_s": 0.05, "backoff_max_s": 0.2, "connect_timeout_s": 2.0}
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
    return checkpoint_pb2.FileTrailer(size=len(data), crc32c=data_crc32c(data))


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
    store.saves.write_file(header, chunks, trailer(data))


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
    save_id = store.saves.open_save(ref(run, step), world_size or len(ranks))
    for path, (rank, kind, data) in files.items():
        store_write(store, save_id, path, rank, kind, data)
    return store.saves.commit(save_id)


def tier_states(info: checkpoint_pb2.CheckpointInfo) -> dict[str, str]:
    """{"memory": "COMMITTED", ...} of a CheckpointInfo, readable in assertion messages."""
    return {
        TIER_NAMES[t.tier]: checkpoint_pb2.TierState.Name(t.state).removeprefix("TIER_STATE_")
        for t in info.tiers
    }


class CkptdProcess:
    """A real ckptd (`python -m scaletrain ckptd ...`) in its own process, for crash tests."""

    def __init__(
        self,
        data_dir: Path,
        s3: S3Config | None = None,
        crash_at: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        args = [
            sys.executable, "-m", "scaletrain", "ckptd",
            "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), "--log-format", "text",
            *extra_args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop(CRASH_ENV, None)
        if s3 is not None:
            args += ["--s3-endpoint", s3.endpoint_url, "--s3-bucket", s3.bucket]
            args += ["--s3-part-mb", str(s3.part_bytes >> 20), "--s3-backoff-max-s", "0.5"]
            env |= {
                "AWS_ACCESS_KEY_ID": s3.access_key_id,
                "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
            }
        if crash_at is not None:
            env[CRASH_ENV] = crash_at
        self.log = data_dir.parent / f"ckptd-{crash_at or 'plain'}.log"
        self._log = self.log.open("w")
        self.process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("ckptd listening on "):
            self.process.kill()
            pytest.fail(f"ckptd did not start: {line!r} {self.log.read_text()[-2000:]}")
        self.address = line.split()[3].rstrip(",")

    def wait_killed(self, timeout_s: float = 60.0) -> None:
        """Wait for the process to die by SIGKILL (its crash point), failing otherwise."""
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"ckptd did not crash within {timeout_s}s: {self.log.read_text()[-2000:]}")
        assert code == -signal.SIGKILL, f"exit code {code}: {self.log.read_text()[-2000:]}"
        self._log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()
