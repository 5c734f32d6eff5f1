"""`scaletrain run --resume` continues a run with the job it was started with: no flag retyped."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from test_cli import assert_one_line_error, scaletrain

from scaletrain.app.commands.launch import RUN_DEFAULTS
from scaletrain.app.stack import Workdir
from scaletrain.v1 import telemetry_pb2
from telemetry.db import connect, migrate
from telemetry.store import TelemetryStore
from trainer import options

# What the first launch set beyond the defaults, a fault it injected among them.
FIRST = {
    "lr": 0.002,
    "dim": 64,
    "seed": 7,
    "steps": 40,
    "ckpt_every": 10,
    "eval_every": 5,
    "inject_straggler": ("rank=0,delay=0.1",),
}


def recorded_run(workdir: Path, run_id: str = "run-first") -> None:
    """The work directory after `run_id` started with FIRST: its rank 0 registered the resolved
    job with telemetry (as `trainer.reporting` does), and it is the directory's last run."""
    engine = connect(Workdir(workdir).db_url)
    migrate(engine)
    job = options.resolve(FIRST, None, RUN_DEFAULTS) | {"run_id": run_id}
    TelemetryStore(engine).register_run(
        telemetry_pb2.RegisterRunRequest(
            run_id=run_id, world_size=2, config_json=json.dumps({"job": job, "dataset": {}})
        )
    )
    engine.dispose()
    Workdir(workdir).remember_run(run_id)


def resumed_config(workdir: Path, *flags: str) -> dict:
    result = scaletrain("run", "--workdir", str(workdir), "--resume", *flags, "--print-config")
    assert result.returncode == 0, result.stderr
    return tomllib.loads(result.stdout)


def test_resume_takes_every_option_the_run_was_started_with(tmp_path: Path):
    recorded_run(tmp_path)
    config = resumed_config(tmp_path)
    assert config["optimizer"]["lr"] == 0.002
    assert config["model"]["dim"] == 64 and config["seed"] == 7
    assert config["schedule"]["steps"] == 40 and config["checkpoint"]["ckpt_every"] == 10
    assert config["data"]["eval_every"] == 5


def test_a_flag_given_again_overrides_the_stored_value(tmp_path: Path):
    recorded_run(tmp_path)
    config = resumed_config(tmp_path, "--steps", "80", "--lr", "0.001")
    assert config["schedule"]["steps"] == 80 and config["optimizer"]["lr"] == 0.001
    assert config["model"]["dim"] == 64


def test_a_resume_injects_no_fault_of_the_first_launch(tmp_path: Path):
    recorded_run(tmp_path)
    assert resumed_config(tmp_path)["health"]["inject_straggler"] == []


def test_a_run_named_by_run_id_is_resumed_with_its_own_job(tmp_path: Path):
    recorded_run(tmp_path, "run-other")
    recorded_run(tmp_path, "run-last")
    config = resumed_config(tmp_path, "--run-id", "run-other")
    assert config["run_id"] == "run-other" and config["optimizer"]["lr"] == 0.002


def test_a_run_telemetry_never_recorded_is_refused_in_one_line(tmp_path: Path):
    recorded_run(tmp_path)
    result = scaletrain(
        "run", "--workdir", str(tmp_path), "--resume", "--run-id", "run-unknown", "--print-config"
    )
    assert_one_line_error(result, "--resume: telemetry in", "no job config of run run-unknown")
