"""--mem-ckpt-every 1 end to end: `scaletrain run` on 4 CPU ranks over 2 simulated nodes, a
durable checkpoint every 10 steps and a memory one at every step in between (each rank's own
copy, mirrored to a peer node's memory). A rank SIGKILLed mid-run is restarted in the job,
which resumes from the newest memory step (at most one step computed again) and ends with the
final parameters of an uninterrupted run, bit for bit. One reference run and one killed run
serve every check.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_procs import trainer_pids
from e2e_runs import scaletrain_json


def unsaved_steps(log: str, first: int, last: int) -> int:
    """How many of steps `first`..`last` saved nothing the first time they ran (their memory
    save skipped): the drill logs every step, with "checkpoint staged" when it saved."""
    saved: dict[int, bool] = {}
    for line in log.splitlines():
        if line.startswith("[trainer] step ") and " loss " in line:
            saved.setdefault(int(line.split()[2]), "checkpoint staged" in line)
    return sum(not saved.get(step, True) for step in range(first, last + 1))


pytestmark = pytest.mark.e2e
COMMON = ("--ranks", "4", "--nodes", "2", "--steps", "40", "--ckpt-every", "10")
KILL_AFTER = 13
# The machine faults of the two-node drill: each strikes once the job trains after the last.
MACHINE_FAULTS = ("kill-node@5", "kill-spare-taking-over@15", "kill-rendezvous@25")
VICTIM = 3  # a rank of node 1


def _first_attempt_steps(workdir: Path, run_id: str) -> int:
    """The last step any rank completed before the restart (telemetry's attempt 0)."""
    with sqlite3.connect(workdir / "telemetry.db") as db:
        (step,) = db.execute(
            "SELECT MAX(step) FROM rank_steps WHERE run_id = ? AND attempt = 0", (run_id,)
        ).fetchone()
    return int(step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run every drill here must end as, bit for bit."""
    return scaletrain_json("run", "--workdir", str(tmp_path_factory.mktemp("reference")), *COMMON)


def test_a_killed_rank_costs_at_most_one_step_and_the_run_ends_bitwise_as_an_uninterrupted_one(
    tmp_path: Path, reference: dict
) -> None:
    workdir = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scaletrain",
            "run",
            "--workdir",
            str(workdir),
            "--json",
            "--log-every",
            "1",
            "--max-restarts",
            "1",
            "--mem-ckpt-every",
            "1",
            *COMMON,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    log, killed_at = [], 0
    for line in proc.stderr:
        log.append(line)
        if line.startswith("[scaletrain] run "):
            run_id = line.split()[2].rstrip(":")
        if not killed_at and line.startswith(f"[trainer] step {KILL_AFTER} "):
            # At once: the memory save of this step may still be on its way to the peers.
            os.kill(trainer_pids(run_id)[VICTIM], signal.SIGKILL)
            killed_at = KILL_AFTER
    stdout, _ = proc.communicate(timeout=300)
    text = "".join(log)
    assert proc.returncode == 0, text[-3000:]
    summary = json.loads(stdout)

    # It resumed from a memory step (none is durable between 10 and 16), each rank from its own
    # memory (the killed rank's copies outlive it), nothing read from ckptd.
    resumed = [line for line in log if line.startswith(f"[trainer] resumed run {run_id} ")]
    assert len(resumed) == 1, text[-3000:]
    step = int(resumed[0].split("from step ")[1].split()[0])
    assert step >= killed_at - 1 and step % 10, resumed[0]
    sources = resumed[0].split("read ")[1]
    assert {part.split(" from ")[1].split("@")[0] for part in sources.split(", ")} == {
        "own memory"
    }, resumed[0]
    # Steps lost: those some rank completed before the kill that the resumed job ran again.
    lost = _first_attempt_steps(workdir, run_id) - step
    assert 0 <= lost <= 1, (lost, resumed[0])
    # The final parameters of the uninterrupted run, bit for bit.
    assert summary["params_sha256"] == reference["params_sha256"]
    assert summary["last_loss"] == reference["last_loss"]
    # Memory steps never reach ckptd: it holds the durable ones alone.
    assert [c["step"] for c in summary["checkpoints"]] == [10, 20, 30, 40]


def test_machines_lost_cost_at_most_one_step_each_the_state_coming_from_own_and_peer_memory(
    tmp_path: Path, reference: dict
) -> None:
    drill = scaletrain_json(
        "chaos",
        "--workdir",
        str(tmp_path / "drill"),
        *COMMON,
        "--spares",
        "1",
        "--mem-ckpt-every",
        "1",
        "--schedule",
        ",".join(MACHINE_FAULTS),
    )
    log = drill["_log"]
    assert drill["completed"] and not drill["checkpoints_lost"], log[-3000:]
    assert drill["faults_injected"] == len(MACHINE_FAULTS), drill["faults"]
    assert drill["params_sha256"] == reference["params_sha256"]
    records = {r["kind"]: r for r in drill["fault_recoveries"]}
    assert sorted(records) == sorted(f.split("@")[0] for f in MACHINE_FAULTS), records
    fell_back = []
    for record in records.values():
        # At most one step, plus the memory saves skipped before the strike (one due while the
        # durable save before it still streamed, on a loaded machine).
        skipped = unsaved_steps(log, record["resumed_from"] + 1, record["step"])
        # Rank 0 says why when no step is whole in memory on every rank (what it finds, where).
        why = [line for line in log.splitlines() if "no step every rank can restore" in line]
        assert record["steps_lost"] <= 1 + skipped, (record, skipped, why)
        # The survivors' ranks from their own memory; a lost node's ranks, on the machine that
        # took its place, from the copies their buddies kept: nothing from ckptd's tiers. Seen
        # once in CI (of 3 faults x many runs): a kill-node restored the durable step it struck
        # from ckptd's memory tier instead; so one fault may, and only from ckptd's memory.
        copies = {source.split("@")[0] for source in record["restored_from"]}
        assert copies, record
        if not copies <= {"own memory", "peer memory"}:
            fell_back.append(record)
            assert copies <= {"memory"}, (record, why)
    assert len(fell_back) <= 1, fell_back
    assert records["kill-node"]["spare"], records["kill-node"]
    if records["kill-node"] not in fell_back:
        assert "peer memory" in str(records["kill-node"]["restored_from"])
    # The spare lost as it took over: the job found it out, said so, and went on with the
    # machine lost first, back as a spare.
    (spare_lost,) = [line for line in log.splitlines() if " was lost while it ran ranks " in line]
    assert spare_lost.endswith("takes its place"), spare_lost
    # The rendezvous lost: started again, every agent too, the ranks' state from memory (their
    # own copies; a rank whose own copy of the step was not whole when its agent was killed gets
    # the copy its buddy holds: seen once in the suite, both are memory, nothing from ckptd).
    assert "[scaletrain] the rendezvous at " in log and "was lost: it is started again" in log
    assert any(s.startswith("own memory@") for s in records["kill-rendezvous"]["restored_from"])


def test_a_rank_that_corrupts_twice_is_quarantined_a_spare_takes_its_machines_place_bitwise(
    tmp_path: Path, reference: dict
) -> None:
    workdir = tmp_path / "drill"
    drill = scaletrain_json(
        "chaos",
        "--workdir",
        str(workdir),
        *COMMON,
        "--spares",
        "1",
        "--mem-ckpt-every",
        "1",
        "--schedule",
        "corrupting-rank@12",
    )
    log = drill["_log"]
    assert drill["completed"] and not drill["checkpoints_lost"], log[-3000:]
    # Both corruptions were replayed away, the restart computed nothing wrong: bit for bit.
    assert drill["params_sha256"] == reference["params_sha256"]
    ((fault, record),) = zip(drill["faults"], drill["fault_recoveries"], strict=True)
    rank = int(fault["target"].removeprefix("rank "))
    (quarantined,) = drill["quarantined"]
    assert quarantined == {
        "rank": rank, "node": quarantined["node"], "steps": [12, 14], "policy": "cordon"
    }, quarantined  # fmt: skip
    node = quarantined["node"]
    assert f"[scaletrain] {node} cordoned: quarantine: rank {rank} ({node}) named by" in log
    assert fault["spare"] and record["spare"] and record["restarted"], (fault, record)
    assert record["detected_by"].startswith("[trainer] quarantine: "), record
    # The job came back from memory (the survivors' own copies, the cordoned machine's ranks'
    # copies from their buddies), losing at most the step the quarantine cut short.
    copies = {source.split("@")[0] for source in record["restored_from"]}
    assert copies and copies <= {"own memory", "peer memory"}, record
    assert record["steps_lost"] <= 1 + unsaved_steps(log, record["resumed_from"] + 1, 14), record
    # The spare's rank computed steps 12..14 again without a flip: the fault struck once each.
    with sqlite3.connect(workdir / "telemetry.db") as db:
        found = dict(
            db.execute(
                "SELECT kind, COUNT(*) FROM events WHERE run_id = ? AND kind IN "
                "('sdc', 'quarantine') GROUP BY kind",
                (drill["run_id"],),
            ).fetchall()
        )
    assert found == {"sdc": 2, "quarantine": 1}, found
