"""Each page of the dashboard, run in-process by Streamlit's AppTest: on a database filled by a
real training run, on an empty one, and on the problems a user can give it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from ui_testing import OVERVIEW, RUN_HEALTH, SDC_STEP, STRAGGLER_RANK, RealRun, open_page

from scaletrain.app.recovery import Recovery
from scaletrain.v1 import telemetry_pb2
from telemetry.client import event, rank_step
from telemetry.db import connect, migrate
from telemetry.store import TelemetryStore
from ui.panels.checkpoints import NO_CHECKPOINTS
from ui.source import NO_RUNS, NO_URL


def infos(app: AppTest) -> list[str]:
    return [info.value for info in app.info]


def metrics(app: AppTest) -> dict[str, str]:
    return {metric.label: metric.value for metric in app.metric}


def test_the_overview_lists_a_real_run_with_its_status_figures_checkpoint_and_alerts(
    monkeypatch: pytest.MonkeyPatch, real_run: RealRun
) -> None:
    app = open_page(monkeypatch, real_run.db_url)

    runs = app.dataframe[0].value
    row = runs.set_index("run_id").loc[real_run.run_id]
    assert row["status"] == "finished"
    assert row["step"] == 12
    assert row["loss"] == pytest.approx(real_run.summary["last_loss"], rel=1e-6)
    assert row["last_checkpoint"] == 12
    # The straggler, the SDC and the loss spike it caused are open alerts of the run.
    assert row["open_alerts"] >= 3
    assert 0 < row["goodput"] < 1
    assert 0 < row["mfu"] < 1
    assert row["open"] == f"./run?run={real_run.run_id}"
    assert app.selectbox[0].value == real_run.run_id


def test_the_health_page_of_a_real_run_shows_every_section(
    monkeypatch: pytest.MonkeyPatch, real_run: RealRun
) -> None:
    app = open_page(monkeypatch, real_run.db_url, RUN_HEALTH, run=real_run.run_id)

    assert app.selectbox[0].value == real_run.run_id
    shown = metrics(app)
    assert shown["step"] == "12"
    assert shown["loss"] == f"{real_run.summary['last_loss']:.4f}"
    assert shown["goodput"].endswith("%")
    assert "since last checkpoint" in shown
    # Loss, throughput, nodes x steps, the opened node's ranks x steps, its phase breakdown and
    # straggler scores, checkpoint timeline, time use.
    assert len(app.get("vega_lite_chart")) == 8
    # Every rank registered this machine as its host: one node, opened first.
    assert app.selectbox[1].value == socket.gethostname()
    slowest_now, _, slowest_over_run, _, tiers, offsets, log = (f.value for f in app.dataframe)
    assert slowest_now["rank"].iloc[0] == STRAGGLER_RANK
    assert slowest_over_run["rank"].iloc[0] == STRAGGLER_RANK
    assert list(tiers["step"]) == [12, 8, 4]
    assert all("ssd" in held for held in tiers["tiers"])
    assert (tiers["ssd MB"] > 0).all()
    # One ckptd, one node: no node names.
    assert "nodes" not in tiers.columns
    assert list(offsets["rank"]) == [0, 1]
    assert (offsets["global_sample"] > 0).all()
    assert {"straggler", "sdc", "loss_spike", "replay", "checkpoint_committed"} <= set(log["kind"])
    assert NO_CHECKPOINTS not in infos(app)


def test_the_events_log_filters_by_kind_rank_and_text(
    monkeypatch: pytest.MonkeyPatch, real_run: RealRun
) -> None:
    app = open_page(monkeypatch, real_run.db_url, RUN_HEALTH, run=real_run.run_id)

    # Text input 0 is the nodes panel's search box.
    app.multiselect[0].select("sdc").select("straggler").run()
    assert set(app.dataframe[-1].value["kind"]) == {"sdc", "straggler"}
    app.text_input[1].input(str(STRAGGLER_RANK)).run()
    assert list(app.dataframe[-1].value["kind"]) == ["straggler"]
    app.text_input[1].input("").run()
    app.text_input[2].input(f"at step {SDC_STEP}").run()
    assert list(app.dataframe[-1].value["kind"]) == ["sdc"]
    app.text_input[1].input("first").run()
    assert [e.value for e in app.error] == ["Rank must be a whole number, got 'first'."]


def test_a_node_is_found_by_rank_and_its_heatmap_can_show_any_phase(
    monkeypatch: pytest.MonkeyPatch, real_run: RealRun
) -> None:
    app = open_page(monkeypatch, real_run.db_url, RUN_HEALTH, run=real_run.run_id)
    app.text_input[0].input("0").run()
    # Every rank of the one-machine run registered this machine as its host: one node.
    host = socket.gethostname()
    assert app.selectbox[1].value == host
    assert any(m.value.startswith(f"**Node {host}**: ranks 0") for m in app.markdown)
    app.selectbox[2].select("comm_wait_s").run()
    assert not app.exception
    assert len(app.get("vega_lite_chart")) == 8
    app.text_input[0].input("gpu-host-9").run()
    assert "No rank or host of this run matches 'gpu-host-9'." in [w.value for w in app.warning]


def test_an_unknown_run_in_the_address_falls_back_to_the_newest_run(
    monkeypatch: pytest.MonkeyPatch, real_run: RealRun
) -> None:
    app = open_page(monkeypatch, real_run.db_url, RUN_HEALTH, run="no-such-run")
    assert app.warning[0].value == (
        "No run 'no-such-run' in this database: showing the newest run instead."
    )
    assert app.selectbox[0].value == real_run.run_id


@pytest.mark.parametrize("page", [OVERVIEW, RUN_HEALTH])
def test_on_an_empty_database_each_page_says_how_to_start_a_run(
    monkeypatch: pytest.MonkeyPatch, empty_db: str, page: str
) -> None:
    app = open_page(monkeypatch, empty_db, page)
    assert infos(app) == [NO_RUNS]
    assert not app.dataframe and not app.get("vega_lite_chart")


def test_before_the_database_exists_the_overview_says_there_are_no_runs_yet(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    app = open_page(monkeypatch, f"sqlite:///{tmp_path / 'telemetry.db'}")
    assert infos(app) == [f"no telemetry database at {tmp_path / 'telemetry.db'} yet. {NO_RUNS}"]
    assert not (tmp_path / "telemetry.db").exists()


def test_without_a_database_url_the_overview_says_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert infos(open_page(monkeypatch, None)) == [NO_URL]


def test_a_bad_database_url_is_shown_as_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    app = open_page(monkeypatch, "mysql://localhost/telemetry")
    assert [error.value for error in app.error] == [
        "unsupported database 'mysql' in mysql://localhost/telemetry: "
        "use sqlite:///PATH or postgresql+psycopg://HOST/DB"
    ]


def test_a_run_without_steps_or_checkpoints_explains_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, empty_db: str
) -> None:
    store = TelemetryStore(connect(empty_db))
    store.register_run(telemetry_pb2.RegisterRunRequest(run_id="fresh", world_size=2))
    app = open_page(monkeypatch, empty_db, RUN_HEALTH, run="fresh")
    assert metrics(app)["step"] == "—"
    assert any(info.startswith("No steps recorded for this run yet") for info in infos(app))
    assert any(info.startswith("No events for this run yet") for info in infos(app))
    assert NO_CHECKPOINTS in infos(app)

    store.add_steps([rank_step("fresh", 1, rank, loss=2.0, times={"step": 0.1}) for rank in (0, 1)])
    app = open_page(monkeypatch, empty_db, RUN_HEALTH, run="fresh")
    assert metrics(app)["step"] == "1"
    assert metrics(app)["last checkpoint"] == "none"
    assert NO_CHECKPOINTS in infos(app)


def test_a_checkpoint_spread_over_two_nodes_shows_where_each_part_and_its_copies_are(
    monkeypatch: pytest.MonkeyPatch, empty_db: str
) -> None:
    store = TelemetryStore(connect(empty_db))
    store.register_run(telemetry_pb2.RegisterRunRequest(run_id="two-nodes", world_size=4))
    store.add_events(
        [
            event("two-nodes", "checkpoint_committed", step=8, tier=tier, bytes=1 << 20, node=node)
            for tier in ("memory", "ssd", "s3")
            for node in ("node0", "node1")
        ]
        # Step 8: each node holds a copy of the other's part; step 4: only node1 of node0's.
        + [
            event(
                "two-nodes",
                "checkpoint_committed",
                step=8,
                tier="ssd",
                bytes=1 << 20,
                node=holder,
                replica_of=owner,
            )
            for holder, owner in (("node0", "node1"), ("node1", "node0"))
        ]
        + [
            event(
                "two-nodes",
                "checkpoint_committed",
                step=4,
                tier="ssd",
                bytes=1 << 20,
                node=node,
                replica_of=owner,
            )
            for node, owner in (("node0", ""), ("node1", ""), ("node1", "node0"))
        ]
    )
    app = open_page(monkeypatch, empty_db, RUN_HEALTH, run="two-nodes")
    (tiers,) = (frame.value for frame in app.dataframe if "tiers" in frame.value.columns)
    assert tiers[["step", "tiers", "nodes", "copies", "node_loss_safe"]].values.tolist() == [
        [8, "memory, ssd, s3", "memory: node0, node1 · ssd: node0, node1 · s3",
         "node0: node0, node1 · node1: node0, node1", "yes"],
        [4, "ssd", "ssd: node0, node1", "node0: node0, node1 · node1: node1", "no"],
    ]  # fmt: skip
    # A part's size counts once, not once per copy.
    assert tiers["ssd MB"].tolist() == [pytest.approx(2 * (1 << 20) / 1e6)] * 2


@pytest.mark.postgres
def test_the_pages_render_from_postgresql(
    monkeypatch: pytest.MonkeyPatch, pg_schema_url: str
) -> None:
    engine = connect(pg_schema_url)
    migrate(engine)
    store = TelemetryStore(engine)
    store.register_run(telemetry_pb2.RegisterRunRequest(run_id="pg-run", world_size=4))
    store.add_steps(
        [
            rank_step(
                "pg-run",
                step,
                rank,
                loss=3.0 / step,
                tokens=64,
                times={"step": 0.2, "compute": 0.1 + 0.1 * (rank == 3)},
                offset=(step * 4, step, 0),
            )
            for step in range(1, 41)
            for rank in range(4)
        ]
    )
    store.roll_up()
    store.add_events([event("pg-run", "checkpoint_committed", step=40, tier="ssd", bytes=1 << 20)])
    engine.dispose()

    overview = open_page(monkeypatch, pg_schema_url)
    assert list(overview.dataframe[0].value["run_id"]) == ["pg-run"]
    page = open_page(monkeypatch, pg_schema_url, RUN_HEALTH, run="pg-run")
    assert metrics(page)["step"] == "40"
    assert len(page.get("vega_lite_chart")) >= 5
    assert "Slower than their peers now: rank 3" in page.warning[0].value


def test_a_run_with_a_recovery_record_shows_it_in_a_table_and_as_a_band_on_the_loss_curve(
    monkeypatch: pytest.MonkeyPatch, empty_db: str
) -> None:
    store = TelemetryStore(connect(empty_db))
    store.register_run(telemetry_pb2.RegisterRunRequest(run_id="drilled", world_size=2))
    store.add_steps(
        [
            rank_step("drilled", s, r, loss=2.0, times={"step": 0.1})
            for s in range(1, 11)
            for r in (0, 1)
        ]
    )
    store.roll_up()
    record = Recovery(
        kind="kill-rank",
        target="rank 1",
        step=7,
        injected_at=1000.0,
        detected_at=1000.4,
        detected_by="[rank0]: Traceback",
        first_step=6,
        first_step_at=1012.5,
        mttr_s=12.5,
        restarted=True,
        resumed_from=5,
        steps_lost=2,
        restored_from={"memory@node0": 2_100_000},
        bytes_per_tier={"memory": 2_100_000},
        badput_s=12.6,
        in_job=True,
    )
    store.add_events(
        [event("drilled", "recovery", step=7, message="recovery", attributes=record.attributes())]
    )
    app = open_page(monkeypatch, empty_db, RUN_HEALTH, run="drilled")
    (table,) = (frame.value for frame in app.dataframe if "MTTR s" in frame.value.columns)
    row = table.iloc[0]
    assert (row["kind"], row["target"], row["step"], row["first step"]) == (
        "kill-rank",
        "rank 1",
        7,
        6,
    )
    assert (row["detected s"], row["first step s"], row["MTTR s"]) == pytest.approx(
        (0.4, 12.5, 12.5)
    )
    assert (row["steps lost"], row["spare"], row["in-job"], row["cost s"]) == (2, False, True, 12.6)
    assert row["restored from"] == "2.10 MB from memory@node0"
    loss = app.get("vega_lite_chart")[0].proto.spec
    assert '"type": "rect"' in loss and '"field": "from_step"' in loss
