"""Restore throughput from ckptd's memory tier, beside the same restore from its SSD tier.

Saves one shard into a ckptd process, then reads it back whole over gRPC, as DCP's reader does on
a restore, from the memory tier (the default: the fastest tier with a good copy) and pinned to the
SSD tier (page cache dropped first when this process may do so), every block CRC-checked by ckptd
and every chunk by the client. Best of a few runs each.
Run: `.venv/bin/python bench/ckptd_restore.py [--mib 256] [--runs 3]`.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from ckptd_common import CkptdProcess, bench_parser, best_of, line, payload, timed

from ckptd.client import CkptdClient
from scaletrain.v1 import checkpoint_pb2, common_pb2


def drop_page_cache() -> bool:
    """Ask the kernel to forget cached file pages (needs root); whether it worked."""
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")
        return True
    return False


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    data = payload(args.mib)
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-") as tmp:
        ckptd = CkptdProcess(Path(tmp), "--memory-budget-mb", str(args.mib + 64))
        try:
            with CkptdClient(ckptd.address) as client:
                save_id = client.open_save("bench", 1, world_size=1).save_id
                client.write_file(save_id, "__0_0.distcp", 0, checkpoint_pb2.FILE_KIND_SHARD, data)
                client.write_file(save_id, ".metadata", 0, checkpoint_pb2.FILE_KIND_METADATA, b"m")
                info = client.commit(save_id)
                held = {
                    t.tier for t in info.tiers if t.state == checkpoint_pb2.TIER_STATE_COMMITTED
                }
                assert common_pb2.TIER_MEMORY in held, "the shard did not stay in memory"
                cold = [False]

                def restore(tier: int) -> float:
                    if tier == common_pb2.TIER_SSD:
                        cold[0] = drop_page_cache()
                    got = [0]

                    def read() -> None:
                        for piece in client.read_stream("bench", 1, "__0_0.distcp", tier=tier):
                            got[0] += len(piece)

                    seconds = timed(read)
                    assert got[0] == len(data)
                    return seconds

                memory, ssd = best_of(
                    args.runs,
                    lambda: restore(common_pb2.TIER_MEMORY),
                    lambda: restore(common_pb2.TIER_SSD),
                )
        finally:
            ckptd.stop()
    print(line("restore from the memory tier (gRPC)", len(data), memory))
    print(
        line(f"restore from the SSD tier ({'cold' if cold[0] else 'page cache'})", len(data), ssd)
    )
    print(f"ratio memory/SSD: {ssd / memory:.2f}")


if __name__ == "__main__":
    main()
