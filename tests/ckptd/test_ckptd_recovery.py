"""Restart and outage: a lost catalog is rebuilt from the tiers; an S3 outage ends in uploads."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from ckptd_testing import (
    FAST_RETRIES,
    checkpoint_files,
    ref,
    store_save,
    tier_states,
    wait_for,
)

from ckptd.catalog import CATALOG_FILE
from ckptd.config import S3Config
from ckptd.manifest import data_crc32c
from ckptd.retention import RetentionPolicy
from ckptd.store import CheckpointStore
from scaletrain.app.seaweed import SeaweedS3
from scaletrain.errors import UserError

OpenStore = Callable[..., CheckpointStore]


def test_a_lost_catalog_is_rebuilt_from_the_ssd_and_s3_markers(
    open_store: OpenStore, s3_config: S3Config, tmp_path: Path
) -> None:
    policy = RetentionPolicy(memory_last=0, ssd_last=1, s3_every=1)
    store = open_store(s3=s3_config, retention=policy)
    files = {step: checkpoint_files(2, 300_000, seed=step) for step in (1, 2, 3)}
    for step, step_files in files.items():
        store_save(store, "run", step, step_files)
    wait_for(
        lambda: (
            all(tier_states(i)["s3"] == "COMMITTED" for i in store.member.checkpoints("run"))
            and len(store.member.checkpoints("run")) == 3
        ),
        what="every step on S3",
    )
    assert store.wait_background(timeout_s=30)
    store.close()
    for name in (CATALOG_FILE, f"{CATALOG_FILE}-wal", f"{CATALOG_FILE}-shm"):
        (tmp_path / "ckptd" / name).unlink(missing_ok=True)

    store = open_store(s3=s3_config, retention=policy)
    assert 3 in {i.ref.step for i in store.member.checkpoints("run")}  # from SSD, before S3 answers
    wait_for(
        lambda: (
            [tier_states(i)["s3"] for i in store.member.checkpoints("run")] == ["COMMITTED"] * 3
        ),
        what="S3's markers to be recovered",
    )
    states = {i.ref.step: tier_states(i) for i in store.member.checkpoints("run")}
    assert states[3]["ssd"] == "COMMITTED" and states[1]["ssd"] == "ABSENT"
    for step, step_files in files.items():
        for path, (_, _, data) in step_files.items():
            assert store.reader.read_range(ref("run", step), path) == data
    info = store.member.checkpoint(ref("run", 1))
    assert info.world_size == 2 and {f.path for f in info.files} == set(files[1])


def test_uploads_complete_after_s3_is_stopped_for_a_while_and_started_again(
    open_store: OpenStore, tmp_path: Path
) -> None:
    with SeaweedS3(tmp_path / "weed") as weed:
        config = S3Config(**{**vars(weed.s3_config("outage")), **FAST_RETRIES})
        store = open_store(s3=config)
        store_save(store, "run", 10, checkpoint_files(1, 100_000, seed=10))
        wait_for(
            lambda: tier_states(store.member.checkpoint(ref("run", 10)))["s3"] == "COMMITTED",
            what="S3",
        )

        weed.stop(timeout_s=1)  # S3 goes away (killed if it does not stop at once)
        files = checkpoint_files(2, 2 << 20, seed=20)
        info = store_save(store, "run", 20, files)  # commits on SSD while S3 is away
        assert tier_states(info)["ssd"] == "COMMITTED"
        wait_for(
            lambda: tier_states(store.member.checkpoint(ref("run", 20)))["s3"] == "FAILED",
            what="the failed upload to show",
        )
        assert store.reader.read_range(ref("run", 20), ".metadata") == files[".metadata"][2]

        weed.start()
        wait_for(
            lambda: tier_states(store.member.checkpoint(ref("run", 20)))["s3"] == "COMMITTED",
            timeout_s=60,
            what="the upload to complete once S3 is back",
        )
        store.ssd.delete(store.ssd.list()[-1])  # lose the SSD copy: S3 must serve it now
        for path, (_, _, data) in files.items():
            assert store.reader.read_range(ref("run", 20), path) == data


def test_a_catalog_of_schema_5_gains_the_memory_only_column_and_keeps_its_checkpoints(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store()
    store_save(store, "run", 4, checkpoint_files(2, 300_000, seed=4))
    store.close()
    db = sqlite3.connect(tmp_path / "ckptd" / CATALOG_FILE, isolation_level=None)
    try:  # the catalog as ckptd wrote it before memory-only checkpoints
        db.execute("ALTER TABLE checkpoints DROP COLUMN memory_only")
        db.execute("PRAGMA user_version = 5")
    finally:
        db.close()
    (info,) = open_store().member.checkpoints("run")
    assert info.ref.step == 4 and not info.memory_only
    assert tier_states(info)["ssd"] == "COMMITTED"


def test_a_catalog_of_another_schema_is_refused_in_one_line_and_rebuilt_once_moved_away(
    open_store: OpenStore, tmp_path: Path
) -> None:
    files = checkpoint_files(2, 300_000, seed=4)
    store = open_store()
    store_save(store, "run", 4, files)
    store.close()
    catalog = tmp_path / "ckptd" / CATALOG_FILE
    db = sqlite3.connect(catalog, isolation_level=None)
    try:
        db.execute("PRAGMA user_version = 4")
    finally:
        db.close()
    with pytest.raises(UserError, match=r"has catalog schema 4; this ckptd knows 6 \(move"):
        open_store()

    for name in (CATALOG_FILE, f"{CATALOG_FILE}-wal", f"{CATALOG_FILE}-shm"):
        (tmp_path / "ckptd" / name).unlink(missing_ok=True)
    store = open_store()  # rebuilds the catalog from the markers
    (info,) = store.member.checkpoints("run")
    assert tier_states(info)["ssd"] == "COMMITTED"
    assert {f.path: f.crc32c for f in info.files} == {
        path: data_crc32c(data) for path, (_, _, data) in files.items()
    }
    for path, (_, _, data) in files.items():
        assert store.reader.read_range(ref("run", 4), path) == data
