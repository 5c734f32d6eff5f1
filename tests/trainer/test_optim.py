"""The optimizer and the schedule: AdamW without decay on norms, biases and embeddings; each LR
curve against its reference formula; gradient accumulation equal to the large batch on several
layouts (one 4-rank job: micro-batches on every rank, FSDP reducing only in the last)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import TrainConfig
from trainer.model.llama import ModelArgs, Transformer
from trainer.optim import build_optimizer, build_scheduler, lr_factor
from trainer.parallel.probe import config_from_layout, launch, reference

STEPS, WARMUP, FLOOR = 100, 10, 0.05


def reference_factor(decay: str, step: int) -> float:
    """Each curve as the literature writes it: warm-up (s+1)/W, then over p in [0, 1]."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    p = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
    return {
        "constant": 1.0,
        "linear": 1 - (1 - FLOOR) * p,
        "cosine": FLOOR + (1 - FLOOR) * (1 + math.cos(math.pi * p)) / 2,
        # Stable until the last 20% of the post-warm-up steps, then linear to the floor.
        "wsd": 1 - (1 - FLOOR) * min(1.0, max(0.0, (p - 0.8) / 0.2)),
    }[decay]


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine", "wsd"])
def test_every_schedule_follows_its_reference_formula_through_the_scheduler(decay: str) -> None:
    cfg = TrainConfig(run_id="r", steps=STEPS, warmup_steps=WARMUP, decay=decay,
                      min_lr_ratio=FLOOR, lr=1.0)  # fmt: skip
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg)
    seen = []
    for _ in range(STEPS + 5):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    expected = [reference_factor(decay, s) for s in range(STEPS + 5)]
    assert seen == pytest.approx(expected, abs=1e-12)


def test_the_default_schedule_is_the_trainers_former_warm_up_and_cosine_to_ten_percent() -> None:
    factor = lr_factor(TrainConfig(run_id="r", steps=300))

    def former(s: int) -> float:  # the trainer's schedule before it had options
        if s < 20:
            return (s + 1) / 20
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * ((s - 20) / 280)))

    assert [factor(s) for s in range(300)] == [former(s) for s in range(300)]


def test_norms_biases_and_embeddings_get_no_weight_decay_by_default() -> None:
    model = Transformer(ModelArgs())
    decayed, plain = build_optimizer(model, TrainConfig(run_id="r")).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {names[id(p)] for p in plain["params"]} == {
        n for n, p in model.named_parameters() if "norm" in n or "embeddings" in n
    }
    everything = build_optimizer(model, TrainConfig(run_id="r", no_decay=()))
    assert [len(g["params"]) for g in everything.param_groups] == [len(list(model.parameters())), 0]


ACCUMULATED = {
    "dp4-accum2": {"parallel": {}, "grad_accum_steps": 2},
    "hsdp2x2-accum4": {"parallel": {"dp_replicate": 2}, "grad_accum_steps": 4},
    "tp2.dp2-accum2": {"parallel": {"tp": 2}, "grad_accum_steps": 2},
}
MODEL = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4}


def test_gradient_accumulation_equals_the_large_batch_on_every_layout() -> None:
    layouts = [{"name": n, "model": MODEL, "global_batch": 16, **spec}
               for n, spec in ACCUMULATED.items()]  # fmt: skip
    measured = launch(4, layouts, steps=3)
    for layout in layouts:
        # The reference trains the whole global batch at once, in one process.
        expected = reference(config_from_layout({**layout, "grad_accum_steps": 1}), 3)
        got = measured[layout["name"]]
        assert got["losses"] == pytest.approx(expected.losses, rel=2e-5), layout["name"]
        assert got["grad_norms"] == pytest.approx(expected.grad_norms, rel=2e-5), layout["name"]
        for key, value in expected.state.items():
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-4)
