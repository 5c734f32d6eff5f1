"""Memory-only checkpoints (`OpenSaveRequest.memory_only`, the trainer's --mem-ckpt-every): a
step kept in the memory of the node that received each part and of one peer, never on SSD or
S3, committed by the cluster protocol so that `latest` names it while every part is in a live
node's memory, and dropped once a newer durable step exists.

The retention rule is a pure function, tested first; the rest runs real ckptd processes on
loopback (`cluster_testing.Cluster`) with a real SeaweedFS as S3.
"""

from __future__ import annotations

from pathlib import Path

from ckptd_testing import checkpoint_files, ref, store_save, store_write, tier_states, wait_for
from cluster_testing import COMMITTED, Cluster, save, steps_listed

from ckptd.config import S3Config
from ckptd.retention import MEMORY_ONLY_LAST, RetentionPolicy, wanted
from scaletrain.v1 import checkpoint_pb2

MEMORY, SSD, S3 = 1, 2, 3
WORLD = 4


def test_retention_keeps_the_newest_memory_only_steps_past_the_newest_durable_one_and_no_more():
    policy = RetentionPolicy(memory_last=1, ssd_last=2, s3_every=10)
    durable, in_memory = [10, 20], [11, 12, 21, 22, 23]
    wants = wanted(policy, durable + in_memory, on_s3=[10], has_s3=True, memory_only=in_memory)
    assert MEMORY_ONLY_LAST == 2
    # The newest 2 memory-only steps newer than step 20, in memory only; older ones nowhere.
    assert {s: wants[s] for s in in_memory} == {11: set(), 12: set(), 21: set(),
                                                 22: {MEMORY}, 23: {MEMORY}}  # fmt: skip
    # The durable steps are kept as if the memory-only ones did not exist: memory_last=1 and
    # ssd_last=2 count durable steps, S3 gets the newest durable one.
    assert wants[20] == {MEMORY, SSD, S3} and wants[10] == {SSD, S3}
    # A newer durable step leaves no memory-only step wanted anywhere.
    newer = wanted(policy, [*durable, 30, *in_memory], [10], True, memory_only=in_memory)
    assert all(not newer[s] for s in in_memory)


def _tiers(info: checkpoint_pb2.CheckpointInfo) -> dict[int, int]:
    return {t.tier: t.state for t in info.tiers}


def _held_in_memory(cluster: Cluster, step: int) -> dict[str, list[tuple[str, bool]]]:
    """owner -> [(node, whether that copy is on its SSD)] for every committed copy of each part
    of `step`, as node 0 sees it."""
    info = next(c for c in cluster.clients[0].list("run", nodes=True) if c.ref.step == step)
    held: dict[str, list[tuple[str, bool]]] = {}
    for part in info.parts:
        if not part.files:
            continue
        copies = [(part.node, list(part.tiers))] + [(c.node, list(c.tiers)) for c in part.replicas]
        held[part.node] = sorted(
            (node, any(t.tier == SSD and t.state == COMMITTED for t in tiers))
            for node, tiers in copies
            if any(t.tier == MEMORY and t.state == COMMITTED for t in tiers)
        )
    return held


def _dirs_named(root: Path, step: int) -> list[Path]:
    return [p for p in root.rglob(str(step)) if p.is_dir()]


