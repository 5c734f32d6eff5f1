"""Peer replicas: each node's part of a checkpoint copied to R-1 other nodes, so that a lost node
is recovered from its peers' copies, with no S3 read, and a damaged copy falls through to the next.

The placement and R rules are pure functions, tested first; the rest runs real ckptd processes on
loopback (`cluster_testing.Cluster`) with a real SeaweedFS where S3 is involved, and counts S3
reads with ckptd's own metrics (`ckptd_tier_bytes_total{tier="S3",op="read"}`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from ckptd_testing import ROOT, checkpoint_files, wait_for
from cluster_testing import (
    COMMITTED,
    Cluster,
    Files,
    cluster_stub,
    save,
    steps_listed,
    wait_until_every_node_sees_it_on_s3,
)

from ckptd.config import S3Config
from ckptd.manifest import FileRecord, Manifest
from ckptd.metrics import Metrics
from ckptd.replicas import (
    Throttle,
    copies_for_safety,
    copy_part,
    effective_replicas,
    placement,
)
from ckptd.retention import RetentionPolicy, wanted
from ckptd.tiers import BLOCK_BYTES, CheckpointKey, block_crcs_of
from ckptd.tiers.memory import MemoryBudget, MemoryFile
from ckptd.tiers.ssd import SsdTier
from scaletrain.errors import InvalidArgument, ScaletrainError
from scaletrain.v1 import checkpoint_pb2

FAILED = checkpoint_pb2.TIER_STATE_FAILED
MEMORY, SSD, S3 = 1, 2, 3

# -- placement and R, without a network ----------------------------------------------------------


def test_copies_go_to_distinct_nodes_after_the_owner_on_a_ring_and_spread_over_owners():
    nodes = {f"n{i}": "" for i in range(4)}
    assert placement("n1", nodes, 2) == ["n1", "n2"]
    assert placement("n3", nodes, 3) == ["n3", "n0", "n1"]
    holders = [placement(owner, nodes, 2)[1] for owner in sorted(nodes)]
    assert sorted(holders) == sorted(nodes)  # each node holds one other node's part


def test_copies_prefer_failure_domains_the_part_is_not_in_yet():
    zones = {"a1": "a", "a2": "a", "b1": "b", "b2": "b", "c1": "c"}
    assert placement("a1", zones, 2) == ["a1", "b1"]
    assert placement("a1", zones, 3) == ["a1", "b1", "c1"]
    assert placement("a1", zones, 4) == ["a1", "b1", "c1", "a2"]


def test_a_lost_owners_part_is_held_by_the_live_nodes_that_follow_it():
    live = {"n0": "", "n2": "", "n3": ""}  # n1 is gone
    assert placement("n1", live, 2) == ["n2", "n3"]


def test_r_is_capped_by_default_and_refused_when_asked_beyond_the_nodes():
    assert effective_replicas(0, 2, 1) == 1  # one node: no replicas, no error
    assert effective_replicas(0, 2, 4) == 2
    assert effective_replicas(3, 2, 4) == 3
    with pytest.raises(InvalidArgument, match="replicas 3 is more than the 2 node"):
        effective_replicas(3, 2, 2)


def test_a_step_is_node_loss_safe_only_once_every_part_has_its_r_copies_and_at_least_two():
    assert [copies_for_safety(r) for r in (1, 2, 3, 4)] == [2, 2, 3, 4]


def test_a_copy_counts_in_memory_once_every_block_checks_then_on_ssd_once_durable(
    tmp_path: Path,
) -> None:
    data = os.urandom(3 * BLOCK_BYTES + 7)
    crcs = b"".join(c.to_bytes(4, "little") for c in block_crcs_of(data))
    record = FileRecord("__1_0.distcp", 1, checkpoint_pb2.FILE_KIND_SHARD, len(data), crcs, "n1")
    manifest = Manifest(CheckpointKey("run", 1), 2, (record,))
    ssd, budget = SsdTier(tmp_path), MemoryBudget(1 << 30)

    def copy(sent: bytes) -> list[tuple[bool, bytes]]:
        seen: list[tuple[bool, bytes]] = []

        def held(memory: dict[str, MemoryFile], total: int) -> bool:
            seen.append((ssd.has(manifest.key), memory[record.path].read(0, total)))
            return True

        def stream(_record: FileRecord, sink: Callable[[int, bytes], None]) -> None:
            for offset in range(0, len(sent), 2 * BLOCK_BYTES):
                sink(offset, sent[offset : offset + 2 * BLOCK_BYTES])

        copy_part(manifest, [record], ssd, budget, True, stream, Throttle(0),
                  threading.Event(), Metrics(), held)  # fmt: skip
        return seen

    assert copy(data) == [(False, data)]  # all in memory, checked, before the SSD copy counts
    assert ssd.has(manifest.key) and ssd.read_range(manifest.key, record.path, 0, len(data)) == data

    ssd.delete(manifest.key)
    damaged = bytearray(data)
    damaged[BLOCK_BYTES + 3] ^= 1
    with pytest.raises(InvalidArgument, match=f"block at offset {BLOCK_BYTES}"):
        copy(bytes(damaged))  # never counted anywhere
    assert not ssd.has(manifest.key) and not ssd.staged_saves()


def test_ssd_keeps_the_newest_node_loss_safe_step_whatever_its_age():
    policy = RetentionPolicy(memory_last=1, ssd_last=2, s3_every=100)
    wants = wanted(policy, [10, 20, 30, 40], on_s3=[], has_s3=False, keep=10)
    assert {s for s, tiers in wants.items() if SSD in tiers} == {10, 30, 40}


# -- real processes ------------------------------------------------------------------------------


def ckpt(*args: str) -> str:
    """What `scaletrain ckpt ARGS` prints, after checking that it succeeded."""
    result = subprocess.run(
        [sys.executable, "-m", "scaletrain", "ckpt", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def metric(cluster: Cluster, i: int, series: str) -> float:
    """A series of node i's ckptd's Prometheus metrics (0 when it has none yet)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics[i]}/metrics").read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(series + " "):
            total += float(line.split()[-1])
    return total


