"""The group commit of concurrent record batches, with a fake writer (the real one is exercised by
the store's tests on SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from telemetry.ingest import GroupCommit

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
