"""The telemetry store on SQLite and PostgreSQL: runs, idempotent records, events, resume points."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from scaletrain.errors import InvalidArgument, NotFound
from scaletrain.v1 import common_pb2, telemetry_pb2
from telemetry.client import event, rank_step
from telemetry.columns import columns_of
from telemetry.models import Event, Rank, RankStep, Run
from telemetry.store import TelemetryStore

RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]


def records(
    steps: range, ranks: int = 4, run_id: str = "run-1", attempt: int = 0
) -> list[telemetry_pb2.RankStep]:
    """Records whose data offsets say where the next step starts: 8 samples a step, 2 a rank."""
    return [
        rank_step(
            run_id,
            step,
            rank,
            loss=1.0 / (step + 1),
            tokens=512,
            times={"step": 0.1 * (rank + 1)},
            offset=((step + 1) * 8, (step + 1) * 8 + rank * 2, attempt),
            attempt=attempt,
        )
        for step in steps
        for rank in range(ranks)
    ]


def test_registering_a_new_run_creates_it_with_its_ranks(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    assert store.register_run(run_request()).created is True
    with Session(engine) as session:
        run = session.get_one(Run, "run-1")
        assert (run.status, run.world_size, run.dp_shard, run.tp) == ("running", 4, 4, 1)
        assert run.started_at.tzinfo == UTC
        assert session.scalar(select(func.count()).select_from(Rank)) == 4


def test_registering_again_resumes_the_run_with_its_new_description(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    store.add_events([event("run-1", "run_failed", step=7)])
    resumed = run_request(world_size=2)
    resumed.ranks[0].host = "other-node"

    assert store.register_run(resumed).created is False
    with Session(engine) as session:
        run = session.get_one(Run, "run-1")
        assert (run.status, run.finished_at, run.world_size) == ("running", None, 2)
        assert session.get_one(Rank, ("run-1", 0)).host == "other-node"


def test_step_records_are_stored_once_and_resent_ones_count_as_duplicates(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())

    assert store.add_steps(records(range(5))) == (20, 0)
    assert store.add_steps(records(range(3, 8))) == (12, 8)
    assert store.add_steps(records(range(3), attempt=1)) == (12, 0)
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(RankStep)) == 44


def test_batches_stored_together_each_count_their_own_new_records_when_some_are_resent(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    store.add_steps(records(range(5)))

    def batch(steps: range) -> telemetry_pb2.StepBatch:
        return telemetry_pb2.StepBatch(columns=columns_of(records(steps)))

    # The second batch resends part of what is stored, the last is the second sent twice at once.
    results = store.add_step_batches([batch(range(3, 8)), batch(range(8, 10)), batch(range(3, 8))])
    assert [(new, repeated) for new, repeated, _ in results] == [(12, 8), (8, 0), (0, 20)]
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(RankStep)) == 40


def test_a_nan_loss_is_stored_and_read_back_as_nan(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    store.add_steps([rank_step("run-1", 0, 0, loss=math.nan, grad_norm=math.inf)])
    with Session(engine) as session:
        record = session.get_one(RankStep, ("run-1", 0, 0, 0))
    assert math.isnan(record.loss)
    assert record.grad_norm == math.inf


def test_record_times_come_back_as_the_same_utc_instant(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    record = rank_step("run-1", 0, 0, loss=1.0)
    when = datetime(2026, 5, 17, 10, 30, 15, 123456, tzinfo=UTC)
    record.time.FromDatetime(when)
    store.add_steps([record])
    with Session(engine) as session:
        assert session.get_one(RankStep, ("run-1", 0, 0, 0)).time == when


def test_resume_point_is_the_latest_committed_step_with_offsets_of_each_ranks_latest_attempt(
    store: TelemetryStore, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    store.add_steps(records(range(10)))
    # A restart replayed step 6 on rank 1: its newer record is the one that counts.
    replay = records(range(6, 7), attempt=1)[1]
    replay.data_offset.rank_sample = 999
    store.add_steps([replay])
    store.add_events(
        [
            event("run-1", "checkpoint_committed", step=3, tier="ssd"),
            event("run-1", "checkpoint_committed", step=6, tier="memory"),
            event("run-1", "checkpoint_started", step=9),
        ]
    )

    point = store.resume_point("run-1")

    assert (point.found, point.step) == (True, 6)
    assert [(o.rank, o.offset.global_sample, o.offset.rank_sample) for o in point.offsets] == [
        (0, 56, 56),
        (1, 56, 999),
        (2, 56, 60),
        (3, 56, 62),
    ]


def test_resume_point_at_a_given_step_uses_that_steps_offsets(
    store: TelemetryStore, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    store.add_steps(records(range(10)))
    point = store.resume_point("run-1", step=4)
    assert (point.found, point.step, len(point.offsets)) == (True, 4, 4)
    assert point.offsets[3].offset.rank_sample == 46


def test_resume_point_is_not_found_before_any_checkpoint_commits(
    store: TelemetryStore, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    store.add_steps(records(range(3)))
    store.add_events([event("run-1", "checkpoint_staged", step=2, tier="memory")])
    assert store.resume_point("run-1").found is False


@pytest.mark.parametrize(
    ("kind", "status"), [("run_finished", "finished"), ("run_failed", "failed")]
)
def test_a_run_ending_event_sets_the_run_status(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun, kind: str, status: str
) -> None:
    store.register_run(run_request())
    ended = event("run-1", kind, step=10)
    store.add_events([ended])
    with Session(engine) as session:
        run = session.get_one(Run, "run-1")
    assert (run.status, run.finished_at) == (status, ended.time.ToDatetime(tzinfo=UTC))


def test_a_resent_event_is_stored_once_and_keeps_its_checkpoint_details(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    committed = event(
        "run-1",
        "checkpoint_committed",
        step=5,
        tier="s3",
        bytes=1 << 30,
        seconds=2.5,
        attributes={"path": "s3://bucket/run-1/5"},
    )
    assert store.add_events([committed]) == 1
    assert store.add_events([committed]) == 0
    with Session(engine) as session:
        stored = session.scalars(select(Event)).one()
    assert (stored.kind, stored.tier, stored.bytes, stored.seconds) == (
        "checkpoint_committed",
        "s3",
        1 << 30,
        2.5,
    )
    assert stored.attributes == {"path": "s3://bucket/run-1/5"}


def test_reports_of_an_unregistered_run_are_not_found(store: TelemetryStore) -> None:
    with pytest.raises(NotFound, match="run 'ghost' is not registered"):
        store.add_steps(records(range(1), run_id="ghost"))
    with pytest.raises(NotFound):
        store.add_events([event("ghost", "alert")])
    with pytest.raises(NotFound):
        store.resume_point("ghost")


def _bad_record(**changes: object) -> Callable[[], telemetry_pb2.RankStep]:
    def build() -> telemetry_pb2.RankStep:
        record = rank_step("run-1", 1, 1, loss=1.0)
        for path, value in changes.items():
            target = record
            *parents, field = path.split("__")
            for parent in parents:
                target = getattr(target, parent)
            setattr(target, field, value)
        return record

    return build


@pytest.mark.parametrize(
    ("build", "problem"),
    [
        (_bad_record(run_id=""), "run_id is empty"),
        (_bad_record(step=-1), "step must not be negative"),
        (_bad_record(rank=-2), "rank must not be negative"),
        (_bad_record(rank=4), "rank 4 is outside run 'run-1' of world size 4"),
        (_bad_record(times__step=math.nan), "times.step must be finite"),
        (_bad_record(times__comm_wait=-1.0), "times.comm_wait must be finite and >= 0"),
        (_bad_record(lr=math.inf), "lr must be finite"),
        (_bad_record(tokens=-5), "tokens must not be negative"),
        (_bad_record(data_offset__rank_sample=-1), "data_offset.rank_sample must not be negative"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_bad_step_record_is_refused_with_one_line_and_its_batch_is_not_stored(
    store: TelemetryStore,
    engine: Engine,
    run_request: RegisterRun,
    build: Callable[[], telemetry_pb2.RankStep],
    problem: str,
) -> None:
    store.register_run(run_request())
    with pytest.raises(InvalidArgument, match=problem) as caught:
        store.add_steps([*records(range(1)), build()])
    assert "\n" not in str(caught.value)
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(RankStep)) == 0


@pytest.mark.parametrize(
    ("build", "problem"),
    [
        (lambda r: r(run_id=""), "run_id is empty"),
        (lambda r: r(world_size=0), "world_size must be at least 1"),
        (lambda r: r(layout=common_pb2.ParallelLayout(tp=3)), "layout .* = 3 but world_size is 4"),
        (
            lambda r: r(layout=common_pb2.ParallelLayout(dp_shard=4, ep=3)),
            "ep=3 does not divide dp_shard\\*cp = 4",
        ),
    ],
    ids=["empty-id", "no-ranks", "layout-size", "expert-parallel"],
)
def test_a_bad_run_registration_is_refused_with_one_line(
    store: TelemetryStore,
    run_request: RegisterRun,
    build: Callable[[RegisterRun], telemetry_pb2.RegisterRunRequest],
    problem: str,
) -> None:
    def request(**fields: object) -> telemetry_pb2.RegisterRunRequest:
        built = run_request()
        for name, value in fields.items():
            if name == "layout":
                built.layout.CopyFrom(value)
            else:
                setattr(built, name, value)
        if built.world_size == 0:
            del built.ranks[:]
        return built

    with pytest.raises(InvalidArgument, match=problem) as caught:
        store.register_run(build(request))
    assert "\n" not in str(caught.value)


def test_bad_events_and_resume_requests_are_refused(
    store: TelemetryStore, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    with pytest.raises(InvalidArgument, match="kind 0 is not a known EventKind"):
        store.add_events([telemetry_pb2.Event(run_id="run-1", step=1)])
    with pytest.raises(InvalidArgument, match=r"checkpoint\.seconds must be finite"):
        store.add_events([event("run-1", "checkpoint_committed", tier="ssd", seconds=math.nan)])
    with pytest.raises(InvalidArgument, match="rank must be -1"):
        store.add_events([event("run-1", "straggler", rank=-3)])
    with pytest.raises(InvalidArgument, match=r"checkpoint\.node must be printable"):
        store.add_events([event("run-1", "checkpoint_committed", tier="ssd", node="node\n0")])
    with pytest.raises(InvalidArgument, match="run_id is empty"):
        store.resume_point("")
    with pytest.raises(InvalidArgument, match="step must not be negative"):
        store.resume_point("run-1", step=-1)


def test_text_the_database_cannot_store_is_refused_as_invalid_not_retried_forever(
    store: TelemetryStore, run_request: RegisterRun, db_url: str
) -> None:
    store.register_run(run_request())
    with_nul = event("run-1", "alert", message="NUL \x00 inside")
    if db_url.startswith("sqlite"):
        assert store.add_events([with_nul]) == 1  # SQLite stores NUL characters
        return
    with pytest.raises(InvalidArgument, match="the database refused the data: ") as caught:
        store.add_events([with_nul])
    assert "\n" not in str(caught.value)


def test_concurrent_writers_all_get_their_records_stored(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    failures: list[BaseException] = []

    def report(rank: int) -> None:
        try:
            for step in range(0, 40, 4):
                batch = [r for r in records(range(step, step + 4)) if r.rank == rank]
                store.add_steps(batch)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=report, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(RankStep)) == 160
