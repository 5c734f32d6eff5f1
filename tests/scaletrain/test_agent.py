"""The launchers' torchrun (`scaletrain.app.agent`) forks the trainer's ranks from one warm process
per machine, at the first start and at every restart, instead of starting a new interpreter per
rank; any other entry point, or `--start-method spawn`, starts as torchrun starts it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import run

from scaletrain.app.agent import warm
from scaletrain.app.seaweed import free_ports
from scaletrain.app.stack import worker_pids
from scaletrain.cordon import CORDONED_EXIT_CODE
from scaletrain.process import descendants

TINY = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1", "--seq-len",
        "32", "--global-batch", "8"]  # fmt: skip
C10D = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
        "127.0.0.1:1"]  # fmt: skip


@pytest.mark.parametrize(
    ("launch", "forked"),
    [
        ([*C10D, "-m", "trainer", "--steps", "3"], True),
        ([*C10D, "--start-method", "forkserver", "-m", "trainer"], True),
        ([*C10D, "--start-method", "spawn", "-m", "trainer"], False),
        ([*C10D, "-m", "other_trainer"], False),
        ([*C10D, "train.py"], False),
        (["--standalone", "--nproc-per-node", "2", "-m", "trainer"], False),
    ],
)
def test_only_the_trainers_module_is_forked_warm_unless_spawn_is_asked_for(launch, forked):
    assert warm(run.parse_args(launch), launch) is forked


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _ranks(agent: subprocess.Popen[str], world: int, other_than: set[int]) -> dict[int, int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and agent.poll() is None:
        pids = worker_pids(agent.pid)
        if len(pids) == world and not set(pids.values()) & other_than:
            return pids
        time.sleep(0.1)
    agent.kill()
    pytest.fail(f"the agent never ran {world} new ranks: {agent.communicate()[0][-3000:]}")


def test_a_restart_forks_the_ranks_again_from_the_same_warm_process():
    (port,) = free_ports(1)
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scaletrain.app.agent",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "warm",
            "--rdzv-conf",
            "is_host=true",
            "--max-restarts",
            "1",
            "-m",
            "trainer",
            "--run-id",
            "warm",
            *TINY,
            "--steps",
            "100000",
            "--in-job-restarts",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    try:
        first = _ranks(agent, 2, set())
        (server,) = {_parent(pid) for pid in first.values()}
        argv = Path(f"/proc/{server}/cmdline").read_bytes()
        # Forked from torchrun's forkserver, not exec'd: each rank has its command line.
        assert b"multiprocessing.forkserver" in argv
        assert {Path(f"/proc/{pid}/cmdline").read_bytes() for pid in first.values()} == {argv}
        os.kill(first[1], signal.SIGKILL)  # the agent restarts both ranks (--in-job-restarts 0)
        again = _ranks(agent, 2, set(first.values()))
        assert {_parent(pid) for pid in again.values()} == {server}
    finally:
        agent.send_signal(signal.SIGTERM)
        out = agent.communicate(timeout=60)[0]
    assert "failed (exitcode: " in out and "Closing process" in out, out[-3000:]
    deadline = time.monotonic() + 5
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server), "the forkserver outlived its agent"


def test_an_agent_whose_ranks_keep_failing_cordons_its_machine_and_leaves_the_job():
    (port,) = free_ports(1)
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scaletrain.app.agent",
            "--cordon-after",
            "2",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "cordon",
            "--rdzv-conf",
            "is_host=true",
            "--max-restarts",
            "0",
            "-m",
            "trainer",
            "--run-id",
            "cordon",
            *TINY,
            "--steps",
            "100000",
            "--in-job-restarts",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        | {"OMP_NUM_THREADS": "1"},
    )
    try:
        first = _ranks(agent, 2, set())
        os.kill(first[1], signal.SIGKILL)  # its keeper restarts the job in-job: one failure
        again = _ranks(agent, 2, set(first.values()))
        machine = [*again.values(), *descendants(agent.pid)]
        os.kill(again[0], signal.SIGKILL)  # the second in a row: the machine is cordoned
        out = agent.communicate(timeout=60)[0]
    finally:
        agent.kill()
    assert agent.returncode == CORDONED_EXIT_CODE, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("[agent] this machine is cordoned")]
    assert "its ranks failed 2 times in a row (the last: rank 0 after step " in line
    assert "was killed by SIGKILL); not on Kubernetes" in line
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in machine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in machine if _alive(pid)], "a process outlived its cordoned agent"


def test_a_bad_cordon_after_is_refused_in_one_line():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaletrain.app.agent",
            "--cordon-after",
            "many",
            *C10D,
            "-m",
            "trainer",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "agent: error: --cordon-after must be a whole number of failures, got 'many'"
    )


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left to a parent that does not reap it has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
