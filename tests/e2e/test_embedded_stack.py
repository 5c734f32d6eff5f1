"""The whole platform end to end: `scaletrain run` on CPU ranks, then everything it promised.

Each check reads what a user would read: the JSON summary, the telemetry database, `ckpt ls`,
`ckpt export` loaded with stock torch.distributed.checkpoint. Runs share work directories per
scenario so that one uninterrupted run serves as the reference of several checks:

- the reference: 4 ranks (FSDP over 4), 6 steps, a checkpoint every 3, trained on the example
  dataset (`scaletrain data example`: BPE tokens of stdlib sources, what `make run` trains on)
  with document masking, and its validation loss on the held-out part every 3 steps;
- the same run SIGKILLed on a random rank after a random step, then `--resume`d to step 8: every
  step after the resume point has the reference's loss, bit for bit;
- the same with HSDP (2 replicas x 2 shards), a 2-D layout, on the built-in byte corpus, started
  again as a restarted pod starts it: its run id, no `--resume`;
- the reference resumed from its dp4 checkpoint at dp2 (resharded): the global sample order is
  unchanged and the losses match the dp4 continuation to fp32 rounding.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from e2e_procs import left_behind, rank_processes, trainer_pids
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ckptd.client import CkptdClient
from telemetry.tensorboard import TAGS
from trainer.checkpoint.digest import probe_logits_sha256, state_sha256
from trainer.data.prepare import EXAMPLE_VOCAB
from trainer.model.llama import ModelArgs, Transformer

pytestmark = pytest.mark.e2e

RANKS, STEPS, EVERY, MORE = 4, 6, 3, 8
GLOBAL_BATCH = 16
ALL_TIERS = ["memory", "ssd", "s3"]
SEED = int(os.environ.get("SCALETRAIN_TEST_SEED", random.randrange(1 << 16)))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The options of a run on the example dataset, documents masked, validation loss every
    checkpoint."""
    out = tmp_path_factory.mktemp("example-data")
    made = scaletrain("data", "example", "--out", str(out))
    assert made.returncode == 0, made.stderr
    return ["--data", str(out / "train"), "--document-masking", "--eval-data",
            str(out / "heldout"), "--eval-every", str(EVERY)]  # fmt: skip


def eval_losses(workdir: Path, run_id: str) -> dict[int, str]:
    """step -> the validation loss telemetry recorded (the latest report of a step)."""
    with sqlite3.connect(workdir / "telemetry.db") as db:
        rows = db.execute(
            "SELECT step, attributes FROM events WHERE run_id = ? AND kind = 'eval' ORDER BY time",
            (run_id,),
        ).fetchall()
    return {step: json.loads(attributes)["loss"] for step, attributes in rows}


