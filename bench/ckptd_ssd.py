"""SSD tier write throughput against `dd ... conv=fsync` of the same bytes to the same disk.

The tier's figure is a whole durable commit through the store, without gRPC: a shard is received
chunk by chunk (CRC-32C, SHA-256 and block CRCs checked in the ingest pipeline), written to a
temporary file, fsynced, renamed into the save's staging dir, then committed (marker written and
fsynced, directories fsynced, the directory renamed into place). The baseline copies the same
bytes from tmpfs with `dd bs=4M conv=fsync` into the same data dir. Target: ratio >= 0.8.

Run: `.venv/bin/python bench/ckptd_ssd.py [--mib 256] [--runs 3]`.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from ckptd_common import MiB, best_of, chunked, line, payload, save_one_shard, timed

from ckptd.config import CkptdConfig
from ckptd.retention import RetentionPolicy
from ckptd.store import CheckpointStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="shard size in MiB")
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs each")
    parser.add_argument("--dir", type=Path, default=None, help="where the data dir goes")
    args = parser.parse_args()
    data = payload(args.mib)
    shard = chunked(data)
    with (
        tempfile.TemporaryDirectory(prefix="ckptd-bench-", dir=args.dir) as tmp,
        tempfile.NamedTemporaryFile(dir="/dev/shm") as source,
    ):
        source.write(data)
        source.flush()
        config = CkptdConfig(
            data_dir=Path(tmp) / "ckptd",
            memory_budget_bytes=256 * MiB,  # in-flight chunks only: memory tier kept off below
            retention=RetentionPolicy(memory_last=0, ssd_last=1, s3_every=1),
        )
        steps = iter(range(1, 1000))
        with CheckpointStore(config) as store:

            def tier() -> float:
                return timed(lambda: save_one_shard(store, next(steps), shard))

            def dd() -> float:
                target = Path(tmp) / "dd.out"
                argv = ["dd", f"if={source.name}", f"of={target}", "bs=4M", "conv=fsync"]
                seconds = timed(lambda: subprocess.run(argv, check=True, capture_output=True))
                target.unlink()
                return seconds

            dd_s, tier_s = best_of(args.runs, dd, tier)
    print(line("dd bs=4M conv=fsync", len(data), dd_s))
    print(line("ckptd SSD tier (ingest + commit)", len(data), tier_s))
    print(f"ratio SSD tier / dd: {dd_s / tier_s:.2f}  (target >= 0.8)")


if __name__ == "__main__":
    main()
