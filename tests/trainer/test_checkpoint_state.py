"""Staging and RNG capture, the pieces that let a save cost training only a memcpy, and the
checkpointer's policy of which steps it saves."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from trainer.checkpoint import rng
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.stager import HostStager
from trainer.data.corpus import stdlib_corpus
from trainer.data.loader import DeterministicLoader


def _state() -> dict:
    return {
        "model": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(4)},
        "optim": {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "train": {"step": 7, "loader": {"global_sample": 112}},
    }


def test_a_staged_copy_is_unchanged_when_training_mutates_the_live_state():
    live = _state()
    staged = HostStager().stage(live)
    live["model"]["w"].add_(100)
    live["train"]["loader"]["global_sample"] = 0
    assert torch.equal(staged["model"]["w"], torch.arange(12.0).view(3, 4))
    assert staged["train"]["loader"]["global_sample"] == 112
    assert staged["optim"]["param_groups"] == [{"lr": 0.1}]


def test_the_stager_reuses_its_buffers_from_one_save_to_the_next():
    stager = HostStager()
    live = _state()
    first = stager.stage(live)
    live["model"]["w"].mul_(2)
    second = stager.stage(live)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], torch.arange(12.0).view(3, 4) * 2)
    assert stager.staged_bytes == (12 + 4 + 1) * 4


def test_every_generator_continues_exactly_after_a_restore():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    blob = rng.capture()
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    rng.restore(blob)
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


@pytest.fixture
def one_process_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_staged_dtensors_keep_their_wrapper_until_the_layout_changes(one_process_group):
    """Building a DTensor costs more than copying a small shard: later saves reuse the first."""
    mesh = init_device_mesh("cpu", (1,))
    live = {"w": distribute_tensor(torch.arange(8.0).view(2, 4), mesh, [Shard(0)])}
    stager = HostStager()
    first = stager.stage(live)["w"]
    live["w"].to_local().mul_(3)
    second = stager.stage(live)["w"]
    assert second is first
    assert torch.equal(second.full_tensor(), torch.arange(8.0).view(2, 4) * 3)
    assert (second.placements, second.shape) == (live["w"].placements, live["w"].shape)

    live["w"] = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    third = stager.stage(live)["w"]
    assert third is not first and torch.equal(third.full_tensor(), torch.ones(4, 4))


def test_a_shard_of_a_gpu_mesh_is_staged_into_host_memory_and_stays_there(one_process_group):
    """The state of a GPU run: DTensors on a CUDA mesh. Their staged copies must live in the
    stager's host buffers, not be moved back to the mesh's device (here, a CUDA mesh on a machine
    without CUDA: any move to it fails)."""
    mesh = DeviceMesh("cuda", [0], _init_backend=False)
    local = torch.arange(8.0).view(2, 4)
    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    live = {"w": DTensor(local, DTensorSpec(mesh, (Shard(0),), meta), requires_grad=False)}
    stager = HostStager()
    first = stager.stage(live)["w"]
    local.mul_(3)
    second = stager.stage(live)["w"]
    assert second.device_mesh is mesh and second.placements == (Shard(0),)
    assert second.to_local().device.type == "cpu"
    assert torch.equal(second.to_local(), torch.arange(8.0).view(2, 4) * 3)
    assert second.to_local().data_ptr() == first.to_local().data_ptr()  # the reused buffer


def test_the_checkpointer_saves_every_n_steps_and_the_last_and_never_at_zero(one_process_group):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    loader = DeterministicLoader(stdlib_corpus(1 << 16), 8, 4, 0, 1, seed=0)

    def due(every: int) -> list[int]:
        saver = Checkpointer("unused:1", "r", model, optimizer, schedule, loader, every=every,
                             last_step=25)  # fmt: skip
        try:
            return [step for step in range(1, 26) if saver.should_save(step)]
        finally:
            saver.close()

    assert due(10) == [10, 20, 25]
    assert due(5) == [5, 10, 15, 20, 25]
    assert due(0) == []