def scaletrain(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_json(workdir: Path, *args: str) -> dict:
    result = scaletrain("run", "--workdir", str(workdir), "--json", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout) | {"_log": result.stderr}


def rank_losses(workdir: Path, run_id: str) -> dict[tuple[int, int], str]:
    """(step, rank) -> loss as float hex, from the latest attempt of each step."""
    with sqlite3.connect(workdir / "telemetry.db") as db:
        rows = db.execute(
            "SELECT step, rank, loss, attempt FROM rank_steps WHERE run_id = ? ORDER BY attempt",
            (run_id,),
        ).fetchall()
    return {(step, rank): float(loss).hex() for step, rank, loss, _ in rows}


def offsets(workdir: Path, run_id: str) -> dict[tuple[int, int], tuple[int, int]]:
    with sqlite3.connect(workdir / "telemetry.db") as db:
        rows = db.execute(
            "SELECT step, rank, global_sample, rank_sample FROM rank_steps WHERE run_id = ? "
            "ORDER BY attempt",
            (run_id,),
        ).fetchall()
    return {(s, r): (g, rs) for s, r, g, rs in rows}


def _wait_committed(address: str, run_id: str, step: int) -> None:
    with CkptdClient(address) as client:
        for _ in range(600):
            if any(c.ref.step == step and c.committed for c in client.list(run_id)):
                return
            time.sleep(0.1)
    pytest.fail(f"checkpoint {run_id}@{step} was not committed within 60 s")


def run_and_kill(workdir: Path, kill_after: int, victim: int, *args: str) -> str:
    """Start a run; once step `kill_after` is done and the checkpoint of step EVERY committed,
    SIGKILL rank `victim` in the middle of the next step. Returns the run's log. Without in-job
    restarts the run fails then (--max-restarts 0), to be started again."""
    others = set(rank_processes())  # not this run's
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
            "--in-job-restarts",
            "0",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = []
    assert proc.stderr is not None
    for line in proc.stderr:
        log.append(line)
        if line.startswith("[scaletrain] run "):
            run_id = line.split()[2].rstrip(":")
            ckptd = line.split("ckptd ")[1].split(",")[0]
        if line.startswith(f"[trainer] step {kill_after} "):
            _wait_committed(ckptd, run_id, EVERY)
            os.kill(trainer_pids(run_id)[victim], signal.SIGKILL)
    proc.wait(timeout=120)
    text = "".join(log)
    assert proc.returncode != 0, f"the run survived the kill of rank {victim}:\n{text[-2000:]}"
    assert "training failed" in text
    # A failed run leaves no child process behind: services and ranks are all gone.
    assert not left_behind([str(workdir), run_id], others)
    return text


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data: list[str]) -> dict:
    workdir = tmp_path_factory.mktemp("reference")
    summary = run_json(
        workdir,
        "--ranks",
        str(RANKS),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        *data,
        "--tensorboard",
        str(workdir / "tensorboard"),
    )
    return summary | {"workdir": workdir, "data": data}


def test_the_run_writes_its_curves_with_the_validation_loss_for_tensorboard(reference: dict):
    """`scaletrain run --tensorboard DIR`, read back with TensorBoard's own reader."""
    logdir = reference["workdir"] / "tensorboard" / reference["run_id"]
    curves = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    curves.Reload()
    assert set(curves.Tags()["scalars"]) >= {TAGS[c] for c in ("loss", "eval_loss", "lr", "mfu")}
    assert [e.step for e in curves.Scalars(TAGS["loss"])] == list(range(1, STEPS + 1))
    recorded = eval_losses(reference["workdir"], reference["run_id"])
    assert {e.step: e.value for e in curves.Scalars(TAGS["eval_loss"])} == pytest.approx(
        {step: float(loss) for step, loss in recorded.items()}
    )


def test_the_runs_health_on_the_command_line_gives_evaluation_a_cause_of_its_own(
    reference: dict,
):
    at = ("--workdir", str(reference["workdir"]))
    result = scaletrain("telemetry", "health", reference["run_id"], *at, "--json")
    assert result.returncode == 0, result.stderr
    health = json.loads(result.stdout)
    assert (health["run_id"], health["last_step"]) == (reference["run_id"], STEPS)
    assert health["goodput"]["badput_s"]["evaluation"] > 0
    assert health["mfu"]["mfu"] > 0
    shown = scaletrain("telemetry", "health", "latest", *at).stdout.splitlines()
    assert shown[0].startswith(f"run          {reference['run_id']}: finished")
    assert shown[3].startswith("badput       ") and "evaluation" in shown[3]


def test_a_checkpoint_held_only_on_s3_exports_to_hugging_face_as_from_ssd(
    reference: dict, tmp_path: Path
):
    """The HF export reads the fastest tier holding the checkpoint: with the first one's SSD copy
    gone (the memory tier died with ckptd), S3; the tensors are those of the SSD export."""
    workdir, run_id = reference["workdir"], reference["run_id"]

    def export(dest: Path) -> dict[str, torch.Tensor]:
        result = scaletrain("ckpt", "export", "--format", "hf", "--workdir", str(workdir),
                            run_id, str(EVERY), str(dest))  # fmt: skip
        assert result.returncode == 0, result.stderr
        return {k: v for p in dest.glob("*.safetensors") for k, v in load_file(p).items()}

    from_ssd = export(tmp_path / "from-ssd")
    (copy,) = [p for p in (workdir / "ckptd").rglob(str(EVERY)) if (p / ".metadata").exists()]
    shutil.rmtree(copy)
    from_s3 = export(tmp_path / "from-s3")
    assert from_ssd and from_s3.keys() == from_ssd.keys()
    assert all(torch.equal(from_s3[k], v) for k, v in from_ssd.items())
    listed = scaletrain("ckpt", "ls", "--workdir", str(workdir), "--json")
    tiers = {c["step"]: c["tiers"] for c in json.loads(listed.stdout) if c["run"] == run_id}
    assert tiers[EVERY] == ["s3"], tiers


