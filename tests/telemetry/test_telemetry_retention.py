"""Retention and the migration to rollups, on SQLite and PostgreSQL: old per-rank rows go in
bounded batches while ingest goes on, never a row a rollup still needs nor the offsets a resume
reads; a database from before rollups keeps every row and gets its rollups from them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, func, select

from scaletrain.errors import UserError
from scaletrain.v1 import telemetry_pb2
from telemetry.client import event, rank_step
from telemetry.config import KEEP_STEPS_ENV, PARTITION_STEPS_ENV, partition_steps, retention_policy
from telemetry.db import alembic_config, migrate
from telemetry.efficiency import goodput
from telemetry.models import Event, NodeStep, Rank, RankStep, Run, StepRollup
from telemetry.partitions import DEFAULT_PARTITION_STEPS
from telemetry.retention import Retention, RetentionPolicy
from telemetry.store import TelemetryStore

RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]


def records(steps: range, ranks: int = 4) -> list[telemetry_pb2.RankStep]:
    return [
        rank_step("run-1", step, rank, loss=1.0, tokens=10, times={"step": 0.5, "compute": 0.4},
                  offset=(step * ranks, step, 0))
        for step in steps
        for rank in range(ranks)
    ]  # fmt: skip


@pytest.fixture
def store(engine: Engine) -> TelemetryStore:
    """Ranges of 10 steps on PostgreSQL: the windows below end on their boundaries, so both
    databases keep exactly the same rows."""
    return TelemetryStore(engine, partition_steps=10)


def stored_steps(engine: Engine, table: type = RankStep) -> set[int]:
    with engine.connect() as connection:
        return set(connection.execute(select(table.step).distinct()).scalars())


def test_retention_keeps_the_recent_window_unrolled_steps_and_the_resume_points_offsets(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request(world_size=4))
    store.add_steps(records(range(1, 101)))
    # Steps 1-60 completed and were rolled up; 61-100 still wait for their rollups.
    store.add_rollups([], [("run-1", 0, step) for step in range(1, 61)])
    store.add_events([event("run-1", "checkpoint_committed", step=10, tier="ssd")])
    before = goodput(engine, "run-1")
    retention = Retention(store, RetentionPolicy(keep_steps=20, batch_rows=8, pause_s=0))
    assert retention.sweep() == 4 * 39  # steps 1-40 but 10, 4 ranks each
    assert stored_steps(engine) == {10, *range(41, 101)}
    assert stored_steps(engine, NodeStep) == set(range(41, 61))
    assert stored_steps(engine, StepRollup) == set(range(1, 61))
    # What the run's figures and its resume read is all still there.
    assert goodput(engine, "run-1") == before
    resume = store.resume_point("run-1")
    assert (resume.step, [o.rank for o in resume.offsets]) == (10, [0, 1, 2, 3])
    assert retention.sweep() == 0


def test_retention_deletes_in_batches_between_which_ingest_goes_on(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request(world_size=4))
    store.add_steps(records(range(1, 301)))
    store.roll_up()
    # One step (4 rows) a batch: 280 short transactions, ingest takes its turn between them.
    retention = Retention(store, RetentionPolicy(keep_steps=20, batch_rows=4, pause_s=0.005))
    sweeping = threading.Thread(target=retention.sweep)
    sweeping.start()
    during = []
    for step in range(301, 311):
        store.add_steps(records(range(step, step + 1)))
        during.append(sweeping.is_alive())
    sweeping.join()
    assert all(during)
    assert stored_steps(engine) == set(range(281, 311))


def test_a_database_from_before_rollups_keeps_every_row_and_gets_rollups_from_them(
    engine: Engine, run_request: RegisterRun
) -> None:
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.downgrade(config, "0003")
    # What revision 0003 stored (rank_steps, runs, ranks and events are unchanged since).
    old = TelemetryStore(engine)
    old.register_run(run_request(world_size=4))
    old.add_steps(records(range(1, 31)))
    old.add_events([event("run-1", "alert", step=20)])  # (a checkpoint event needs 0005's key)
    tables = (Run, Rank, RankStep, Event)

    def counts() -> list[int]:
        with engine.connect() as connection:
            return [
                connection.execute(select(func.count()).select_from(t)).scalar() for t in tables
            ]

    before = counts()
    migrate(engine)
    assert counts() == before == [1, 4, 120, 1]
    # The service's start rolls up every step that has rows and no rollup.
    assert TelemetryStore(engine).roll_up() == 30
    assert stored_steps(engine, StepRollup) == set(range(1, 31))
    assert goodput(engine, "run-1").productive_s > 0


def test_the_per_rank_window_comes_from_the_flag_then_the_environment_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(KEEP_STEPS_ENV, raising=False)
    assert retention_policy(None) == RetentionPolicy()
    monkeypatch.setenv(KEEP_STEPS_ENV, "20000")
    assert retention_policy(None).keep_steps == 20_000
    assert retention_policy("50").keep_steps == 50


def test_the_steps_per_range_partition_come_from_the_environment_or_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PARTITION_STEPS_ENV, raising=False)
    assert partition_steps() == DEFAULT_PARTITION_STEPS
    monkeypatch.setenv(PARTITION_STEPS_ENV, "250")
    assert partition_steps() == 250
    monkeypatch.setenv(PARTITION_STEPS_ENV, "0")
    with pytest.raises(UserError, match=rf"^\${PARTITION_STEPS_ENV} must be a whole number"):
        partition_steps()


@pytest.mark.parametrize(
    ("flag", "environment", "named"),
    [
        ("0", None, "--keep-steps"),
        ("ten", None, "--keep-steps"),
        (None, "-5", f"${KEEP_STEPS_ENV}"),
    ],
    ids=["zero-flag", "word-flag", "negative-variable"],
)
def test_a_bad_retention_window_is_refused_naming_the_flag_or_the_variable(
    monkeypatch: pytest.MonkeyPatch, flag: str | None, environment: str | None, named: str
) -> None:
    monkeypatch.delenv(KEEP_STEPS_ENV, raising=False)
    if environment is not None:
        monkeypatch.setenv(KEEP_STEPS_ENV, environment)
    with pytest.raises(UserError, match=r"whole number of steps >= 1") as refused:
        retention_policy(flag)
    assert str(refused.value).startswith(named)


def test_the_service_command_stops_on_a_bad_retention_window_with_one_line(
    tmp_path: Path,
) -> None:
    env = {key: value for key, value in os.environ.items() if key != KEEP_STEPS_ENV}
    database = tmp_path / "telemetry.db"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaletrain",
            "telemetry",
            "--listen",
            "127.0.0.1:0",
            "--db",
            f"sqlite:///{database}",
            "--keep-steps",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert "--keep-steps must be a whole number of steps >= 1" in line and "'0'" in line
    assert not database.exists()
