"""--mem-ckpt-every 1 end to end: `scaletrain run` on 4 CPU ranks over 2 simulated nodes, a
durable checkpoint every 10 steps and a memory-only one at every step in between. A rank
SIGKILLed mid-run makes torchrun restart the job, which resumes from the newest memory step (at
most one step computed again) and ends with the final parameters of an uninterrupted run, bit
for bit. One reference run and one killed run serve every check.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_procs import trainer_pids

from ckptd.client import CkptdClient
from scaletrain.errors import ScaletrainError

pytestmark = pytest.mark.e2e
COMMON = ("--ranks", "4", "--nodes", "2", "--steps", "16", "--ckpt-every", "10")
KILL_AFTER = 13
VICTIM = 3  # a rank of node 1


def _newest(address: str, run_id: str, at_least: int) -> int:
    """Wait until `latest` of the run is at least step `at_least`; return it."""
    with CkptdClient(address) as client:
        for _ in range(600):
            try:
                step = client.get(run_id).ref.step
            except ScaletrainError:
                step = 0
            if step >= at_least:
                return step
            time.sleep(0.05)
    pytest.fail(f"no checkpoint of step {at_least} or later within 30 s")


def _first_attempt_steps(workdir: Path, run_id: str) -> int:
    """The last step any rank completed before the restart (telemetry's attempt 0)."""
    with sqlite3.connect(workdir / "telemetry.db") as db:
        (step,) = db.execute(
            "SELECT MAX(step) FROM rank_steps WHERE run_id = ? AND attempt = 0", (run_id,)
        ).fetchone()
    return int(step)


def test_a_killed_rank_costs_at_most_one_step_and_the_run_ends_bitwise_as_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    reference = subprocess.run(
        [sys.executable, "-m", "scaletrain", "run", "--workdir", str(tmp_path / "reference"),
         "--json", *COMMON],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = json.loads(reference.stdout)

    workdir = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "run", "--workdir", str(workdir), "--json",
         "--log-every", "1", "--max-restarts", "1", "--mem-ckpt-every", "1", *COMMON],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    log, killed_at = [], 0
    for line in proc.stderr:
        log.append(line)
        if line.startswith("[scaletrain] run "):
            run_id = line.split()[2].rstrip(":")
            ckptd = line.split("ckptd ")[1].split()[0]  # node 0's, the coordinator's
        if not killed_at and line.startswith(f"[trainer] step {KILL_AFTER} "):
            killed_at = _newest(ckptd, run_id, KILL_AFTER)
            os.kill(trainer_pids(run_id)[VICTIM], signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=300)
    text = "".join(log)
    assert proc.returncode == 0, text[-3000:]
    summary = json.loads(stdout)

    # It resumed from a memory-only step (none is durable between 10 and 16), read from memory.
    resumed = [line for line in log if line.startswith(f"[trainer] resumed run {run_id} ")]
    assert len(resumed) == 1, text[-3000:]
    step = int(resumed[0].split("from step ")[1].split()[0])
    assert step >= killed_at >= KILL_AFTER and step % 10, resumed[0]
    assert "memory@" in resumed[0] and "s3" not in resumed[0].split("read ")[1], resumed[0]
    # Steps lost: those some rank completed before the kill that the resumed job ran again.
    lost = _first_attempt_steps(workdir, run_id) - step
    assert 0 <= lost <= 1, (lost, resumed[0])
    # The final parameters of the uninterrupted run, bit for bit.
    assert summary["params_sha256"] == expected["params_sha256"]
    assert summary["last_loss"] == expected["last_loss"]
    # No memory-only step outlives the run's last (durable) step: the newer durable one retired
    # them; the durable ones stay.
    assert [c["step"] for c in summary["checkpoints"]] == [10, 16]
