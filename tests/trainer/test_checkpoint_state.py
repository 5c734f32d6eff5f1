"""Staging and RNG capture: the pieces that let a save cost training only a memcpy."""

from __future__ import annotations

import random

import numpy as np
import torch

from trainer.checkpoint import rng
from trainer.checkpoint.stager import HostStager


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
