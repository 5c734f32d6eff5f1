"""N ckptd processes on loopback that list each other as peers, and a save over them as DCP
makes it: what the cluster and replica tests share."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from ckptd_testing import CkptdProcess, wait_for

from ckptd.client import CkptdClient
from ckptd.config import S3Config
from scaletrain.app.stack import free_port
from scaletrain.errors import Unavailable
from scaletrain.transport import wait_until_healthy
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

Files = dict[str, tuple[int, int, bytes]]
COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED
S3 = 3
# The command line of a cluster that keeps no replicas: each part only on its own node.
NO_REPLICAS = ("--replicas", "1")


class Cluster:
    """N ckptd processes that list each other as peers, each with its own data dir; `args` go
    to every one's command line (`--replicas 1`, say). With `metrics`, node i serves its
    Prometheus metrics on port `metrics[i]`."""

    def __init__(
        self,
        root: Path,
        n: int,
        s3: S3Config | None = None,
        args: tuple[str, ...] = (),
        metrics: bool = False,
    ) -> None:
        self.root, self.s3, self.args = root, s3, args
        self.metrics = [free_port() for _ in range(n)] if metrics else []
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        self.procs: list[CkptdProcess | None] = [None] * n
        self.clients: list[CkptdClient] = [CkptdClient(a) for a in self.addresses]
        with ThreadPoolExecutor(n) as pool:  # their start-ups overlap
            list(pool.map(self.start, range(n)))

    def data_dir(self, i: int) -> Path:
        return self.root / f"node{i}" / "ckptd"

    def start(self, i: int, crash_at: str | None = None) -> CkptdProcess:
        peers = ",".join(a for j, a in enumerate(self.addresses) if j != i)
        self.data_dir(i).mkdir(parents=True, exist_ok=True)
        args = ("--listen", self.addresses[i], "--node", f"node{i}", "--peers", peers)
        if self.metrics:
            args += ("--metrics", f"127.0.0.1:{self.metrics[i]}")
        proc = CkptdProcess(
            self.data_dir(i), self.s3, crash_at, (*args, "--sync-interval-s", "0.5", *self.args)
        )
        self.procs[i] = proc
        # gRPC shares connections between channels to one address: wait out the backoff of the
        # one to the process this replaces, so the first call does not fail UNAVAILABLE.
        wait_until_healthy(self.addresses[i], timeout_s=30)
        self.clients[i].close()
        self.clients[i] = CkptdClient(self.addresses[i])
        return proc

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.stop()
            self.procs[i] = None

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for i in range(len(self.procs)):
            self.kill(i)


def node_of_rank(rank: int, world_size: int, nodes: int) -> int:
    return rank // (world_size // nodes)


def save(
    cluster: Cluster,
    step: int,
    files: Files,
    world_size: int,
    commit: bool = True,
    retention: checkpoint_pb2.RetentionPolicy | None = None,
    memory_only: bool = False,
) -> str:
    """A save as DCP makes it: the coordinator (rank 0, node 0) opens it, every rank joins it on
    its own node's ckptd and writes its shard there; the metadata goes to node 0, which commits.
    `retention`, if given, becomes the run's; `memory_only`: a memory-only checkpoint."""
    nodes = len(cluster.clients)
    opened = cluster.clients[0].open_save(
        "run", step, world_size, retention=retention, memory_only=memory_only
    )
    joined = set()
    for path, (rank, kind, data) in files.items():
        client = cluster.clients[node_of_rank(rank, world_size, nodes)]
        if rank not in joined:
            client.join_save(opened, "run", step, world_size, memory_only)
            joined.add(rank)
        client.write_file(opened.save_id, path, rank, kind, data)
    if commit:
        cluster.clients[0].commit(opened.save_id)
    return opened.save_id


def steps_listed(client: CkptdClient) -> set[int] | None:
    """The steps a node lists; None while it cannot be reached (just restarted)."""
    try:
        return {c.ref.step for c in client.list("run")}
    except Unavailable:
        return None


def assert_every_node_reads_back(cluster: Cluster, step: int, files: Files) -> None:
    for i, client in enumerate(cluster.clients):
        for path, (_, _, data) in files.items():
            assert client.read("run", step, path) == data, f"node {i} reading {path}"


def wait_until_every_node_sees_it_on_s3(cluster: Cluster, step: int) -> None:
    def whole_on_s3(client: CkptdClient) -> bool:
        return next(t for t in client.get("run", step).tiers if t.tier == S3).state == COMMITTED

    wait_for(
        lambda: all(whole_on_s3(c) for c in cluster.clients),
        timeout_s=60,
        what=f"every node to see step {step} whole on S3",
    )


def cluster_stub(address: str) -> checkpoint_pb2_grpc.ClusterServiceStub:
    return checkpoint_pb2_grpc.ClusterServiceStub(grpc.insecure_channel(address))
