"""Bad input on the command line gets one line naming the problem and a non-zero exit."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest


def scaletrain(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_an_unknown_command_is_one_line():
    assert_one_line_error(scaletrain("fly"), "invalid choice", "fly")


def test_a_non_numeric_option_is_one_line():
    assert_one_line_error(scaletrain("run", "--steps", "many"), "--steps", "many")


def test_zero_ranks_is_refused_before_anything_starts(tmp_path: Path):
    result = scaletrain("run", "--ranks", "0", "--workdir", str(tmp_path / "w"))
    assert_one_line_error(result, "--ranks must be at least 1")
    assert not (tmp_path / "w" / "logs").exists()


def test_resume_without_an_earlier_run_says_so(tmp_path: Path):
    result = scaletrain("run", "--resume", "--workdir", str(tmp_path))
    assert_one_line_error(result, "no earlier run")


def test_a_taken_port_is_reported_as_such(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = scaletrain(
            "telemetry", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp_path}/t.db"
        )
    assert_one_line_error(result, f"127.0.0.1:{port}", "in use")


def test_the_ui_without_a_database_says_to_run_first(tmp_path: Path):
    assert_one_line_error(scaletrain("ui", "--workdir", str(tmp_path)), "scaletrain run")


def test_listing_an_empty_workdir_lists_nothing(tmp_path: Path):
    result = scaletrain("ckpt", "ls", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no checkpoints"


def test_exporting_an_unknown_checkpoint_is_one_line(tmp_path: Path):
    result = scaletrain(
        "ckpt", "export", "--workdir", str(tmp_path), "nope", "3", str(tmp_path / "x")
    )
    assert_one_line_error(result, "nope")


@pytest.mark.parametrize("argv", [["ckptd", "--data-dir"], ["ckpt", "export", "run"]])
def test_missing_arguments_are_one_line(argv: list[str]):
    assert_one_line_error(scaletrain(*argv), "error")


def test_a_layout_that_cannot_split_the_model_is_refused_before_anything_starts(tmp_path: Path):
    result = scaletrain("run", "--ranks", "4", "--tp", "4", "--workdir", str(tmp_path / "w"))
    assert_one_line_error(result, "n_kv_heads 2 is not divisible by tp 4", "valid tp")
    assert not (tmp_path / "w" / "logs").exists()


def test_expert_parallelism_needs_ranks_it_can_borrow(tmp_path: Path):
    result = scaletrain(
        "run",
        "--ranks",
        "4",
        "--tp",
        "2",
        "--ep",
        "4",
        "--n-experts",
        "8",
        "--workdir",
        str(tmp_path / "w"),
    )
    assert_one_line_error(result, "ep 4 does not divide dp_shard x cp = 2")


def test_a_config_file_that_is_not_there_is_one_line_and_starts_nothing(tmp_path: Path):
    result = scaletrain(
        "run", "--config", str(tmp_path / "job.toml"), "--workdir", str(tmp_path / "w")
    )
    assert_one_line_error(result, "--config", "job.toml: cannot read it")
    assert not (tmp_path / "w").exists()


def test_plan_of_an_unknown_preset_lists_the_presets():
    assert_one_line_error(scaletrain("plan", "--preset", "llama9"), "llama9", "llama3-8b")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--nodes", "2", "--spares", "-1"), "--spares must be 0 or more, got -1"),
        (("--spares", "1"), "--spares 1 needs --nodes 2 or more"),
        (("--nodes", "2", "--spares", "400"), "402 simulated machines need about"),
    ],
    ids=["negative", "on-one-node", "more-than-memory-holds"],
)
def test_spares_that_cannot_be_started_are_refused_before_anything_starts(
    tmp_path: Path, args: tuple[str, ...], needle: str
):
    for command in ("run", "chaos"):
        result = scaletrain(command, *args, "--workdir", str(tmp_path / command))
        assert_one_line_error(result, needle)
        assert not (tmp_path / command / "logs").exists()


def test_the_rendezvous_refuses_a_bad_or_taken_address_in_one_line():
    assert_one_line_error(scaletrain("rendezvous", "--listen", "nowhere"), "expected HOST:PORT")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = scaletrain("rendezvous", "--listen", f"127.0.0.1:{port}")
    assert_one_line_error(result, f"cannot listen on 127.0.0.1:{port}")


def test_health_with_no_run_to_show_says_so(tmp_path: Path):
    result = scaletrain("telemetry", "health", "--workdir", str(tmp_path))
    assert_one_line_error(result, "no run in", "health RUN")


def test_the_summarys_health_line_shows_a_data_spike_closed_and_no_open_alert():
    from scaletrain.app.commands.run import _findings

    counts = {"straggler": 0, "loss_spike": 1, "sdc": 0, "replay": 1, "alert": 0, "restart": 0}
    assert _findings(counts, data_spikes=1) == (
        "no open alert (straggler, loss spike, silent data corruption); 1 loss spike(s) from "
        "the data, closed, 1 step(s) replayed"
    )
    assert _findings(counts | {"sdc": 1}, data_spikes=0).startswith("1 loss_spike, 1 sdc; ")


def test_the_summary_says_what_its_other_badput_is_where_it_shows_some(
    capsys: pytest.CaptureFixture[str],
):
    from scaletrain.app.commands.run import _print_summary
    from scaletrain.app.summary import RunSummary

    def goodput_lines(badput_s: dict[str, float]) -> list[str]:
        _print_summary(RunSummary("r", "w", 0, 3, 5.6, 5.0, 3e3, "sha", 17.2, [], "ui",
                                  goodput=0.552, badput_s=badput_s))  # fmt: skip
        lines = capsys.readouterr().out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("goodput"))
        return lines[at : at + 2]

    assert goodput_lines({"startup": 0.9, "other": 0.6}) == [
        "goodput      55.2%  badput: startup 0.9s, other 0.6s",
        "             other: the end of the run after its last step (the final checkpoint, the "
        "digests), logging, gaps without records",
    ]
    assert goodput_lines({"startup": 0.9, "other": 0.01})[1].startswith("health ")