def s3_reads(cluster: Cluster, i: int) -> float:
    """Bytes node i's ckptd has read from S3."""
    return metric(cluster, i, 'ckptd_tier_bytes_total{op="read",tier="S3"}')


def copies(cluster: Cluster, i: int, step: int) -> tuple[bool, dict[str, list[str]]]:
    """(node-loss safe?, owner -> the nodes holding a committed copy of its part) as node i
    sees step `step`."""
    info = next(c for c in cluster.clients[i].list("run", nodes=True) if c.ref.step == step)
    held = {}
    for part in info.parts:
        if not part.files:
            continue
        own = [part.node] if any(t.state == COMMITTED for t in part.tiers if t.tier != 3) else []
        held[part.node] = sorted(
            own + [c.node for c in part.replicas if any(t.state == COMMITTED for t in c.tiers)]
        )
    return info.node_loss_safe, held


def parts(cluster: Cluster, i: int, step: int) -> list[checkpoint_pb2.NodePart]:
    """Every node's part of `step` as node i sees it."""
    return list(
        next(c for c in cluster.clients[i].list("run", nodes=True) if c.ref.step == step).parts
    )


def wait_until_safe(
    cluster: Cluster, step: int, r: int = 2, i: int = 0, exactly: bool = False
) -> dict[str, list[str]]:
    """Wait until node i sees every part of `step` on `r` nodes (so node-loss safe); with
    `exactly`, on no more than `r` either (a surplus copy is dropped at a later sync)."""

    def done() -> bool:
        safe, held = copies(cluster, i, step)
        return safe and all(
            len(holders) == r if exactly else len(holders) >= r for holders in held.values()
        )

    wait_for(done, timeout_s=30, what=f"step {step} on {r} nodes each part")
    return copies(cluster, i, step)[1]


