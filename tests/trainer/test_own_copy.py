"""The rank's own copy of its last staged step (trainer.checkpoint.own_copy): buffers in shared
memory that a new process restores from, and never when the copy is not intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.checkpoint import own_copy
from trainer.checkpoint.own_copy import OwnCopy, Unusable
from trainer.checkpoint.stager import HostStager


def state(scale: float) -> dict:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3) * scale, "b": torch.zeros(0)},
        "optim": {"state": [torch.full((4,), scale, dtype=torch.bfloat16)]},
        "train": {"step": int(scale), "loader": {"global_sample": 16 * int(scale)}},
    }


def sealed(directory: Path, scale: float) -> None:
    own = OwnCopy(directory)
    stager = HostStager(own.allocate)
    staged = stager.stage(state(scale))
    own.seal(int(scale), staged, stager.buffers)


def test_a_new_process_restores_the_sealed_step_bit_for_bit_from_shared_memory(tmp_path: Path):
    sealed(tmp_path, 3.0)
    live = state(0.0)
    restored, copied = OwnCopy(tmp_path).restore_into(3, live)
    expected = state(3.0)
    assert torch.equal(restored["model"]["w"], expected["model"]["w"])
    assert restored["model"]["w"] is live["model"]["w"]  # filled in place
    assert torch.equal(restored["optim"]["state"][0], expected["optim"]["state"][0])
    assert restored["train"] == expected["train"]
    assert copied == 6 * 4 + 4 * 2


def test_a_copy_that_fails_its_crc_or_holds_another_step_is_never_loaded(tmp_path: Path):
    sealed(tmp_path, 3.0)
    with pytest.raises(Unusable, match="holds step 3"):
        OwnCopy(tmp_path).restore_into(4, state(0.0))
    damaged = tmp_path / "0.bin"
    data = bytearray(damaged.read_bytes())
    data[5] ^= 0xFF
    damaged.write_bytes(bytes(data))
    live = state(0.0)
    with pytest.raises(Unusable, match=r"fails its CRC-32"):
        OwnCopy(tmp_path).restore_into(3, live)


def test_a_copy_of_another_layout_or_one_being_overwritten_is_not_restored(tmp_path: Path):
    sealed(tmp_path, 3.0)
    other = state(0.0)
    other["model"]["w"] = torch.zeros(3, 2)
    with pytest.raises(Unusable, match=r"layout differs at \.model\.w"):
        OwnCopy(tmp_path).restore_into(3, other)
    own = OwnCopy(tmp_path)
    own.invalidate()
    with pytest.raises(Unusable, match="no sealed copy"):
        own.restore_into(3, state(0.0))


def test_dropping_a_runs_copies_leaves_other_runs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(own_copy, "SHM_ROOT", tmp_path)
    for run in ("r1", "r2"):
        for host in ("node0", "node1"):
            (own_copy.host_dir(run, host) / "rank0").mkdir(parents=True)
    own_copy.remove_copies("r1", "node1")
    assert (own_copy.host_dir("r1", "node0")).exists()
    assert not (own_copy.host_dir("r1", "node1")).exists()
    own_copy.remove_copies("r1")
    assert not (tmp_path / "scaletrain" / "r1").exists()
    assert (own_copy.host_dir("r2", "node0")).exists() and own_copy.host_dir("r2", "node1").exists()
