"""Training the tiny model with each FP8 recipe ends where bf16 training does (within 1%)."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from fp8_testing import DISTRIBUTED_STEPS, LAYOUTS, TinyTrainer, distributed_job, tiny_model

from trainer.fp8.recipes import RECIPES

# 16 steps keep `make test` short; FP8_LOSS_GAP_STEPS=200 measures the 200-step gap.
STEPS = int(os.environ.get("FP8_LOSS_GAP_STEPS", "16"))
TAIL = 4  # the end of a run: the mean loss of its last steps, as one step's loss is noisy


@pytest.fixture(scope="module")
def curves() -> dict[str, list[float]]:
    """Loss curves of bf16 (None) and of every recipe, over the same batches from the same init."""
    return {name: TinyTrainer(tiny_model(name)[0]).losses(STEPS) for name in (None, *RECIPES)}


def end(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / TAIL


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_training_ends_within_one_percent_of_the_bf16_loss_without_nan_or_inf(curves, name):
    assert all(math.isfinite(loss) for loss in curves[name])
    bf16, fp8 = end(curves[None]), end(curves[name])
    assert fp8 < 0.75 * curves[name][0], "the model did not learn"
    gap = (fp8 - bf16) / bf16
    print(f"{name}: loss {fp8:.4f} vs bf16 {bf16:.4f} after {STEPS} steps: gap {gap:+.3%}")
    assert abs(gap) < 0.01


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_every_recipe_trains_under_data_and_tensor_parallelism_like_bf16(tmp_path):
    """dp2·tp2 (FSDP2 x torch's tensor parallel) for every recipe; FSDP dp4 and HSDP 2x2 for
    delayed scaling, whose amax histories must then be the same on every rank."""
    out = tmp_path / "losses.json"
    mp.start_processes(
        distributed_job, args=(4, _free_port(), str(out)), nprocs=4, start_method="spawn"
    )
    results = json.loads(Path(out).read_text())
    # Data parallelism does not change the loss: every layout is held to bf16 under dp2·tp2.
    bf16 = end(results["dp2·tp2 bf16"])
    runs = [f"dp2·tp2 {name}" for name in RECIPES]
    runs += [f"{layout} tensorwise-delayed" for layout in LAYOUTS if layout != "dp2·tp2"]
    for run in runs:
        losses = results[run]
        assert len(losses) == DISTRIBUTED_STEPS and all(math.isfinite(x) for x in losses), run
        gap = (end(losses) - bf16) / bf16
        print(f"{run}: loss {end(losses):.4f} vs bf16 {bf16:.4f}: gap {gap:+.3%}")
        assert abs(gap) < 0.01, run
    for layout in LAYOUTS:
        assert results[f"{layout} tensorwise-delayed histories agree"], layout
