"""How close does a restore from ckptd come to a raw TCP loopback transfer?

Saves one shard into a ckptd process, then reads it back whole, as DCP's reader does on a restore
(every block CRC-checked by ckptd, every frame or chunk by the client), interleaved run by run,
best of a few each:

1. raw TCP: a sender process `sendall`s 4 MiB slices to this one, which `recv_into`s a
   preallocated buffer (the baseline, `ckptd_common.RawTcp`);
2. the memory tier through gRPC ReadFile (the client with `fast_path=False`: the old path, and
   what a client gets where the data socket is not offered);
3. the memory tier over the fast path: OpenRead, then the range's frames over ckptd's data
   socket (`ckptd.readpath`);
4. the SSD tier over the fast path (page cache dropped first when this process may do so);
5. a peer: the client asks a second ckptd process, configured as the first one's peer, which
   holds no copy of the shard: it sends the client to the first one's data socket with that
   one's ticket (OpenReadRequest.direct), so the bytes take one hop (before 2026-12-02 the
   second ckptd relayed them, `Reader._relay`: 0.28-0.36 of raw TCP).

Both ckptds run with R = 1 (`--replicas 1`): with the default R = 2 the second one copied the
shard in the background while the first restores were timed (CPU taken from them), and then
served its own replica instead of reading the peer's, so that "restore from a peer" measured
neither a peer read nor an idle machine.

Prints MB/s and each restore's ratio to raw TCP (target >= 0.5 for memory and peer), and the CPU
seconds per GB that a memory and a peer restore cost each process (from one more run of each):
all of them share this machine's cores, where on a cluster the two ckptds have their own. For
reference beside the peer restore, also a raw TCP relay: the same bytes from a sender process
through a second process that passes them on (`RawTcp(relay=True)`), the floor of any two-hop
path on these two cores (what a ckptd that relays, as with TLS across hosts, comes to).
Run: `.venv/bin/python bench/ckptd_restore.py [--mib 256] [--runs 3]`.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from ckptd_common import (
    CkptdProcess,
    RawTcp,
    bench_parser,
    best_of,
    cpu_seconds,
    line,
    payload,
    timed,
)

from ckptd.client import CkptdClient
from scaletrain.app.stack import free_port
from scaletrain.v1 import checkpoint_pb2, common_pb2

SHARD = "__0_0.distcp"


def drop_page_cache() -> bool:
    """Ask the kernel to forget cached file pages (needs root); whether it worked."""
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")
        return True
    return False


def peers(root: Path, budget_mib: int) -> list[CkptdProcess]:
    """Two ckptd processes that list each other as peers (node0 and node1), making no replicas
    (see the module)."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    return [
        CkptdProcess(
            root / f"node{i}",
            *("--listen", addresses[i], "--node", f"node{i}", "--peers", addresses[1 - i]),
            *("--memory-budget-mb", str(budget_mib), "--replicas", "1"),
        )
        for i in range(2)
    ]


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    data = payload(args.mib)
    tcp = RawTcp(len(data), to_child=False)
    tcp_relay = RawTcp(len(data), to_child=False, relay=True)
    cold = [False]
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-") as tmp:
        nodes = peers(Path(tmp), args.mib + 64)
        try:
            with (
                CkptdClient(nodes[0].address, fast_path=True) as fast,
                CkptdClient(nodes[0].address, fast_path=False) as rpc,
                CkptdClient(nodes[1].address, fast_path=True) as peer,
            ):
                save_id = fast.open_save("bench", 1, world_size=1).save_id
                fast.write_file(save_id, SHARD, 0, checkpoint_pb2.FILE_KIND_SHARD, data)
                fast.write_file(save_id, ".metadata", 0, checkpoint_pb2.FILE_KIND_METADATA, b"m")
                info = fast.commit(save_id)
                held = {
                    t.tier for t in info.tiers if t.state == checkpoint_pb2.TIER_STATE_COMMITTED
                }
                assert common_pb2.TIER_MEMORY in held, "the shard did not stay in memory"

                def restore(client: CkptdClient, tier: int = 0) -> float:
                    if tier == common_pb2.TIER_SSD:
                        cold[0] = drop_page_cache()
                    got = [0]

                    def read() -> None:
                        for piece in client.read_stream("bench", 1, SHARD, tier=tier):
                            got[0] += len(piece)

                    seconds = timed(read)
                    assert got[0] == len(data)
                    return seconds

                raw, raw_relay, grpc_memory, memory, ssd, from_peer = best_of(
                    args.runs,
                    tcp.transfer,
                    tcp_relay.transfer,
                    lambda: restore(rpc, common_pb2.TIER_MEMORY),
                    lambda: restore(fast, common_pb2.TIER_MEMORY),
                    lambda: restore(fast, common_pb2.TIER_SSD),
                    lambda: restore(peer),
                )
                if not (fast.fast_path and peer.fast_path):
                    raise SystemExit("ckptd did not offer its fast path to this client")
                cpu = {}
                for name, client in (("memory", fast), ("peer", peer)):
                    pids = [node.process.pid for node in nodes]
                    before = [*map(cpu_seconds, pids), cpu_seconds()]
                    restore(client)
                    after = [*map(cpu_seconds, pids), cpu_seconds()]
                    gb = len(data) / 1e9
                    cpu[name] = [(a - b) / gb for a, b in zip(after, before, strict=True)]
                served = dict(peer.served)
        finally:
            for node in nodes:
                node.stop()
            tcp.close()
            tcp_relay.close()
    print(line("raw TCP loopback (process to process)", len(data), raw))
    print(line("raw TCP loopback through a relay process", len(data), raw_relay))
    print(line("restore from memory, gRPC ReadFile", len(data), grpc_memory))
    print(line("restore from memory, fast path", len(data), memory))
    page = "cold" if cold[0] else "page cache"
    print(line(f"restore from SSD ({page}), fast path", len(data), ssd))
    print(line("restore from a peer's memory, fast path", len(data), from_peer))
    print(f"ratio memory fast path/raw: {raw / memory:.2f}  (target >= 0.5)")
    print(f"ratio peer fast path/raw: {raw / from_peer:.2f}  (target >= 0.5)")
    print(f"ratio peer fast path/raw relay: {raw_relay / from_peer:.2f}  (for reference)")
    print(f"ratio memory ReadFile/raw: {raw / grpc_memory:.2f}  (the old path)")
    print(f"ratio SSD fast path/raw: {raw / ssd:.2f}")
    print(f"ratio memory/SSD: {ssd / memory:.2f}")
    print(f"a peer restore's bytes came from: {served}")
    for name, (first, second, client) in cpu.items():
        print(
            f"CPU per GB, {name} restore: ckptd node0 {first:.2f} s, node1 {second:.2f} s, "
            f"client {client:.2f} s"
        )


if __name__ == "__main__":
    main()