def test_the_run_trains_every_step_and_reports_its_loss(reference: dict):
    assert reference["steps"] == STEPS
    assert reference["first_loss"] > reference["last_loss"] > 0
    assert reference["tokens_per_s"] > 0
    assert reference["ui_command"].startswith("scaletrain ui --workdir")
    assert sorted(eval_losses(reference["workdir"], reference["run_id"])) == [EVERY, STEPS]
    # Telemetry keeps what the run trained on: the data's digest and tokens, its tokenizer's.
    with sqlite3.connect(reference["workdir"] / "telemetry.db") as db:
        (config,) = db.execute(
            "SELECT config_json FROM runs WHERE run_id = ?", (reference["run_id"],)
        ).fetchone()
    dataset = json.loads(config)["dataset"]
    assert (dataset["kind"], dataset["tokenizer_kind"]) == ("prepared", "hf")
    assert dataset["tokens"] > 0 and len(dataset["sha256"]) == len(dataset["tokenizer"]) == 64


def test_every_checkpoint_is_committed_on_memory_ssd_and_s3(reference: dict):
    steps = [c["step"] for c in reference["checkpoints"]]
    assert steps == [EVERY, STEPS]
    for checkpoint in reference["checkpoints"]:
        assert checkpoint["tiers"] == ALL_TIERS
        assert checkpoint["bytes"] > 0


def test_each_save_reports_its_blocking_and_background_time_to_telemetry(reference: dict):
    with sqlite3.connect(reference["workdir"] / "telemetry.db") as db:
        rows = db.execute(
            "SELECT kind, step, seconds, bytes FROM events WHERE run_id = ? AND kind IN "
            "('checkpoint_staged', 'checkpoint_saved') ORDER BY kind, step",
            (reference["run_id"],),
        ).fetchall()
    assert [(kind, step) for kind, step, _, _ in rows] == [
        ("checkpoint_saved", EVERY), ("checkpoint_saved", STEPS),
        ("checkpoint_staged", EVERY), ("checkpoint_staged", STEPS),
    ]  # fmt: skip
    assert all(seconds > 0 and nbytes > 0 for _, _, seconds, nbytes in rows)
    assert "checkpoint staged in" in reference["_log"]


def _finished_attributes(workdir: Path, run_id: str) -> dict[str, str]:
    with sqlite3.connect(workdir / "telemetry.db") as db:
        (attributes,) = db.execute(
            "SELECT attributes FROM events WHERE run_id = ? AND kind = 'run_finished' "
            "ORDER BY time DESC LIMIT 1",
            (run_id,),
        ).fetchone()
    return json.loads(attributes)


def test_telemetry_holds_a_record_for_every_rank_and_step(reference: dict):
    losses = rank_losses(reference["workdir"], reference["run_id"])
    assert sorted(losses) == [(s, r) for s in range(1, STEPS + 1) for r in range(RANKS)]


def test_the_offline_listing_shows_the_tiers_that_outlive_the_services(reference: dict):
    result = scaletrain("ckpt", "ls", "--workdir", str(reference["workdir"]), "--json")
    assert result.returncode == 0, result.stderr
    listed = {(c["run"], c["step"]): c["tiers"] for c in json.loads(result.stdout)}
    # The memory tier died with ckptd; SSD and S3 copies remain.
    assert listed[(reference["run_id"], STEPS)] == ["ssd", "s3"]


