"""The chaos suite: one run on the embedded stack (CPU, 4 ranks) under nine kinds of faults.

To stay inside the CI budget the nine cases share two jobs: a fault-free reference run, and one
`scaletrain chaos` run whose schedule strikes each fault in turn (the drill never lets two faults
overlap). Each case checks what the issue asks of it: the run completed, its final loss equals the
reference's bit for bit, no committed checkpoint was lost, and telemetry recorded the fault. The
S3 outage lasts 2 s here instead of 30 s (`stop-s3@STEP:SECONDS`); `scaletrain chaos` uses 30 s by
default. The SSD disk fills on a size-limited tmpfs, which needs root (and the right to mount):
without it that case skips.
"""

from __future__ import annotations

import itertools
import re
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime

import pytest
from e2e_runs import TINY, events, injected, restart_after, scaletrain_json

from scaletrain.app.chaos import AGENT_STOPPED_RANKS, can_mount_tmpfs
from trainer.keeper import FROZEN_AFTER_S

pytestmark = pytest.mark.e2e

RANKS, STEPS, EVERY = 4, 240, 5
CAN_MOUNT = can_mount_tmpfs()
# The corruption strikes after the last rank is killed: a rank SIGKILLed within half a second of
# a step takes that step's unsent events with it.
SDC_STEP = 30
SCHEDULE = [
    "kill-rank@6",
    "kill-rank-twice@9",
    "stop-rank@11",
    "corrupt-shard@17",
    "kill-telemetry@22:1",
    "kill-ckptd@26:1",
    f"sdc@{SDC_STEP}",
    "stop-s3@32:2",
    *(["disk-full@40:20"] if CAN_MOUNT else []),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("chaos-reference")
    return scaletrain_json(
        "run",
        "--workdir",
        str(workdir),
        "--ranks",
        str(RANKS),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        *TINY,
    )


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("chaos")
    report = scaletrain_json(
        "chaos",
        "--workdir",
        str(workdir),
        "--ranks",
        str(RANKS),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        "--schedule",
        ",".join(SCHEDULE),
        "--seed",
        "8",
        "--watchdog-min-s",
        "6",
        "--ssd-mb",
        "32",
        *TINY,
    )
    return report | {"workdir": workdir}


def test_every_scheduled_fault_is_injected_and_the_run_completes(drill: dict):
    assert drill["completed"], drill["_log"][-3000:]
    assert drill["faults_injected"] == drill["faults_survived"] == len(SCHEDULE)
    assert drill["restarts"] >= 3  # kill-rank, stop-rank, corrupt-shard
    assert drill["steps_replayed"] >= 0 and drill["steps_replayed_in_place"] >= 1
    assert 0 < drill["goodput"] < 1


def test_the_final_loss_and_parameters_equal_a_fault_free_run_bit_for_bit(
    reference: dict, drill: dict
):
    assert drill["last_loss"] == reference["last_loss"]
    assert drill["params_sha256"] == reference["params_sha256"]


def test_no_committed_checkpoint_is_lost(drill: dict):
    assert drill["checkpoints_committed"] > STEPS // EVERY // 2
    assert drill["checkpoints_lost"] == []


def test_case1_a_rank_killed_mid_step_restarts_the_job_from_its_checkpoint(drill: dict):
    fault = injected(drill, "kill-rank")
    assert fault["target"].startswith("rank ")
    restart_after(drill, fault)


def test_a_killed_or_hung_rank_is_restarted_in_job_by_the_keepers_not_by_torchrun(drill: dict):
    """Each rank's keeper forks every rank again (trainer.keeper): the agents never restart."""
    records = {r["kind"]: r for r in drill["fault_recoveries"]}
    for kind in ("kill-rank", "stop-rank"):
        assert records[kind]["in_job"] and records[kind]["restarted"], records[kind]
    assert "[keeper] in-job restart 1: rank " in drill["_log"]
    # corrupt-shard's restart reads a damaged copy: in-job too, from S3.
    assert records["corrupt-shard"]["in_job"], records["corrupt-shard"]
    assert not re.search(AGENT_STOPPED_RANKS, drill["_log"]), "torchrun's agent restarted them"


def test_two_failures_inside_one_recovery_are_mended_in_job_from_the_same_checkpoint(
    drill: dict,
):
    fault = injected(drill, "kill-rank-twice")
    assert "new pid" in fault["detail"] and "before it trained a step" in fault["detail"], fault
    restart_after(drill, fault)
    (record,) = [r for r in drill["fault_recoveries"] if r["kind"] == "kill-rank-twice"]
    assert record["in_job"] and record["restarted"], record
    assert record["resumed_from"] <= record["step"], record
    # Two in-job restarts with no step trained between them: the second failure struck the
    # generation the first one started.
    lines = drill["_log"].splitlines()
    restarts = [i for i, line in enumerate(lines) if line.startswith("[keeper] in-job restart ")]
    assert any(
        not any(line.startswith("[trainer] step ") for line in lines[first:second])
        for first, second in itertools.pairwise(restarts)
    ), restarts


def test_case2_a_stopped_rank_is_ended_by_its_keeper_before_the_watchdogs_deadline(drill: dict):
    fault = injected(drill, "stop-rank")
    assert "a watchdog fired" in fault["detail"]
    hangs = events(drill, "hang")
    assert hangs, "no hang event in telemetry"
    # The diagnostic names the rank and the step it froze in; its keeper judged it after
    # FROZEN_AFTER_S without a sign of life, not the peers' watchdogs after their 6 s.
    step, rank, message, attrs = hangs[0]
    assert f"rank {rank} made no progress in phase frozen of step {step}" in message
    assert float(attrs["waited_s"]) > float(attrs["deadline_s"]) == FROZEN_AFTER_S
    assert (
        f"trainer: rank {rank}: error: watchdog: rank {rank} shows no sign of life"
        in (drill["_log"])
    )
    restart_after(drill, fault)


def test_case3_ckptd_killed_mid_upload_is_restarted_and_the_run_goes_on(drill: dict):
    fault = injected(drill, "kill-ckptd")
    assert fault["detail"].startswith("SIGKILL with an upload in flight, restarted")
    # Started once, then again after this fault and after corrupt-shard's restart.
    log = (drill["workdir"] / "logs" / "ckptd.log").read_text()
    assert log.count('"message": "ckptd started on') == 3


def test_case4_an_s3_outage_ends_with_every_checkpoint_on_s3(drill: dict):
    fault = injected(drill, "stop-s3")
    assert fault["detail"] == "stopped for 2.0s"
    final = max(drill["checkpoints"], key=lambda c: c["step"])
    assert final["step"] == STEPS and "s3" in final["tiers"]


@pytest.mark.skipif(not CAN_MOUNT, reason="mounting a size-limited tmpfs for the SSD needs root")
def test_case5_a_full_ssd_fails_saves_until_it_is_freed(drill: dict):
    fault = injected(drill, "disk-full")
    assert "(a save failed)" in fault["detail"]
    failed = [msg for _, _, msg, _ in events(drill, "checkpoint_failed")]
    assert any("No space left on device" in msg for msg in failed)
    final = max(drill["checkpoints"], key=lambda c: c["step"])
    assert final["step"] == STEPS and "ssd" in final["tiers"]


def test_case6_a_shard_damaged_on_ssd_is_read_from_s3_on_resume(drill: dict):
    fault = injected(drill, "corrupt-shard")
    damaged_step = int(fault["detail"].split(" of step ")[1].split()[0])
    log = (drill["workdir"] / "logs" / "ckptd.log").read_text()
    assert f"SSD copy of {drill['run_id']}/{damaged_step} is damaged" in log
    resumed = [step for step, *_ in events(drill, "restart")]
    assert damaged_step in resumed
    restart_after(drill, fault)


def test_case7_telemetry_killed_and_restarted_loses_no_step_record(drill: dict):
    """Every rank's record of every step from the outage on reaches telemetry (a rank SIGKILLed
    earlier may take its last unsent records with it: that is another fault's cost)."""
    fault = injected(drill, "kill-telemetry")
    with sqlite3.connect(drill["workdir"] / "telemetry.db") as db:
        recorded = set(
            db.execute(
                "SELECT DISTINCT step, rank FROM rank_steps WHERE run_id = ? AND step >= ?",
                (drill["run_id"], fault["step"]),
            ).fetchall()
        )
    assert recorded == {(s, r) for s in range(fault["step"], STEPS + 1) for r in range(RANKS)}


def test_case8_an_injected_silent_data_corruption_is_caught_and_replayed(drill: dict):
    fault = injected(drill, "sdc")
    rank = int(fault["target"].removeprefix("rank "))
    sdc = [(step, r) for step, r, *_ in events(drill, "sdc")]
    assert (SDC_STEP, rank) in sdc
    assert any(step == SDC_STEP for step, *_ in events(drill, "replay"))


def test_each_fault_has_a_recovery_record_in_the_report_and_in_telemetry(drill: dict):
    records = drill["fault_recoveries"]
    assert [r["kind"] for r in records] == [f["kind"] for f in drill["faults"]]
    with sqlite3.connect(drill["workdir"] / "telemetry.db") as db:
        (last,) = db.execute(
            "SELECT max(time) FROM rank_steps WHERE run_id = ?", (drill["run_id"],)
        ).fetchone()
    last_step_at = datetime.fromisoformat(last).replace(tzinfo=UTC).timestamp()
    for fault, record in zip(drill["faults"], records, strict=True):
        if record["first_step"] is None:
            # A fault the job rode through may end after its last step: each fault waits for
            # the previous one, so on a loaded machine the late ones slip to the end of the run.
            assert not record["restarted"] and fault["ended_at"] > last_step_at - 1, record
            continue
        if record["detected_at"] is None:
            # Nothing showed it (a 2 s S3 outage that no upload met: ckptd logged no failure);
            # the job rode through, and the record still says what the fault cost.
            assert not record["restarted"], record
            assert record["injected_at"] <= record["first_step_at"], record
        else:
            assert record["injected_at"] <= record["detected_at"] <= record["first_step_at"]
        assert (
            record["mttr_s"] > 0 and record["steps_lost"] >= 0 and record["spare"] is False
        )  # no spares on one node
        if record["kind"] in ("kill-rank", "kill-rank-twice", "stop-rank", "corrupt-shard"):
            assert record["restarted"] and record["resumed_from"] <= record["step"], record
            # Read from the tiers, unless nothing was committed yet (a start from step 0).
            restored = sum(record["bytes_per_tier"].values())
            assert (restored > 0) == (record["resumed_from"] > 0), record
    # corrupt-shard's damaged SSD copy was read from S3 instead.
    (corrupt,) = [r for r in records if r["kind"] == "corrupt-shard"]
    assert corrupt["bytes_per_tier"].get("S3", 0) > 0
    recorded = [attrs for *_, attrs in events(drill, "recovery")]
    # Stamped at each strike: sdc's (in its step, by the trainer) may come before the drill's.
    assert sorted((a["kind"], a["mttr_s"]) for a in recorded) == sorted(
        (r["kind"], "" if r["mttr_s"] is None else str(r["mttr_s"])) for r in records
    )
    # Goodput counts what each kind cost, and the drill says how much of it trained for good.
    assert set(drill["badput_by_fault_s"]) == {r["kind"] for r in records}
    assert drill["badput_by_fault_s"]["kill-rank"] > 0
    assert 0 < drill["effective_training"] < 1


def test_the_drill_prints_its_report_and_every_rank_heartbeats(drill: dict):
    beats = {rank for _, rank, _, _ in events(drill, "heartbeat")}
    assert beats == set(range(RANKS))
    assert f"[chaos] run {drill['run_id']}: {len(SCHEDULE)} faults scheduled" in drill["_log"]


def test_a_rank_whose_device_computes_wrong_is_named_before_training_starts(
    tmp_path_factory: pytest.TempPathFactory,
):
    workdir = tmp_path_factory.mktemp("bad-device")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaletrain",
            "run",
            "--workdir",
            str(workdir),
            "--ranks",
            "2",
            "--steps",
            "1",
            "--inject-bad-device",
            "rank=1",
            *TINY,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "health check before start failed: rank 1 on " in result.stderr
    assert "(matmul wrong)" in result.stderr and "rank 0 on" not in result.stderr
    assert "[trainer] step 1 " not in result.stdout