@pytest.mark.parametrize(("nodes", "r"), [(2, 2), (4, 3)])
def test_after_a_save_every_part_is_on_r_distinct_nodes_and_the_step_is_node_loss_safe(
    nodes: int, r: int, make_cluster
) -> None:
    cluster = make_cluster(nodes, None, "--replicas", str(r))
    world = 4
    files = checkpoint_files(world_size=world, shard_bytes=300_000, seed=nodes)
    save(cluster, 10, files, world)
    held = wait_until_safe(cluster, 10, r, exactly=True)
    assert sorted(held) == [f"node{i}" for i in range(nodes)]
    for owner, holders in held.items():
        assert len(holders) == r and owner in holders, (owner, holders)
    # Every node says the same (once its next sync has seen a surplus copy dropped), and
    # `latest` can ask for the newest node-loss-safe step.
    for i in range(nodes):
        wait_for(lambda i=i: copies(cluster, i, 10) == (True, held), timeout_s=10, what=f"node {i}")
        assert cluster.clients[i].get("run", node_loss_safe=True).ref.step == 10

    if nodes > r:  # a copy beyond R (offered by hand here) is dropped once R copies are held
        spare = next(i for i in range(nodes) if f"node{i}" not in held["node0"])
        offer = checkpoint_pb2.OfferReplicaRequest(
            ref=checkpoint_pb2.CheckpointRef(run="run", step=10), owner="node0", sender="test"
        )
        assert cluster_stub(cluster.addresses[spare]).OfferReplica(offer, timeout=10).queued
        log = cluster.procs[spare].log
        wait_for(lambda: "dropped the replica of node0's part of run/10" in log.read_text(),
                 timeout_s=20, what="the surplus copy dropped")  # fmt: skip
        wait_for(lambda: copies(cluster, 0, 10) == (True, held), timeout_s=10, what="R copies")

    if nodes == 2:  # what the command line shows of it
        listed = ckpt("ls", "--ckptd", cluster.addresses[1])
        assert listed.splitlines()[1].split()[3] == "yes", listed  # the `safe` column
        shown = json.loads(
            ckpt("show", "run", "--node-loss-safe", "--ckptd", cluster.addresses[0], "--json")
        )
        assert (shown["step"], shown["node_loss_safe"]) == (10, True)
        assert shown["copies"] == held

    # Bad input: R beyond the nodes at OpenSave; a replica of a step the receiver never saw.
    with pytest.raises(InvalidArgument, match=rf"replicas {nodes + 1} is more than the {nodes}"):
        cluster.clients[0].open_save("run", 20, world, replicas=nodes + 1)
    offer = checkpoint_pb2.OfferReplicaRequest(
        ref=checkpoint_pb2.CheckpointRef(run="run", step=999), owner="node0", sender="test"
    )
    with pytest.raises(grpc.RpcError) as refused:
        cluster_stub(cluster.addresses[1]).OfferReplica(offer, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not know run/999 as committed" in refused.value.details()


def test_a_lost_node_is_replaced_and_restores_its_part_from_its_peer_with_no_s3_read(
    make_cluster, s3_config: S3Config
) -> None:
    cluster = make_cluster(2, s3_config, metrics=True)
    files = checkpoint_files(world_size=4, shard_bytes=400_000, seed=5)
    save(cluster, 10, files, 4)
    wait_until_safe(cluster, 10)
    wait_until_every_node_sees_it_on_s3(cluster, 10)  # S3 has it too: reading it is a choice

    cluster.kill(1)
    shutil.rmtree(cluster.data_dir(1))  # a replaced machine: empty data dir, same name
    cluster.start(1)
    wait_for(lambda: steps_listed(cluster.clients[1]) == {10}, what="the new node to learn step 10")
    assert cluster.clients[1].get("run").ref.step == 10
    for path, (_, _, data) in files.items():
        assert cluster.clients[1].read("run", 10, path) == data, path
    # Its own part comes back to its own SSD from node 0's copy, in the background: R again.
    wait_for(lambda: copies(cluster, 1, 10) == (True, {"node0": ["node0", "node1"],
                                                      "node1": ["node0", "node1"]}),
             timeout_s=30, what="node 1 to hold its part again")  # fmt: skip
    assert [s3_reads(cluster, i) for i in range(2)] == [0.0, 0.0]


def test_an_old_steps_ssd_copy_goes_once_every_node_learns_a_newer_step_is_node_loss_safe(
    make_cluster, s3_config: S3Config
) -> None:
    # SSD keeps the newest node-loss-safe step whatever its age, as each node last learned it
    # from its peers. Once a newer step is safe, the older one's SSD copy must go at once, not
    # at the run's next commit, which never comes once the run has ended. And the run's policy,
    # given at OpenSave to node 0, is node 1's too.
    cluster = make_cluster(2, s3_config)
    files = checkpoint_files(world_size=4, shard_bytes=100_000, seed=6)
    policy = checkpoint_pb2.RetentionPolicy(memory_last=1, ssd_last=1, s3_every=1)
    for step in (10, 20):
        save(cluster, step, files, 4, retention=policy)
        wait_until_safe(cluster, step)
        wait_until_every_node_sees_it_on_s3(cluster, step)

    wait_for(lambda: [p.latest_safe_step for p in parts(cluster, 0, 20)] == [20, 20],
             timeout_s=30, what="every node to learn that step 20 is node-loss safe")  # fmt: skip

    def held(step: int) -> list[list[int]]:
        return [
            sorted(t.tier for t in p.tiers if t.state == COMMITTED) for p in parts(cluster, 0, step)
        ]

    assert held(10) == [[S3], [S3]]
    assert held(20) == [[MEMORY, SSD, S3], [MEMORY, SSD, S3]]


def damage(path: Path, offset: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_replica_falls_through_to_the_next_copy_then_to_s3(
    make_cluster, s3_config: S3Config
) -> None:
    # No memory tier: every copy is on SSD, where a test can damage it.
    cluster = make_cluster(3, s3_config, "--replicas", "3", "--memory-budget-mb", "0", metrics=True)
    files = checkpoint_files(world_size=3, shard_bytes=500_000, seed=9)
    save(cluster, 10, files, 3)
    held = wait_until_safe(cluster, 10, 3)
    assert held["node1"] == ["node0", "node1", "node2"]
    wait_until_every_node_sees_it_on_s3(cluster, 10)
    shard, data = "__1_0.distcp", files["__1_0.distcp"][2]
    cluster.kill(1)  # node 1's part now lives on in its copies on nodes 0 and 2, and on S3

    damage(cluster.data_dir(0) / "replicas" / "node1" / "run" / "10" / shard)
    assert cluster.clients[0].read("run", 10, shard) == data  # from node 2's copy
    assert s3_reads(cluster, 0) == 0.0
    # Node 0 found its copy damaged (and marked it FAILED: that state is not asserted here, as
    # the copy made again in the background may already have replaced it).
    assert metric(cluster, 0, 'ckptd_failures_total{op="verify",tier="SSD"}') == 1

    # Node 0 makes its copy again from node 2's, in the background; then every copy rots.
    wait_for(lambda: "node0" in copies(cluster, 0, 10)[1]["node1"], what="node 0's copy again")
    for holder in (0, 2):
        damage(cluster.data_dir(holder) / "replicas" / "node1" / "run" / "10" / shard)
    assert cluster.clients[0].read("run", 10, shard) == data  # every copy bad: from S3
    assert s3_reads(cluster, 0) > 0


def test_a_node_without_a_copy_sends_the_reader_to_a_peers_data_socket_and_takes_over_if_it_fails(
    make_cluster,
) -> None:
    # R = 2 over 3 nodes: node 1's part is on nodes 1 and 2, none on node 0. A trainer on node 0
    # reads it straight from node 1's data socket (one hop, not relayed through node 0); when
    # node 1's copy is damaged, node 0 takes the read over and serves it from node 2's copy.
    cluster = make_cluster(3, None, "--replicas", "2", "--memory-budget-mb", "0", metrics=True)
    files = checkpoint_files(world_size=3, shard_bytes=600_000, seed=12)
    save(cluster, 10, files, 3)
    assert wait_until_safe(cluster, 10, 2, exactly=True)["node1"] == ["node1", "node2"]
    shard, data = "__1_0.distcp", files["__1_0.distcp"][2]
    relayed_before = metric(cluster, 0, 'ckptd_tier_bytes_total{op="read",tier="peer"}')

    reader = cluster.clients[0]
    assert reader.read("run", 10, shard) == data
    assert b"".join(reader.read_stream("run", 10, shard, 1000, 50_000)) == data[1000:51_000]
    assert dict(reader.served) == {"SSD@node1": len(data) + 50_000}
    # Not one of those bytes went through node 0.
    relayed = metric(cluster, 0, 'ckptd_tier_bytes_total{op="read",tier="peer"}')
    assert relayed == relayed_before

    damage(cluster.data_dir(1) / "ssd" / "run" / "10" / shard)
    reader.served.clear()
    assert reader.read("run", 10, shard) == data
    assert b"".join(reader.read_stream("run", 10, shard)) == data
    assert reader.served["SSD@node2"] == 2 * len(data)
    assert reader.fast_path


def test_a_copy_cut_off_by_its_source_is_retried_and_the_step_is_safe_only_once_it_lands(
    make_cluster,
) -> None:
    # Copies at 1 MB/s: a 3 MB part takes seconds, so its source can die in the middle.
    cluster = make_cluster(2, None, "--replica-mb-s", "1")
    files: Files = checkpoint_files(world_size=2, shard_bytes=3_000_000, seed=3)
    save(cluster, 10, files, 2)
    wait_for(
        lambda: any((cluster.data_dir(0) / "replicas" / "node1").glob(".incoming/*")),
        what="node 0 to start copying node 1's part",
    )
    cluster.kill(1)
    assert copies(cluster, 0, 10)[0] is False
    cluster.start(1)
    held = wait_until_safe(cluster, 10)
    assert held == {"node0": ["node0", "node1"], "node1": ["node0", "node1"]}
    assert cluster.clients[0].read("run", 10, "__1_0.distcp") == files["__1_0.distcp"][2]


def test_the_replica_rate_set_while_ckptd_runs_slows_the_next_copies_until_it_is_put_back(
    make_cluster,
) -> None:
    # Started without a limit; at 0.25 MB/s a 2 MB part takes seconds to reach its peer.
    cluster = make_cluster(2, None, "--replica-mb-s", "0")
    slow = 0.25 * (1 << 20)
    assert [c.set_replica_rate(slow) for c in cluster.clients] == [0.0, 0.0]
    save(cluster, 10, checkpoint_files(world_size=2, shard_bytes=2_000_000, seed=5), 2)
    time.sleep(2.0)
    assert copies(cluster, 0, 10)[0] is False, "a 2 MB part copied at 0.25 MB/s within 2 s"
    assert [c.set_replica_rate(0) for c in cluster.clients] == [slow, slow]
    wait_until_safe(cluster, 10)
    with pytest.raises(InvalidArgument, match="replica rate must be >= 0 bytes/s"):
        cluster.clients[0].set_replica_rate(-1)
    assert cluster.clients[0].set_replica_rate(0) == 0.0  # the bad call changed nothing


def test_a_node_lost_before_its_part_is_copied_leaves_the_step_unsafe_and_the_older_safe_one_whole(
    make_cluster,
) -> None:
    # Copies at 0.25 MB/s: step 10's small parts are copied at once, step 20's 2 MB parts take
    # seconds, so node 1 dies (its disk with it) after its vote and before its part of step 20
    # reaches node 0. SSD keeps one step by the policy: only the "newest node-loss-safe step"
    # rule keeps step 10 there, even across a restart of the node that survived.
    cluster = make_cluster(2, None, "--replicas", "2", "--replica-mb-s", "0.25")
    policy = checkpoint_pb2.RetentionPolicy(memory_last=1, ssd_last=1, s3_every=1)
    small = checkpoint_files(world_size=2, shard_bytes=20_000, seed=21)
    save(cluster, 10, small, 2, retention=policy)
    wait_until_safe(cluster, 10)
    wait_for(lambda: [p.latest_safe_step for p in parts(cluster, 0, 10)] == [10, 10],
             what="every node to learn that step 10 is node-loss safe")  # fmt: skip

    reported: list[int] = []  # every step any node called node-loss safe meanwhile
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            for client in cluster.clients:  # once node 1 is gone, no step is safe: NotFound
                with contextlib.suppress(ScaletrainError):
                    listed = client.list("run", nodes=True)
                    reported.extend(c.ref.step for c in listed if c.node_loss_safe)
                with contextlib.suppress(ScaletrainError):
                    reported.append(client.get("run", node_loss_safe=True).ref.step)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_for(lambda: 10 in reported, what="the watch to see step 10 node-loss safe")
    save(cluster, 20, checkpoint_files(world_size=2, shard_bytes=2_000_000, seed=22), 2)
    wait_for(
        lambda: any((cluster.data_dir(0) / "replicas" / "node1").glob(".incoming/*")),
        what="node 0 to start copying node 1's part of step 20",
    )
    cluster.kill(1)
    shutil.rmtree(cluster.data_dir(1))  # lost with its disk: its part of step 20 is nowhere

    def restorable_is_step_10() -> None:
        client = cluster.clients[0]
        assert client.get("run").ref.step == 10  # never step 20, which nothing can restore
        assert {c.ref.step for c in client.list("run")} == {10, 20}
        for path, (_, _, data) in small.items():
            assert client.read("run", 10, path) == data, path

    restorable_is_step_10()
    stop.set()
    watcher.join()
    assert 20 not in reported, sorted(set(reported))
    cluster.kill(0)  # a restart of the node that survived forgets nothing it must keep
    cluster.start(0)
    time.sleep(2.0)  # a few syncs with the peer that is gone
    restorable_is_step_10()


def test_a_node_lost_for_good_gets_its_copies_remade_on_the_rest_and_saves_go_on_without_it(
    make_cluster,
) -> None:
    cluster = make_cluster(3, None, "--replicas", "2")
    files = checkpoint_files(world_size=3, shard_bytes=200_000, seed=31)
    save(cluster, 10, files, 3)  # rank i on node i
    assert any(
        "node1" in holders for holders in wait_until_safe(cluster, 10, exactly=True).values()
    )
    cluster.kill(1)
    shutil.rmtree(cluster.data_dir(1))  # lost for good, with its disk

    # Every part that had a copy on node 1 gets one on a node that remains: R = 2 again.
    rest = ["node0", "node2"]
    remade = (True, dict.fromkeys(["node0", "node1", "node2"], rest))
    for i in (0, 2):
        wait_for(lambda i=i: copies(cluster, i, 10) == remade, timeout_s=30,
                 what=f"node {i} to see every part of step 10 on nodes 0 and 2")  # fmt: skip

    # The job re-formed on nodes 0 and 2 saves without waiting for node 1, which is known down.
    opened = cluster.clients[0].open_save("run", 20, 2)
    reformed = checkpoint_files(world_size=2, shard_bytes=100_000, seed=32)
    for path, (rank, kind, data) in reformed.items():
        client = cluster.clients[2 * rank]
        client.join_save(opened, "run", 20, 2)
        client.write_file(opened.save_id, path, rank, kind, data)
    started = time.monotonic()
    assert cluster.clients[0].commit(opened.save_id).committed
    assert time.monotonic() - started < 1.5  # the connect timeout, which each phase waited out
    assert wait_until_safe(cluster, 20, exactly=True) == dict.fromkeys(rest, rest)

    # Node 2 lost too: one live node of the 3, R = 2. A save still commits, said to be below R,
    # and becomes node-loss safe once a replacement for node 1 joins, as do the older steps.
    cluster.kill(2)
    wait_for(lambda: not next(p for p in parts(cluster, 0, 20) if p.node == "node2").reachable,
             what="node 0 to see node 2 down")  # fmt: skip
    opened = cluster.clients[0].open_save("run", 30, 1)
    for path, (rank, kind, data) in checkpoint_files(world_size=1, shard_bytes=50_000).items():
        cluster.clients[0].write_file(opened.save_id, path, rank, kind, data)
    assert cluster.clients[0].commit(opened.save_id).committed
    log = cluster.procs[0].log
    below_r = "run/30 is below R: its run asks for 2 copies of each part, and 1 node(s) are live"
    wait_for(lambda: f"{below_r} (down: node1, node2)" in log.read_text(), what="a warning")
    assert copies(cluster, 0, 30) == (False, {"node0": ["node0"]})
    cluster.start(1)  # a replacement: an empty machine under the lost node's name
    for step in (10, 20, 30):
        wait_until_safe(cluster, step)
    assert cluster.clients[0].get("run", node_loss_safe=True).ref.step == 30
