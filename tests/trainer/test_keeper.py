"""The keeper above each rank (trainer.keeper): a failed rank is forked again in a new generation
by the same process, an error the rank reported in one line ends the job, and the in-job restarts
are bounded. Each case runs a keeper of a one-rank job in a process of its own, with the job's
store hosted here as torchrun's agent hosts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from scaletrain.app.seaweed import free_ports
from trainer.keeper import FAILED_EXIT_CODE, JOIN_S

# The rank: records its generation, store prefix and parent, then does what `action` names
# for its generation ("die": SIGKILL itself, "error": a one-line error, "wait": wait for peers
# that never come, "freeze": sign once then SIGSTOP itself, "unjudged": go quiet after its last
# sign, "ok": train and end).
RANK = """
import json, os, signal, sys, time
from trainer.keeper import FROZEN_AFTER_S, alive, keep

def train():
    generation = int(os.environ["SCALETRAIN_GENERATION"])
    with open(sys.argv[1], "a") as out:
        prefix = os.environ["SCALETRAIN_STORE_PREFIX"]
        out.write(json.dumps({"generation": generation, "pid": os.getpid(),
                              "keeper": os.getppid(), "prefix": prefix,
                              "torch_loaded": "torch" in sys.modules}) + "\\n")
    action = sys.argv[2].split(",")[generation]
    if action == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "wait":  # for peers that never come
        signal.pause()
    if action == "freeze":  # a sign of life, then none: stopped
        alive()
        os.kill(os.getpid(), signal.SIGSTOP)
    if action == "unjudged":  # signs, then stops its watchdog and goes quiet for a while
        alive()
        alive(False)
        time.sleep(FROZEN_AFTER_S + 1)
    return 1 if action == "error" else 0

code = keep(train, int(sys.argv[3]))
print("keeper pid", os.getpid(), "exit", code, flush=True)
sys.exit(code)
"""


def run_keeper(
    tmp_path: Path, actions: str, restarts: int, world: int = 1
) -> tuple[int, list[dict], str]:
    """A keeper of rank 0 of `world`; the other ranks' keepers come to the first generation only."""
    (port,) = free_ports(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    store.add("scaletrain/attempt-0/gen-0/joined", world - 1)
    env = os.environ | {
        "RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
    }  # fmt: skip
    seen = tmp_path / "ranks.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", RANK, str(seen), actions, str(restarts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    del store
    ranks = [json.loads(line) for line in seen.read_text().splitlines()] if seen.exists() else []
    return done.returncode, ranks, done.stdout + done.stderr


def test_a_killed_rank_is_forked_again_by_the_same_keeper_in_a_new_generation(tmp_path: Path):
    code, ranks, out = run_keeper(tmp_path, "die,die,ok", restarts=3)
    assert code == 0, out
    assert [r["generation"] for r in ranks] == [0, 1, 2]
    # One keeper forked them all, with torch already loaded: no new interpreter, no new import.
    assert len({r["keeper"] for r in ranks}) == 1 and f"keeper pid {ranks[0]['keeper']}" in out
    assert all(r["torch_loaded"] for r in ranks)
    assert len({r["pid"] for r in ranks}) == 3
    # Each generation meets under a store prefix of its own.
    assert len({r["prefix"] for r in ranks}) == 3
    assert "[keeper] in-job restart 1: rank 0 was killed by SIGKILL" in out


def test_a_frozen_rank_is_ended_by_its_keeper_and_forked_again_without_a_watchdogs_wait(
    tmp_path: Path,
):
    code, ranks, out = run_keeper(tmp_path, "freeze,ok", restarts=3)
    assert code == 0, out
    assert [r["generation"] for r in ranks] == [0, 1]
    # Said as the drill and the recovery records read a watchdog's verdict.
    assert "trainer: rank 0: error: watchdog: rank 0 shows no sign of life for " in out
    assert "[keeper] in-job restart 1: rank 0 froze (no sign of life for " in out


def test_a_rank_whose_watchdog_stopped_is_not_judged_frozen(tmp_path: Path):
    code, ranks, out = run_keeper(tmp_path, "unjudged", restarts=3)
    assert code == 0, out
    assert [r["generation"] for r in ranks] == [0] and "no sign of life" not in out


def test_an_error_the_rank_reported_in_one_line_is_not_restarted_in_job(tmp_path: Path):
    code, ranks, out = run_keeper(tmp_path, "error,ok", restarts=3)
    assert code == 1, out
    assert [r["generation"] for r in ranks] == [0]


@pytest.mark.parametrize("restarts", [0, 1])
def test_after_its_in_job_restarts_a_failure_goes_to_torchruns_agent(tmp_path: Path, restarts):
    code, ranks, out = run_keeper(tmp_path, "die,die,ok", restarts=restarts)
    assert code == FAILED_EXIT_CODE, out
    assert len(ranks) == restarts + 1
    assert f"{restarts} in-job restarts used, the agent restarts the job" in out


def test_a_generation_whose_other_keepers_never_come_goes_to_torchruns_agent(tmp_path: Path):
    """A machine lost with its keepers: the survivors do not wait for them forever."""
    code, ranks, out = run_keeper(tmp_path, "die,wait", restarts=3, world=2)
    assert code == FAILED_EXIT_CODE, out
    assert [r["generation"] for r in ranks] == [0, 1]
    assert f"1 of 2 ranks' keepers came within {JOIN_S:g}s (a machine lost?)" in out
