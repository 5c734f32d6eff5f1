"""The health options on the command lines of the trainer and of `scaletrain run`: bad input is one
line naming the problem, refused before any process or service starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import from_args, parser
from trainer.health.faults import SdcFault, StragglerFault


def command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120
    )


def test_the_trainer_reads_its_health_options_into_its_config() -> None:
    args = parser().parse_args(
        [
            "--run-id",
            "r",
            "--health-policy",
            "skip",
            "--peak-flops",
            "1e12",
            "--inject-sdc",
            "step=3,rank=1",
            "--inject-sdc",
            "step=4,rank=0,target=param",
            "--inject-straggler",
            "rank=2,delay=0.5",
        ]
    )
    cfg = from_args(args)
    assert (cfg.health_policy, cfg.peak_flops) == ("skip", 1e12)
    assert cfg.faults.sdc == (SdcFault(3, 1), SdcFault(4, 0, "param"))
    assert cfg.faults.stragglers == (StragglerFault(2, 0.5),)
    assert from_args(parser().parse_args(["--run-id", "r"])).health_policy == "rollback"


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (["--inject-straggler", "rank=1"], "--inject-straggler 'rank=1': missing delay"),
        (["--peak-flops", "-5"], "--peak-flops (telemetry.peak_flops): -5.0 is not allowed"),
    ],
)
def test_a_bad_health_option_stops_the_trainer_with_one_line(
    options: list[str], problem: str
) -> None:
    result = command("trainer", "--run-id", "r", *options)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trainer: error: {problem}")


def test_a_bad_fault_flag_is_refused_by_scaletrain_run_before_anything_starts(
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "w"
    result = command("scaletrain", "run", "--workdir", str(workdir), "--inject-sdc", "step=3")
    assert result.returncode == 1
    assert result.stderr.strip() == "scaletrain run: error: --inject-sdc 'step=3': missing rank"
    assert not workdir.exists()
