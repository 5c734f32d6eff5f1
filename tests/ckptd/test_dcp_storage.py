"""Any PyTorch program saves to and loads from ckptd by handing DCP scaletrain's writer/reader."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

from ckptd.client import CkptdClient
from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter, first_cause
from ckptd.server import RunningCkptd
from scaletrain.errors import AlreadyExists
from scaletrain.process import exit_now
from scaletrain.transport import CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2


def _state(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "weights": torch.randn(64, 33, generator=gen),
        # Larger than one gRPC chunk, so the upload and the range reads both span chunks.
        "big": torch.randn(CHUNK_BYTES // 4 + 1000, generator=gen),
        "nested": {"bias": torch.randn(7, generator=gen), "step": 12, "name": "llama"},
    }


def test_a_single_process_save_loads_back_bit_exactly(run_ckptd):
    server: RunningCkptd = run_ckptd()
    saved = _state(1)
    writer = CkptdStorageWriter(server.address, run="solo", step=5)
    dcp.save(saved, storage_writer=writer)
    assert writer.committed is not None and writer.committed.committed
    names = sorted(f.path for f in writer.committed.files)
    assert names == [".metadata", "__0_0.distcp"]

    loaded = _state(2)
    dcp.load(loaded, storage_reader=CkptdStorageReader(server.address, run="solo", step=5))
    assert torch.equal(loaded["weights"], saved["weights"])
    assert torch.equal(loaded["big"], saved["big"])
    assert torch.equal(loaded["nested"]["bias"], saved["nested"]["bias"])
    assert loaded["nested"]["step"] == 12 and loaded["nested"]["name"] == "llama"


def test_saving_the_same_step_twice_is_refused_and_keeps_the_first(run_ckptd):
    server: RunningCkptd = run_ckptd()
    dcp.save(_state(1), storage_writer=CkptdStorageWriter(server.address, run="twice", step=1))
    with pytest.raises(CheckpointException) as failed:
        dcp.save(_state(2), storage_writer=CkptdStorageWriter(server.address, "twice", 1))
    cause = first_cause(failed.value)
    assert isinstance(cause, AlreadyExists) and "already committed" in str(cause)
    loaded = _state(3)
    dcp.load(loaded, storage_reader=CkptdStorageReader(server.address, "twice", 1))
    assert torch.equal(loaded["weights"], _state(1)["weights"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_rank_save(rank: int, world: int, port: int, address: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)
        state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}
        dcp.save(state, storage_writer=CkptdStorageWriter(address, "sharded", 3))
        dist.barrier()
        # Load back into the same layout; a plain process below reshards to one full tensor.
        target = {"w": distribute_tensor(torch.zeros(40, 6), mesh, [Shard(0)]), "step": 0}
        dcp.load(target, storage_reader=CkptdStorageReader(address, "sharded", 3))
        assert torch.equal(target["w"].full_tensor(), full)
        if rank == 0:
            Path(out).write_text("ok")
    finally:
        dist.destroy_process_group()
    # It ends as the trainer's ranks do: the interpreter's teardown with gloo's threads about
    # could abort the process ("terminate called without an active exception") after the test
    # had passed.
    exit_now(0)


def test_every_rank_streams_its_own_shard_and_a_single_process_reshards_on_load(
    run_ckptd, tmp_path: Path
):
    server: RunningCkptd = run_ckptd()
    marker = tmp_path / "ok"
    mp.start_processes(
        _two_rank_save,
        args=(2, _free_port(), server.address, str(marker)),
        nprocs=2,
        start_method="spawn",
    )
    assert marker.read_text() == "ok"
    with CkptdClient(server.address) as client:
        info = client.get("sharded", 3)
    ranks = sorted({f.rank for f in info.files if f.kind == checkpoint_pb2.FILE_KIND_SHARD})
    assert ranks == [0, 1] and info.world_size == 2
    resharded = {"w": torch.zeros(40, 6)}
    dcp.load(resharded, storage_reader=CkptdStorageReader(server.address, "sharded", 3))
    assert torch.equal(resharded["w"], torch.arange(240, dtype=torch.float32).view(40, 6))
