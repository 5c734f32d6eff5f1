"""The dashboard, run in-process by Streamlit's AppTest against real telemetry databases."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from scaletrain.v1 import telemetry_pb2
from telemetry.client import event, rank_step
from telemetry.db import connect, migrate
from telemetry.store import TelemetryStore
from ui.app import DB_ENV, step_time_chart
from ui.launch import APP_PATH


@pytest.fixture(autouse=True)
def fresh_app_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No URL from the environment, and no engine cached by an earlier test."""
    monkeypatch.delenv(DB_ENV, raising=False)
    yield
    st.cache_resource.clear()


def run_app(monkeypatch: pytest.MonkeyPatch, *args: str) -> AppTest:
    """Run the app as `streamlit run ui/app.py -- ARGS` would; fail on any exception."""
    monkeypatch.setattr(sys, "argv", [str(APP_PATH), *args])
    app = AppTest.from_file(str(APP_PATH), default_timeout=30)
    app.run()
    assert not app.exception, app.exception
    return app


def infos(app: AppTest) -> list[str]:
    return [info.value for info in app.info]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'telemetry.db'}"


@pytest.fixture
def filled_db(db_url: str) -> str:
    """Two runs; "run-b" (the newer) has 3 ranks x 30 steps, a NaN loss and two events."""
    engine = connect(db_url)
    migrate(engine)
    store = TelemetryStore(engine)
    store.register_run(telemetry_pb2.RegisterRunRequest(run_id="run-a", name="first", world_size=1))
    store.register_run(
        telemetry_pb2.RegisterRunRequest(run_id="run-b", name="second", world_size=3)
    )
    store.add_steps(
        [
            rank_step(
                "run-b",
                step,
                rank,
                loss=math.nan if step == 7 else 5.0 / (step + 1),
                tokens=2048,
                times={"step": 0.2 + 0.1 * rank},
            )
            for step in range(30)
            for rank in range(3)
        ]
    )
    store.add_events(
        [
            event("run-b", "checkpoint_committed", step=20, tier="ssd", bytes=1 << 20, seconds=0.3),
            event("run-b", "straggler", step=25, rank=2, attributes={"slowdown": "2.0"}),
        ]
    )
    engine.dispose()
    return db_url


def test_without_a_database_url_the_app_explains_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = run_app(monkeypatch)
    assert any("No telemetry database given" in info for info in infos(app))


def test_before_the_database_exists_the_app_says_there_are_no_runs_yet(
    monkeypatch: pytest.MonkeyPatch, db_url: str
) -> None:
    app = run_app(monkeypatch, "--db", db_url)
    assert any("No runs yet: run `scaletrain run`" in info for info in infos(app))
    assert not Path(db_url.removeprefix("sqlite:///")).exists()


def test_on_an_empty_database_the_app_says_there_are_no_runs_yet(
    monkeypatch: pytest.MonkeyPatch, db_url: str
) -> None:
    engine = connect(db_url)
    migrate(engine)
    engine.dispose()
    app = run_app(monkeypatch, "--db", db_url)
    assert infos(app) == [
        "No runs yet: run `scaletrain run` to start one; its ranks report here as they train."
    ]
    assert len(app.dataframe) == 0


def test_a_bad_database_url_is_shown_as_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    app = run_app(monkeypatch, "--db", "mysql://localhost/telemetry")
    assert [error.value for error in app.error] == [
        "unsupported database 'mysql' in mysql://localhost/telemetry: "
        "use sqlite:///PATH or postgresql+psycopg://HOST/DB"
    ]


def test_the_app_shows_the_runs_and_the_charts_and_events_of_the_newest_run(
    monkeypatch: pytest.MonkeyPatch, filled_db: str
) -> None:
    app = run_app(monkeypatch, "--db", filled_db)

    runs = app.dataframe[0].value
    assert list(runs["run_id"]) == ["run-b", "run-a"]
    assert app.selectbox[0].value == "run-b"
    assert len(app.get("vega_lite_chart")) == 2
    run_events = app.dataframe[1].value
    assert list(run_events["kind"]) == ["straggler", "checkpoint_committed"]
    assert list(run_events["attributes"]) == ['{"slowdown": "2.0"}', "{}"]


def test_picking_a_run_without_records_explains_that_none_arrived_yet(
    monkeypatch: pytest.MonkeyPatch, filled_db: str
) -> None:
    app = run_app(monkeypatch, "--db", filled_db)
    app.selectbox[0].select("run-a").run()
    assert not app.exception
    assert "No steps recorded for this run yet." in infos(app)
    assert len(app.get("vega_lite_chart")) == 0


def test_the_database_url_may_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, filled_db: str
) -> None:
    monkeypatch.setenv(DB_ENV, filled_db)
    app = run_app(monkeypatch)
    assert len(app.get("vega_lite_chart")) == 2


def test_step_times_of_many_ranks_are_drawn_as_a_heatmap_and_of_few_as_lines() -> None:
    def times(ranks: int) -> pd.DataFrame:
        return pd.DataFrame(
            [(step, rank, 0.1) for step in range(3) for rank in range(ranks)],
            columns=["step", "rank", "step_s"],
        )

    assert step_time_chart(times(64)).to_dict()["mark"]["type"] == "rect"
    assert step_time_chart(times(4)).to_dict()["mark"]["type"] == "line"
