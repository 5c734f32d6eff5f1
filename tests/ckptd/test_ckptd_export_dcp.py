"""A checkpoint saved by stock torch.distributed.checkpoint survives ckptd and loads back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckptd_testing import METADATA, SHARD, ref, store_write

from ckptd.store import CheckpointStore
from scaletrain.errors import FailedPrecondition


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_exported_checkpoint_loads_with_stock_dcp_and_equals_what_was_saved(
    open_store: Callable[..., CheckpointStore], tmp_path: Path
) -> None:
    torch.manual_seed(0)
    state = {
        "model": {"w": torch.randn(64, 32), "b": torch.arange(32, dtype=torch.int64)},
        "step": torch.tensor(1234),
    }
    saved = tmp_path / "dcp_saved"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(saved))

    store = open_store()
    save_id = store.saves.open_save(ref("dcp", 1234), world_size=1)
    for file in sorted(saved.iterdir()):
        kind = METADATA if file.name == ".metadata" else SHARD
        store_write(store, save_id, file.name, 0, kind, file.read_bytes())
    store.saves.commit(save_id)

    exported = tmp_path / "exported"
    written = store.export(ref("dcp", 1234), exported)
    assert sorted(p.name for p in written) == sorted(p.name for p in saved.iterdir())

    loaded = {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.int64)},
        "step": torch.tensor(0),
    }
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(exported))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["model"]["b"], state["model"]["b"])
    assert loaded["step"].item() == 1234

    with pytest.raises(FailedPrecondition, match="not empty"):
        store.export(ref("dcp", 1234), exported)
