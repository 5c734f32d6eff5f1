"""The UI's views of a run (telemetry.views) on SQLite and PostgreSQL: bounded reads that still
say what a person checking a run's health must know."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine

from scaletrain.v1 import telemetry_pb2
from telemetry.client import event, rank_step
from telemetry.store import TelemetryStore
from telemetry.views.checkpoints import (
    PART_COLUMNS,
    checkpoint_parts,
    checkpoint_timeline,
    resume_offsets,
)
from telemetry.views.common import live, sampled_steps
from telemetry.views.nodes import rank_phases, rank_steps
from telemetry.views.overview import runs_table
from telemetry.views.run import eval_points, headline, loss_points, markers

RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def stamped(built: telemetry_pb2.Event, seconds: float) -> telemetry_pb2.Event:
    built.time.FromDatetime(T0 + timedelta(seconds=seconds))
    return built


@pytest.fixture
def registered(store: TelemetryStore, run_request: RegisterRun) -> TelemetryStore:
    """run-1, 4 ranks, launched at T0."""
    request = run_request(world_size=4)
    request.started_at.FromDatetime(T0)
    store.register_run(request)
    return store


def steps(
    store: TelemetryStore, numbers: range, *, ranks: int = 4, attempt: int = 0, **times: float
) -> None:
    """Records of `numbers` on every rank: loss 100/step (+rank/100), 1000 tokens, `times`; rolled
    up as the service rolls up complete steps."""
    store.add_steps(
        [
            rank_step(
                "run-1",
                number,
                rank,
                loss=100 / number + rank / 100,
                tokens=1000,
                times={"step": 0.5, **times},
                attempt=attempt,
                offset=(number * ranks, number, 0),
            )
            for number in numbers
            for rank in range(ranks)
        ]
    )
    store.roll_up()


def test_sampled_steps_spread_evenly_from_the_first_to_the_last_step(
    engine: Engine, registered: TelemetryStore
) -> None:
    steps(registered, range(1, 11), ranks=1)
    assert sampled_steps(engine, "run-1", 100) == list(range(1, 11))
    assert sampled_steps(engine, "run-1", 4) == [1, 4, 7, 10]
    assert sampled_steps(engine, "no-such-run", 4) == []


def test_the_loss_of_a_long_run_is_read_at_a_bounded_number_of_steps(
    engine: Engine, registered: TelemetryStore
) -> None:
    steps(registered, range(1, 301))
    points = loss_points(engine, "run-1", max_points=30)
    assert len(points) == 30
    assert (points["step"].iloc[0], points["step"].iloc[-1]) == (1, 300)
    last = points.iloc[-1]
    assert last["loss"] == pytest.approx(100 / 300 + 0.015)
    assert (last["loss_min"], last["loss_max"]) == pytest.approx((100 / 300, 100 / 300 + 0.03))
    assert set(points["ranks"]) == {4}  # every step trained by the run's 4 ranks


def test_a_replayed_step_is_shown_as_its_latest_attempt_recorded_it(
    engine: Engine, registered: TelemetryStore, run_request: RegisterRun
) -> None:
    steps(registered, range(1, 6), compute=0.1)
    registered.register_run(run_request(world_size=4))  # the restart: attempt 1
    steps(registered, range(4, 6), attempt=1, compute=0.3)
    grid = rank_steps(engine, "run-1", [0, 1, 2, 3])
    assert grid.groupby("step")["compute_s"].max().to_dict() == pytest.approx(
        {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.3, 5: 0.3}
    )
    assert len(grid) == 5 * 4


def test_a_rank_twice_as_slow_as_its_peers_scores_one_half(
    engine: Engine, registered: TelemetryStore
) -> None:
    registered.add_steps(
        [
            rank_step(
                "run-1",
                number,
                rank,
                times={
                    "step": 0.5,
                    "compute": 0.1 + 0.1 * (rank == 3),
                    "comm_wait": 0.3 - 0.1 * (rank == 3),
                },
            )
            for number in range(1, 31)
            for rank in range(4)
        ]
    )
    registered.roll_up()
    phases = rank_phases(engine, "run-1", [0, 1, 2, 3], window=20)
    assert list(phases["rank"]) == [0, 1, 2, 3]
    assert list(phases["relative_score"]) == pytest.approx([1.0, 1.0, 1.0, 0.5])
    assert list(phases["comm_wait_s"]) == pytest.approx([0.3, 0.3, 0.3, 0.2])


def test_the_headline_compares_the_latest_steps_with_the_ones_before(
    engine: Engine, registered: TelemetryStore
) -> None:
    steps(registered, range(1, 21), step=1.0)
    steps(registered, range(21, 41), step=0.5)
    figures = headline(engine, "run-1", window=20)
    assert figures.last_step == 40
    assert figures.tokens_per_s == pytest.approx(4000 / 0.5)
    assert figures.previous_tokens_per_s == pytest.approx(4000 / 1.0)
    assert figures.loss == pytest.approx(100 / 40 + 0.015)
    assert figures.previous_loss == pytest.approx(100 / 20 + 0.015)
    assert figures.last_checkpoint is None and figures.last_checkpoint_at is None


def test_the_checkpoint_timeline_has_blocking_and_background_time_and_the_tiers_holding_it(
    engine: Engine, registered: TelemetryStore
) -> None:
    registered.add_events(
        [
            stamped(event("run-1", "checkpoint_staged", step=10, bytes=500, seconds=0.25), 1),
            stamped(event("run-1", "checkpoint_committed", step=10, tier="ssd", bytes=900), 2),
            stamped(event("run-1", "checkpoint_saved", step=10, bytes=900, seconds=1.5), 3),
            stamped(event("run-1", "checkpoint_committed", step=10, tier="s3", bytes=901), 4),
            stamped(event("run-1", "checkpoint_failed", step=10, tier="memory"), 5),
        ]
    )
    (row,) = checkpoint_timeline(engine, "run-1").to_dict("records")
    assert row["step"] == 10
    assert (row["blocking_s"], row["background_s"]) == pytest.approx((0.25, 1.5))
    assert (row["tiers"], row["failed_tiers"]) == ("ssd, s3", "memory")
    assert (row["ssd_bytes"], row["s3_bytes"]) == (900, 901)
    assert math.isnan(row["memory_bytes"])
    assert row["started_at"] == T0 + timedelta(seconds=0.75)
    # No node named: no node names to show.
    assert row["nodes"] == ""


def test_two_nodes_commits_of_one_step_are_two_parts_and_the_views_show_both_nodes(
    engine: Engine, registered: TelemetryStore
) -> None:
    def committed(tier: str, node: str, size: int, at: float) -> telemetry_pb2.Event:
        built = event("run-1", "checkpoint_committed", step=4, tier=tier, bytes=size, node=node)
        return stamped(built, at)

    first = [
        stamped(event("run-1", "checkpoint_staged", step=4, bytes=1000, seconds=0.5), 1),
        committed("memory", "node2", 400, 2), committed("ssd", "node2", 400, 3),
        committed("s3", "node2", 1000, 5),
    ]  # fmt: skip
    assert registered.add_events(first) == 4
    # While one node is all there is, its name says nothing.
    assert checkpoint_timeline(engine, "run-1")["nodes"].tolist() == [""]
    # The second node commits on memory at the same instant as the first: a second event, not
    # a resent one. Each node reports S3's whole copy once it sees it: the earliest report counts.
    second = [
        committed("memory", "node10", 600, 2), committed("ssd", "node10", 600, 3.5),
        committed("s3", "node10", 1000, 6),
    ]  # fmt: skip
    assert registered.add_events(second) == 3
    assert registered.add_events(first + second) == 0

    parts = checkpoint_parts(engine, "run-1")
    assert list(parts.columns) == PART_COLUMNS
    assert parts[["step", "tier", "node", "bytes"]].values.tolist() == [
        [4, "memory", "node2", 400], [4, "memory", "node10", 600],
        [4, "ssd", "node2", 400], [4, "ssd", "node10", 600],
        [4, "s3", "", 1000],
    ]  # fmt: skip
    assert parts["committed_at"].iloc[-1] == T0 + timedelta(seconds=5)
    (row,) = checkpoint_timeline(engine, "run-1").to_dict("records")
    assert row["tiers"] == "memory, ssd, s3"
    assert row["nodes"] == "memory: node2, node10 · ssd: node2, node10 · s3"
    assert (row["memory_bytes"], row["ssd_bytes"], row["s3_bytes"]) == (1000, 1000, 1000)
    assert row["blocking_s"] == 0.5
    (overview,) = runs_table(engine).to_dict("records")
    assert (overview["last_checkpoint"], overview["last_checkpoint_at"]) == (
        4,
        T0 + timedelta(seconds=2),
    )
    assert headline(engine, "run-1").last_checkpoint == 4


def test_beyond_a_handful_of_nodes_the_timeline_counts_them_and_names_the_missing_ones(
    engine: Engine, registered: TelemetryStore
) -> None:
    registered.add_events(
        [
            event("run-1", "checkpoint_committed", step=4, tier=tier, node=f"node{n}")
            for tier, nodes in (("memory", 9), ("ssd", 10))
            for n in range(nodes)
        ]
    )
    (row,) = checkpoint_timeline(engine, "run-1").to_dict("records")
    assert row["nodes"] == "memory: 9 of 10 nodes, not node9 · ssd: 10 of 10 nodes"


def test_the_resume_point_is_the_latest_committed_step_with_each_ranks_offset(
    engine: Engine, registered: TelemetryStore
) -> None:
    steps(registered, range(1, 9))
    assert resume_offsets(engine, "run-1")[0] is None
    registered.add_events(
        [
            stamped(event("run-1", "checkpoint_committed", step=4, tier="ssd"), 1),
            stamped(event("run-1", "checkpoint_committed", step=8, tier="memory"), 2),
            stamped(event("run-1", "checkpoint_failed", step=8, tier="s3"), 3),
        ]
    )
    step, offsets = resume_offsets(engine, "run-1")
    assert step == 8
    assert offsets.to_dict("list") == {
        "rank": [0, 1, 2, 3],
        "global_sample": [32] * 4,
        "rank_sample": [8] * 4,
        "epoch": [0] * 4,
    }


def spike(step: int, verdict: str) -> telemetry_pb2.Event:
    """A loss spike the step guard replayed, found to be `verdict`'s (data or sdc)."""
    built = event("run-1", "loss_spike", step=step, message=f"step {step}: loss spike")
    built.attributes.update({"verdict": verdict, "action": "kept"})
    return built


