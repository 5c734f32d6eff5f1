"""Recovery records computed from a job's stamped output, its signs and its restarts, without a
job: what `scaletrain chaos` writes per fault."""

from __future__ import annotations

import json
import re

import pytest

from scaletrain.app.chaos import FAULTS
from scaletrain.app.recovery import Sign, Timeline, recovery_record
from telemetry.queries import Restart

RUN = "[trainer] run r1: 4 ranks, 20,576 parameters, steps 1..9"


def step(n: int) -> str:
    return f"[trainer] step {n} loss 4.0000 tok/s 2,400"


# Steps 1-7 a second each; rank 1 killed at 107.2; the job back at 115, resuming from step 5.
KILLED = Timeline(
    [
        (100.0, RUN),
        *((100.0 + n, step(n)) for n in range(1, 8)),
        (107.5, "[rank1]: Traceback (most recent call last):"),
        (115.0, RUN),
        (117.0, step(6)),
        (118.0, step(7)),
        (119.0, step(8)),
    ]
)
RESTART = Restart(step=5, attempt=1, restored_from={"memory@node0": 100, "S3": 50},
                  first_step_at=117.0)  # fmt: skip


def record(kind: str, timeline: Timeline, signs: list[Sign], **fault: float):
    return recovery_record(
        kind=kind,
        target="rank 1",
        step=int(fault.pop("step")),
        **fault,  # type: ignore[arg-type]
        restarts=FAULTS[kind].restarts,
        detected_by=re.compile(FAULTS[kind].detected_by),
        timeline=timeline,
        signs=signs,
        restarts_seen=[RESTART],
    )


def test_a_killed_rank_is_recovered_at_the_first_step_after_the_restart_with_what_it_read():
    signs = [Sign(106.9, "[rank1]: Traceback (old)"), Sign(107.5, "[rank1]: Traceback")]
    got = record("kill-rank", KILLED, signs, step=7, injected_at=107.2, ended_at=107.3)
    assert (got.detected_at, got.first_step, got.first_step_at) == (107.5, 6, 117.0)
    assert got.mttr_s == pytest.approx(9.8)
    assert (got.restarted, got.resumed_from, got.steps_lost) == (True, 5, 2)
    assert got.bytes_per_tier == {"memory": 100, "S3": 50} and got.spare is False
    # The window less the first step after (kept), plus steps 6 and 7 computed the first time.
    assert got.badput_s == pytest.approx(9.8 - 1 + 2)


def test_a_fault_ridden_through_recovers_at_the_first_step_after_it_ended():
    timeline = Timeline([(100.0, RUN), *((100.0 + n, step(n)) for n in range(1, 8))])
    signs = [Sign(104.0, "ckptd: S3 job ('upload', r1/5) failed: connection refused")]
    got = record("stop-s3", timeline, signs, step=3, injected_at=103.5, ended_at=105.5)
    assert (got.detected_at, got.first_step, got.mttr_s) == (104.0, 6, 2.5)
    assert (got.restarted, got.resumed_from, got.steps_lost, got.restored_from) == (
        False,
        None,
        0,
        {},
    )
    # It trained on at full speed meanwhile: the outage cost nothing.
    assert got.badput_s == 0.0


def test_a_fault_the_job_never_showed_has_no_detection_and_the_record_goes_to_telemetry():
    timeline = Timeline([(100.0, RUN), (101.0, step(1)), (102.0, step(2))])
    got = record("kill-telemetry", timeline, [], step=1, injected_at=101.1, ended_at=101.5)
    assert got.detected_at is None and got.detected_by == ""
    attributes = got.attributes()
    assert all(isinstance(value, str) for value in attributes.values())
    assert attributes["detected_at"] == "" and attributes["first_step"] == "2"
    assert json.loads(attributes["restored_from"]) == {} and attributes["spare"] == "false"


def test_a_slow_step_is_what_a_fault_inside_a_step_cost_and_kept_steps_are_effective_time():
    # Step 3 took 3 s (a silent data corruption replayed): its start is the fault's strike.
    lines = [(100.0, RUN), (101.0, step(1)), (102.0, step(2)), (105.0, step(3)), (106.0, step(4))]
    timeline = Timeline(lines)
    assert timeline.step_started(3) == 102.0 and timeline.step_started(1) == 100.0
    # Computed again after a restart: the strike was the first time.
    assert Timeline([*lines, (110.0, RUN), (111.0, step(3))]).step_started(3) == 102.0
    signs = [Sign(103.0, "event sdc: rank 1's gradients differ")]
    got = record("sdc", timeline, signs, step=3, injected_at=102.0, ended_at=102.0)
    assert (got.detected_at, got.first_step, got.mttr_s, got.badput_s) == (103.0, 3, 3.0, 2.0)
    # Steps 1-4 kept: 1 (typical, its own time includes the start) + 1 + 3 + 1 of 10 s.
    assert timeline.effective_training(100.0, 110.0) == pytest.approx(0.6)
    # Steps 6 and 7 were computed again after the restart: only their last computation counts.
    assert KILLED.effective_training(100.0, 120.0) == pytest.approx(8 / 20)


def test_a_restart_is_in_job_only_when_the_attempt_that_trained_again_was_forked_by_keepers():
    lines = [(100.0, RUN), *((100.0 + n, step(n)) for n in range(1, 8)),
             (115.0, RUN + ", in-job restart 1"), (117.0, step(6))]  # fmt: skip
    signs = [Sign(at, line) for at, line in lines]
    got = record("kill-rank", Timeline(lines), signs, step=7, injected_at=107.2, ended_at=107.3)
    assert got.in_job and got.attributes()["in_job"] == "true"
    # An in-job restart that could not form (a node lost) and torchrun's cold one after it.
    cold = [Sign(110.0, RUN + ", in-job restart 1"), Sign(115.0, RUN)]
    got = record("kill-rank", KILLED, cold, step=7, injected_at=107.2, ended_at=107.3)
    assert got.restarted and not got.in_job
