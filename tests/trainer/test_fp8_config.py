"""FP8 on the command lines: the trainer's flags and `scaletrain run --fp8`, bad values refused in
one line before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import TrainConfig, from_args, parser


def test_the_trainer_flags_build_the_fp8_config():
    args = parser().parse_args(
        [
            "--run-id",
            "r",
            "--fp8",
            "blockwise",
            "--fp8-keep-high-precision",
            "output,layers.0",
            "--fp8-option",
            "backward_format=e4m3",
            "--fp8-option",
            "margin=1",
            "--fp8-all-gather",
            "--fp8-count-every",
            "1",
        ]
    )
    cfg = from_args(args)
    assert cfg.fp8 == "blockwise"
    assert cfg.fp8_count_every == 1
    assert cfg.fp8_keep_high_precision == ("output", "layers.0")
    assert cfg.fp8_options == ("backward_format=e4m3", "margin=1")
    assert cfg.fp8_all_gather
    default = from_args(parser().parse_args(["--run-id", "r"]))
    assert (default.fp8, default.fp8_keep_high_precision) == ("none", ("output", "router"))
    assert default.fp8_count_every == 10


def test_bad_fp8_options_are_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match="bad --fp8-option 'margin=-'"):
        TrainConfig(run_id="r", fp8="tensorwise-delayed", fp8_options=("margin=-",))
    with pytest.raises(ValueError, match="--fp8-option and --fp8-all-gather need --fp8"):
        TrainConfig(run_id="r", fp8_options=("margin=1",))
    with pytest.raises(ValueError, match="--fp8-option and --fp8-all-gather need --fp8"):
        TrainConfig(run_id="r", fp8_all_gather=True)
    with pytest.raises(ValueError, match="cannot be all-gathered in FP8; drop --fp8-all-gather"):
        TrainConfig(run_id="r", fp8="mxfp8", fp8_all_gather=True)
    with pytest.raises(ValueError, match="--fp8-count-every must be at least 1, got 0"):
        TrainConfig(run_id="r", fp8="tensorwise", fp8_count_every=0)


def test_scaletrain_run_refuses_an_unknown_recipe_in_one_line_before_starting(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "scaletrain", "run", "--fp8", "fp4", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "scaletrain run: error: argument --fp8: invalid choice: 'fp4' (choose from 'none', "
        "'tensorwise-delayed', 'tensorwise', 'blockwise', 'mxfp8') (see scaletrain run --help)"
    )
    assert not (tmp_path / "logs").exists()