def test_a_restarted_run_is_restarting_until_its_new_attempt_records_a_step(
    engine: Engine, registered: TelemetryStore, run_request: RegisterRun
) -> None:
    steps(registered, range(1, 6))
    registered.add_events(
        [
            stamped(event("run-1", "run_started"), 0),
            stamped(event("run-1", "straggler", step=2, rank=3), 10),
            stamped(event("run-1", "checkpoint_committed", step=4, tier="ssd"), 11),
            stamped(event("run-1", "restart", step=4), 20),
            stamped(event("run-1", "sdc", step=5, rank=1), 21),
            stamped(event("run-1", "alert", step=5), 22),
            stamped(event("run-1", "replay", step=5), 23),
            stamped(spike(5, "data"), 24),
            stamped(spike(5, "sdc"), 25),
        ]
    )
    registered.register_run(run_request(world_size=4))
    (row,) = runs_table(engine).to_dict("records")
    assert (row["status"], row["attempt"], row["step"]) == ("restarting", 1, 5)
    assert row["last_checkpoint"] == 4
    # The straggler was before the restart; the SDC, the alert and the hardware's loss spike
    # after it. The data's loss spike closed its own alert.
    assert row["open_alerts"] == 3
    assert live(engine) and live(engine, "run-1")

    steps(registered, range(5, 6), attempt=1)
    assert runs_table(engine)["status"].tolist() == ["running"]
    assert markers(engine, "run-1")[["step", "kind"]].values.tolist() == [
        [4, "checkpoint"], [4, "restart"], [5, "sdc"], [5, "replay"], [5, "loss_spike"],
        [5, "loss_spike"],
    ]  # fmt: skip
    registered.add_events([stamped(event("run-1", "run_finished", step=5), 30)])
    assert not live(engine)


def test_the_validation_loss_is_read_by_step_and_a_step_evaluated_again_keeps_the_latest(
    engine: Engine, registered: TelemetryStore
) -> None:
    steps(registered, range(1, 7))
    registered.add_events(
        [
            stamped(event("run-1", "eval", step=3, attributes={"loss": "2.5"}), 10),
            stamped(event("run-1", "eval", step=6, attributes={"loss": "2.25"}), 20),
            # The restarted attempt evaluated step 6 again.
            stamped(event("run-1", "eval", step=6, attributes={"loss": "2.125"}), 30),
        ]
    )
    points = eval_points(engine, "run-1")
    assert points.values.tolist() == [[3, 2.5], [6, 2.125]]
    assert eval_points(engine, "run-2").empty
