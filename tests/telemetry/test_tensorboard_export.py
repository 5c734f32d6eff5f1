"""A stored run's curves become TensorBoard event files that TensorBoard's own reader reads back:
every scalar per step, computed from what telemetry stored, with eval loss when a step has one."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from scaletrain.app import cli
from scaletrain.errors import NotFound
from scaletrain.v1 import telemetry_pb2
from telemetry.client import rank_step
from telemetry.models import Event
from telemetry.scalars import SCALAR_COLUMNS, step_scalars
from telemetry.store import TelemetryStore
from telemetry.tensorboard import TAGS, write_tensorboard

STEPS = 4
RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]


def stored_run(store: TelemetryStore, engine: Engine, run_request: RegisterRun) -> None:
    """Two ranks, four steps: 1,000 tokens a rank and 0.5 s a step (the slower rank), step 2
    blocked 0.1 s by a checkpoint; an eval event at step 4."""
    store.register_run(run_request(world_size=2, peak_flops=1e12))
    store.add_steps([
        rank_step("run-1", step, rank, loss=2.0 / step, grad_norm=1.5, tokens=1000, lr=1e-3 * step,
                  times={"step": 0.4 + 0.1 * rank, "checkpoint": 0.1 if step == 2 else 0.0})
        for step in range(1, STEPS + 1)
        for rank in range(2)
    ])  # fmt: skip
    store.roll_up("run-1")  # what the service does as each step completes
    with engine.begin() as connection:
        connection.execute(
            Event.__table__.insert().values(
                run_id="run-1",
                step=4,
                rank=-1,
                kind="eval",
                message="",
                time=datetime.now(UTC),
                attributes={"loss": "0.75"},
            )
        )


def test_step_scalars_compute_each_curve_from_the_stored_records(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    stored_run(store, engine, run_request)
    scalars = step_scalars(engine, "run-1")
    assert list(scalars.columns) == SCALAR_COLUMNS and list(scalars["step"]) == [1, 2, 3, 4]
    row = scalars.set_index("step").loc[2]
    assert row["loss"] == pytest.approx(1.0) and row["lr"] == pytest.approx(2e-3)
    assert row["grad_norm"] == pytest.approx(1.5)
    assert row["tokens_per_s"] == pytest.approx(2000 / 0.5)
    assert row["mfu"] == pytest.approx(6 * 1_000_000 * 4000 / (2 * 1e12))
    assert row["checkpoint_stall_s"] == pytest.approx(0.1)
    assert row["goodput"] == pytest.approx(0.4 / 0.5)
    assert math.isnan(row["eval_loss"]) and scalars["eval_loss"].iloc[-1] == 0.75


def test_the_event_files_read_back_with_tensorboards_reader_give_every_scalar(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun, tmp_path: Path
) -> None:
    stored_run(store, engine, run_request)
    logdir, written = write_tensorboard(engine, "run-1", tmp_path)
    events = EventAccumulator(str(logdir))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(TAGS.values())
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(s, pytest.approx(2.0 / s)) for s in range(1, STEPS + 1)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(4, 0.75)]
    assert written == 7 * STEPS + 1


def test_an_unknown_run_is_refused_in_one_line(engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="run 'nope' is not registered"):
        write_tensorboard(engine, "nope", tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_scaletrain_telemetry_export_writes_the_event_files_of_a_stored_run(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun, db_url: str,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    stored_run(store, engine, run_request)
    out = tmp_path / "tb"
    argv = ["telemetry", "export", "--db", db_url, "--tensorboard", str(out), "--run", "run-1"]
    assert cli.main(argv) == 0
    assert "29 scalars of run run-1" in capsys.readouterr().err
    assert list((out / "run-1").glob("events.out.tfevents.*"))
    assert cli.main(["telemetry", "export", "--db", db_url, "--run", "run-1"]) == 1
    assert "needs --tensorboard DIR and --run RUN" in capsys.readouterr().err
