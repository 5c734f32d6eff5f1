"""Retention: the pure rules, then a store on real disk and a real SeaweedFS applying them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from ckptd_testing import checkpoint_files, ref, store_save, store_write, tier_states, wait_for

from ckptd.config import S3Config
from ckptd.retention import MEMORY, S3, SSD, RetentionPolicy, droppable, wanted
from ckptd.store import CheckpointStore
from ckptd.tiers import CheckpointKey
from ckptd.tiers.s3 import S3Tier
from scaletrain.errors import InvalidArgument

OpenStore = Callable[..., CheckpointStore]


def test_each_tier_wants_its_newest_steps_and_s3_every_kth_step_plus_the_latest() -> None:
    wants = wanted(RetentionPolicy(2, 3, 10), list(range(1, 26)), on_s3=[], has_s3=True)
    assert {s for s, w in wants.items() if MEMORY in w} == {24, 25}
    assert {s for s, w in wants.items() if SSD in w} == {23, 24, 25}
    assert {s for s, w in wants.items() if S3 in w} == {10, 20, 25}
    assert not wants[7]


def test_s3_keeps_its_newest_copy_until_the_latest_checkpoint_has_reached_it() -> None:
    wants = wanted(RetentionPolicy(0, 1, 10), [10, 11, 12], on_s3=[10, 11], has_s3=True)
    assert S3 in wants[11] and S3 in wants[12] and S3 in wants[10]
    wants = wanted(RetentionPolicy(0, 1, 10), [10, 11, 12], on_s3=[10, 11, 12], has_s3=True)
    assert S3 not in wants[11]


def test_a_copy_leaves_a_tier_only_when_another_durable_tier_holds_it_or_nobody_wants_it() -> None:
    everywhere = {MEMORY: True, SSD: True, S3: True}
    assert droppable({S3}, {SSD: True, S3: False}) == []  # S3 wants it but lacks it: SSD stays
    assert droppable({S3}, {SSD: True, S3: True}) == [SSD]
    assert droppable({MEMORY}, everywhere) == [SSD]  # one durable copy always stays
    assert droppable({SSD}, {SSD: False, S3: True}) == []  # the only copy, even if unwanted there
    assert droppable(set(), everywhere) == [MEMORY, SSD, S3]


@pytest.mark.parametrize("policy", [(-1, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_a_policy_that_keeps_nothing_durable_is_refused(policy: tuple[int, int, int]) -> None:
    with pytest.raises(InvalidArgument, match="retention"):
        RetentionPolicy(*policy)


def steps_on(store: CheckpointStore, tier: str) -> set[int]:
    return {
        i.ref.step for i in store.member.checkpoints("run") if tier_states(i)[tier] == "COMMITTED"
    }


def test_retention_never_deletes_the_only_copy_while_s3_is_unreachable(
    open_store: OpenStore, dead_s3_config: S3Config, s3_config: S3Config
) -> None:
    policy = RetentionPolicy(memory_last=1, ssd_last=2, s3_every=1)
    store = open_store(s3=dead_s3_config, retention=policy)
    files = {step: checkpoint_files(1, 50_000, seed=step) for step in (1, 2, 3, 4)}
    for step, step_files in files.items():
        store_save(store, "run", step, step_files)
    wait_for(lambda: steps_on(store, "s3") == set() and all(
        tier_states(i)["s3"] == "FAILED" for i in store.member.checkpoints("run")
    ), what="every upload to fail")  # fmt: skip
    assert steps_on(store, "ssd") == {1, 2, 3, 4}  # beyond ssd_last: S3 has no copy yet
    assert steps_on(store, "memory") == {4}
    store.close()

    store = open_store(s3=s3_config, retention=policy)
    wait_for(lambda: steps_on(store, "s3") == {1, 2, 3, 4}, what="the uploads after the outage")
    wait_for(lambda: steps_on(store, "ssd") == {3, 4}, what="SSD to keep only its last two")
    for step, step_files in files.items():
        assert (
            store.reader.read_range(ref("run", step), "__0_0.distcp")
            == step_files["__0_0.distcp"][2]
        )


def test_retention_removes_everywhere_what_no_tier_wants_and_each_run_has_its_own_policy(
    open_store: OpenStore, s3_config: S3Config
) -> None:
    store = open_store(s3=s3_config)
    tight = RetentionPolicy(memory_last=1, ssd_last=2, s3_every=10)
    for step in (5, 10, 15, 20, 25):
        save_id = store.saves.open_save(ref("run", step), 1, retention=tight)
        for path, (rank, kind, data) in checkpoint_files(1, 10_000, seed=step).items():
            store_write(store, save_id, path, rank, kind, data)
        store.saves.commit(save_id)
        wait_for(lambda s=step: steps_on(store, "s3") >= {s}, what=f"step {step} on S3")
    for step in (5, 15):  # another run, with ckptd's default policy, keeps everything
        store_save(store, "other", step, checkpoint_files(1, 10_000, seed=step))
    assert store.wait_background(timeout_s=30)

    assert [i.ref.step for i in store.member.checkpoints("run")] == [10, 20, 25]
    assert steps_on(store, "s3") == {10, 20, 25}
    assert steps_on(store, "ssd") == {20, 25}
    assert steps_on(store, "memory") == {25}
    assert [i.ref.step for i in store.member.checkpoints("other")] == [5, 15]
    on_s3 = {key for key in S3Tier(s3_config).list() if key.run == "run"}
    assert on_s3 == {CheckpointKey("run", s) for s in (10, 20, 25)}
    shown = store.member.checkpoint(ref("run", 10)).retention
    assert (shown.memory_last, shown.ssd_last, shown.s3_every) == (1, 2, 10)
