"""Checkpoints spread over nodes: one ckptd per node, each rank writing to its own node's ckptd.

Every ckptd here is a real process on loopback (`scaletrain ckptd --node --peers`), as the Helm
chart's DaemonSet runs one per node, with a real SeaweedFS behind them where S3 is involved. A
save commits on every node or none: the coordinator's ckptd asks every peer to vote, writes its
marker (the decision) and tells the peers; a peer that missed it asks later. Each test kills real
processes at the protocol's instants (CKPTD_CRASH_AT) or for good (a lost node).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch.distributed as dist
from ckptd_testing import ROOT, CkptdProcess, checkpoint_files, wait_for
from cluster_testing import (
    COMMITTED,
    NO_REPLICAS,
    assert_every_node_reads_back,
    cluster_stub,
    node_of_rank,
    save,
    steps_listed,
    wait_until_every_node_sees_it_on_s3,
)

from ckptd.client import CkptdClient
from ckptd.config import S3Config
from scaletrain.app.stack import free_port
from scaletrain.errors import (
    FailedPrecondition,
    InvalidArgument,
    ScaletrainError,
    Unavailable,
)
from scaletrain.v1 import checkpoint_pb2
from trainer.checkpoint.resume import latest_step


@pytest.mark.parametrize("nodes", [2, 4])
def test_a_save_over_several_nodes_commits_on_every_node_and_any_node_serves_every_file(
    nodes: int, make_cluster, s3_config: S3Config
) -> None:
    cluster = make_cluster(nodes, s3_config if nodes == 2 else None)
    world = 4
    files = checkpoint_files(world_size=world, shard_bytes=300_000, seed=nodes)
    save(cluster, 100, files, world)

    for i, client in enumerate(cluster.clients):
        assert steps_listed(client) == {100}, f"node {i}"
        assert client.get("run").ref.step == 100, f"node {i}'s latest"
    (info,) = cluster.clients[-1].list("run", nodes=True)
    holders = {f.path: f.node for f in info.files}
    for path, (rank, _, _) in files.items():
        assert holders[path] == f"node{node_of_rank(rank, world, nodes)}", path
    parts = {p.node: p for p in info.parts}
    assert sorted(parts) == [f"node{i}" for i in range(nodes)]
    for i in range(nodes):
        part = parts[f"node{i}"]
        assert part.reachable and part.files == sum(1 for n in holders.values() if n == f"node{i}")
        ssd = next(t for t in part.tiers if t.tier == 2)
        assert ssd.state == COMMITTED, f"node{i}'s part on its SSD"
    assert_every_node_reads_back(cluster, 100, files)
    if cluster.s3 is None:
        return
    # S3's marker is written once every node's part is there; each node then says so.
    wait_until_every_node_sees_it_on_s3(cluster, 100)


def test_a_node_lost_with_its_disk_is_replaced_empty_and_restores_its_part_from_s3(
    make_cluster, s3_config: S3Config
) -> None:
    cluster = make_cluster(2, s3_config, *NO_REPLICAS)
    files = {s: checkpoint_files(world_size=4, shard_bytes=200_000, seed=s) for s in (10, 20)}
    save(cluster, 10, files[10], 4)
    wait_until_every_node_sees_it_on_s3(cluster, 10)
    cluster.kill(1)  # before its part of step 20 can be saved: step 20 fails, 10 stays
    with pytest.raises(ScaletrainError):
        save(cluster, 20, files[20], 4)
    assert cluster.clients[0].get("run").ref.step == 10

    shutil.rmtree(cluster.data_dir(1))  # a replaced machine: empty data dir, same name
    cluster.start(1)
    wait_for(lambda: steps_listed(cluster.clients[1]) == {10}, what="the new node to learn step 10")
    assert cluster.clients[1].get("run").ref.step == 10
    assert_every_node_reads_back(cluster, 10, files[10])  # node 1's part from S3
    save(cluster, 20, files[20], 4)  # and the cluster saves again
    assert_every_node_reads_back(cluster, 20, files[20])


def test_latest_skips_a_step_whose_part_is_on_a_node_that_is_down_and_not_on_s3(
    make_cluster,
) -> None:
    cluster = make_cluster(2, None, *NO_REPLICAS)  # no S3: a node's part is only on that node
    for step in (1, 2):
        save(cluster, step, checkpoint_files(world_size=2, shard_bytes=1000, seed=step), 2)
    assert cluster.clients[0].get("run").ref.step == 2
    cluster.kill(1)
    # Not NotFound, which means "no checkpoint": the run has two, and a trainer must wait.
    with pytest.raises(
        Unavailable,
        match=r"2 committed checkpoint\(s\), none of which can be restored in full now; the "
        r"newest, step 2, lacks node1's part \(0 of 1 copies on a live node\) and S3 lacks it "
        r"\(down or unreachable: node1\)",
    ):
        cluster.clients[0].get("run")
    with pytest.raises(ScaletrainError, match="node1"):
        cluster.clients[0].read("run", 2, "__1_0.distcp")
    cluster.start(1)
    wait_for(lambda: _latest_or_none(cluster.clients[0]) == 2, what="node 1 back")


def _latest_or_none(client: CkptdClient) -> int | None:
    try:
        return client.get("run").ref.step
    except Unavailable:
        return None


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group in this process: the trainer's resume decision is a collective."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_restart_while_a_node_holding_the_newest_part_is_down_waits_and_never_starts_over(
    make_cluster, one_rank_group
) -> None:
    cluster = make_cluster(2, None, *NO_REPLICAS)
    save(cluster, 5, checkpoint_files(world_size=2, shard_bytes=1000, seed=5), 2)
    cluster.kill(1)
    address = cluster.addresses[0]
    with pytest.raises(
        ScaletrainError,
        match=r"run run has committed checkpoints but none could be restored within "
        r"--resume-wait-s 1: .*the newest, step 5, lacks node1's part",
    ):
        latest_step(address, "run", 0, wait_s=1.0, required=False)
    # A run that never committed starts at step 0 (unless --resume asks for a checkpoint);
    # one that did, once its node is back, resumes: the wait ends once step 5 can be restored.
    assert latest_step(address, "another-run", 0, wait_s=1.0, required=False) == -1
    with pytest.raises(ScaletrainError, match="run 'another-run' has no committed checkpoint"):
        latest_step(address, "another-run", 0, wait_s=1.0, required=True)
    threading.Timer(1.0, cluster.start, args=(1,)).start()
    assert latest_step(address, "run", 0, wait_s=60.0, required=False) == 5


@pytest.mark.parametrize(
    ("node", "phase"), [(1, None), (1, "cluster-prepared")], ids=["before-vote", "after-vote"]
)
def test_a_participant_killed_before_or_after_its_vote_leaves_no_step_and_the_next_save_succeeds(
    node: int, phase: str | None, make_cluster
) -> None:
    cluster = make_cluster(2)
    files = checkpoint_files(world_size=2, shard_bytes=50_000, seed=7)
    if phase is not None:
        cluster.kill(node)
        cluster.start(node, crash_at=phase)
    save_id = save(cluster, 5, files, 2, commit=False)
    if phase is None:
        cluster.kill(node)
    with pytest.raises(ScaletrainError, match="rank\\(s\\) 1 of world size 2; unreachable: node"):
        cluster.clients[0].commit(save_id)
    proc = cluster.procs[node]
    if proc is not None:
        proc.wait_killed()
        cluster.kill(node)
    cluster.clients[0].abort(save_id, "the save failed")  # as the trainer's writer does
    cluster.start(node)
    for client in cluster.clients:
        assert steps_listed(client) == set()
    # The restarted node voted before it died: it learns the abort and drops its part.
    wait_for(
        lambda: (
            not cluster.clients[node].list("run", include_uncommitted=True)
            or all(not c.committed for c in cluster.clients[node].list("run", True))
        ),
        what="the in-doubt save to be resolved",
    )
    save(cluster, 6, files, 2)
    for client in cluster.clients:
        assert steps_listed(client) == {6}


@pytest.mark.parametrize("phase", ["cluster-voted", "cluster-decided"])
def test_a_coordinator_killed_between_the_phases_leaves_the_step_committed_everywhere_or_nowhere(
    phase: str, make_cluster
) -> None:
    cluster = make_cluster(2)
    files = checkpoint_files(world_size=2, shard_bytes=50_000, seed=9)
    cluster.kill(0)
    cluster.start(0, crash_at=phase)
    save_id = save(cluster, 8, files, 2, commit=False)
    with pytest.raises(ScaletrainError):
        cluster.clients[0].commit(save_id)
    proc = cluster.procs[0]
    assert proc is not None
    proc.wait_killed()
    cluster.kill(0)
    cluster.start(0)
    if phase == "cluster-decided":  # the decision was durable: node 1 learns it by asking
        wait_for(
            lambda: all(steps_listed(c) == {8} for c in cluster.clients),
            what="both nodes to hold step 8",
        )
        assert_every_node_reads_back(cluster, 8, files)
    else:  # no decision: the trainer aborts, and no node ever shows the step
        cluster.clients[0].abort(save_id, "the coordinator died")
        for client in cluster.clients:
            assert steps_listed(client) == set()
        save(cluster, 9, files, 2)
        assert all(steps_listed(c) == {9} for c in cluster.clients)


def test_messages_from_a_stale_coordinator_a_world_size_disagreement_and_unknown_saves_are_refused(
    make_cluster,
) -> None:
    cluster = make_cluster(2)
    files = checkpoint_files(world_size=2, shard_bytes=10_000, seed=3)
    old = save(cluster, 3, files, 2, commit=False)
    # A restarted job whose coordinator rank is on node 1 saves the same step again, while the
    # old job's coordinator (node 0) still tries to commit its attempt.
    newer = cluster.clients[1].open_save("run", 3, 2)
    with pytest.raises(FailedPrecondition, match="stale coordinator: the vote request of node"):
        cluster.clients[0].commit(old)
    stub = cluster_stub(cluster.addresses[1])
    stale = checkpoint_pb2.DecideRequest(
        save_id=old, ref=checkpoint_pb2.CheckpointRef(run="run", step=3), epoch=1, commit=False
    )
    with pytest.raises(grpc.RpcError, match="stale coordinator") as refused:
        stub.Decide(stale, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    unknown = checkpoint_pb2.PrepareRequest(
        save_id="f" * 32, ref=checkpoint_pb2.CheckpointRef(run="run", step=77), epoch=1
    )
    with pytest.raises(grpc.RpcError, match="unknown save") as refused:
        stub.Prepare(unknown, timeout=10)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(InvalidArgument, match="world size 2 on node node1; a rank joined"):
        cluster.clients[1].join_save(newer, "run", 3, 3)
    for client in cluster.clients:
        assert steps_listed(client) == set()


def test_a_part_damaged_on_its_node_is_read_from_s3_instead(
    make_cluster, s3_config: S3Config
) -> None:
    cluster = make_cluster(2, s3_config, *NO_REPLICAS)
    files = checkpoint_files(world_size=2, shard_bytes=600_000, seed=11)
    save(cluster, 4, files, 2)
    wait_until_every_node_sees_it_on_s3(cluster, 4)
    # Node 1's memory copy dies with a restart; then its SSD copy rots.
    cluster.kill(1)
    shard = cluster.data_dir(1) / "ssd" / "run" / "4" / "__1_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[1000] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    cluster.start(1)
    assert cluster.clients[0].read("run", 4, "__1_0.distcp") == files["__1_0.distcp"][2]


def _ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", "ckptd", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_peer_list_naming_the_node_itself_or_a_node_name_in_use_refuses_to_start(
    tmp_path: Path,
) -> None:
    own = f"127.0.0.1:{free_port()}"
    alias = f"localhost:{own.rsplit(':', 1)[1]}"
    for peers in (own, alias):  # its own address, and another name for it
        result = _ckptd(
            "--listen", own, "--data-dir", str(tmp_path / "a"), "--node", "a", "--peers", peers
        )
        assert result.returncode != 0
        assert (
            result.stderr.strip()
            .splitlines()[-1]
            .endswith(f"peer list names this node itself ({peers}); list the other nodes only")
        ), result.stderr
        assert "Traceback" not in result.stderr
    first = CkptdProcess(tmp_path / "b", extra_args=("--node", "twin"))
    try:
        result = _ckptd(
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path / "c"),
            "--node",
            "twin",
            "--peers",
            first.address,
        )
    finally:
        first.stop()
    assert result.returncode != 0
    assert "node name 'twin' is already used by the live ckptd at" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_frozen_participant_delays_the_commit_until_it_thaws(make_cluster) -> None:
    cluster = make_cluster(2)
    files = checkpoint_files(world_size=2, shard_bytes=20_000, seed=5)
    save_id = save(cluster, 2, files, 2, commit=False)
    proc = cluster.procs[1]
    assert proc is not None
    proc.process.send_signal(signal.SIGSTOP)
    try:
        thaw = threading.Timer(1.5, lambda: proc.process.send_signal(signal.SIGCONT))
        thaw.start()
        info = cluster.clients[0].commit(save_id)
        thaw.join()
    finally:
        proc.process.send_signal(signal.SIGCONT)
    assert info.committed
    wait_for(lambda: steps_listed(cluster.clients[1]) == {2}, what="node 1 to commit its part")
    assert cluster.clients[1].read("run", 2, "__1_0.distcp") == files["__1_0.distcp"][2]


def test_nodes_that_disagree_about_a_steps_world_size_commit_nothing(make_cluster) -> None:
    cluster = make_cluster(2)
    opened = cluster.clients[0].open_save("run", 12, 2)
    cluster.clients[0].join_save(opened, "run", 12, 2)
    cluster.clients[1].join_save(opened, "run", 12, 3)  # a rank told another world size
    files = checkpoint_files(world_size=2, shard_bytes=1000, seed=12)
    for path, (rank, kind, data) in files.items():
        cluster.clients[rank].write_file(opened.save_id, path, rank, kind, data)
    with pytest.raises(FailedPrecondition, match="node node1 was told world size 3, the coord"):
        cluster.clients[0].commit(opened.save_id)
    assert all(steps_listed(c) == set() for c in cluster.clients)


def test_peers_found_through_dns_leave_out_this_node_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckptd.cluster import Peers
    from ckptd.config import ClusterConfig

    def resolve(host: str, port: int, *args: object, **kwargs: object) -> list:
        assert host == "ckptd-peers.ns.svc.cluster.local"
        ips = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
        return [(2, 1, 6, "", (ip, port)) for ip in ips]

    monkeypatch.setattr("socket.getaddrinfo", resolve)
    config = ClusterConfig(
        node="b", peers_dns="ckptd-peers.ns.svc.cluster.local:50051", advertise="10.0.0.2:50051"
    )
    peers = Peers(config, "b")
    try:
        assert [p.address for p in peers.all()] == ["10.0.0.1:50051", "10.0.0.3:50051"]
    finally:
        peers.close()


def test_a_ckptd_whose_dns_name_resolves_to_itself_starts_as_a_node_of_one(
    tmp_path: Path,
) -> None:
    port = free_port()
    proc = CkptdProcess(
        tmp_path / "a",
        extra_args=("--listen", f"127.0.0.1:{port}", "--peers-dns", f"localhost:{port}"),
    )
    try:
        with CkptdClient(proc.address) as client:
            files = checkpoint_files(world_size=1, shard_bytes=1000, seed=1)
            opened = client.open_save("run", 1, 1)
            client.join_save(opened, "run", 1, 1)
            for path, (rank, kind, data) in files.items():
                client.write_file(opened.save_id, path, rank, kind, data)
            assert client.commit(opened.save_id).committed
    finally:
        proc.stop()
