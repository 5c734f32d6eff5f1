"""Memory checkpoints (--mem-ckpt-every) in the trainer's Checkpointer: when each kind of save
is due, and the lazy copy of the state, which must be the state of its step bit for bit though
the loop changes the live state as soon as `wait_staged` returns (one gloo rank, its own copy in
shared memory; a real ckptd, which the memory save does not use)."""

from __future__ import annotations

import pytest
import torch
from copy_testing import own_steps, resume
from fp8_testing import TinyTrainer, tiny_model

from ckptd.client import CkptdClient
from scaletrain.errors import NotFound
from trainer.checkpoint.checkpointer import Checkpointer, SaveKind
from trainer.checkpoint.digest import state_sha256


def _optimizer_digest(optimizer: torch.optim.Optimizer) -> str:
    states = enumerate(optimizer.state.values())
    return state_sha256({f"{i}.{k}": v.reshape(-1) for i, s in states for k, v in s.items()})


def test_memory_saves_fill_the_steps_between_durable_ones_and_the_last_step_is_durable(ckptd):
    model, _ = tiny_model(None)
    trainer = TinyTrainer(model, steps=12)
    saver = Checkpointer(ckptd.address, "kinds", model, trainer.optimizer, trainer.scheduler,
                         trainer.loader, every=5, last_step=12, mem_every=2)  # fmt: skip
    try:
        kinds = {step: saver.kind(step) for step in range(1, 13)}
        assert [s for s, k in kinds.items() if k is SaveKind.DURABLE] == [5, 10, 12]
        assert [s for s, k in kinds.items() if k is SaveKind.MEMORY] == [2, 4, 6, 8]
        assert [s for s in range(1, 13) if saver.should_save(s)] == [2, 4, 5, 6, 8, 10, 12]
    finally:
        saver.close()


def test_a_lazy_memory_save_holds_its_steps_state_bitwise_though_training_goes_on_at_once(ckptd):
    model, _ = tiny_model(None)
    trainer = TinyTrainer(model, steps=8)
    saver = Checkpointer(ckptd.address, "lazy", model, trainer.optimizer, trainer.scheduler,
                         trainer.loader, every=0, last_step=8, mem_every=1)  # fmt: skip
    trainer.step(), trainer.step()
    expected = state_sha256(model.state_dict()), _optimizer_digest(trainer.optimizer)
    sample = trainer.loader.offset()
    started = saver.save(2, labels={})
    assert started is not None and started.kind is SaveKind.MEMORY
    saver.wait_staged()  # what train_step waits for before its optimizer step
    straight = [trainer.step() for _ in range(2)]
    done = saver.finish()
    # In the rank's own memory (one node: no peer to mirror to), not through ckptd.
    assert [d.error for d in done] == [None] and done[0].info is None
    with CkptdClient(ckptd.address) as client, pytest.raises(NotFound):
        client.get("lazy")

    saver.load(2)
    assert (state_sha256(model.state_dict()), _optimizer_digest(trainer.optimizer)) == expected
    assert trainer.loader.offset() == sample
    assert [trainer.step() for _ in range(2)] == straight
    saver.close()


def test_a_save_after_a_restart_leaves_the_restored_steps_copy_whole(ckptd):
    # Saves take turns on two sets of buffers (the rank's own copies); one after a restart must
    # not overwrite the step the job just restored, its only whole copy until the save is
    # sealed: a failure during it would find no step to resume from.
    model, _ = tiny_model(None)
    trainer = TinyTrainer(model, steps=8)

    def checkpointer() -> Checkpointer:
        return Checkpointer(ckptd.address, "turns", model, trainer.optimizer, trainer.scheduler,
                            trainer.loader, every=0, last_step=8, mem_every=1)  # fmt: skip

    first = checkpointer()
    for step in (1, 2, 3):
        trainer.step()
        assert first.save(step, labels={}) is not None
        first.wait_staged()
    assert [d.error for d in first.finish()] == [None, None, None]
    restarted = checkpointer()  # the same rank's next generation (its copies outlive it)
    assert resume(restarted, "turns") == 3
    trainer.step()
    assert restarted.save(4, labels={}) is not None
    assert [d.error for d in restarted.finish()] == [None]
    assert own_steps(restarted) == {3, 4}
    restarted.close()