def test_a_memory_only_step_is_latest_in_two_nodes_memory_never_on_ssd_or_s3_and_gives_way(
    make_cluster, s3_config: S3Config
) -> None:
    cluster = make_cluster(2, s3_config)
    files = {step: checkpoint_files(world_size=WORLD, shard_bytes=200_000, seed=step)
             for step in (10, 11, 12, 13, 20, 21)}  # fmt: skip
    save(cluster, 10, files[10], WORLD)
    for step in (11, 12, 13):
        save(cluster, step, files[step], WORLD, memory_only=True)

    # `latest` names the newest memory-only step on every node, and it reads back whole.
    for client in cluster.clients:
        latest = client.get("run")
        assert (latest.ref.step, latest.memory_only) == (13, True)
        for path, (_, _, data) in files[13].items():
            assert client.read("run", 13, path) == data, path
    # Each part in its own node's memory and in one peer's, on neither's SSD.
    both = [("node0", False), ("node1", False)]
    wait_for(lambda: _held_in_memory(cluster, 13) == {"node0": both, "node1": both},
             timeout_s=30, what="each part of step 13 in both nodes' memory")  # fmt: skip
    for i, client in enumerate(cluster.clients):
        info = client.get("run", 13)
        assert _tiers(info)[SSD] != COMMITTED and _tiers(info)[S3] != COMMITTED, i
        assert not _dirs_named(cluster.data_dir(i), 13), "a memory-only step reached the disk"
    # Two copies on distinct nodes make it safe against a node's loss, but the step SSD keeps
    # for such a loss (the run's newest node-loss-safe one) stays the durable step 10.
    shown = cluster.clients[0].get("run")
    assert shown.node_loss_safe
    wait_for(
        lambda: all(p.latest_safe_step == 10 for p in cluster.clients[0].get("run").parts),
        timeout_s=20,
        what="every node to know step 10 as its newest safe durable step",
    )
    # Retention: only the newest two memory-only steps; the durable step stays on all tiers.
    wait_for(lambda: all(steps_listed(c) == {10, 12, 13} for c in cluster.clients),
             timeout_s=20, what="step 11 dropped")  # fmt: skip
    wait_for(lambda: _tiers(cluster.clients[0].get("run", 10))[S3] == COMMITTED, timeout_s=30,
             what="step 10 on S3")  # fmt: skip

    # A newer durable step makes them go, everywhere.
    save(cluster, 20, files[20], WORLD)
    wait_for(lambda: all(steps_listed(c) == {10, 20} for c in cluster.clients),
             timeout_s=20, what="the memory-only steps dropped for step 20")  # fmt: skip

    # A restart of one holder loses its memory; the peer's copy keeps the step restorable.
    save(cluster, 21, files[21], WORLD, memory_only=True)
    wait_for(lambda: _held_in_memory(cluster, 21) == {"node0": both, "node1": both},
             timeout_s=30, what="each part of step 21 in both nodes' memory")  # fmt: skip
    cluster.kill(1)
    cluster.start(1)
    wait_for(lambda: steps_listed(cluster.clients[1]) == {10, 20, 21}, what="node 1 back")
    assert [c.get("run").ref.step for c in cluster.clients] == [21, 21]
    for path, (_, _, data) in files[21].items():
        assert cluster.clients[1].read("run", 21, path) == data, path
    # Both restarted: no memory holds it, and `latest` falls back to the newest durable step.
    cluster.kill(0)
    cluster.kill(1)
    cluster.start(0)
    cluster.start(1)
    wait_for(lambda: all(steps_listed(c) is not None for c in cluster.clients), what="both up")
    assert [c.get("run").ref.step for c in cluster.clients] == [20, 20]
    latest = cluster.clients[0].get("run")
    assert not latest.memory_only and _tiers(latest)[SSD] == COMMITTED


def test_a_full_memory_budget_evicts_a_memory_only_step_before_any_durable_copy(open_store):
    mib = 1 << 20
    store = open_store(memory_budget_bytes=5 * mib)
    files = {step: checkpoint_files(world_size=2, shard_bytes=mib, seed=step) for step in (1, 2, 3)}
    store_save(store, "run", 1, files[1])
    ranks = {rank for rank, _, _ in files[2].values()}
    save_id = store.saves.open_save(ref("run", 2), len(ranks), memory_only=True)
    for path, (rank, kind, data) in files[2].items():
        store_write(store, save_id, path, rank, kind, data)
    store.saves.commit(save_id)
    assert tier_states(store.member.checkpoint(ref("run", 2)))["memory"] == "COMMITTED"

    # Step 3 needs room: the memory-only step 2 leaves memory, step 1's durable copy stays.
    store_save(store, "run", 3, files[3])
    assert tier_states(store.member.checkpoint(ref("run", 1)))["memory"] == "COMMITTED"
    assert tier_states(store.member.checkpoint(ref("run", 3)))["memory"] == "COMMITTED"
    listed = {c.ref.step for c in store.member.checkpoints("run")}
    assert listed == {1, 3}  # and step 3 is newer and durable
