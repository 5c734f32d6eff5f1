"""CheckpointStore on real directories: the save protocol, verification, memory and SSD tiers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from ckptd_testing import (
    METADATA,
    SHARD,
    checkpoint_files,
    chunk,
    payload,
    ref,
    store_save,
    store_write,
    tier_states,
    trailer,
)

from ckptd.config import CkptdConfig
from ckptd.datadir import list_offline
from ckptd.manifest import data_crc32c
from ckptd.store import CheckpointStore, TierCommit
from ckptd.tiers import CheckpointKey
from ckptd.tiers.memory import MemoryFile
from scaletrain.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    UserError,
)
from scaletrain.v1 import checkpoint_pb2

OpenStore = Callable[..., CheckpointStore]


def header(save_id: str, path: str, rank: int = 0, kind: int = SHARD) -> checkpoint_pb2.FileHeader:
    return checkpoint_pb2.FileHeader(save_id=save_id, path=path, rank=rank, kind=kind)


def assert_nothing_stored(store: CheckpointStore, run: str, step: int) -> None:
    """No file of the save was recorded and no partial file was left on disk."""
    infos = store.member.checkpoints(run, include_uncommitted=True)
    assert all(not info.files for info in infos if info.ref.step == step)
    assert not any((store.ssd.root / ".incoming").iterdir())


def test_a_committed_checkpoint_is_in_memory_and_on_ssd_under_its_dcp_names(
    open_store: OpenStore,
) -> None:
    store = open_store()
    files = checkpoint_files(world_size=2, shard_bytes=3 << 20)
    info = store_save(store, "run", 100, files)
    assert info.committed and info.world_size == 2
    assert tier_states(info) == {"memory": "COMMITTED", "ssd": "COMMITTED", "s3": "ABSENT"}
    assert info.total_bytes == sum(len(data) for _, _, data in files.values())
    assert {f.path: f.crc32c for f in info.files} == {
        path: data_crc32c(data) for path, (_, _, data) in files.items()
    }
    on_disk = store.ssd.dir_of(CheckpointKey("run", 100))
    for path, (_, _, data) in files.items():
        assert (on_disk / path).read_bytes() == data


def test_byte_ranges_read_back_bit_exact_from_any_offset(open_store: OpenStore) -> None:
    store = open_store()
    files = checkpoint_files(world_size=2, shard_bytes=5 << 20)
    store_save(store, "run", 1, files)
    data = files["__1_0.distcp"][2]
    for offset, length in [(0, 0), (0, 1), (262_143, 2), (1_000_001, 3 << 20), (len(data) - 1, 1)]:
        got = store.reader.read_range(ref("run", 1), "__1_0.distcp", offset, length)
        assert got == data[offset : offset + length if length else None]
    assert store.reader.read_range(ref("run", 1), "__1_0.distcp", len(data), 0) == b""


def test_reading_beyond_the_end_of_a_file_is_an_invalid_argument(open_store: OpenStore) -> None:
    store = open_store()
    store_save(store, "run", 1, checkpoint_files(world_size=1, shard_bytes=100))
    with pytest.raises(InvalidArgument, match="beyond"):
        store.reader.read_range(ref("run", 1), ".metadata", 900, 200)
    with pytest.raises(NotFound, match="no file"):
        store.reader.read_range(ref("run", 1), "__7_0.distcp")


def test_commit_names_the_ranks_that_wrote_nothing_and_the_missing_metadata(
    open_store: OpenStore,
) -> None:
    store = open_store()
    save_id = store.saves.open_save(ref("run", 5), world_size=4)
    store_write(store, save_id, "__0_0.distcp", 0, SHARD, payload(10, 0))
    store_write(store, save_id, "__2_0.distcp", 2, SHARD, payload(10, 2))
    with pytest.raises(FailedPrecondition) as err:
        store.saves.commit(save_id)
    message = str(err.value)
    assert "rank(s) 1, 3 of world size 4" in message and "no metadata file" in message
    assert "\n" not in message
    assert store.member.checkpoints("run") == []


def test_a_chunk_with_a_bad_crc_is_an_invalid_argument_and_stores_nothing(
    open_store: OpenStore,
) -> None:
    store = open_store()
    save_id = store.saves.open_save(ref("run", 1), world_size=1)
    data = payload(1000, 1)
    with pytest.raises(InvalidArgument, match="CRC-32C mismatch"):
        store.saves.write_file(
            header(save_id, "__0_0.distcp"), [chunk(0, data, crc=1234)], trailer(data)
        )
    assert_nothing_stored(store, "run", 1)


def test_an_out_of_order_chunk_is_an_invalid_argument_and_stores_nothing(
    open_store: OpenStore,
) -> None:
    store = open_store()
    save_id = store.saves.open_save(ref("run", 1), world_size=1)
    data = payload(2000, 1)
    chunks = [chunk(0, data[:1000]), chunk(1500, data[1000:])]
    with pytest.raises(InvalidArgument, match="offset 1500, expected 1000"):
        store.saves.write_file(header(save_id, "__0_0.distcp"), chunks, trailer(data))
    assert_nothing_stored(store, "run", 1)


def test_a_trailer_with_a_wrong_size_or_checksum_is_an_invalid_argument_and_stores_nothing(
    open_store: OpenStore,
) -> None:
    store = open_store()
    before = checkpoint_files(world_size=1, shard_bytes=3 << 20, seed=1)
    store_save(store, "run", 1, before)
    save_id = store.saves.open_save(ref("run", 2), world_size=1)
    shard = payload(3 << 20, 2)
    store_write(store, save_id, ".metadata", 0, METADATA, b"meta")
    chunks = [chunk(i, shard[i : i + (1 << 20)]) for i in range(0, len(shard), 1 << 20)]
    with pytest.raises(InvalidArgument, match=r"__0_0\.distcp: trailer says 3145727 bytes"):
        store.saves.write_file(header(save_id, "__0_0.distcp"), chunks, trailer(shard[1:]))
    # Every chunk checks out, but they do not make the file the trailer describes.
    with pytest.raises(
        InvalidArgument, match=r"__0_0.distcp: the trailer's file CRC-32C \w+ does not match"
    ):
        store.saves.write_file(header(save_id, "__0_0.distcp"), chunks, trailer(shard[::-1]))
    with pytest.raises(FailedPrecondition, match=r"no shard file from rank\(s\) 0"):
        store.saves.commit(save_id)
    (pending,) = [
        i for i in store.member.checkpoints("run", include_uncommitted=True) if i.ref.step == 2
    ]
    assert not pending.committed and [f.path for f in pending.files] == [".metadata"]
    assert not (store.ssd.staging_dir(save_id) / "__0_0.distcp").exists()
    for path, (_, _, data) in before.items():
        assert store.reader.read_range(ref("run", 1), path, 0, 0) == data

    store_write(store, save_id, "__0_0.distcp", 0, SHARD, shard)
    assert store.saves.commit(save_id).committed
    assert store.reader.read_range(ref("run", 2), "__0_0.distcp", 0, 0) == shard
    for path, (_, _, data) in before.items():
        assert store.reader.read_range(ref("run", 1), path, 0, 0) == data


@pytest.mark.parametrize("path", ["../escape", "/abs/file", "a/../../b", "x\x00y", ""])
def test_a_path_that_escapes_the_checkpoint_is_refused_before_anything_is_written(
    open_store: OpenStore, tmp_path: Path, path: str
) -> None:
    store = open_store()
    save_id = store.saves.open_save(ref("run", 1), world_size=1)
    with pytest.raises(InvalidArgument):
        store.saves.begin_file(header(save_id, path))
    assert_nothing_stored(store, "run", 1)
    assert not (tmp_path / "ckptd" / "ssd" / "escape").exists()


def test_header_errors_name_the_problem(open_store: OpenStore) -> None:
    store = open_store()
    save_id = store.saves.open_save(ref("run", 1), world_size=2)
    with pytest.raises(InvalidArgument, match=r"rank 2 is outside 0\.\.1"):
        store.saves.begin_file(header(save_id, "__2_0.distcp", rank=2))
    with pytest.raises(InvalidArgument, match="kind must be"):
        store.saves.begin_file(header(save_id, "x", kind=checkpoint_pb2.FILE_KIND_UNSPECIFIED))
    with pytest.raises(NotFound, match="unknown save"):
        store.saves.begin_file(header("nope", "x"))
    store_write(store, save_id, ".metadata", 0, METADATA, b"meta")
    with pytest.raises(InvalidArgument, match="already has the metadata file"):
        store.saves.begin_file(header(save_id, ".other_metadata", kind=METADATA))
    with pytest.raises(InvalidArgument, match="world size"):
        store.saves.open_save(ref("run", 2), world_size=0)
    with pytest.raises(InvalidArgument, match="step"):
        store.saves.open_save(ref("run", -1), world_size=1)


def test_writing_to_a_committed_save_or_reopening_a_committed_step_is_refused(
    open_store: OpenStore,
) -> None:
    store = open_store()
    save_id = store.saves.open_save(ref("run", 3), world_size=1)
    store_write(store, save_id, "__0_0.distcp", 0, SHARD, b"shard")
    store_write(store, save_id, ".metadata", 0, METADATA, b"meta")
    store.saves.commit(save_id)
    with pytest.raises(FailedPrecondition, match="already committed"):
        store_write(store, save_id, "__0_1.distcp", 0, SHARD, b"more")
    with pytest.raises(FailedPrecondition, match="already committed"):
        store.saves.commit(save_id)
    with pytest.raises(AlreadyExists, match="already committed"):
        store.saves.open_save(ref("run", 3), world_size=1)
    files = store.member.checkpoint(ref("run", 3)).files
    assert [f.path for f in files] == [".metadata", "__0_0.distcp"]


def test_reopening_an_uncommitted_save_replaces_the_stale_attempt(open_store: OpenStore) -> None:
    store = open_store()
    stale = store.saves.open_save(ref("run", 4), world_size=1)
    store_write(store, stale, "__0_0.distcp", 0, SHARD, b"stale shard")
    fresh = store.saves.open_save(ref("run", 4), world_size=1, labels={"try": "2"})
    with pytest.raises(NotFound):
        store_write(store, stale, ".metadata", 0, METADATA, b"meta")
    assert not store.ssd.staging_dir(stale).exists()
    store_write(store, fresh, "__0_0.distcp", 0, SHARD, b"fresh shard")
    store_write(store, fresh, ".metadata", 0, METADATA, b"meta")
    info = store.saves.commit(fresh)
    assert dict(info.labels) == {"try": "2"}
    assert store.reader.read_range(ref("run", 4), "__0_0.distcp") == b"fresh shard"


def test_a_file_written_again_in_the_same_save_replaces_the_first_copy(
    open_store: OpenStore,
) -> None:
    store = open_store()
    save_id = store.saves.open_save(ref("run", 1), world_size=1)
    store_write(store, save_id, "__0_0.distcp", 0, SHARD, b"first")
    store_write(store, save_id, "__0_0.distcp", 0, SHARD, b"second, longer")
    store_write(store, save_id, ".metadata", 0, METADATA, b"meta")
    info = store.saves.commit(save_id)
    assert info.total_bytes == len(b"second, longer") + 4
    assert store.reader.read_range(ref("run", 1), "__0_0.distcp") == b"second, longer"


def test_an_aborted_save_keeps_no_files_and_lists_only_as_uncommitted(
    open_store: OpenStore,
) -> None:
    store = open_store()
    save_id = store.saves.open_save(ref("run", 1), world_size=1)
    store_write(store, save_id, "__0_0.distcp", 0, SHARD, b"shard")
    store.saves.abort(save_id, reason="rank 3 died")
    store.saves.abort(save_id)  # twice is harmless
    assert not store.ssd.staging_dir(save_id).exists()
    assert store.member.checkpoints() == []
    (info,) = store.member.checkpoints(include_uncommitted=True)
    assert not info.committed and not info.files
    with pytest.raises(FailedPrecondition, match="aborted"):
        store.saves.commit(save_id)
    with pytest.raises(NotFound):
        store.member.checkpoint(ref("run", 1))


def test_latest_is_the_newest_committed_step_never_an_open_one(open_store: OpenStore) -> None:
    store = open_store()
    for step in (10, 30, 20):
        store_save(store, "run", step, checkpoint_files(world_size=1, shard_bytes=10, seed=step))
    store.saves.open_save(ref("run", 40), world_size=1)
    assert store.member.checkpoint(ref("run", 0), latest=True).ref.step == 30
    assert [i.ref.step for i in store.member.checkpoints("run")] == [10, 20, 30]
    with pytest.raises(NotFound, match="no committed checkpoint"):
        store.member.checkpoint(ref("other", 0), latest=True)
    with pytest.raises(NotFound):
        store.member.checkpoint(ref("run", 40))


def test_a_checkpoint_larger_than_the_memory_budget_is_kept_only_on_ssd(
    open_store: OpenStore,
) -> None:
    store = open_store(memory_budget_bytes=1 << 20)
    info = store_save(store, "run", 1, checkpoint_files(world_size=2, shard_bytes=1 << 20))
    assert tier_states(info)["memory"] == "ABSENT"
    assert store.memory.used_bytes == 0


def test_the_oldest_checkpoint_leaves_memory_first_once_a_slower_tier_holds_it(
    open_store: OpenStore,
) -> None:
    store = open_store(memory_budget_bytes=5 << 20)
    for step in (1, 2, 3):
        store_save(store, "run", step, checkpoint_files(world_size=1, shard_bytes=2 << 20))
    states = {i.ref.step: tier_states(i)["memory"] for i in store.member.checkpoints("run")}
    assert states == {1: "ABSENT", 2: "COMMITTED", 3: "COMMITTED"}
    assert store.memory.used_bytes <= 5 << 20


def test_a_read_falls_through_to_ssd_when_the_memory_copy_is_corrupt_and_says_so(
    tmp_path: Path,
) -> None:
    heard: list[TierCommit] = []
    store = CheckpointStore(CkptdConfig(data_dir=tmp_path / "ckptd"), on_tier_commit=heard.append)
    files = checkpoint_files(world_size=1, shard_bytes=1 << 20)
    store_save(store, "run", 1, files)
    key = CheckpointKey("run", 1)
    damaged = bytearray(files["__0_0.distcp"][2])
    damaged[12345] ^= 0xFF
    rotten = MemoryFile()
    rotten.append(bytes(damaged))
    store.memory._checkpoints[key]["__0_0.distcp"] = rotten
    pieces = list(store.reader.iter_range(ref("run", 1), "__0_0.distcp"))
    assert b"".join(piece.data for piece in pieces) == files["__0_0.distcp"][2]
    assert pieces[0].tier == 2  # TIER_SSD
    assert tier_states(store.member.checkpoint(ref("run", 1)))["memory"] == "FAILED"
    # The observer (telemetry) hears of the damaged copy, not only of the commits.
    (damage,) = [event for event in heard if event.failed]
    assert (damage.tier, damage.node) == (1, store.node)  # TIER_MEMORY
    assert "__0_0.distcp fails its checksum in block" in damage.failed
    store.close()


def test_a_corrupt_ssd_copy_with_no_other_tier_is_data_loss(open_store: OpenStore) -> None:
    store = open_store(memory_budget_bytes=0)
    store_save(store, "run", 1, checkpoint_files(world_size=1, shard_bytes=1 << 20))
    shard = store.ssd.path_of(CheckpointKey("run", 1), "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(700_000)
        f.write(b"\x00\x01\x02")
    assert store.reader.read_range(ref("run", 1), "__0_0.distcp", 0, 1000)  # block 0 is intact
    with pytest.raises(DataLoss, match="block 2"):
        store.reader.read_range(ref("run", 1), "__0_0.distcp", 600_000, 200_000)
    info = store.member.checkpoint(ref("run", 1))
    assert tier_states(info)["ssd"] == "FAILED"
    assert "checksum" in next(t.error for t in info.tiers if t.tier == 2)


def test_delete_removes_the_checkpoint_from_every_tier(open_store: OpenStore) -> None:
    store = open_store()
    store_save(store, "run", 1, checkpoint_files(world_size=1, shard_bytes=100))
    assert store.delete(ref("run", 1)) == ([1, 2], [])  # memory, SSD; nothing pending
    assert not store.ssd.dir_of(CheckpointKey("run", 1)).exists()
    assert store.member.checkpoints() == []
    with pytest.raises(NotFound):
        store.delete(ref("run", 1))
    with pytest.raises(NotFound):
        store.reader.read_range(ref("run", 1), ".metadata")


def test_a_second_store_on_the_same_data_dir_is_refused(open_store: OpenStore) -> None:
    open_store()
    with pytest.raises(UserError, match="in use"):
        open_store()


def test_a_reopened_store_lists_committed_checkpoints_with_memory_absent(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store()
    files = checkpoint_files(world_size=2, shard_bytes=1000)
    store_save(store, "run", 7, files)
    open_save = store.saves.open_save(ref("run", 8), world_size=1)
    store_write(store, open_save, "__0_0.distcp", 0, SHARD, b"staged before the restart")
    store.close()

    (offline,) = list_offline(tmp_path / "ckptd")
    assert tier_states(offline) == {"memory": "ABSENT", "ssd": "COMMITTED", "s3": "ABSENT"}

    store = open_store(memory_budget_bytes=0)
    (info,) = store.member.checkpoints()
    assert info.ref.step == 7 and tier_states(info)["memory"] == "ABSENT"
    assert store.reader.read_range(ref("run", 7), "__1_0.distcp") == files["__1_0.distcp"][2]
    # A save left open survives the restart: its staged files still count.
    store_write(store, open_save, ".metadata", 0, METADATA, b"meta")
    assert store.saves.commit(open_save).committed
    assert store.reader.read_range(ref("run", 8), "__0_0.distcp") == b"staged before the restart"


def test_offline_listing_sees_the_memory_tier_only_while_a_store_holds_the_data_dir(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store()
    store_save(store, "run", 1, checkpoint_files(world_size=1, shard_bytes=10))
    (while_running,) = list_offline(tmp_path / "ckptd")
    assert tier_states(while_running)["memory"] == "COMMITTED"
    with pytest.raises(UserError, match="no ckptd catalog"):
        list_offline(tmp_path / "elsewhere")
