"""`train` hands over telemetry and stops its threads on any exit, a failing step's included."""

from __future__ import annotations

import contextlib

import pytest

from trainer import train as loop
from trainer.config import TrainConfig


def test_a_loop_that_fails_still_stops_what_setup_started(monkeypatch: pytest.MonkeyPatch):
    stopped: list[str] = []

    def setup(cfg: TrainConfig, cleanup: contextlib.ExitStack) -> object:
        cleanup.callback(stopped.append, "reporter closed")
        cleanup.callback(stopped.append, "watchdog stopped")
        return object()

    def run_loop(run: object) -> None:
        raise RuntimeError("a step failed")

    monkeypatch.setattr(loop, "setup", setup)
    monkeypatch.setattr(loop, "run_loop", run_loop)
    with pytest.raises(RuntimeError, match="a step failed"):
        loop.train(TrainConfig(run_id="r"))
    assert stopped == ["watchdog stopped", "reporter closed"]
