"""The whole platform end to end: `scaletrain run` on 4 CPU ranks, then everything it promised.

One run (two checkpoints) and one resumed run share a work directory; every check reads what a
user would read: the JSON summary, the telemetry database, `ckpt ls`, `ckpt export` loaded with
stock torch.distributed.checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from sqlalchemy import create_engine, text

from trainer.checkpoint.digest import state_sha256
from trainer.model.llama import ModelArgs, Transformer

pytestmark = pytest.mark.e2e

RANKS, STEPS, EVERY = 4, 6, 3
ALL_TIERS = ["memory", "ssd", "s3"]


def scaletrain(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack")


@pytest.fixture(scope="module")
def first_run(workdir: Path) -> dict:
    result = scaletrain(
        "run", "--workdir", str(workdir), "--ranks", str(RANKS), "--steps", str(STEPS),
        "--ckpt-every", str(EVERY), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_the_run_trains_every_step_and_reports_its_loss(first_run: dict):
    assert first_run["steps"] == STEPS
    assert first_run["first_loss"] > first_run["last_loss"] > 0
    assert first_run["tokens_per_s"] > 0
    assert first_run["ui_command"].startswith("scaletrain ui --workdir")


def test_every_checkpoint_is_committed_on_memory_ssd_and_s3(first_run: dict):
    steps = [c["step"] for c in first_run["checkpoints"]]
    assert steps == [EVERY, STEPS]
    for checkpoint in first_run["checkpoints"]:
        assert checkpoint["tiers"] == ALL_TIERS
        assert checkpoint["bytes"] > 0


def test_telemetry_holds_a_record_for_every_rank_and_step(first_run: dict, workdir: Path):
    engine = create_engine(f"sqlite:///{workdir / 'telemetry.db'}")
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT step, rank FROM rank_steps WHERE run_id = :run"),
            {"run": first_run["run_id"]},
        ).all()
    engine.dispose()
    assert sorted(rows) == [(s, r) for s in range(1, STEPS + 1) for r in range(RANKS)]


def test_the_offline_listing_shows_the_tiers_that_outlive_the_services(
    first_run: dict, workdir: Path
):
    result = scaletrain("ckpt", "ls", "--workdir", str(workdir), "--json")
    assert result.returncode == 0, result.stderr
    listed = {(c["run"], c["step"]): c["tiers"] for c in json.loads(result.stdout)}
    # The memory tier died with ckptd; SSD and S3 copies remain.
    assert listed[(first_run["run_id"], STEPS)] == ["ssd", "s3"]


def test_an_exported_checkpoint_restores_bit_exactly_into_a_fresh_model_with_stock_dcp(
    first_run: dict, workdir: Path, tmp_path: Path
):
    dest = tmp_path / "export"
    result = scaletrain(
        "ckpt", "export", "--workdir", str(workdir), first_run["run_id"], str(STEPS), str(dest)
    )
    assert result.returncode == 0, result.stderr
    assert (dest / ".metadata").exists()
    fresh = Transformer(ModelArgs())
    state = {"model": fresh.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(dest)))
    fresh.load_state_dict(state["model"])
    assert state_sha256(fresh.state_dict()) == first_run["params_sha256"]
    logits = fresh(torch.arange(16).view(1, 16))
    assert torch.isfinite(logits).all()


def test_a_resumed_run_continues_from_the_latest_checkpoint(first_run: dict, workdir: Path):
    result = scaletrain(
        "run", "--workdir", str(workdir), "--ranks", str(RANKS), "--steps", str(STEPS + 2),
        "--ckpt-every", str(EVERY), "--resume", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = json.loads(result.stdout)
    assert resumed["run_id"] == first_run["run_id"]
    assert f"resumed run {first_run['run_id']} from step {STEPS}" in result.stderr
    assert resumed["steps"] == STEPS + 2
    assert [c["step"] for c in resumed["checkpoints"]] == [EVERY, STEPS, STEPS + 2]
