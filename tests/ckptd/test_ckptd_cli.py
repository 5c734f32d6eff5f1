"""`scaletrain ckpt ls | show | verify | export | rm` as a user runs them, online and offline."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

from ckptd_testing import ROOT, checkpoint_files, ref, store_save, tier_states, wait_for

from ckptd.config import S3Config
from ckptd.server import RunningCkptd
from ckptd.store import CheckpointStore
from ckptd.tiers import CheckpointKey
from scaletrain.app.commands.launch import RUN_DEFAULTS
from scaletrain.app.stack import Workdir
from scaletrain.v1 import telemetry_pb2
from telemetry.db import connect, migrate
from telemetry.store import TelemetryStore
from trainer import options

RunCkptd = Callable[..., RunningCkptd]
OpenStore = Callable[..., CheckpointStore]


def ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", "ckpt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_against_a_running_ckptd_every_command_works_and_verify_names_a_damaged_tier(
    run_ckptd: RunCkptd, s3_config: S3Config, tmp_path: Path
) -> None:
    running = run_ckptd(s3=s3_config)
    files = checkpoint_files(world_size=2, shard_bytes=3 << 20)
    store_save(running.store, "run", 10, files)
    wait_for(
        lambda: tier_states(running.store.member.checkpoint(ref("run", 10)))["s3"] == "COMMITTED",
        what="S3",
    )
    at = ("--ckptd", running.address)

    listed = json.loads(ckpt("ls", *at, "--json").stdout)
    total = sum(len(data) for _, _, data in files.values())
    node = running.store.node
    assert listed == [
        {"run": "run", "step": 10, "world_size": 2, "bytes": total,
         "tiers": ["memory", "ssd", "s3"],
         # One node: its part has one copy, so losing that node would lose it (not S3's copy).
         "node_loss_safe": False, "copies": {node: [node]}}
    ]  # fmt: skip
    shown = json.loads(ckpt("show", *at, "run", "--json").stdout)
    assert shown["step"] == 10 and {f["path"] for f in shown["files"]} == set(files)

    shard = running.store.ssd.path_of(CheckpointKey("run", 10), "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"bit rot")
    verified = ckpt("verify", *at, "run", "10")
    assert verified.returncode == 1
    assert "memory  ok" in verified.stdout and "s3      ok" in verified.stdout
    assert "fails its checksum" in verified.stdout
    assert verified.stderr.strip().splitlines()[-1].endswith("damaged copy on ssd")
    assert "verify run@10 on s3 [####################]" in verified.stderr  # progress
    # With no run named, every checkpoint ckptd holds (here the one; the damaged SSD copy
    # is marked FAILED by now, so only the good copies are left to read).
    line, summary = ckpt("verify", *at).stdout.splitlines()
    assert line.startswith("run@10  ") and "memory ok" in line and "s3 ok" in line
    assert summary.startswith("verified 1 checkpoint(s) of 1 run(s): ")

    exported = ckpt("export", *at, "run", "10", str(tmp_path / "out"))
    assert exported.returncode == 0, exported.stderr
    for path, (_, _, data) in files.items():
        assert (tmp_path / "out" / path).read_bytes() == data

    # The run's newest checkpoint, where --resume goes on from, goes only with --force.
    kept = ckpt("rm", *at, "run", "10")
    assert kept.returncode == 1 and "refusing to remove run@10: it is the run's newest" in (
        kept.stderr
    )
    removed = ckpt("rm", *at, "run", "latest", "--force")
    assert removed.stdout.strip() == (
        "removed run@10 from memory, ssd; removal from s3 continues in the background"
    )
    assert ckpt("ls", *at).stdout.strip() == "no checkpoints"


def test_on_a_work_directory_with_no_ckptd_running_every_command_works(
    open_store: OpenStore, tmp_path: Path
) -> None:
    workdir = tmp_path / "wd"
    store = open_store(data_dir=workdir / "ckptd")
    files = checkpoint_files(world_size=1, shard_bytes=1 << 20)
    store_save(store, "run", 3, files)
    store.close()
    at = ("--workdir", str(workdir))

    assert "run" in ckpt("ls", *at).stdout
    assert "ssd      COMMITTED" in ckpt("show", *at, "run", "3").stdout
    assert ckpt("verify", *at, "run", "3").stdout.strip() == "run@3\nssd     ok"
    exported = json.loads(ckpt("export", *at, "run", "3", str(tmp_path / "out"), "--json").stdout)
    assert exported == {
        "run": "run", "step": 3, "dest": str(tmp_path / "out"), "files": sorted(files),
    }  # fmt: skip
    assert (tmp_path / "out" / "__0_0.distcp").read_bytes() == files["__0_0.distcp"][2]
    assert ckpt("rm", *at, "run", "3", "--force").stdout.strip() == "removed run@3 from ssd"
    unknown = ckpt("verify", *at, "run", "3")
    assert unknown.returncode == 1 and "no committed checkpoint of run run in" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1 and "Traceback" not in unknown.stderr


def _three_checkpoints(open_store: OpenStore, tmp_path: Path) -> Path:
    """A work directory whose store holds other@1, run@3 and run@6 (ckptd not running)."""
    workdir = tmp_path / "wd"
    store = open_store(data_dir=workdir / "ckptd")
    for run, step in (("other", 1), ("run", 3), ("run", 6)):
        store_save(store, run, step, checkpoint_files(world_size=1, shard_bytes=1 << 16))
    store.close()
    return workdir


def test_latest_names_the_newest_and_a_wrong_name_lists_the_nearest_that_exist(
    open_store: OpenStore, tmp_path: Path
) -> None:
    workdir = _three_checkpoints(open_store, tmp_path)
    at = ("--workdir", str(workdir))

    # The run committed last, its newest step: by name, or with nothing named (verify with
    # nothing named checks every checkpoint instead).
    assert json.loads(ckpt("show", *at, "latest", "last", "--json").stdout)["step"] == 6
    assert json.loads(ckpt("show", *at, "--json").stdout)["step"] == 6
    assert ckpt("verify", *at, "latest").stdout.splitlines()[0] == "run@6"
    step = ckpt("show", *at, "run", "5")
    assert step.returncode == 1 and step.stderr.strip().endswith(
        "no committed checkpoint run@5 in " + str(workdir) + "; the nearest steps: 3, 6 (newest 6)"
    )
    run = ckpt("show", *at, "runn")
    assert run.returncode == 1 and "runs with checkpoints: run" in run.stderr
    bad = ckpt("show", *at, "run", "six")
    assert bad.returncode == 2 and "a step is a whole number or one of latest, last" in bad.stderr

    # What rm would remove, and nothing removed; the newest stays without --force.
    dry = ckpt("rm", *at, "run", "6", "--dry-run")
    assert dry.stdout.strip() == (
        "would remove run@6: 2 files, 0.07 MB, from ssd (nothing removed: --dry-run)"
    )
    newest = ckpt("rm", *at, "run", "6")
    assert newest.returncode == 1 and newest.stderr.strip().endswith(
        "--dry-run shows what would go, --force removes it"
    )
    assert "1 older one(s) left" in newest.stderr
    assert ckpt("rm", *at, "run", "3").stdout.strip() == "removed run@3 from ssd"
    assert [c["step"] for c in json.loads(ckpt("ls", *at, "--run", "run", "--json").stdout)] == [6]

    # A mistyped work directory is an error, not an empty one.
    missing = ckpt("ls", "--workdir", str(tmp_path / "typo"))
    assert missing.returncode == 1 and "no work directory" in missing.stderr


def test_verify_with_no_run_checks_every_checkpoint_of_every_run(
    open_store: OpenStore, tmp_path: Path
) -> None:
    workdir = _three_checkpoints(open_store, tmp_path)
    damaged = workdir / "ckptd" / "ssd" / "run" / "3" / "__0_0.distcp"
    at = ("--workdir", str(workdir))

    everything = ckpt("verify", *at)
    assert everything.stdout.splitlines() == [
        "other@1  ok      ssd ok",
        "run@3    ok      ssd ok",
        "run@6    ok      ssd ok",
        "verified 3 checkpoint(s) of 2 run(s): 3 ok, 0 failed",
    ]
    assert everything.returncode == 0, everything.stderr

    with open(damaged, "r+b") as f:
        f.seek(1 << 10)
        f.write(b"bit rot")
    failed = ckpt("verify", *at)
    assert failed.returncode == 1
    lines = failed.stdout.splitlines()
    assert lines[0] == "other@1  ok      ssd ok" and lines[2] == "run@6    ok      ssd ok"
    assert lines[1].startswith("run@3    FAILED  ssd: ") and "__0_0.distcp" in lines[1]
    assert lines[3] == "verified 3 checkpoint(s) of 2 run(s): 2 ok, 1 failed"
    assert failed.stderr.strip().splitlines()[-1] == (
        "scaletrain ckpt: error: 1 of 3 checkpoint(s) failed: run@3 (ssd)"
    )
    # The store marked the damaged copy FAILED: a later verify has nothing of it to read, and
    # says so.
    again = ckpt("verify", *at, "--json")
    assert again.returncode == 1 and json.loads(again.stdout) == [
        {"run": "other", "step": 1, "ok": True, "tiers": {"ssd": "ok"}},
        {"run": "run", "step": 3, "ok": False,
         "tiers": {"ssd": "marked FAILED (__0_0.distcp fails its checksum in block 0)"}},
        {"run": "run", "step": 6, "ok": True, "tiers": {"ssd": "ok"}},
    ]  # fmt: skip

    # A run or a step named: that checkpoint alone, as before.
    assert ckpt("verify", *at, "run").stdout.strip() == "run@6\nssd     ok"
    assert ckpt("verify", *at, "other", "1").stdout.strip() == "other@1\nssd     ok"

    # No checkpoint at all: one line, no traceback.
    (tmp_path / "empty").mkdir()
    empty = ckpt("verify", "--workdir", str(tmp_path / "empty"))
    assert empty.returncode == 1 and empty.stdout == ""
    assert empty.stderr.strip() == (
        f"scaletrain ckpt: error: no checkpoint of any run in {tmp_path / 'empty'}"
    )


def test_resume_at_a_step_goes_on_only_from_the_runs_newest_checkpoint(
    open_store: OpenStore, tmp_path: Path
) -> None:
    workdir = tmp_path / "wd"
    store = open_store(data_dir=workdir / "ckptd")
    for step in (3, 6):
        store_save(store, "run", step, checkpoint_files(world_size=1, shard_bytes=1 << 16))
    store.close()
    engine = connect(Workdir(workdir).db_url)
    migrate(engine)
    job = options.resolve({"lr": 0.002}, None, RUN_DEFAULTS) | {"run_id": "run"}
    TelemetryStore(engine).register_run(
        telemetry_pb2.RegisterRunRequest(
            run_id="run", world_size=1, config_json=json.dumps({"job": job})
        )
    )
    engine.dispose()

    def resume(target: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "scaletrain",
                "run",
                "--workdir",
                str(workdir),
                "--resume",
                target,
                "--print-config",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )

    older = resume("run@3")
    assert older.returncode == 1 and older.stderr.strip().endswith(
        "run run goes on from its newest checkpoint, step 6; to go back to step 3, remove the "
        "newer ones first (steps 6: scaletrain ckpt rm run STEP --force)"
    )
    newest = resume("run@latest")
    assert newest.returncode == 0, newest.stderr
    config = tomllib.loads(newest.stdout)
    assert config["run_id"] == "run" and config["optimizer"]["lr"] == 0.002
