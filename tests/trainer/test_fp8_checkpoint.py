"""Delayed scaling's amax histories go through the trainer's checkpoints (a real ckptd, DCP, one
gloo rank), so a resumed FP8 run continues bit for bit."""

from __future__ import annotations

import torch
from fp8_testing import TinyTrainer, tiny_model

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.digest import state_sha256
from trainer.fp8 import Fp8Training


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
