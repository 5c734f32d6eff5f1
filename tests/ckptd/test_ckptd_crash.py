"""A real ckptd SIGKILLed at every step of the commit protocol never exposes a partial checkpoint.

Each case saves step 10 completely (memory, SSD, S3), then starts ckptd as its own process with
CKPTD_CRASH_AT naming one protocol phase, drives a save of step 20 (or the removal of step 10)
through it over gRPC until ckptd kills itself there, and checks what a reader sees right after
the crash (the catalog on disk and the markers on S3), and again after a restart: every visible
checkpoint is whole and reads back bit-exact, "latest" names a visible one, and the restart
finishes what the dead process left (the SSD commit stays or goes as a whole, the S3 upload or
removal completes, no multipart upload is left behind).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from ckptd_testing import (
    CkptdProcess,
    checkpoint_files,
    payload,
    ref,
    store_save,
    tier_states,
    wait_for,
)

from ckptd.client import CkptdClient
from ckptd.config import S3Config
from ckptd.crash import PHASES
from ckptd.datadir import list_offline
from ckptd.manifest import MARKER
from ckptd.store import CheckpointStore
from ckptd.tiers import CheckpointKey
from ckptd.tiers.s3 import S3Tier, make_s3_client
from scaletrain.errors import ScaletrainError

OpenStore = Callable[..., CheckpointStore]
Files = dict[str, tuple[int, int, bytes]]

# Steps a reader may see right after ckptd died at each phase, and once it has restarted.
EXPECTED = {
    "file-staged": ({10}, {10}),
    "ssd-before-rename": ({10}, {10}),
    "ssd-after-rename": ({10}, {10, 20}),  # the marker is in place: a restart trusts it
    "ssd-committed": ({10, 20}, {10, 20}),
    "s3-part-uploaded": ({10, 20}, {10, 20}),
    "s3-files-uploaded": ({10, 20}, {10, 20}),
    "s3-marker-written": ({10, 20}, {10, 20}),
    "s3-marker-deleted": (set(), set()),  # step 10 was being removed
}


def step_20_files() -> Files:
    files = checkpoint_files(world_size=2, shard_bytes=1 << 20, seed=20)
    rank, kind, _ = files["__0_0.distcp"]
    files["__0_0.distcp"] = (rank, kind, payload(12 << 20, 2020))  # three 5 MiB parts on S3
    return files


def save_through(client: CkptdClient, step: int, files: Files) -> None:
    save_id = client.open_save("run", step, world_size=2).save_id
    for path, (rank, kind, data) in files.items():
        client.write_file(save_id, path, rank, kind, data)
    client.commit(save_id)


def assert_every_s3_marker_names_whole_files(s3: S3Config) -> None:
    tier = S3Tier(s3)
    client = make_s3_client(s3)
    for key in tier.list():
        manifest = tier.manifest(key)
        assert manifest is not None
        for f in manifest.files:
            head = client.head_object(Bucket=s3.bucket, Key=tier.object_key(key, f.path))
            assert head["ContentLength"] == f.size, f"{key}/{f.path} is partial on S3"
    tier.close()


def assert_reads_back(store: CheckpointStore, step: int, files: Files) -> None:
    for path, (_, _, data) in files.items():
        assert store.reader.read_range(ref("run", step), path) == data, f"step {step} {path}"


@pytest.mark.parametrize("phase", PHASES)
def test_a_ckptd_killed_at_this_phase_exposes_no_partial_checkpoint_and_a_restart_finishes(
    phase: str, open_store: OpenStore, s3_config: S3Config, tmp_path: Path
) -> None:
    s3 = S3Config(**{**vars(s3_config), "part_bytes": 5 << 20})
    data_dir = tmp_path / "ckptd"
    files = {10: checkpoint_files(world_size=2, shard_bytes=1 << 20, seed=10), 20: step_20_files()}
    first = open_store(s3=s3)
    store_save(first, "run", 10, files[10])
    wait_for(
        lambda: tier_states(first.member.checkpoint(ref("run", 10)))["s3"] == "COMMITTED", what="S3"
    )
    first.close()

    ckptd = CkptdProcess(data_dir, s3, crash_at=phase)
    try:
        with CkptdClient(ckptd.address) as client:
            try:
                if phase == "s3-marker-deleted":
                    client.delete("run", 10)
                else:
                    save_through(client, 20, files[20])
            except ScaletrainError:
                pass  # the crash cut the call short
        ckptd.wait_killed()
    finally:
        ckptd.stop()

    after_crash, after_restart = EXPECTED[phase]
    assert {i.ref.step for i in list_offline(data_dir)} == after_crash
    assert_every_s3_marker_names_whole_files(s3)

    store = open_store(s3=s3)
    assert {i.ref.step for i in store.member.checkpoints()} == after_restart
    for step in after_restart:
        assert_reads_back(store, step, files[step])
        wait_for(
            lambda s=step: tier_states(store.member.checkpoint(ref("run", s)))["s3"] == "COMMITTED",
            what=f"step {step} to reach S3 after the restart",
        )
    if after_restart:
        assert store.member.checkpoint(ref("run", 0), latest=True).ref.step == max(after_restart)
    assert store.wait_background(timeout_s=30)
    listing = make_s3_client(s3).list_objects_v2(Bucket=s3.bucket).get("Contents", [])
    markers = {obj["Key"] for obj in listing if obj["Key"].endswith(MARKER)}
    assert markers == {f"run/{step}/{MARKER}" for step in after_restart}
    assert S3Tier(s3).list() == sorted(CheckpointKey("run", s) for s in after_restart)
    uploads = make_s3_client(s3).list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
    assert not uploads, "an interrupted multipart upload was left on S3"
