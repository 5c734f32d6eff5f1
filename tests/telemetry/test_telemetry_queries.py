"""Queries on SQLite and PostgreSQL: events, and run summaries counting only latest attempts."""

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


def test_a_run_without_events_lists_none(filled: TelemetryStore, engine: Engine) -> None:
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
        through_session = queries.events(session, "run-1")
    assert through_session.equals(queries.events(engine, "run-1"))


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


def test_kept_steps_take_each_step_from_the_latest_attempt_that_trained_it(
    store: TelemetryStore, run_request: RegisterRun, engine: Engine
) -> None:
    """A global batch of 4: steps 1-2 on 2 ranks (attempt 0), step 2 again and step 3 on 4
    ranks (attempt 1, resized); every sample read once, by the steps the run kept."""
    store.register_run(run_request(world_size=4))

    def record(step: int, ranks: int, attempt: int) -> list[telemetry_pb2.RankStep]:
        share = 4 // ranks
        return [
            rank_step(
                "run-1", step, rank, loss=float(step), lr=step / 8, attempt=attempt,
                offset=(4 * step, 4 * step + rank * share, 0),
            )
            for rank in range(ranks)
        ]  # fmt: skip

    store.add_steps(record(1, 2, 0) + record(2, 2, 0) + record(2, 4, 1) + record(3, 4, 1))
    kept = queries.kept_steps(engine, "run-1")
    assert {step: len(ranks) for step, ranks in kept.items()} == {1: 2, 2: 4, 3: 4}
    assert kept[3][1] == queries.KeptRankStep(rank=1, rank_sample=13, loss=3.0, lr=0.375, world=4)
    assert queries.consumed_samples(kept, 4) == list(range(12))
    assert queries.unrecorded(kept) == []
    # Rank 3's record of step 3 lost: its slice is not known, the others' still are.
    lost = {**kept, 3: kept[3][:3]}
    assert queries.unrecorded(lost) == [3]
    assert queries.consumed_samples(lost, 4) == list(range(11))
    # A step whose slice was read twice, and one never read, show in the order.
    kept[2] = kept[1]
    assert queries.consumed_samples(kept, 4) == [0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11]
