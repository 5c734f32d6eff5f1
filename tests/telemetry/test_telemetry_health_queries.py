"""Run health in SQL on SQLite and PostgreSQL: MFU, goodput by cause, findings, checkpoints.

One hand-made run whose every figure below is worked out by hand in the comments: 2 ranks, 10^6
parameters, a 10^12 FLOP/s peak per device; attempt 0 trains steps 1-4 and dies, attempt 1 resumes
from the checkpoint of step 2 and trains steps 3-5; the update of step 5 was skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, update

from scaletrain.errors import NotFound
from scaletrain.v1 import telemetry_pb2
from telemetry import queries
from telemetry.client import event, rank_step
from telemetry.efficiency import BADPUT_CAUSES, goodput, mfu
from telemetry.health import render, run_health
from telemetry.models import Run
from telemetry.store import TelemetryStore

RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def record(
    number: int, rank: int, attempt: int, ends_at: float, **times: float
) -> telemetry_pb2.RankStep:
    """A record of step `number` (1000 tokens) that ended `ends_at` seconds after T0."""
    built = rank_step(
        "run-1",
        number,
        rank,
        loss=1.0,
        tokens=1000,
        times=times,
        attempt=attempt,
        dropped_records=3 * rank + attempt,
    )
    built.time.FromDatetime(at(ends_at))
    return built


def stamped(built: telemetry_pb2.Event, seconds: float) -> telemetry_pb2.Event:
    built.time.FromDatetime(at(seconds))
    return built


def registered_at_t0(
    store: TelemetryStore, run_request: RegisterRun
) -> telemetry_pb2.RegisterRunRequest:
    """Run "run-1" of 2 ranks, registered as started at T0; its request (to register again)."""
    request = run_request(world_size=2)
    request.started_at.FromDatetime(T0)
    store.register_run(request)
    return request


@pytest.fixture
def run(store: TelemetryStore, run_request: RegisterRun) -> TelemetryStore:
    request = run_request(world_size=2)  # 10^6 parameters
    request.started_at.FromDatetime(T0)
    request.precision, request.peak_flops, request.peak_flops_source = "bf16", 1e12, "test peak"
    request.recompute_fraction = 0.5
    store.register_run(request)
    records = []
    # Attempt 0: steps of 2 s (rank 1 is the slower), ending at 12, 14, 16, 18 s: the first step
    # starts at 10 s, so start-up took 10 s. Step 2 saved a checkpoint for 0.5 s; step 3 replayed
    # for 0.4 s on rank 1 (steps 3 and 4 are recomputed later: their 4 s are lost progress).
    for step in range(1, 5):
        ends = 10 + 2 * step
        records.append(record(step, 0, 0, ends, step=1.0, data=0.1))
        extra = {"checkpoint": 0.5} if step == 2 else {"replay": 0.4} if step == 3 else {}
        records.append(record(step, 1, 0, ends, step=2.0, data=0.3, **extra))
    # Attempt 1 starts its first step at 30 s (12 s after attempt 0's last record); step 5 takes
    # 4 s on rank 1.
    for step in range(3, 6):
        ends = 30 + 2 * (step - 2) + (2 if step == 5 else 0)
        records.append(record(step, 0, 1, ends, step=1.0, data=0.1))
        records.append(record(step, 1, 1, ends, step=4.0 if step == 5 else 2.0, data=0.3))
    store.register_run(request)  # the restart registers again: attempt 1
    store.add_steps(records)
    store.roll_up()
    store.add_events(
        [
            stamped(event("run-1", "checkpoint_staged", step=2, bytes=100, seconds=0.5), 15),
            stamped(
                event("run-1", "checkpoint_committed", step=2, tier="ssd", bytes=100, seconds=1),
                16,
            ),
            stamped(event("run-1", "checkpoint_committed", step=2, tier="s3", bytes=100), 20),
            stamped(event("run-1", "restart", step=2, message="attempt 1"), 29),
            stamped(event("run-1", "straggler", step=4, rank=1, message="rank 1 slow"), 19),
            stamped(
                event(
                    "run-1",
                    "loss_spike",
                    step=5,
                    message="data",
                    attributes={"verdict": "data", "action": "skipped"},
                ),
                38,
            ),
            stamped(event("run-1", "run_finished", step=5), 40),
        ]
    )
    return store


def test_mfu_is_six_n_times_tokens_per_second_over_devices_times_peak(
    run: TelemetryStore, engine: Engine
) -> None:
    # Latest attempts: steps 1-5, 2000 tokens each, walls 2+2+2+2+4 = 12 s: 833.33 tokens/s.
    # MFU = 6 * 1e6 * 833.33 / (2 * 1e12); HFU counts 6.5 * 1e6 * ... for half the forward redone.
    whole = mfu(engine, "run-1")
    assert whole.tokens_per_s == pytest.approx(10_000 / 12)
    assert whole.mfu == pytest.approx(6e6 * (10_000 / 12) / 2e12)
    assert whole.hfu == pytest.approx(7e6 * (10_000 / 12) / 2e12)
    assert (whole.steps, whole.devices, whole.precision) == (5, 2, "bf16")
    assert whole.label == "MFU 0.2% (HFU 0.3%) of 1 TFLOP/s x 2 devices in bf16, peak test peak"
    # The last step alone: 2000 tokens in 4 s.
    assert mfu(engine, "run-1", last_steps=1).mfu == pytest.approx(6e6 * 500 / 2e12)


def test_steps_an_elastic_job_ran_on_fewer_ranks_cost_the_share_the_lost_ranks_had(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    # Two ranks for steps 1-2, then one (a node lost, no spare) for steps 3-4, in attempt 1;
    # every step 2 s on its slowest rank, one after the other from 0 s.
    request = registered_at_t0(store, run_request)
    records = [record(step, rank, 0, 2 * step, step=2.0) for step in (1, 2) for rank in (0, 1)]
    store.register_run(request)
    records += [record(step, 0, 1, 2 * step, step=2.0) for step in (3, 4)]
    store.add_steps(records)
    store.roll_up()
    result = goodput(engine, "run-1")
    # Steps 3 and 4 ran at half the size: half of each one's 2 s is the lost node's share.
    assert result.badput_s["reduced_size"] == pytest.approx(2.0)
    assert result.productive_s == pytest.approx(8.0 - 2.0)


def test_mfu_is_unknown_without_a_peak_and_the_label_says_so(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    unknown = mfu(engine, "run-1")
    assert math.isnan(unknown.mfu) and math.isnan(unknown.tokens_per_s)
    assert unknown.label.startswith("MFU unknown")
    with pytest.raises(NotFound, match="run 'ghost' is not registered"):
        mfu(engine, "ghost")


def test_goodput_splits_the_wall_time_by_cause(run: TelemetryStore, engine: Engine) -> None:
    # Wall: 0 to 40 s (run_finished). Productive: steps 1, 3, 4 give 2 - 0.3 (data) = 1.7 each,
    # step 2 gives 2 - 0.3 - 0.5 (checkpoint) = 1.2, skipped step 5 gives nothing: 6.3 s.
    # Start-up 10 s; restart 12 s gap + 4 s lost (attempt 0's steps 3 and 4); replay: step 5's
    # 4 - 0.3 = 3.7 s thrown away (attempt 0's replay was lost with its step); data 5 x 0.3 s;
    # checkpoint 0.5 s; other: 40 - 38 = 2 s.
    result = goodput(engine, "run-1")
    assert result.wall_s == pytest.approx(40.0)
    assert result.productive_s == pytest.approx(6.3)
    assert result.goodput == pytest.approx(6.3 / 40)
    assert list(result.badput_s) == list(BADPUT_CAUSES)
    expected = {
        "startup": 10.0,
        "checkpoint_stall": 0.5,
        "restart": 16.0,
        "replay": 3.7,
        "data_wait": 1.5,
        "reduced_size": 0.0,
        "evaluation": 0.0,
        "other": 2.0,
    }
    assert result.badput_s == pytest.approx(expected)


def test_time_spent_evaluating_is_a_cause_of_its_own_not_other(
    run: TelemetryStore, engine: Engine
) -> None:
    evaluated = event("run-1", "eval", step=4, message="validation loss 3.1 after step 4")
    evaluated.attributes.update({"loss": "3.1", "seconds": "1.250"})
    run.add_events([stamped(evaluated, 36)])
    result = goodput(engine, "run-1")
    assert result.badput_s["evaluation"] == pytest.approx(1.25)
    assert result.badput_s["other"] == pytest.approx(0.75)


def test_goodput_counts_what_each_kind_of_fault_cost_from_its_recovery_records(
    run: TelemetryStore, engine: Engine
) -> None:
    assert goodput(engine, "run-1").badput_by_fault_s == {}
    costs = [("kill-rank", "14.5"), ("stop-s3", "0.25"), ("kill-rank", "6"), ("sdc", "")]
    run.add_events(
        [
            stamped(event("run-1", "recovery", step=4, attributes={"kind": kind, "badput_s": s}), i)
            for i, (kind, s) in enumerate(costs)
        ]
    )
    result = goodput(engine, "run-1")
    assert result.badput_by_fault_s == pytest.approx({"kill-rank": 20.5, "stop-s3": 0.25, "sdc": 0})
    # An attribution of the same wall time the causes split: never added to them.
    assert result.badput_s["restart"] == pytest.approx(16.0)


def test_goodput_of_a_run_without_records_is_empty(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    store.register_run(run_request())
    empty = goodput(engine, "run-1")
    assert (empty.wall_s, empty.productive_s) == (0.0, 0.0)
    assert math.isnan(empty.goodput)


def test_goodput_of_a_running_never_restarted_run_ends_at_its_latest_record(
    store: TelemetryStore, engine: Engine, run_request: RegisterRun
) -> None:
    registered_at_t0(store, run_request)
    # Steps of 2 s on rank 1 (0.5 s of it waiting for data) ending at 12, 14 and 19 s: the first
    # starts at 10 s; step 2 saved a checkpoint for 0.5 s; nothing explains 14-17 s.
    ends = {1: 12, 2: 14, 3: 19}
    store.add_steps(
        [
            record(step, rank, 0, ends[step], step=1.0 + rank, data=0.5 * rank, **extra)
            for step in ends
            for rank in (0, 1)
            for extra in [{"checkpoint": 0.5 * rank} if step == 2 else {}]
        ]
    )
    store.roll_up()
    # Wall: 0 to 19 s (no run_finished: the latest record). Productive 1.5 + 1 + 1.5 s.
    result = goodput(engine, "run-1")
    assert result.wall_s == pytest.approx(19.0)
    assert result.productive_s == pytest.approx(4.0)
    expected = {
        "startup": 10.0,
        "checkpoint_stall": 0.5,
        "restart": 0.0,
        "replay": 0.0,
        "data_wait": 1.5,
        "reduced_size": 0.0,
        "evaluation": 0.0,
        "other": 3.0,
    }
    assert result.badput_s == pytest.approx(expected)


def test_goodput_counts_restarts_from_the_records_when_the_run_never_registered_again(
    run: TelemetryStore, engine: Engine
) -> None:
    # Records of attempts 0 and 1 under a run whose registration says attempt 0 (a client that
    # numbered its attempts itself): the same split as when the restart registered.
    registered_again = goodput(engine, "run-1")
    with engine.begin() as connection:
        connection.execute(update(Run).values(attempt=0))
    assert goodput(engine, "run-1") == registered_again
    assert registered_again.badput_s["restart"] == pytest.approx(16.0)


def test_run_health_counts_findings_stragglers_and_dropped_records(
    run: TelemetryStore, engine: Engine
) -> None:
    health = run_health(engine, "run-1")
    assert (health.status, health.attempt, health.last_step) == ("finished", 1, 5)
    assert health.event_counts == {
        "straggler": 1,
        "loss_spike": 1,
        "sdc": 0,
        "replay": 0,
        "alert": 0,
        "restart": 1,
        "quarantine": 0,
    }
    assert health.straggler_ranks == [1]
    assert [(f.step, f.kind) for f in health.findings] == [
        (2, "restart"),
        (4, "straggler"),
        (5, "loss_spike"),
    ]
    assert health.findings[2].attributes == {"verdict": "data", "action": "skipped"}
    # Per client (rank, attempt) its latest count: rank 0: 0 and 1, rank 1: 3 and 4.
    assert health.dropped_records == 8
    assert health.goodput.productive_s == pytest.approx(6.3)
    with pytest.raises(NotFound):
        run_health(engine, "ghost")


def test_a_runs_health_reads_as_lines_a_subject(run: TelemetryStore, engine: Engine) -> None:
    shown = render(run_health(engine, "run-1")).splitlines()
    assert shown[0] == "run          run-1: finished, attempt 1, last step 5"
    assert "goodput      15.8% of 40.0 s wall (6.3 s productive)" in shown
    # Badput by cause, largest first, and what "other" is made of.
    assert shown[3].startswith("badput       restart 16.0 s, startup 10.0 s, replay 3.7 s")
    assert shown[4].startswith("  other      the end of the run after its last step")
    assert "stragglers   1 event(s); ranks [1], slow nodes none" in shown
    assert "recoveries   1 restart(s)" in shown
    assert "telemetry    8 record(s) dropped by the ranks' clients" in shown
    assert shown[-1].startswith("  step      5      run  loss_spike: ")
    # The fixture's loss spike was the data's (its batch skipped): closed, not open.
    assert "sdc          0 event(s); loss spikes 1 (of which 1 the data's, closed)" in "\n".join(
        shown
    )


def test_checkpoint_events_fill_one_row_per_tier_with_the_trainers_stall(
    run: TelemetryStore, engine: Engine
) -> None:
    table = queries.checkpoints(engine, "run-1")
    assert list(table.columns) == queries.CHECKPOINT_COLUMNS
    rows = {row.tier: row for row in table.itertuples()}
    assert sorted(rows) == ["s3", "ssd", "trainer"]
    trainer = rows["trainer"]
    # Staged at 15 s after blocking training for 0.5 s: it started at 14.5 s.
    assert (trainer.started_at, trainer.staged_at) == (at(14.5), at(15))
    assert (trainer.bytes, trainer.seconds) == (100, 0.5)
    assert (rows["ssd"].committed_at, rows["ssd"].seconds) == (at(16), 1.0)
    assert rows["s3"].committed_at == at(20)
    # A late started event keeps what the staged event inferred only if it was missing.
    run.add_events([stamped(event("run-1", "checkpoint_started", step=2), 14)])
    assert queries.checkpoints(engine, "run-1").iloc[-1]["started_at"] == at(14)


def test_events_can_be_filtered_by_kind(run: TelemetryStore, engine: Engine) -> None:
    listed = queries.events(engine, "run-1", kinds=["straggler", "loss_spike"])
    assert list(listed["kind"]) == ["loss_spike", "straggler"]


def test_a_run_registering_again_learns_the_newest_step_it_recorded(
    store: TelemetryStore, run_request: RegisterRun
) -> None:
    request = registered_at_t0(store, run_request)
    store.add_steps([record(step, 0, 0, 10 + step) for step in (1, 2, 3)])
    again = store.register_run(request)
    assert (again.created, again.attempt, again.last_step) == (False, 1, 3)
    assert store.register_run(run_request("run-2")).last_step == -1  # a new run: none


def test_a_quarantined_rank_is_reported_with_its_machine_and_evidence(
    store: TelemetryStore, run_request: RegisterRun, engine: Engine
) -> None:
    registered_at_t0(store, run_request)
    store.add_events(
        [
            event("run-1", "sdc", step=12, rank=1, message="silent data corruption on rank 1"),
            event("run-1", "sdc", step=14, rank=1, message="silent data corruption on rank 1"),
            event(
                "run-1",
                "quarantine",
                step=14,
                rank=1,
                message="rank 1 (node0) named twice",
                attributes={"node": "node0", "steps": "12,14", "policy": "cordon"},
            ),
        ]
    )
    health = run_health(engine, "run-1")
    assert health.event_counts["quarantine"] == 1
    assert [(f.rank, f.attributes["node"]) for f in health.quarantined] == [(1, "node0")]
    assert "quarantine   rank 1 (node0) at steps 12,14: cordon" in render(health)
