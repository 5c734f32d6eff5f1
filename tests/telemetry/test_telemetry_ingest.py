"""The ingest path: the group commit of concurrent batches (with a fake handler), and records sent
as columns, stored on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from datetime import UTC
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from scaletrain.errors import InvalidArgument
from scaletrain.v1 import telemetry_pb2
from telemetry.client import rank_step
from telemetry.columns import columns_of
from telemetry.ingest import GroupCommit
from telemetry.models import RankStep
from telemetry.store import TelemetryStore

RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]

Rows = Sequence[tuple[Any, ...]]


class Writer:
    """Counts rows as new; the first write blocks until `release`, so that others queue up."""

    def __init__(self, refuse: str | None = None) -> None:
        self.groups: list[int] = []
        self.first_started = threading.Event()
        self.release = threading.Event()
        self._refuse = refuse

    def __call__(self, groups: list[Rows]) -> list[int]:
        if not self.groups:
            self.first_started.set()
            self.release.wait(10)
        self.groups.append(len(groups))
        if any(row[0] == self._refuse for rows in groups for row in rows):
            raise ValueError(f"refused {self._refuse}")
        return [len(rows) for rows in groups]


def submit_all(commit: GroupCommit, writer: Writer, batches: list[Rows]) -> list[object]:
    """Submit the first batch, then the others while the first is being written."""
    results: list[object] = [None] * len(batches)

    def submit(index: int) -> None:
        try:
            results[index] = commit.submit(batches[index])
        except ValueError as exc:
            results[index] = str(exc)

    first = threading.Thread(target=submit, args=(0,))
    first.start()
    assert writer.first_started.wait(10)
    others = [threading.Thread(target=submit, args=(i,)) for i in range(1, len(batches))]
    for thread in others:
        thread.start()
    while len(commit._pending) < len(others):  # the others are queued behind the first write
        threading.Event().wait(0.001)
    writer.release.set()
    for thread in [first, *others]:
        thread.join()
    return results


def test_batches_that_arrive_during_a_write_are_written_together_in_the_next() -> None:
    writer = Writer()
    commit = GroupCommit(writer)
    batches = [[("a", i)] * (i + 1) for i in range(6)]
    assert submit_all(commit, writer, batches) == [1, 2, 3, 4, 5, 6]
    assert writer.groups == [1, 5]


def test_a_refused_batch_fails_alone_and_the_others_of_its_group_are_written() -> None:
    writer = Writer(refuse="bad")
    commit = GroupCommit(writer)
    batches = [[("a", 0)], [("a", 1)], [("bad", 2)], [("a", 3)]]
    assert submit_all(commit, writer, batches) == [1, 1, "refused bad", 1]
    # The group of three failed, then each of its batches was written alone.
    assert writer.groups == [1, 3, 1, 1, 1]


def test_a_lone_caller_writes_its_own_batch_and_sees_its_error() -> None:
    commit = GroupCommit(lambda groups: [len(rows) for rows in groups])
    assert commit.submit([("a", 1), ("a", 2)]) == 2

    def refuse(groups: list[Rows]) -> list[int]:
        raise ValueError("database gone")

    with pytest.raises(ValueError, match="database gone"):
        GroupCommit(refuse).submit([("a", 1)])


def test_records_sent_as_columns_are_stored_as_the_same_rows_as_records(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    sent = [
        rank_step("run-1", step, rank, loss=math.nan if step == 2 else 1.5, tokens=8,
                  times={"step": 0.5, "compute": 0.25}, offset=(step, step + rank, 0),
                  param_checksum="ab" * 8, dropped_records=rank)
        for step in range(3)
        for rank in range(4)
    ]  # fmt: skip
    ((accepted, duplicates, rows),) = store.add_step_batches(
        [telemetry_pb2.StepBatch(columns=columns_of(sent))]
    )
    assert (accepted, duplicates, len(rows)) == (12, 0, 12)
    assert store.add_steps(sent) == (0, 12)  # the same rows, sent again as records
    with Session(engine) as session:
        stored = session.scalars(select(RankStep).order_by(RankStep.step, RankStep.rank)).all()
    assert [(r.step, r.rank, r.rank_sample, r.dropped_records) for r in stored[4:8]] == [
        (1, rank, 1 + rank, rank) for rank in range(4)
    ]
    assert math.isnan(stored[8].loss) and stored[0].loss == 1.5
    assert stored[0].time == sent[0].time.ToDatetime(tzinfo=UTC)


def test_a_bad_value_in_a_column_is_refused_naming_its_record_and_field(
    store: TelemetryStore, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    columns = columns_of([rank_step("run-1", step, 0, times={"step": 0.1}) for step in range(3)])
    columns.comm_wait_s[2] = -1.0
    with pytest.raises(InvalidArgument, match=r"^record 2 \(step 2, rank 0\): times.comm_wait"):
        store.add_step_batches([telemetry_pb2.StepBatch(columns=columns)])
    del columns.tokens[1:]
    with pytest.raises(InvalidArgument, match="columns: tokens has 1 values, run_id has 3"):
        store.add_step_batches([telemetry_pb2.StepBatch(columns=columns)])
