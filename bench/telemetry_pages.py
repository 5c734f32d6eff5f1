"""Do the run page, the runs overview and goodput hold at 16,384 ranks x 1,000 steps (16.4M rank
records) in PostgreSQL? Each beside a baseline query of the same rows, in one command.

Fills one simulated run (`telemetry.simulated_cluster`: nodes of 8, two stragglers, a slow node, an
SDC, loss spikes) once, through the service's own write paths (`telemetry.ingest.insert_steps`
for the rank rows, `telemetry.rollup` for the rollups and node rows, as the service writes them
when each step completes), in a database of its own (default `bench_telemetry`, created if
missing; `--keep` reuses a filled one). Then, in this process:
  run page cold   the health page built by Streamlit's AppTest (what a browser gets) with every
                  Streamlit cache emptied and a fresh engine (PostgreSQL's own buffers stay warm:
                  dropping the OS page cache needs root on the database host)
  run page warm   the same page again, its caches warm (best of 3): what an auto-refresh costs
  overview        the runs overview page, cold
  goodput         efficiency.goodput alone
  baselines       the same figures read from the rank rows as a page without rollups must:
                  the latest 20 steps of every rank (run page, overview: 330k rows) and one
                  pass over every record of the run (goodput)
and the database's bytes per row of each table, projected to bytes per million steps at 16,384
ranks with the default retention.

    nice -n 10 .venv/bin/python bench/telemetry_pages.py [--ranks 16384 --steps 1000] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from telemetry.db import connect, migrate
from telemetry.efficiency import goodput
from telemetry.ingest import insert_steps, step_values, time_format
from telemetry.models import RankStep, Run
from telemetry.retention import RetentionPolicy
from telemetry.rollup import NodeMap, summarise, write
from telemetry.simulated_cluster import Cluster
from telemetry.store import TelemetryStore

RUN_ID = "cluster-16k"
DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_telemetry"
STARTED = 1_780_000_000.0


def ensure_database(url: str) -> None:
    """Create the benchmark's PostgreSQL database if missing (the test database stays small)."""
    parsed = make_url(url)
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        exists = connection.execute(
            text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": parsed.database}
        ).first()
        if exists is None:
            connection.exec_driver_sql(f'CREATE DATABASE "{parsed.database}"')
    admin.dispose()


def fill(url: str, cluster: Cluster) -> float:
    """The simulated run, step by step as the service would store it; returns seconds taken."""
    started = time.perf_counter()
    engine = connect(url)
    migrate(engine)
    store = TelemetryStore(engine)
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM runs WHERE run_id = :run"), {"run": RUN_ID})
    store.register_run(cluster.registration(STARTED))
    store.add_events([e for s in range(1, cluster.steps + 1) for e in cluster.events(s, STARTED)])
    nodes = NodeMap.of_hosts(cluster.ranks, {r: cluster.host(r) for r in range(cluster.ranks)})
    to_stored = time_format(engine.dialect.name)
    for step in range(1, cluster.steps + 1):
        rows = [
            step_values(0, r, to_stored)
            for r in cluster.records(step, range(cluster.ranks), STARTED)
        ]
        summary = summarise(RUN_ID, 0, step, rows, nodes)
        with engine.begin() as connection:
            insert_steps(connection, [rows])
            write(connection, [summary])
        store.steps_written({RUN_ID: step})  # its range partitions ahead, as the service does
        if step % 100 == 0:
            print(f"filled {step}/{cluster.steps} steps", flush=True)
    with engine.begin() as connection:
        connection.execute(
            text("UPDATE runs SET status = 'finished' WHERE run_id = :r"), {"r": RUN_ID}
        )
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.exec_driver_sql("VACUUM ANALYZE")
    store.wait_for_partitions()
    engine.dispose()
    return time.perf_counter() - started


