"""A DCP save whose shards are streamed by the low-priority upload process (ckptd.uploader)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.server import RunningCkptd
from ckptd.uploader import Uploader
from scaletrain.errors import NotFound
from scaletrain.rpc import CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2


def _state(seed: int, numel: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(numel, generator=gen), "step": seed}


@pytest.fixture
def uploader():
    handle = Uploader()
    yield handle
    handle.close()


def _shard(info: checkpoint_pb2.CheckpointInfo) -> checkpoint_pb2.FileInfo:
    (shard,) = [f for f in info.files if f.kind == checkpoint_pb2.FILE_KIND_SHARD]
    return shard


def test_shards_sent_by_the_upload_process_equal_a_direct_upload_and_load_back(run_ckptd, uploader):
    server: RunningCkptd = run_ckptd()
    numels = [CHUNK_BYTES // 2 + 1000, 1000]  # the second save is shorter: its spool is reused
    for step, numel in enumerate(numels, start=1):
        direct = CkptdStorageWriter(server.address, "direct", step)
        dcp.save(_state(step, numel), storage_writer=direct)
        spooled = CkptdStorageWriter(server.address, "spooled", step, uploader=uploader)
        dcp.save(_state(step, numel), storage_writer=spooled)
        assert _shard(spooled.committed) == _shard(direct.committed)  # size and SHA-256 alike

        loaded = _state(0, numel)
        dcp.load(loaded, storage_reader=CkptdStorageReader(server.address, "spooled", step))
        assert torch.equal(loaded["big"], _state(step, numel)["big"]) and loaded["step"] == step


def test_an_upload_ckptd_refuses_raises_ckptds_error_and_the_next_upload_works(run_ckptd, uploader):
    server: RunningCkptd = run_ckptd()
    with uploader.spool("__0_0.distcp") as spool:
        spool.write(b"shard bytes")
    with pytest.raises(NotFound, match="unknown save 'no-such-save'"):
        uploader.upload(server.address, "no-such-save", "__0_0.distcp", 0, 1)
    writer = CkptdStorageWriter(server.address, "after", 1, uploader=uploader)
    dcp.save(_state(1, 100), storage_writer=writer)
    assert writer.committed is not None and writer.committed.committed


def test_an_upload_process_that_died_between_saves_is_replaced_by_the_next_save(
    run_ckptd, uploader
):
    server: RunningCkptd = run_ckptd()
    uploader._child.kill()
    uploader._child.wait()
    writer = CkptdStorageWriter(server.address, "replaced", 1, uploader=uploader)
    dcp.save(_state(1, 100), storage_writer=writer)
    assert writer.committed is not None and writer.committed.committed
