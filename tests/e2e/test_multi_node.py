"""Two nodes on one machine: `scaletrain run --nodes 2` and the chaos drill on two nodes.

Each simulated node has its own ckptd and torchrun agent; the agents form one 4-rank gloo job by
c10d rendezvous, each rank saving to its own node's ckptd, and a save commits across both. To stay
inside the CI budget (under three minutes for all of this) the checks share two jobs: a fault-free
`scaletrain run --nodes 2`, which is also the drill's reference, and one `scaletrain chaos --nodes
2 --spares 1` whose schedule strikes the two node faults (kill-node: a machine lost with its
SSD, the warm spare taking its place; partition-node: a node's ckptd frozen), an S3 outage (S3
holds whole checkpoints, every node's part) and a silent data corruption. The other faults
strike the same code on one node as on two and run in the one-node chaos suite.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from e2e_runs import TINY, events, injected, restart_after, scaletrain, scaletrain_json

from scaletrain.app.chaos import (
    DEFAULT_SCHEDULE,
    KINDS,
    MULTI_NODE,
    NEEDS_SPARES,
    default_schedule,
    parse_schedule,
)
from scaletrain.app.cli import main
from scaletrain.app.commands.run import _print_summary
from scaletrain.app.stack import Stack, Workdir
from scaletrain.app.summary import RunSummary, checkpoint_row, whole_tiers
from scaletrain.names import TIER_NAMES
from scaletrain.v1 import checkpoint_pb2

pytestmark = pytest.mark.e2e

RANKS, NODES, STEPS, EVERY = 4, 2, 60, 5
# ckptd's default retention: memory keeps the newest 2 checkpoints, SSD the newest 5, S3 all.
KEEP = {"memory": 2, "ssd": 5, "s3": STEPS}
SDC_STEP = 18
# Each fault strikes once the job completed a step after the previous one ended, and a recovery
# takes longer than all the steps of this small model: every fault that strikes later than its
# step must still find steps left to run. kill-node-mid-save strikes as the next save after
# step 19 commits, well before the last step (on a fast machine the job runs on meanwhile), so
# that stop-s3 (a ride-through fault) and the final save, made by node0 and the spare that took
# over, still have steps to run.
SCHEDULE = ["kill-node@8", "partition-node@13:2", f"sdc@{SDC_STEP}", "kill-node-mid-save@19",
            "flaky-node@26", "stop-s3@30:2"]  # fmt: skip
# A global batch every data-parallel degree of the reshard test divides (4, 2 and 8 ranks).
MODEL = [*TINY, "--global-batch", "24"]
LAYOUT = ["--ranks", str(RANKS), "--nodes", str(NODES), "--steps", str(STEPS),
          "--ckpt-every", str(EVERY), *MODEL]  # fmt: skip


def tiers_of(step: int, tiers: tuple[str, ...] = tuple(KEEP)) -> list[str]:
    """The tiers of `tiers` that keep the checkpoint of `step` once the run has ended."""
    newer = (STEPS - step) // EVERY
    return [tier for tier in tiers if newer < KEEP[tier]]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("two-nodes")
    return scaletrain_json("run", "--workdir", str(workdir), *LAYOUT) | {"workdir": workdir}


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("two-node-drill")
    report = scaletrain_json(
        "chaos",
        "--workdir",
        str(workdir),
        *LAYOUT,
        "--spares",
        "1",
        "--schedule",
        ",".join(SCHEDULE),
        "--seed",
        "3",
        "--watchdog-min-s",
        "6",
    )
    return report | {"workdir": workdir}


def test_a_two_node_run_commits_every_checkpoint_with_a_part_on_each_node(two_nodes: dict):
    assert two_nodes["steps"] == STEPS
    assert f"({NODES} nodes of {RANKS // NODES} ranks)" in two_nodes["_log"]
    assert [c["step"] for c in two_nodes["checkpoints"]] == list(range(EVERY, STEPS + 1, EVERY))
    for checkpoint in two_nodes["checkpoints"]:
        tiers = tiers_of(checkpoint["step"])
        assert checkpoint["tiers"] == tiers, checkpoint
        parts = checkpoint["parts"]
        assert [p["node"] for p in parts] == ["node0", "node1"], checkpoint
        # Each node holds its two ranks' shards (node0 the metadata too), on the same tiers.
        assert all(p["reachable"] and p["tiers"] == tiers for p in parts), checkpoint
        assert [p["files"] for p in parts] == [3, 2], checkpoint
        assert sum(p["bytes"] for p in parts) == checkpoint["bytes"] > 0
    # The newest on every tier of every node, and each node's part copied to the other node
    # (R = 2 by default): what the end of the run waited for.
    newest = two_nodes["checkpoints"][-1]
    assert newest["tiers"] == list(KEEP) and newest["node_loss_safe"], newest
    assert [sorted(p["replicas"]) for p in newest["parts"]] == [["node1"], ["node0"]], newest
    # Each rank saved to its own node's ckptd: node0 (its agent c10d's group rank 0) has ranks 0
    # and 1, node1 ranks 2 and 3. node0's data dir and log keep the names they have on one node.
    workdir = Workdir(two_nodes["workdir"])
    run, step = two_nodes["run_id"], str(STEPS)
    on_ssd = [
        sorted(p.name for p in (workdir.ckptd_dir(node) / "ssd" / run / step).iterdir())
        for node in range(NODES)
    ]
    assert on_ssd == [
        [".metadata", "_COMMITTED", "__0_0.distcp", "__1_0.distcp"],
        ["_COMMITTED", "__2_0.distcp", "__3_0.distcp"],
    ]
    # node0 holds a copy of node1's part, with the checkpoint's marker, and node1 of node0's.
    copies = [
        sorted(p.name for p in (workdir.ckptd_dir(node) / "replicas" / f"node{1 - node}" / run
                                / step).iterdir())
        for node in range(NODES)
    ]  # fmt: skip
    assert copies == [
        ["_COMMITTED", "__2_0.distcp", "__3_0.distcp"],
        [".metadata", "_COMMITTED", "__0_0.distcp", "__1_0.distcp"],
    ]
    assert workdir.ckptd == workdir.ckptd_dir(0) and workdir.trainer_log(1).exists()
    assert "[trainer] done: final loss" in workdir.trainer_log(0).read_text()


def _listed(*where: str) -> list[tuple[int, int, list[str]]]:
    result = scaletrain("ckpt", "ls", *where, "--json")
    assert result.returncode == 0, result.stderr
    return [(c["step"], c["world_size"], c["tiers"]) for c in json.loads(result.stdout)]


def test_every_nodes_ckptd_lists_the_same_checkpoints(two_nodes: dict):
    """`ckpt ls` against each node's ckptd (the cluster started again on the run's data dirs),
    and offline on the work directory."""
    # The memory tier died with the first cluster.
    expected = [(s, RANKS, tiers_of(s, ("ssd", "s3"))) for s in range(EVERY, STEPS + 1, EVERY)]
    workdir = Workdir(two_nodes["workdir"])
    with Stack(workdir, nodes=NODES) as stack:
        listings = [_listed("--ckptd", address) for address in stack.ckptd_addresses]
    assert listings == [expected] * NODES
    assert _listed("--workdir", str(workdir.root)) == expected


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            ["run", "--ranks", "3", "--nodes", "2"],
            "scaletrain run: error: --ranks 3 is not a multiple of --nodes 2: every node runs the "
            "same number of ranks; nearest valid --ranks: 2 or 4",
        ),
        (
            ["chaos", "--ranks", "4", "--nodes", "3"],
            "scaletrain chaos: error: --ranks 4 is not a multiple of --nodes 3: every node runs "
            "the same number of ranks; nearest valid --ranks: 3 or 6",
        ),
        (
            ["chaos", "--schedule", "kill-node@3"],
            "scaletrain chaos: error: --schedule: kill-node needs --nodes 2 or more",
        ),
        (
            ["chaos", "--nodes", "2", "--schedule", "flaky-node@3"],
            "scaletrain chaos: error: --schedule: flaky-node needs --spares 1 or more",
        ),
        (
            [
                "chaos",
                "--nodes",
                "2",
                "--spares",
                "1",
                "--cordon-after",
                "0",
                "--schedule",
                "flaky-node@3",
            ],
            "scaletrain chaos: error: --schedule: flaky-node needs --cordon-after 1 or more (0 "
            "never cordons)",
        ),
        (
            ["run", "--nodes", "2", "--spares", "1", "--cordon-after", "-1"],
            "scaletrain run: error: --cordon-after must be 0 or more, got -1",
        ),
    ],
)
def test_a_layout_the_nodes_cannot_split_is_refused_in_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str], message: str
):
    workdir = tmp_path / "refused"
    assert main([command[0], "--workdir", str(workdir), *command[1:]]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [message]
    assert not workdir.exists()


def test_a_two_node_drill_ends_bit_for_bit_as_the_fault_free_run(two_nodes: dict, drill: dict):
    assert drill["completed"], drill["_log"][-3000:]
    assert drill["faults_injected"] == drill["faults_survived"] == len(SCHEDULE)
    assert drill["last_loss"] == two_nodes["last_loss"]
    assert drill["params_sha256"] == two_nodes["params_sha256"]
    assert drill["checkpoints_lost"] == []
    assert drill["checkpoints_committed"] >= STEPS // EVERY // 2
    assert injected(drill, "stop-s3")["detail"] == "stopped for 2.0s"
    injected(drill, "sdc")
    assert any(step == SDC_STEP for step, *_ in events(drill, "replay"))


def test_a_killed_node_is_replaced_by_the_warm_spare_and_comes_back_as_the_next_spare(
    drill: dict,
):
    fault = injected(drill, "kill-node")
    # Never node0 (whose ckptd the drill asks), and the spare node2 runs no rank yet.
    assert fault["target"] == "node1"
    assert fault["spare"] == "node2", fault
    assert (
        "data dir deleted; spare node2 took its place; a fresh machine comes up at "
        in (fault["detail"])
    )
    assert "[chaos] a fresh machine node1 lists step " in drill["_log"]
    restart_after(drill, fault)
    # The spare got node1's part from the copies its peers hold (the spare itself held one,
    # placed there from the start): the restore read no S3.
    recovery = drill["recoveries"][0]
    assert recovery["step"] <= fault["step"], drill["recoveries"]
    sources = recovery["restored_from"]
    assert sum(sources.values()) > 0 and "S3" not in sources, sources
    # The survivors, node0's ranks, restored from their own copies; only the spare's ranks read
    # ckptd, the lost node's part from the copies in the live nodes' memory.
    assert sources.get("own memory@node0", 0) > 0, sources
    assert any(where.startswith("memory@") for where in sources), sources
    workdir = Workdir(drill["workdir"])
    ckptd_log = (workdir.logs / "ckptd-node1.log").read_text()
    assert ckptd_log.count('"message": "ckptd started on') == 2
    assert "[scaletrain] spare node2 is warm, waiting in the rendezvous" in drill["_log"]
    (record,) = [r for r in drill["fault_recoveries"] if r["kind"] == "kill-node"]
    assert record["spare"] is True and record["mttr_s"] > 0, record
    # The last checkpoint has a part on node0 and on the spare that took the cordoned node's
    # place (flaky-node strikes after the node faults), each on its SSD; the spare of the end
    # holds none.
    final = max(drill["checkpoints"], key=lambda c: c["step"])
    assert final["step"] == STEPS
    saved = {part["node"]: part for part in final["parts"] if part["files"]}
    assert sorted(saved) == ["node0", injected(drill, "flaky-node")["spare"]], final
    assert all("ssd" in part["tiers"] for part in saved.values()), final


def test_a_node_whose_ranks_keep_failing_is_cordoned_and_a_spare_takes_its_place(drill: dict):
    fault = injected(drill, "flaky-node")
    target, spare = fault["target"], fault["spare"]
    assert spare and spare != target, fault
    # 3 failures of its ranks, each counted unless a peer's loss was seen before it.
    kills = int(fault["detail"].split("SIGKILLed ")[1].split()[0])
    assert kills >= 3 and "; cordoned, spare " in fault["detail"], fault
    said = [line for line in drill["_log"].splitlines() if " cordoned: " in line]
    assert said == [
        f"[scaletrain] {target} cordoned: its ranks failed 3 times (the last: rank "
        + said[0].split("(the last: rank ")[1]
    ], said
    assert said[0].endswith(f"the waiting spare {spare} takes its place"), said
    # The cordoned machine never comes back: it runs no rank at the end and holds no part.
    final = max(drill["checkpoints"], key=lambda c: c["step"])
    assert target not in {part["node"] for part in final["parts"] if part["files"]}, final
    (record,) = [r for r in drill["fault_recoveries"] if r["kind"] == "flaky-node"]
    assert record["mttr_s"] > 0, record


def test_a_node_lost_right_after_a_commit_loses_at_most_that_unsafe_step_and_the_job_goes_on(
    drill: dict,
):
    fault = injected(drill, "kill-node-mid-save")
    assert fault["target"] in ("node1", "node2"), fault  # node2: the spare, now a node
    assert fault["spare"], fault
    ((struck, state),) = re.findall(
        r"step (\d+) committed, (not yet node-loss safe(?: but already on S3)?|already node-loss "
        r"safe)",
        fault["detail"],
    )
    # Only a step that was never node-loss safe may go with the node; the drill's
    # checkpoints_lost (asserted empty above) counts every other.
    assert set(drill["lost_with_node"]) <= {int(struck)}, drill["lost_with_node"]
    restart_after(drill, fault)
    # The restart this fault caused (flaky-node's come after it).
    (record,) = [r for r in drill["fault_recoveries"] if r["kind"] == "kill-node-mid-save"]
    # An attempt that made no step (struck again while it restored) did not resume the job.
    resumed = min(
        (
            r
            for r in drill["recoveries"]
            if r["first_step_at"] is not None and r["first_step_at"] >= record["injected_at"]
        ),
        key=lambda r: r["first_step_at"],
    )
    assert resumed["step"] == record["resumed_from"], (resumed, record)
    assert resumed["step"] <= int(struck), drill["recoveries"]
    # The struck step's lost part was never copied to a peer: restoring that step reads the part
    # from S3 (its upload may finish in the instant before the kill as well), every older step
    # from the copies in the live nodes' memory.
    if resumed["step"] < int(struck) or state == "already node-loss safe":
        assert "S3" not in resumed["restored_from"], (resumed, fault)


def test_a_partitioned_node_is_frozen_and_thawed_and_the_run_goes_on(drill: dict):
    fault = injected(drill, "partition-node")
    assert fault["target"] in ("node0", "node1")
    assert fault["detail"] == "ckptd frozen (SIGSTOP) for 2.0s, then SIGCONT"


def _info(
    own: tuple[str, ...], *parts: tuple[str, tuple[str, ...], bool]
) -> checkpoint_pb2.CheckpointInfo:
    """A CheckpointInfo with the answering node's tiers `own` and `parts` (node, its tiers,
    reachable)."""
    tier_of = {name: tier for tier, name in TIER_NAMES.items()}

    def statuses(names: tuple[str, ...]) -> list[checkpoint_pb2.TierStatus]:
        return [
            checkpoint_pb2.TierStatus(tier=tier_of[n], state=checkpoint_pb2.TIER_STATE_COMMITTED)
            for n in names
        ]

    return checkpoint_pb2.CheckpointInfo(
        ref=checkpoint_pb2.CheckpointRef(run="r", step=7),
        total_bytes=3_000_000,
        tiers=statuses(own),
        parts=[
            checkpoint_pb2.NodePart(
                node=node,
                files=2,
                bytes=1_500_000,
                tiers=statuses(tiers),
                reachable=reachable,
                error="" if reachable else "UNAVAILABLE",
            )
            for node, tiers, reachable in parts
        ],
    )


def test_a_checkpoint_is_whole_on_a_tier_only_where_every_nodes_part_is(
    capsys: pytest.CaptureFixture[str],
):
    every = ("memory", "ssd", "s3")
    assert whole_tiers(_info(every)) == list(every)  # one node's view, no parts asked for
    assert whole_tiers(_info(every, ("node0", every, True), ("node1", ("ssd", "s3"), True))) == [
        "ssd", "s3",
    ]  # fmt: skip
    # An unreachable node's part counts on no tier of its own; S3's marker still says it is whole.
    lost = _info(every, ("node0", every, True), ("node1", (), False))
    assert whole_tiers(lost) == ["s3"]
    row = checkpoint_row(lost)
    summary = RunSummary("r", "w", 0, 7, 1.0, 0.5, 1.0, "sha", 1.0, [row], "ui")
    _print_summary(summary)
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("  step      7      3.00 MB  tiers: s3")
    assert lines[at + 1 : at + 3] == [
        "    node0          1.50 MB    2 files  tiers: memory, ssd, s3",
        "    node1          1.50 MB  unreachable: UNAVAILABLE",
    ]


def test_the_default_drill_leaves_out_on_one_node_what_needs_two():
    assert default_schedule(2) == DEFAULT_SCHEDULE
    kinds = {f.kind for f in parse_schedule(default_schedule(1))}
    assert kinds == set(KINDS) - MULTI_NODE - NEEDS_SPARES and "partition-node" in kinds


def test_a_two_node_checkpoint_restores_resharded_from_copies_of_a_lost_nodes_part_not_s3(
    two_nodes: dict,
):
    """The run saved at 4 ranks over 2 nodes resumes resharded, and no restore reads S3:
    - at 2 ranks on 1 node, saving nothing: node1's part (its ckptd not running) comes from
      node0's copy of it;
    - node1 lost with its disk, at 8 ranks over 4 nodes: node1, node2 and node3 are empty
      machines that learn the checkpoints from their peers, and node1's part again comes from
      node0's copy; the step it saves then has a part on each of the 4 nodes.
    Runs last: it adds steps to the two-node run."""
    workdir = str(two_nodes["workdir"])
    # (ranks, nodes, save every); one step each, from the two-node run's last checkpoint.
    for ranks, nodes, every in ((2, 1, 0), (8, 4, 1)):
        if nodes == 4:
            shutil.rmtree(Workdir(two_nodes["workdir"]).ckptd_dir(1))
        resumed = scaletrain_json(
            "run",
            "--workdir",
            workdir,
            "--resume",
            "--ranks",
            str(ranks),
            "--nodes",
            str(nodes),
            "--steps",
            str(STEPS + 1),
            "--ckpt-every",
            str(every),
            *MODEL,
        )
        assert resumed["run_id"] == two_nodes["run_id"]
        (line,) = [x for x in resumed["_log"].splitlines() if "[trainer] resumed run" in x]
        assert f"from step {STEPS} " in line, line
        assert "from S3" not in line and "@node0" in line, line
        assert resumed["steps"] == STEPS + 1
        if not every:
            continue
        newest = max(resumed["checkpoints"], key=lambda c: c["step"])
        assert newest["step"] == STEPS + 1
        assert [p["node"] for p in newest["parts"] if p["files"]] == [
            f"node{i}" for i in range(nodes)
        ]