def test_an_exported_checkpoint_restores_bit_exactly_into_a_fresh_model_with_stock_dcp(
    reference: dict, tmp_path: Path
):
    dest = tmp_path / "export"
    result = scaletrain(
        "ckpt",
        "export",
        "--workdir",
        str(reference["workdir"]),
        reference["run_id"],
        str(STEPS),
        str(dest),
    )
    assert result.returncode == 0, result.stderr
    assert (dest / ".metadata").exists()
    args = ModelArgs(vocab_size=EXAMPLE_VOCAB)  # the model took the example data's vocabulary
    fresh = Transformer(args)
    state = {"model": fresh.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(dest)))
    fresh.load_state_dict(state["model"])
    assert state_sha256(fresh.state_dict()) == reference["params_sha256"]
    trained = _finished_attributes(reference["workdir"], reference["run_id"])
    assert probe_logits_sha256(fresh.state_dict(), args) == trained["probe_logits_sha256"]


def _kill_and_resume(
    reference: dict, workdir: Path, *layout: str, restarted_pod: bool = False
) -> tuple[dict, int]:
    """Kill a rank mid-step, then start the run again: with --resume, or (`restarted_pod`) as
    a restarted pod or a replaced node starts it, with its run id and no --resume."""
    rng = random.Random(SEED)
    kill_after, victim = rng.choice([EVERY + 1, EVERY + 2]), rng.randrange(RANKS)
    common = ["--ranks", str(RANKS), "--ckpt-every", str(EVERY), *layout]
    log = run_and_kill(workdir, kill_after, victim, "--steps", str(STEPS), *common)
    run_id = next(line.split()[2].rstrip(":") for line in log.splitlines()
                  if line.startswith("[scaletrain] run "))  # fmt: skip
    again = ("--run-id", run_id) if restarted_pod else ("--resume",)
    resumed = run_json(workdir, *again, "--steps", str(MORE), *common)
    assert resumed["run_id"] == run_id
    assert f"resumed run {run_id} from step {EVERY}" in resumed["_log"], SEED
    return resumed, kill_after


