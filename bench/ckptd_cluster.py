"""Commit latency of a checkpoint spread over two ckptds, beside the same save on one ckptd.

A save of W ranks, as DCP makes it: the coordinator's ckptd opens it, each rank joins it on its
own node's ckptd and writes its shard there, the metadata goes to the coordinator's node, which
commits. Once the last rank's file is written (durable on its node), CommitSave runs the
two-phase commit: every peer votes, the coordinator writes its marker, every peer takes the
decision; it returns when the step is committed on every node. Measured with one node (every
rank on it: the protocol with nobody to ask) and with two (half the ranks each), ckptds as real
processes on loopback, median of several saves each, interleaved so that both see the same load.
Also the whole save (open, join, write, commit), as a rank's background thread waits for it.
Run: `.venv/bin/python bench/ckptd_cluster.py [--mib 64] [--runs 5] [--ranks 4]`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from ckptd_common import CkptdProcess, bench_parser, payload

from ckptd.client import CkptdClient
from scaletrain.app.stack import free_port
from scaletrain.security import ClientSecurity
from scaletrain.v1 import checkpoint_pb2

SHARD = checkpoint_pb2.FILE_KIND_SHARD
METADATA = checkpoint_pb2.FILE_KIND_METADATA


class Nodes:
    """`n` ckptd processes that list each other as peers; `extra` goes to every one's command
    line (after the defaults, so it overrides them), `per_node[i]` to node i's."""

    def __init__(
        self,
        root: Path,
        n: int,
        *extra: str,
        per_node: list[tuple[str, ...]] | None = None,
        env: dict[str, str] | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        self.procs = []
        for i, address in enumerate(addresses):
            peers = ",".join(a for a in addresses if a != address)
            args = ["--listen", address, "--node", f"node{i}", "--memory-budget-mb", "1024"]
            own = per_node[i] if per_node else ()
            self.procs.append(
                CkptdProcess(root / f"node{i}", *args, "--peers", peers, *extra, *own, env=env)
            )
        self.clients = [CkptdClient(p.address, security) for p in self.procs]

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for proc in self.procs:
            proc.stop()


def save(nodes: Nodes, step: int, ranks: int, shard: bytes) -> tuple[float, float]:
    """One save; returns (seconds of the commit, seconds of the whole save)."""
    began = time.perf_counter()
    n = len(nodes.clients)
    opened = nodes.clients[0].open_save("bench", step, ranks)
    for rank in range(ranks):
        client = nodes.clients[rank * n // ranks]
        client.join_save(opened, "bench", step, ranks)
        client.write_file(opened.save_id, f"__{rank}_0.distcp", rank, SHARD, shard)
    nodes.clients[0].write_file(opened.save_id, ".metadata", 0, METADATA, b"m" * 4096)
    committing = time.perf_counter()
    nodes.clients[0].commit(opened.save_id)
    done = time.perf_counter()
    nodes.clients[0].delete("bench", step)  # from every node: keep the disk small
    return done - committing, done - began


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--ranks", type=int, default=4, help="ranks per save (default 4)")
    args = parser.parse_args()
    shard = payload(max(1, args.mib // args.ranks))
    with tempfile.TemporaryDirectory(prefix="ckptd-cluster-bench-") as tmp:
        # No replicas: the commit alone, as before replicas existed (bench/ckptd_replicas.py
        # measures those).
        clusters = {n: Nodes(Path(tmp) / f"n{n}", n, "--replicas", "1") for n in (1, 2)}
        try:
            commit: dict[int, list[float]] = {1: [], 2: []}
            whole: dict[int, list[float]] = {1: [], 2: []}
            for run in range(args.runs + 1):
                for n, nodes in clusters.items():
                    c, w = save(nodes, run + 1, args.ranks, shard)
                    if run:  # the first save of each warms up (connections, buffers)
                        commit[n].append(c)
                        whole[n].append(w)
        finally:
            for nodes in clusters.values():
                nodes.close()
    med = {n: (statistics.median(commit[n]), statistics.median(whole[n])) for n in (1, 2)}
    for n in (1, 2):
        commit_ms, save_ms = med[n][0] * 1000, med[n][1] * 1000
        print(f"{n} node(s): commit {commit_ms:.1f} ms, whole save {save_ms:.1f} ms")
    ratio = med[2][0] / med[1][0]
    print(f"ratio commit latency 2 nodes/1 node: {ratio:.2f}")
    print(f"ratio whole save 2 nodes/1 node: {med[2][1] / med[1][1]:.2f}")
    print(
        json.dumps(
            {
                "mib": args.mib,
                "ranks": args.ranks,
                "commit_ms": {n: round(med[n][0] * 1000, 2) for n in (1, 2)},
                "save_ms": {n: round(med[n][1] * 1000, 2) for n in (1, 2)},
                "commit_ratio": round(ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
