"""Running `scaletrain` as a user does and reading what a run or a drill left behind."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

# A model small enough that a step takes ~0.1 s on two shared cores.
TINY = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
        "--seq-len", "32", "--global-batch", "8"]  # fmt: skip


def scaletrain(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True, timeout=timeout
    )


def scaletrain_json(*args: str) -> dict:
    """`scaletrain ARGS --json`, which must succeed: its JSON, with its stderr under "_log"."""
    result = scaletrain(*args, "--json")
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout) | {"_log": result.stderr}


def events(drill: dict, kind: str) -> list[tuple[int, int, str, dict]]:
    """(step, rank, message, attributes) of the events of `kind` telemetry recorded, in order."""
    with sqlite3.connect(drill["workdir"] / "telemetry.db") as db:
        rows = db.execute(
            "SELECT step, rank, message, attributes FROM events WHERE run_id = ? AND kind = ? "
            "ORDER BY time",
            (drill["run_id"], kind),
        ).fetchall()
    return [(step, rank, message, json.loads(attrs or "{}")) for step, rank, message, attrs in rows]


def injected(drill: dict, kind: str) -> dict:
    """The drill's record of fault `kind`, after checking telemetry recorded it too."""
    (fault,) = [f for f in drill["faults"] if f["kind"] == kind]
    assert not fault["detail"].startswith("could not inject"), fault
    recorded = [attrs for *_, attrs in events(drill, "fault") if attrs.get("fault") == kind]
    assert recorded == [{"fault": kind, "target": fault["target"]}]
    return fault


def restart_after(drill: dict, fault: dict) -> None:
    """The fault restarted the job, which resumed from a checkpoint of a step before it."""
    assert fault["detail"].endswith("the job restarted"), fault
    resumed = [step for step, *_ in events(drill, "restart")]
    assert any(step <= fault["step"] for step in resumed), (resumed, fault)
