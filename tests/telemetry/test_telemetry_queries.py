"""The UI's queries on SQLite and PostgreSQL: aggregates, latest attempts and downsampling."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from scaletrain.errors import NotFound
from scaletrain.v1 import telemetry_pb2
from telemetry import queries
from telemetry.client import event, rank_step
from telemetry.store import TelemetryStore

RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]


@pytest.fixture
def filled(store: TelemetryStore, run_request: RegisterRun) -> TelemetryStore:
    """Run "run-1": 2 ranks x 100 steps, loss 100/(step+1) on rank 0 and twice that on rank 1,
    rank 1 twice as slow; rank 0's loss at step 3 is NaN; steps 90-99 replayed by attempt 1 with
    loss 1.0. Run "run-2" is registered but has no records."""
    store.register_run(run_request(world_size=2))
    store.register_run(run_request("run-2", world_size=1))
    store.add_steps(
        [
            rank_step(
                "run-1",
                step,
                rank,
                loss=math.nan if (step, rank) == (3, 0) else 100.0 * (rank + 1) / (step + 1),
                tokens=1000,
                times={"step": 0.5 * (rank + 1)},
            )
            for step in range(100)
            for rank in range(2)
        ]
    )
    store.add_steps(
        [
            rank_step("run-1", step, rank, loss=1.0, tokens=1000, times={"step": 0.5}, attempt=1)
            for step in range(90, 100)
            for rank in range(2)
        ]
    )
    store.add_events(
        [
            event("run-1", "checkpoint_committed", step=50, tier="ssd", bytes=10, seconds=1.5),
            event("run-1", "straggler", step=60, rank=1, message="rank 1 is 2x slower"),
        ]
    )
    return store


def test_runs_overview_summarises_each_run_with_its_latest_step(
    filled: TelemetryStore, engine: Engine
) -> None:
    runs = queries.runs_overview(engine).set_index("run_id")
    assert list(runs.reset_index().columns) == queries.RUNS_COLUMNS
    assert set(runs.index) == {"run-1", "run-2"}
    first = runs.loc["run-1"]
    assert (first["status"], first["world_size"], first["last_step"]) == ("running", 2, 99)
    assert first["last_loss"] == pytest.approx(1.0)
    # The last 20 steps: 2 ranks x 1000 tokens per step, each step 0.5 s (steps 90-99, replayed)
    # or 1.0 s (steps 80-89, where rank 1 is the slowest).
    assert first["tokens_per_s"] == pytest.approx(20 * 2000 / (10 * 0.5 + 10 * 1.0))
    assert math.isnan(runs.loc["run-2"]["last_loss"])


def test_runs_overview_of_an_empty_database_has_the_columns_and_no_rows(engine: Engine) -> None:
    runs = queries.runs_overview(engine)
    assert runs.empty
    assert list(runs.columns) == queries.RUNS_COLUMNS


def test_loss_curve_averages_ranks_skipping_nan_and_counting_only_the_latest_attempt(
    filled: TelemetryStore, engine: Engine
) -> None:
    curve = queries.loss_curve(engine, "run-1").set_index("step")
    assert len(curve) == 100
    assert curve.loc[1, "loss"] == pytest.approx((50.0 + 100.0) / 2)
    assert curve.loc[3, "loss"] == pytest.approx(50.0)
    assert curve.loc[95, "loss"] == pytest.approx(1.0)


def test_loss_curve_of_a_long_run_is_downsampled_keeping_each_buckets_extremes(
    filled: TelemetryStore, engine: Engine
) -> None:
    curve = queries.loss_curve(engine, "run-1", max_points=10)
    assert len(curve) == 10
    first = curve.iloc[0]
    assert first["step"] == 9
    assert (first["loss_min"], first["loss_max"]) == (pytest.approx(10.0), pytest.approx(200.0))


def test_rank_step_times_show_each_rank_per_step_bucket(
    filled: TelemetryStore, engine: Engine
) -> None:
    times = queries.rank_step_times(engine, "run-1", max_steps=25)
    assert list(times.columns) == queries.STEP_TIME_COLUMNS
    assert len(times) == 25 * 2
    early = times[times["step"] == 3].set_index("rank")["step_s"]
    assert early.to_dict() == {0: pytest.approx(0.5), 1: pytest.approx(1.0)}


def test_queries_of_a_run_without_records_are_empty(filled: TelemetryStore, engine: Engine) -> None:
    assert queries.loss_curve(engine, "run-2").empty
    assert queries.rank_step_times(engine, "run-2").empty
    assert queries.events(engine, "run-2").empty


def test_events_are_listed_newest_first(filled: TelemetryStore, engine: Engine) -> None:
    listed = queries.events(engine, "run-1")
    assert list(listed.columns) == queries.EVENT_COLUMNS
    assert list(listed["kind"]) == ["straggler", "checkpoint_committed"]
    assert listed.iloc[1]["tier"] == "ssd"


def test_queries_read_through_a_session_as_well_as_an_engine(
    filled: TelemetryStore, engine: Engine
) -> None:
    with Session(engine) as session:
        through_session = queries.loss_curve(session, "run-1")
    assert through_session.equals(queries.loss_curve(engine, "run-1"))


def test_run_summary_gives_the_headline_numbers_of_a_finished_run(
    filled: TelemetryStore, engine: Engine
) -> None:
    filled.add_events(
        [event("run-1", "run_finished", step=99, attributes={"params_sha256": "abc123"})]
    )
    summary = queries.run_summary(engine, "run-1")
    assert (summary.status, summary.last_step, summary.params_sha256) == ("finished", 99, "abc123")
    assert (summary.first_loss, summary.last_loss) == (pytest.approx(150.0), pytest.approx(1.0))
    # 100 steps of 2000 tokens; 90 steps of 1.0 s (rank 1 is the slowest) and 10 replayed of 0.5 s.
    assert summary.tokens_per_s == pytest.approx(100 * 2000 / (90 * 1.0 + 10 * 0.5))


def test_run_summary_of_a_run_without_records_or_of_no_run(
    filled: TelemetryStore, engine: Engine
) -> None:
    summary = queries.run_summary(engine, "run-2")
    assert (summary.last_step, summary.params_sha256) == (None, "")
    assert math.isnan(summary.last_loss) and math.isnan(summary.tokens_per_s)
    with pytest.raises(NotFound, match="run 'ghost' is not registered"):
        queries.run_summary(engine, "ghost")