@pytest.fixture(scope="module")
def killed_fsdp(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("killed-fsdp")
    resumed, kill_after = _kill_and_resume(reference, workdir, *reference["data"])
    return resumed | {"workdir": workdir, "kill_after": kill_after}


def test_a_run_killed_mid_step_resumes_with_bit_identical_losses(reference: dict, killed_fsdp):
    """SIGKILL of a random rank (seed in SCALETRAIN_TEST_SEED to replay), then --resume."""
    assert f"resumed run {killed_fsdp['run_id']} from step {EVERY}" in killed_fsdp["_log"], SEED
    expected = rank_losses(reference["workdir"], reference["run_id"])
    got = rank_losses(killed_fsdp["workdir"], killed_fsdp["run_id"])
    after_resume = {k: v for k, v in expected.items() if k[0] > EVERY}
    assert {k: got[k] for k in after_resume} == after_resume, f"seed {SEED}"
    assert [c["step"] for c in killed_fsdp["checkpoints"]] == [EVERY, STEPS, MORE]
    # The validation loss after the resume too, bit for bit.
    evaluated = eval_losses(killed_fsdp["workdir"], killed_fsdp["run_id"])
    assert evaluated[STEPS] == eval_losses(reference["workdir"], reference["run_id"])[STEPS]
    # Step EVERY's, made before the kill, is in telemetry unless the killed rank took it with
    # its unsent records (a SIGKILL gives it no time to hand them over).
    assert {STEPS, MORE} <= set(evaluated) <= {EVERY, STEPS, MORE}, evaluated


def test_a_2d_hsdp_run_killed_and_started_again_without_resume_goes_on_bit_identically(
    tmp_path_factory: pytest.TempPathFactory,
):
    layout = ("--dp-replicate", "2")
    ref_dir = tmp_path_factory.mktemp("hsdp-reference")
    hsdp_reference = run_json(
        ref_dir, "--ranks", str(RANKS), "--steps", str(STEPS), "--ckpt-every", str(EVERY), *layout
    ) | {"workdir": ref_dir}
    workdir = tmp_path_factory.mktemp("killed-hsdp")
    # Started again without --resume: the run's committed checkpoints decide, not a flag or
    # torchrun's restart count (0 in a restarted pod).
    resumed, _ = _kill_and_resume(hsdp_reference, workdir, *layout, restarted_pod=True)
    expected = rank_losses(ref_dir, hsdp_reference["run_id"])
    got = rank_losses(workdir, resumed["run_id"])
    after_resume = {k: v for k, v in expected.items() if k[0] > EVERY}
    assert {k: got[k] for k in after_resume} == after_resume, f"seed {SEED}"


def test_a_resume_whose_telemetry_disagrees_with_the_checkpoint_is_refused(
    tmp_path_factory: pytest.TempPathFactory,
):
    workdir = tmp_path_factory.mktemp("disagree")
    first = run_json(workdir, "--ranks", "2", "--steps", "2", "--ckpt-every", "2")
    with sqlite3.connect(workdir / "telemetry.db") as db:
        db.execute(
            "UPDATE rank_steps SET global_sample = 999 WHERE run_id = ? AND step = 2 AND rank = 1",
            (first["run_id"],),
        )
    result = scaletrain("run", "--workdir", str(workdir), "--resume", "--ranks", "2",
                        "--steps", "3")  # fmt: skip
    assert result.returncode == 1
    assert "refusing to resume run" in result.stderr
    assert "global sample 32, telemetry recorded 999 for rank 1" in result.stderr


def test_a_dp4_checkpoint_resumes_at_dp2_with_the_same_global_data_order(
    reference: dict, killed_fsdp: dict
):
    # Only what changes: the run's own job (its data, its checkpoint interval) is stored.
    resharded = run_json(reference["workdir"], "--resume", "--ranks", "2", "--steps", str(MORE))
    assert f"from step {STEPS}" in resharded["_log"]
    at_dp2 = offsets(reference["workdir"], reference["run_id"])
    for step in range(STEPS + 1, MORE + 1):
        for rank in range(2):
            assert at_dp2[(step, rank)] == (step * GLOBAL_BATCH, step * GLOBAL_BATCH + rank * 8)
    # The same samples as the dp4 continuation, so the same mean loss up to reduction order.
    dp4 = rank_losses(killed_fsdp["workdir"], killed_fsdp["run_id"])
    dp2 = rank_losses(reference["workdir"], reference["run_id"])
    for step in range(STEPS + 1, MORE + 1):
        mean4 = sum(float.fromhex(dp4[(step, r)]) for r in range(4)) / 4
        mean2 = sum(float.fromhex(dp2[(step, r)]) for r in range(2)) / 2
        assert mean2 == pytest.approx(mean4, rel=1e-5)
    at_dp4 = float(eval_losses(killed_fsdp["workdir"], killed_fsdp["run_id"])[MORE])
    assert float(eval_losses(reference["workdir"], reference["run_id"])[MORE]) == pytest.approx(
        at_dp4, rel=1e-5
    )


def test_a_dp4_checkpoint_resumes_at_dp2_tp2_with_the_same_global_data_order(
    reference: dict, killed_fsdp: dict
):
    resumed = run_json(
        killed_fsdp["workdir"],
        "--resume",
        "--ranks",
        "4",
        "--tp",
        "2",
        "--steps",
        str(MORE + 2),
        "--ckpt-every",
        str(EVERY),
        *reference["data"],
    )
    assert f"from step {MORE}" in resumed["_log"]
    recorded = offsets(killed_fsdp["workdir"], killed_fsdp["run_id"])
    for step in (MORE + 1, MORE + 2):
        for rank in range(4):
            dp_rank = rank // 2  # tensor-parallel pairs read the same slice
            assert recorded[(step, rank)] == (
                step * GLOBAL_BATCH,
                step * GLOBAL_BATCH + dp_rank * 8,
            )
    assert resumed["last_loss"] < resumed["first_loss"]
