"""SSD tier write throughput against `dd ... conv=fsync` of the same bytes to the same disk.

Three figures from one command, interleaved run by run, best of a few each:

1. `dd if=<tmpfs copy> of=<data dir> bs=4M conv=fsync` (the baseline);
2. the SSD tier's own commit protocol on the same disk (the target figure): the shard written in
   4 MiB pieces from page-aligned buffers, as ckptd's data socket receives them (so around the
   page cache: `IncomingFile`), to a temporary file, fsynced, renamed into the save's staging
   dir, then the commit (marker written and fsynced, directories fsynced, the directory renamed
   into place, the parent fsynced);
3. for reference, the whole store path without gRPC: the same plus the ingest pipeline's
   CRC-32C and block CRCs of every chunk (`ckptd.ingest`) and the catalog update, from chunks
   that are views of one bytes object, as WriteFile's are (so through a bounce buffer).

Prints MB/s and the ratios to dd (target for 2: >= 0.8).
Run: `.venv/bin/python bench/ckptd_ssd.py [--mib 256] [--runs 3]`.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from ckptd_common import MiB, bench_parser, best_of, chunked, line, payload, save_one_shard, timed

from ckptd.config import CkptdConfig
from ckptd.manifest import FileRecord, Manifest
from ckptd.retention import RetentionPolicy
from ckptd.store import CheckpointStore
from ckptd.tiers import CheckpointKey, page_aligned_buffer
from ckptd.tiers.ssd import SsdTier
from scaletrain.v1 import checkpoint_pb2


def tier_commit(tier: SsdTier, step: int, shard: list[memoryview], size: int) -> None:
    """The SSD tier's part of a save: temp file, fsync, rename, then the commit of the dir."""
    save_id = f"bench-{step}"
    for path, pieces in (("__0_0.distcp", shard), (".metadata", [memoryview(b"m")])):
        incoming = tier.incoming_file()
        for piece in pieces:
            incoming.write(piece)
        incoming.sync_and_close()
        tier.stage(incoming, save_id, path)
    files = (
        FileRecord("__0_0.distcp", 0, checkpoint_pb2.FILE_KIND_SHARD, size, b""),
        FileRecord(".metadata", 0, checkpoint_pb2.FILE_KIND_METADATA, 1, b""),
    )
    tier.put(Manifest(CheckpointKey("tier", step), 1, files), save_id)


def _received(data: memoryview) -> memoryview:
    """A copy of `data` in a buffer like those the data socket receives into (page-aligned, so
    the SSD tier writes it around the page cache)."""
    buffer = page_aligned_buffer(len(data))
    buffer[:] = data
    return memoryview(buffer)


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    data = payload(args.mib)
    shard = chunked(data)
    pieces = [_received(chunk.data) for chunk in shard[0]]
    with (
        tempfile.TemporaryDirectory(prefix="ckptd-bench-") as tmp,
        tempfile.NamedTemporaryFile(dir="/dev/shm") as source,
    ):
        source.write(data)
        source.flush()
        config = CkptdConfig(
            data_dir=Path(tmp) / "ckptd",
            memory_budget_bytes=256 * MiB,  # for chunks in flight; the memory tier is off
            retention=RetentionPolicy(memory_last=0, ssd_last=1, s3_every=1),
        )
        steps = iter(range(1, 1000))
        with CheckpointStore(config) as store:
            tier = SsdTier(Path(tmp) / "tier")

            def dd() -> float:
                target = Path(tmp) / "dd.out"
                argv = ["dd", f"if={source.name}", f"of={target}", "bs=4M", "conv=fsync"]
                seconds = timed(lambda: subprocess.run(argv, check=True, capture_output=True))
                target.unlink()
                return seconds

            def tier_only() -> float:
                step = next(steps)
                seconds = timed(lambda: tier_commit(tier, step, pieces, len(data)))
                tier.delete(CheckpointKey("tier", step))
                return seconds

            def store_path() -> float:
                return timed(lambda: save_one_shard(store, next(steps), shard))

            dd_s, tier_s, store_s = best_of(args.runs, dd, tier_only, store_path)
    print(line("dd bs=4M conv=fsync", len(data), dd_s))
    print(line("ckptd SSD tier commit protocol", len(data), tier_s))
    print(line("ckptd store: ingest checks + SSD commit", len(data), store_s))
    print(f"ratio SSD tier / dd: {dd_s / tier_s:.2f}  (target >= 0.8)")
    print(f"ratio store path / dd: {dd_s / store_s:.2f}  (adds CRC-32C, block CRCs)")


if __name__ == "__main__":
    main()
