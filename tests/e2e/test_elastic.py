"""Elastic jobs (`--nodes MIN:MAX`): a node lost with no spare left, the job re-forms on the nodes
that remain and trains on, resharded; a node that comes back is taken in again. Real agents,
ckptds and ranks on simulated nodes (`scaletrain chaos`), against a fault-free run of the same
job: the global batch, the data order and the schedule never change with the size.

Two drills: 3 nodes of 2 ranks down to 2 and back to 3, twice (the second loss, soon after the
grow, is a flap: the second grow is held back), and 4 nodes of
one rank with MIN 2 losing three (the third leaves one: the job waits for a machine) and taking
two back. And a job left with fewer than MIN nodes for longer than --capacity-wait-s stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_runs import TINY, events, scaletrain, scaletrain_json

from scaletrain.app.growth import GROW_HOLD_BASE_S
from telemetry import queries
from telemetry.db import reading
from telemetry.queries import KeptRankStep, consumed_samples, unrecorded

pytestmark = pytest.mark.e2e

# Enough steps that a machine coming back (its ckptd and agent start in seconds) finds the job
# still training.
STEPS, EVERY, BATCH = 80, 10, 24
# A machine that comes back takes seconds to start (its ckptd learns the checkpoints, its agent
# imports the trainer) while the tiny model trains a step in a few milliseconds: rank 0 sleeps
# this long in every step (a straggler, which changes no number) so that the job still trains
# when it joins. Over 80 steps at least 12 s.
PACED = ["--inject-straggler", "rank=0,delay=0.15"]
# The flapping drill also waits out a held-back grow (growth.GROW_HOLD_BASE_S, 10 s) while
# training: over 80 steps at least 24 s.
SLOW = ["--inject-straggler", "rank=0,delay=0.3"]
# A global batch that 6, 4, 3 and 2 ranks all divide.
MODEL = [*TINY, "--global-batch", str(BATCH)]
COMMON = ["--steps", str(STEPS), "--ckpt-every", str(EVERY), *MODEL]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("elastic-reference")
    run = scaletrain_json("run", "--workdir", str(workdir), "--ranks", "6", "--nodes", "3", *COMMON)
    return run | {"workdir": workdir}


def _drill(
    factory: pytest.TempPathFactory, ranks: int, nodes: str, schedule: str, paced: list[str]
) -> dict:
    workdir = factory.mktemp(f"elastic-{nodes.replace(':', '-')}")
    report = scaletrain_json(
        "chaos",
        "--workdir",
        str(workdir),
        "--ranks",
        str(ranks),
        "--nodes",
        nodes,
        *COMMON,
        "--schedule",
        schedule,
        *paced,
    )
    return report | {"workdir": workdir}


@pytest.fixture(scope="module")
def shrink_and_grow(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # The second machine comes back at once: within the hold its loss set off.
    schedule = "lose-node@6,return-node@12,lose-node@18,return-node@19"
    return _drill(tmp_path_factory, 6, "2:3", schedule, SLOW)


@pytest.fixture(scope="module")
def shrink_twice(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # The third loss leaves 1 node of MIN 2: the first return-node strikes at once.
    schedule = "lose-node@5,lose-node@11,lose-node@17,return-node@23,return-node@29"
    return _drill(tmp_path_factory, 4, "2:4", schedule, PACED)


def kept_steps(run: dict) -> dict[int, list[KeptRankStep]]:
    """Step -> every rank's record of it, from the attempt that kept it (telemetry's)."""
    with reading(f"sqlite:///{Path(run['workdir']) / 'telemetry.db'}") as engine:
        return queries.kept_steps(engine, run["run_id"])


def world_sizes(run: dict) -> dict[int, int]:
    return {step: len(ranks) for step, ranks in kept_steps(run).items()}


def test_a_node_lost_with_no_spare_shrinks_the_job_and_a_node_back_grows_it(shrink_and_grow):
    drill = shrink_and_grow
    assert drill["completed"] and drill["faults_survived"] == 4
    assert drill["checkpoints_lost"] == []
    lost = [f for f in drill["faults"] if f["kind"] == "lose-node"]
    back = [f for f in drill["faults"] if f["kind"] == "return-node"]
    assert all(
        "no machine takes its place: the job re-forms on 2 node(s)" in f["detail"] for f in lost
    )
    assert all("the job grows to 3 node(s)" in f["detail"] for f in back)
    # The job trained at 6 ranks, then 4, then 6 again, twice: telemetry's elastic events say
    # so. A resume that restores a step saved at its own size is no resize: a grow that
    # restores a step saved before the loss, or a loss one saved before the grow.
    resized = [(attrs["saved_world"], attrs["world"]) for *_, attrs in events(drill, "elastic")]
    assert resized[0] == ("6", "4") and resized[-1] == ("4", "6")
    assert set(resized) == {("6", "4"), ("4", "6")}
    # A lost node is detected by the rendezvous as a membership change: no restart is spent.
    assert drill["_log"].count("the job goes on with 2 node(s) (--nodes 2:3)") == 2
    sizes = world_sizes(drill)
    assert sizes[1] == 6 and sizes[STEPS] == 6 and 4 in sizes.values()
    for record in drill["fault_recoveries"]:
        assert record["mttr_s"] > 0 and not record["spare"], record


def test_a_node_lost_soon_after_a_grow_holds_the_next_grow_back(shrink_and_grow):
    """Flapping: the second loss came within FLAP_WINDOW_S of the first grow, so the machine
    that returned after it waited GROW_HOLD_BASE_S from the job's re-form before it was taken
    in; the first grow was taken at once."""
    log = shrink_and_grow["_log"]
    held = [line for line in log.splitlines() if "wait to join; the job lost a machine" in line]
    assert held, log[-3000:]
    assert f"{GROW_HOLD_BASE_S:g}s after it last re-formed, not at once" in held[0]
    first_grow, second_grow = [
        r for r in shrink_and_grow["fault_recoveries"] if r["kind"] == "return-node"
    ]
    assert first_grow["mttr_s"] < second_grow["mttr_s"]


def test_a_job_shrinks_to_min_waits_below_it_for_a_machine_and_grows_back(shrink_twice):
    drill = shrink_twice
    assert drill["completed"] and drill["faults_survived"] == 5
    assert drill["checkpoints_lost"] == []
    # Each resume reshards the checkpoint it restores, saved at 4 ranks or, later, at 3 or 2.
    resized = [(attrs["saved_world"], attrs["world"]) for *_, attrs in events(drill, "elastic")]
    worlds = [world for _, world in resized]
    assert [w for i, w in enumerate(worlds) if worlds[i - 1 : i] != [w]] == ["3", "2", "3"]
    assert resized[0][0] == "4" and resized[1][0] in ("4", "3")
    assert world_sizes(drill)[STEPS] == 3
    # One node left of MIN 2: the survivor waited in the rendezvous until a machine came back.
    assert (
        "1 node(s) left, fewer than --nodes 2:4 allows: the job waits up to 600s" in drill["_log"]
    )
    third = [f for f in drill["faults"] if f["kind"] == "lose-node"][2]
    assert "fewer than 2; the job waits up to 600s for a machine to join" in third["detail"]
    # The first return struck at once (the job trained no step without it), not at step 23.
    returned = [f for f in drill["faults"] if f["kind"] == "return-node"]
    assert returned[0]["step"] < 23 and all("the job grows to" in f["detail"] for f in returned)
    # On 2 of its 4 ranks each runs 2 micro-batches a step: its micro-batch stays the full
    # job's (on 3, 4/3 is no whole number: each rank's batch grows instead).
    assert "[trainer] elastic: 2 ranks of 4: 2 micro-batches a step (configured 1)" in drill["_log"]


@pytest.mark.parametrize("drill", ["shrink_and_grow", "shrink_twice"])
def test_every_sample_is_consumed_exactly_once_across_every_resize(
    drill: str, request: pytest.FixtureRequest
):
    run = request.getfixturevalue(drill)
    kept = kept_steps(run)
    consumed = consumed_samples(kept, BATCH)
    # A node lost at once may take its ranks' unsent records of the step before with it: those
    # slices are not known (at most one step a lost node), every other sample read exactly once.
    unknown = unrecorded(kept)
    assert len(unknown) <= sum(f["kind"] == "lose-node" for f in run["faults"]), unknown
    assert len(consumed) == len(set(consumed)), "a sample read twice"
    never = set(range(STEPS * BATCH)) - set(consumed)
    assert {sample // BATCH + 1 for sample in never} <= set(unknown), sorted(never)[:20]


@pytest.mark.parametrize("drill", ["shrink_and_grow", "shrink_twice"])
def test_a_resized_run_trains_as_the_uninterrupted_one_within_fp32_noise(
    drill: str, request: pytest.FixtureRequest, reference: dict
):
    run = request.getfixturevalue(drill)
    ours, theirs = kept_steps(run), kept_steps(reference)
    assert list(ours) == list(theirs) == list(range(1, STEPS + 1))
    # The schedule counts the same steps: the learning rate of each step is the reference's.
    assert [ranks[0].lr for ranks in ours.values()] == [ranks[0].lr for ranks in theirs.values()]
    # Losses: each rank's is the mean over its own slice; the global batch's is their mean (of
    # the steps whose every rank's record arrived).
    known = set(ours) - set(unrecorded(ours))
    gaps = [abs(_mean_loss(ours[s]) - _mean_loss(theirs[s])) for s in sorted(known)]
    assert max(gaps) < 1e-4, gaps
    assert abs(run["last_loss"] - reference["last_loss"]) < 1e-4


def _mean_loss(ranks: list[KeptRankStep]) -> float:
    return sum(r.loss for r in ranks) / len(ranks)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--nodes", "3:2"], 2, "--nodes 3:2: MIN must be at least 1 and at most MAX"),
        (["--nodes", "two"], 2, "--nodes takes N or MIN:MAX, got 'two'"),
        (
            ["--ranks", "6", "--nodes", "2:3", "--global-batch", "18"],
            1,
            "--nodes 2:3: on 2 node(s), 4 ranks: ",
        ),
    ],
)
def test_a_bad_elastic_request_is_refused_in_one_line(tmp_path, args, code, message):
    result = scaletrain("run", "--workdir", str(tmp_path), *args, timeout=120)
    assert result.returncode == code
    (line,) = result.stderr.strip().splitlines()
    assert message in line, line


def test_resizing_faults_need_an_elastic_job(tmp_path):
    result = scaletrain(
        "chaos",
        "--workdir",
        str(tmp_path),
        "--nodes",
        "2",
        "--schedule",
        "lose-node@3",
        timeout=120,
    )
    assert result.returncode == 1
    assert "lose-node needs an elastic job, --nodes MIN:MAX with MIN below MAX" in result.stderr


def test_a_job_left_below_min_for_longer_than_its_capacity_wait_stops_and_keeps_its_checkpoints(
    tmp_path,
):
    result = scaletrain(
        "chaos",
        "--workdir",
        str(tmp_path),
        "--ranks",
        "3",
        "--nodes",
        "2:3",
        *COMMON,
        "--schedule",
        "lose-node@5,lose-node@12",
        "--capacity-wait-s",
        "8",
        *PACED,
        "--json",
    )
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert not report["completed"] and report["checkpoints_lost"] == []
    assert "the run did not survive the drill" in result.stderr.strip().splitlines()[-1]
    # The survivor's agent says in one line why it stopped (the ranks the lost machines left
    # behind may have logged their own failure, as torchrun logs every failed worker).
    assert (
        "[agent] no round of at least 2 machine(s) formed within the rendezvous' join_timeout "
        "(8s; scaletrain's --capacity-wait-s): this machine stops" in result.stderr
    )
    # What was committed before is still there to resume from.
    listed = scaletrain(
        "ckpt", "ls", "--workdir", str(tmp_path), "--run", report["run_id"], "--json", timeout=120
    )
    assert listed.returncode == 0, listed.stderr
    assert 10 in [c["step"] for c in json.loads(listed.stdout)], listed.stdout
