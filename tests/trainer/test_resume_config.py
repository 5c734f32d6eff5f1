"""A resume compares the job config saved in the checkpoint with the run's own: a change that
alters results (model shape, seed, data, optimizer, schedule) is refused with the list of
differences, unless --allow-config-change, which goes on and says so."""

from __future__ import annotations

import pytest

from scaletrain.errors import UserError
from trainer import options
from trainer.checkpoint.resume import check_config
from trainer.config import from_args, parser
from trainer.reporting import Reporter

SAVED = ["--run-id", "r", "--preset", "moe-small", "--seed", "7", "--lr", "1e-3"]


def saved_toml() -> str:
    return options.to_toml(from_args(parser().parse_args(SAVED)).job)


def test_resume_with_changed_results_altering_options_is_refused_with_each_difference() -> None:
    cfg = from_args(parser().parse_args([*SAVED, "--lr", "2e-3", "--seed", "8", "--dim", "512"]))
    with pytest.raises(UserError) as refused:
        check_config(cfg, 100, saved_toml(), Reporter(None, "r", 0), rank=0)
    message = str(refused.value)
    assert message.startswith("refusing to resume run r at step 100: the job config changed")
    for change in ("seed: 7 -> 8", "model.dim: 256 -> 512", "optimizer.lr: 0.001 -> 0.002"):
        assert change in message
    assert "--allow-config-change" in message


def test_options_that_do_not_alter_results_may_change_on_resume() -> None:
    cfg = from_args(parser().parse_args([*SAVED, "--log-every", "1", "--steps", "900"]))
    check_config(cfg, 100, saved_toml(), Reporter(None, "r", 0), rank=0)


def test_allow_config_change_resumes_and_says_what_changed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = from_args(parser().parse_args([*SAVED, "--lr", "2e-3", "--allow-config-change"]))
    check_config(cfg, 100, saved_toml(), Reporter(None, "r", 0), rank=0)
    assert "changed config (--allow-config-change): optimizer.lr: 0.001 -> 0.002" in (
        capsys.readouterr().out
    )
