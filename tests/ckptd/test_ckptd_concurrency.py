"""Many writers and readers at once over real gRPC, a full memory budget, abandoned saves."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ckptd_testing import (
    METADATA,
    SHARD,
    checkpoint_files,
    payload,
    ref,
    store_save,
    store_write,
    tier_states,
    wait_for,
)

from ckptd.client import CkptdClient
from ckptd.server import RunningCkptd
from ckptd.store import CheckpointStore
from scaletrain.errors import FailedPrecondition

OpenStore = Callable[..., CheckpointStore]
RunCkptd = Callable[..., RunningCkptd]


def test_64_concurrent_shard_streams_of_two_runs_commit_and_read_back_under_concurrent_readers(
    run_ckptd: RunCkptd,
) -> None:
    running = run_ckptd(memory_budget_bytes=64 << 20)
    runs, world = ("alpha", "beta"), 32
    shards = {(run, rank): payload(200_000 + rank, hash((run, rank)) % 1000) for run in runs
              for rank in range(world)}  # fmt: skip
    with CkptdClient(running.address) as client:
        saves = {run: client.open_save(run, 100, world_size=world).save_id for run in runs}
        start = threading.Barrier(len(shards))

        def write(item: tuple[tuple[str, int], bytes]) -> None:
            (run, rank), data = item
            start.wait()  # all 64 streams open at once
            client.write_file(saves[run], f"__{rank}_0.distcp", rank, SHARD, data)

        with ThreadPoolExecutor(len(shards)) as pool:
            list(pool.map(write, shards.items()))
        for run in runs:
            client.write_file(saves[run], ".metadata", 0, METADATA, run.encode())
            assert client.commit(saves[run]).committed

        def read(item: tuple[tuple[str, int], bytes]) -> None:
            (run, rank), data = item
            rng = random.Random(rank)
            for _ in range(3):
                offset = rng.randrange(len(data))
                length = rng.randrange(1, len(data) - offset + 1)
                got = client.read(run, 100, f"__{rank}_0.distcp", offset, length)
                assert got == data[offset : offset + length]

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(read, shards.items()))
        assert client.read("beta", 100, ".metadata") == b"beta"  # runs are namespaced
        assert [i.ref.run for i in client.list()] == ["alpha", "beta"]


def test_a_full_memory_budget_slows_writers_and_spills_to_ssd_without_exceeding_it(
    open_store: OpenStore,
) -> None:
    budget, streams, chunk = 4 << 20, 4, 1 << 20
    store = open_store(memory_budget_bytes=budget)
    store_save(store, "run", 1, checkpoint_files(1, 1 << 20, seed=1))  # fills memory first
    peak = [0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], store.budget.used)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    files = {f"__{r}_0.distcp": (r, SHARD, payload(6 << 20, r)) for r in range(streams)}
    files[".metadata"] = (0, METADATA, b"meta")
    save_id = store.saves.open_save(ref("run", 2), world_size=streams)
    with ThreadPoolExecutor(streams) as pool:
        list(
            pool.map(
                lambda item: store_write(store, save_id, item[0], *item[1], chunk_bytes=chunk),
                files.items(),
            )
        )
    info = store.saves.commit(save_id)
    sampling.set()
    sampler.join()
    assert peak[0] <= budget + streams * chunk  # the budget, plus one chunk per stream at most
    assert tier_states(info)["memory"] == "ABSENT" and tier_states(info)["ssd"] == "COMMITTED"
    for path, (_, _, data) in files.items():
        assert store.reader.read_range(ref("run", 2), path) == data
    assert store.budget.used == store.memory.used_bytes  # nothing in flight is left reserved


def test_a_save_whose_writer_went_away_is_aborted_and_cleaned_up_after_the_timeout(
    open_store: OpenStore,
) -> None:
    store = open_store(abandon_after_s=0.4)
    save_id = store.saves.open_save(ref("run", 1), world_size=2)
    store_write(store, save_id, "__0_0.distcp", 0, SHARD, payload(1000, 0))
    wait_for(
        lambda: not store.ssd.staging_dir(save_id).exists(), what="the janitor to abort the save"
    )
    (info,) = store.member.checkpoints(include_uncommitted=True)
    assert not info.committed and not info.files
    try:
        store_write(store, save_id, "__1_0.distcp", 1, SHARD, b"late")
    except FailedPrecondition as exc:
        assert "aborted" in str(exc)
    else:
        raise AssertionError("a write to an abandoned save was accepted")
    wait_for(
        lambda: not store.member.checkpoints(include_uncommitted=True), what="the aborted row to go"
    )
