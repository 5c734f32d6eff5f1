"""Ctrl-C (SIGINT) or `kill` (SIGTERM) on `scaletrain run` stops every child process it started
and leaves nothing running."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_procs import left_behind, processes_mentioning, rank_processes

pytestmark = pytest.mark.e2e


def _as_foreground_process(argv: list[str]) -> subprocess.Popen[str]:
    """Start `argv` with SIGINT's default disposition, as a terminal's foreground process has it.

    A test runner started in the background by a shell without job control (`(make test &)`)
    inherits SIGINT ignored, passes that on, and Python then installs no Ctrl-C handler at all.
    A handler of ours while starting the child makes it start with the default instead (exec
    resets handled signals to their default, while ignored ones stay ignored).
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["ctrl-c", "kill"],
)
def test_ctrl_c_or_kill_stops_the_services_and_the_training_job(
    tmp_path: Path, sig: signal.Signals, code: int, said: str
):
    workdir = tmp_path / "interrupted"
    others = set(rank_processes())  # not this run's
    run = _as_foreground_process(
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
            "1000",
            "--log-every",
            "1",
        ]
    )
    assert run.stdout is not None
    run_id = ""
    for line in run.stdout:
        if line.startswith("[scaletrain] run "):
            run_id = line.split()[2].rstrip(":")
        if line.startswith("[trainer] step 2 "):
            break
    else:
        pytest.fail(f"training never reached step 2: {run.stderr.read() if run.stderr else ''}")
    assert processes_mentioning(str(workdir)), "the services should be running now"
    assert processes_mentioning(run_id), "the training job should be running now"
    assert set(rank_processes()) - others, "its ranks, forked warm, should be running now"
    run.send_signal(sig)  # a terminal's Ctrl-C to the foreground process, or `kill`
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == code
    assert stderr.strip().splitlines()[-1] == f"scaletrain: {said}; every child process was stopped"
    left = left_behind([str(workdir), run_id], others)
    assert not left, left