def timed(work: Callable[[], Any]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def build_page(page: str | None) -> None:
    """One page built as a browser would get it; fails on any exception the page shows."""
    from streamlit.testing.v1 import AppTest

    from ui.launch import APP_PATH

    app = AppTest.from_file(str(APP_PATH), default_timeout=600)
    app.run()
    if page is not None:
        app.query_params["run"] = RUN_ID
        app.switch_page(page).run()
    assert not app.exception, app.exception
    assert not app.error, [e.value for e in app.error]


_last_step = select(func.max(RankStep.step)).where(RankStep.run_id == RUN_ID)


def latest_rank_rows(url: str, window: int = 20) -> None:
    """Baseline of the run page: every rank's phase times at the latest `window` steps."""
    engine = connect(url, read_only=True)
    columns = ["step", "rank", "loss", "step_s", "compute_s", "data_s", "forward_s",
               "backward_s", "optimizer_s", "comm_wait_s"]  # fmt: skip
    with engine.connect() as connection:
        last = connection.execute(
            select(func.max(RankStep.step)).where(RankStep.run_id == RUN_ID)
        ).scalar()
        rows = connection.execute(
            select(*(getattr(RankStep, c) for c in columns)).where(
                RankStep.run_id == RUN_ID, RankStep.step > last - window
            )
        ).all()
    assert rows
    engine.dispose()


def recent_aggregate(url: str, window: int = 20) -> None:
    """Baseline of the overview: loss, tokens and wall time of the latest steps from rank rows."""
    engine = connect(url, read_only=True)
    with engine.connect() as connection:
        last = connection.execute(
            select(func.max(RankStep.step)).where(RankStep.run_id == RUN_ID)
        ).scalar()
        rows = connection.execute(
            select(
                RankStep.step,
                func.avg(RankStep.loss),
                func.sum(RankStep.tokens),
                func.max(RankStep.step_s),
            )
            .where(RankStep.run_id == RUN_ID, RankStep.step > last - window)
            .group_by(RankStep.step)
        ).all()
    assert rows
    engine.dispose()


_PHASES = ("step_s", "data_s", "checkpoint_s", "replay_s")


def whole_run_pass(url: str) -> None:
    """Baseline of goodput: one pass over every record of the run, per step (the old goodput)."""
    engine = connect(url, read_only=True)
    per_step = (
        select(*(func.max(getattr(RankStep, c)).label(c) for c in _PHASES))
        .where(RankStep.run_id == RUN_ID)
        .group_by(RankStep.step)
        .subquery()
    )
    with engine.connect() as connection:
        connection.execute(select(*(func.sum(c) for c in per_step.c))).one()
    engine.dispose()


def sizes(url: str, ranks: int, policy: RetentionPolicy) -> dict[str, Any]:
    """Bytes per row of each table and the projection to a million steps at `ranks` ranks."""
    engine = connect(url, read_only=True)
    result: dict[str, Any] = {}
    with engine.connect() as connection:
        for table in ("rank_steps", "step_rollups", "node_steps"):
            size, rows = connection.execute(
                # A partitioned table's bytes are its partitions' (it holds none itself).
                text(
                    "SELECT coalesce((SELECT sum(pg_total_relation_size(relid)) FROM "
                    "pg_partition_tree(CAST(:table AS regclass)) WHERE isleaf), "
                    "pg_total_relation_size(:table)), "
                    f"(SELECT count(*) FROM {table})"
                ),
                {"table": table},
            ).one()
            result[f"{table}_bytes"] = int(size)
            result[f"{table}_bytes_per_row"] = round(int(size) / rows, 1) if rows else None
        world = connection.execute(select(Run.world_size).where(Run.run_id == RUN_ID)).scalar()
    engine.dispose()
    nodes = -(-world // 8)
    kept_rank_rows = ranks * (policy.keep_steps + policy.keep_checkpoints)
    projected = (
        result["step_rollups_bytes_per_row"] * 1_000_000
        + result["rank_steps_bytes_per_row"] * kept_rank_rows
        + result["node_steps_bytes_per_row"] * nodes * policy.keep_steps
    )
    result["bytes_per_million_steps_default_retention"] = int(projected)
    result["bytes_per_million_steps_without_retention"] = int(
        result["rank_steps_bytes_per_row"] * ranks * 1_000_000
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default=DEFAULT_DB, help="PostgreSQL URL of the benchmark database")
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--keep", action="store_true", help="reuse the run if it is there")
    args = parser.parse_args()
    import streamlit as st

    if args.db.startswith("postgresql"):
        ensure_database(args.db)
    cluster = Cluster(RUN_ID, ranks=args.ranks, steps=args.steps)
    engine = connect(args.db)
    migrate(engine)
    with engine.connect() as connection:
        have = connection.execute(
            select(func.count()).where(RankStep.run_id == RUN_ID, RankStep.step == args.steps)
        ).scalar()
    engine.dispose()
    fill_s = 0.0 if args.keep and have == args.ranks else fill(args.db, cluster)
    os.environ["SCALETRAIN_DB_URL"] = args.db

    def cold(work: Callable[[], Any]) -> float:
        st.cache_data.clear()
        st.cache_resource.clear()
        return timed(work)

    figures = {
        "baseline_latest_20_steps_of_every_rank_s": cold(lambda: latest_rank_rows(args.db)),
        "baseline_overview_aggregate_s": cold(lambda: recent_aggregate(args.db)),
        "baseline_goodput_pass_over_every_record_s": cold(lambda: whole_run_pass(args.db)),
        "run_page_cold_s": cold(lambda: build_page("pages/run_health.py")),
        "overview_cold_s": cold(lambda: build_page(None)),
        "goodput_s": cold(lambda: goodput(connect(args.db, read_only=True), RUN_ID)),
    }
    timed(lambda: build_page("pages/run_health.py"))
    figures["run_page_warm_s"] = min(
        timed(lambda: build_page("pages/run_health.py")) for _ in range(3)
    )
    rank_rows = figures["baseline_latest_20_steps_of_every_rank_s"]
    ratios = {
        "ratio_run_page_warm_to_baseline": figures["run_page_warm_s"] / rank_rows,
        "ratio_run_page_cold_to_baseline": figures["run_page_cold_s"] / rank_rows,
        "ratio_overview_to_baseline": (
            figures["overview_cold_s"] / figures["baseline_overview_aggregate_s"]
        ),
        "ratio_goodput_to_baseline": (
            figures["goodput_s"] / figures["baseline_goodput_pass_over_every_record_s"]
        ),
    }
    result = {
        "run": f"{args.ranks} ranks x {args.steps} steps = {args.ranks * args.steps:,} records",
        "database": make_url(args.db).render_as_string(hide_password=True),
        "fill_s": round(fill_s, 1),
        **{name: round(value, 3) for name, value in figures.items()},
        **{name: round(value, 4) for name, value in ratios.items()},
        **(
            sizes(args.db, args.ranks, RetentionPolicy())
            if args.db.startswith("postgresql")
            else {}
        ),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
