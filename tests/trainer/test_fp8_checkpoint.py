"""Delayed scaling's amax histories go through the trainer's checkpoints (a real ckptd, DCP, one
gloo rank), so a resumed FP8 run continues bit for bit."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fp8_testing import TinyTrainer, tiny_model

from ckptd.config import CkptdConfig
from ckptd.server import RunningCkptd, start
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.digest import state_sha256
from trainer.fp8 import Fp8Training


@pytest.fixture
def ckptd(tmp_path: Path) -> Iterator[RunningCkptd]:
    """A ckptd on loopback and a one-rank process group, as the trainer runs with one rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    server = start(CkptdConfig(data_dir=tmp_path / "ckptd", listen="127.0.0.1:0"))
    try:
        yield server
    finally:
        server.stop(grace=1)
        dist.destroy_process_group()


def _run(address: str, recipe: str | None) -> tuple[TinyTrainer, Fp8Training | None, Checkpointer]:
    model, fp8 = tiny_model(recipe)
    trainer = TinyTrainer(model, steps=6)
    checkpointer = Checkpointer(
        address, "fp8", model, trainer.optimizer, trainer.scheduler, trainer.loader, fp8=fp8
    )
    return trainer, fp8, checkpointer


def _save(checkpointer: Checkpointer, step: int) -> None:
    checkpointer.save(step, labels={})
    assert all(done.error is None for done in checkpointer.finish())


def _histories(fp8: Fp8Training) -> dict[str, torch.Tensor]:
    return {name: history.clone() for name, history in fp8.state_dict().items()}


def test_a_resumed_delayed_scaling_run_continues_bit_identically(ckptd):
    trainer, fp8, checkpointer = _run(ckptd.address, "tensorwise-delayed")
    trainer.losses(3)
    _save(checkpointer, 3)
    saved = _histories(fp8)
    assert any(h.abs().sum() > 0 for h in saved.values())
    straight = trainer.losses(3)
    final = (state_sha256(trainer.model.state_dict()), _histories(fp8))
    checkpointer.close()

    trainer, fp8, checkpointer = _run(ckptd.address, "tensorwise-delayed")
    checkpointer.load(3)
    restored = _histories(fp8)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[name], saved[name]) for name in saved)
    assert trainer.losses(3) == straight
    assert state_sha256(trainer.model.state_dict()) == final[0]
    assert all(torch.equal(h, final[1][name]) for name, h in _histories(fp8).items())
    checkpointer.close()


def test_a_checkpoint_without_fp8_state_resumes_delayed_scaling_with_empty_histories(ckptd):
    trainer, _, checkpointer = _run(ckptd.address, None)
    trainer.losses(1)
    _save(checkpointer, 1)
    checkpointer.close()

    trainer, fp8, checkpointer = _run(ckptd.address, "tensorwise-delayed")
    checkpointer.load(1)
    assert all(h.abs().sum() == 0 for h in _histories(fp8).values())
    checkpointer.close()
