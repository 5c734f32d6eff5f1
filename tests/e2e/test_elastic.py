"""Elastic jobs (`--nodes MIN:MAX`): a node lost with no spare left, the job re-forms on the nodes
that remain and trains on, resharded; a node that comes back is taken in again. Real agents,
ckptds and ranks on simulated nodes (`scaletrain chaos`), against a fault-free run of the same
job: the global batch, the data order and the schedule never change with the size.

Two drills: 3 nodes of 2 ranks down to 2 and back to 3 (lose-node, return-node), and 4 nodes of
one rank down to 2 and back to 3 (lose-node twice, return-node)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from e2e_runs import TINY, events, injected, scaletrain, scaletrain_json

pytestmark = pytest.mark.e2e

# Enough steps that a machine coming back (its ckptd and agent start in seconds) finds the job
# still training.
STEPS, EVERY, BATCH = 80, 10, 24
# A machine that comes back takes seconds to start (its ckptd learns the checkpoints, its agent
# imports the trainer) while the tiny model trains a step in a few milliseconds: rank 0 sleeps
# this long in every step (a straggler, which changes no number) so that the job still trains
# when it joins. Over 80 steps at least 12 s.
PACED = ["--inject-straggler", "rank=0,delay=0.15"]
# A global batch that 6, 4, 3 and 2 ranks all divide.
MODEL = [*TINY, "--global-batch", str(BATCH)]
COMMON = ["--steps", str(STEPS), "--ckpt-every", str(EVERY), *MODEL]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("elastic-reference")
    run = scaletrain_json("run", "--workdir", str(workdir), "--ranks", "6", "--nodes", "3", *COMMON)
    return run | {"workdir": workdir}


def _drill(factory: pytest.TempPathFactory, ranks: int, nodes: str, schedule: str) -> dict:
    workdir = factory.mktemp(f"elastic-{nodes.replace(':', '-')}")
    report = scaletrain_json(
        "chaos", "--workdir", str(workdir), "--ranks", str(ranks), "--nodes", nodes, *COMMON,
        "--schedule", schedule, *PACED,
    )  # fmt: skip
    return report | {"workdir": workdir}


@pytest.fixture(scope="module")
def shrink_and_grow(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _drill(tmp_path_factory, 6, "2:3", "lose-node@6,return-node@12")


@pytest.fixture(scope="module")
def shrink_twice(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _drill(tmp_path_factory, 4, "2:4", "lose-node@5,lose-node@11,return-node@17")


def kept_steps(run: dict) -> dict[int, list[tuple[int, int, float, float]]]:
    """Step -> (rank, rank_sample, loss, lr) of every rank, from the latest attempt that trained
    the step (an attempt that failed may have trained steps a later one trained again)."""
    with sqlite3.connect(Path(run["workdir"]) / "telemetry.db") as db:
        rows = db.execute(
            "SELECT step, attempt, rank, rank_sample, loss, lr FROM rank_steps WHERE run_id = ?",
            (run["run_id"],),
        ).fetchall()
    latest: dict[int, int] = {}
    for step, attempt, *_ in rows:
        latest[step] = max(latest.get(step, attempt), attempt)
    kept: dict[int, list[tuple[int, int, float, float]]] = {}
    for step, attempt, rank, sample, loss, lr in rows:
        if attempt == latest[step]:
            kept.setdefault(step, []).append((rank, sample, loss, lr))
    return {step: sorted(ranks) for step, ranks in sorted(kept.items())}


def samples_consumed(run: dict) -> list[int]:
    """Every sample index the kept steps read, in order. A rank's `rank_sample` after a step is
    where its slice of the next step starts: its slice of this one is the `BATCH / ranks`
    samples one global batch before."""
    consumed: list[int] = []
    for ranks in kept_steps(run).values():
        share = BATCH // len(ranks)
        for _, sample, _, _ in ranks:
            consumed += range(sample - BATCH, sample - BATCH + share)
    return consumed


def world_sizes(run: dict) -> dict[int, int]:
    return {step: len(ranks) for step, ranks in kept_steps(run).items()}


def test_a_node_lost_with_no_spare_shrinks_the_job_and_a_node_back_grows_it(shrink_and_grow):
    drill = shrink_and_grow
    assert drill["completed"] and drill["faults_survived"] == 2
    assert drill["checkpoints_lost"] == []
    lost, back = injected(drill, "lose-node"), injected(drill, "return-node")
    assert "no machine takes its place: the job re-forms on 2 node(s)" in lost["detail"]
    assert "the job grows to 3 node(s)" in back["detail"]
    # The job trained at 6 ranks, then 4, then 6 again: telemetry's elastic events say so.
    resized = [(attrs["saved_world"], attrs["world"]) for *_, attrs in events(drill, "elastic")]
    assert resized == [("6", "4"), ("4", "6")]
    sizes = world_sizes(drill)
    assert sizes[1] == 6 and sizes[STEPS] == 6 and 4 in sizes.values()
    # A lost node is detected by the rendezvous as a membership change: no restart is spent.
    assert "the job goes on with 2 node(s) (--nodes 2:3)" in drill["_log"]
    for record in drill["fault_recoveries"]:
        assert record["mttr_s"] > 0 and not record["spare"], record


def test_a_job_shrinks_twice_from_four_nodes_to_two_and_grows_once(shrink_twice):
    drill = shrink_twice
    assert drill["completed"] and drill["faults_survived"] == 3
    # Each resume reshards the checkpoint it restores, saved at 4 ranks or, later, at 3.
    resized = [(attrs["saved_world"], attrs["world"]) for *_, attrs in events(drill, "elastic")]
    assert [world for _, world in resized] == ["3", "2", "3"]
    assert resized[0][0] == "4" and resized[1][0] in ("4", "3")
    assert world_sizes(drill)[STEPS] == 3
    # On 2 of its 4 ranks each runs 2 micro-batches a step: its micro-batch stays the full
    # job's (on 3, 4/3 is no whole number: each rank's batch grows instead).
    assert "[trainer] elastic: 2 ranks of 4: 2 micro-batches a step (configured 1)" in drill["_log"]


@pytest.mark.parametrize("drill", ["shrink_and_grow", "shrink_twice"])
def test_every_sample_is_consumed_exactly_once_across_every_resize(
    drill: str, request: pytest.FixtureRequest
):
    run = request.getfixturevalue(drill)
    assert samples_consumed(run) == list(range(STEPS * BATCH))


@pytest.mark.parametrize("drill", ["shrink_and_grow", "shrink_twice"])
def test_a_resized_run_trains_as_the_uninterrupted_one_within_fp32_noise(
    drill: str, request: pytest.FixtureRequest, reference: dict
):
    run = request.getfixturevalue(drill)
    ours, theirs = kept_steps(run), kept_steps(reference)
    assert list(ours) == list(theirs) == list(range(1, STEPS + 1))
    # The schedule counts the same steps: the learning rate of each step is the reference's.
    assert [ranks[0][3] for ranks in ours.values()] == [ranks[0][3] for ranks in theirs.values()]
    # Losses: each rank's is the mean over its own slice; the global batch's is their mean.
    gaps = [abs(_mean_loss(ours[s]) - _mean_loss(theirs[s])) for s in ours]
    assert max(gaps) < 1e-4, gaps
    assert abs(run["last_loss"] - reference["last_loss"]) < 1e-4


def _mean_loss(ranks: list[tuple[int, int, float, float]]) -> float:
    return sum(loss for _, _, loss, _ in ranks) / len(ranks)


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
        "chaos", "--workdir", str(tmp_path), "--nodes", "2", "--schedule", "lose-node@3",
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "lose-node needs an elastic job, --nodes MIN:MAX with MIN below MAX" in result.stderr
