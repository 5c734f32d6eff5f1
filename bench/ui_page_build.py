"""How long do the dashboard's pages take to build on a long, wide run? Against reading its rows.

One synthetic run in SQLite: STEPS steps x RANKS ranks (100k x 64 = 6.4M rank records by default),
one rank (13 of 64) a straggler, a checkpoint every 1000 steps on three tiers, a few detector
events. Then, in this process, each cold (caches emptied):
  baseline     a plain SELECT of the columns an undownsampled page would draw (step, rank, loss
               and the phase times of every record), what a page without server-side
               downsampling must read at least
  overview     the runs overview page, built by Streamlit's AppTest (what a browser gets)
  run_health   the run's health page, built the same way
  goodput      efficiency.goodput alone: the one whole-run figure both pages compute (cached, and
               drawn last, so every other section is on screen before it)
and run_health with goodput cached (best of 3): what an auto-refresh costs, and the time to
everything on the page but goodput.

    .venv/bin/python bench/ui_page_build.py [--steps 100000 --ranks 64 --db /tmp/ui-bench.db]

Prints one JSON object with seconds and ratios against the baseline. --db keeps the database
for another run (it is filled once); without it a temporary file is used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select

from telemetry.client import event
from telemetry.db import connect, migrate
from telemetry.efficiency import goodput
from telemetry.ingest import insert_steps, sqlite_time
from telemetry.models import RankStep, Run
from telemetry.store import TelemetryStore

RUN_ID = "synthetic"
CHECKPOINT_EVERY = 1000
START = datetime(2026, 11, 1, tzinfo=UTC)
STEP_S = 0.5


def fill(url: str, steps: int, ranks: int) -> None:
    """The synthetic run: records in bulk through the ingest path's own insert, events through
    the store (so checkpoint rows are derived as the service derives them)."""
    engine = connect(url)
    migrate(engine)
    with engine.begin() as connection:
        connection.execute(
            insert(Run).values(
                run_id=RUN_ID, name="100k x 64 synthetic", world_size=ranks, started_at=START,
                model_params=7_000_000_000, peak_flops=989e12, precision="bf16",
                peak_flops_source="datasheet", status="finished",
                finished_at=START + timedelta(seconds=steps * STEP_S),
            )
        )  # fmt: skip
    rng = random.Random(0)
    straggler = ranks * 13 // 64
    per_chunk = max(1, 64_000 // ranks)
    for first in range(1, steps + 1, per_chunk):
        rows = []
        for step in range(first, min(first + per_chunk, steps + 1)):
            loss = 8 * math.exp(-step / (steps / 5)) + 2
            time_text = sqlite_time(int(START.timestamp() + step * STEP_S), 0)
            for rank in range(ranks):
                slow = 1.6 if rank == straggler else 1.0
                compute = 0.3 * slow + rng.random() * 0.01
                rows.append(
                    (RUN_ID, step, rank, 0, loss + rng.random() * 0.05, 1.0, 4096,
                     STEP_S, 0.01, 0.1 * slow, 0.2 * slow, 0.02, STEP_S - compute - 0.01, 0.0,
                     compute, 0.0, 1 << 30, 2 << 30, 3e-4, time_text, "",
                     step * ranks * 8, step * 8, 0, 0)
                )  # fmt: skip
        with engine.begin() as connection:
            insert_steps(connection, rows)
    events = []
    for step in range(CHECKPOINT_EVERY, steps + 1, CHECKPOINT_EVERY):
        events.append(event(RUN_ID, "checkpoint_staged", step=step, bytes=7 << 30, seconds=0.8))
        events.append(event(RUN_ID, "checkpoint_saved", step=step, bytes=14 << 30, seconds=40.0))
        for tier in ("memory", "ssd", "s3"):
            events.append(
                event(RUN_ID, "checkpoint_committed", step=step, tier=tier, bytes=14 << 30)
            )
    for step in range(500, steps + 1, steps // 10):
        events.append(event(RUN_ID, "straggler", step=step, rank=straggler, message="slow rank"))
    events.append(event(RUN_ID, "loss_spike", step=steps // 3, message="spike"))
    events.append(event(RUN_ID, "sdc", step=steps // 2, rank=7, message="bit flip"))
    TelemetryStore(engine).add_events(events)
    engine.dispose()


def timed(work: Callable[[], Any]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def plain_select(url: str) -> None:
    engine = connect(url, read_only=True)
    columns = ["step", "rank", "loss", "step_s", "data_s", "forward_s", "backward_s",
               "optimizer_s", "comm_wait_s", "compute_s"]  # fmt: skip
    with engine.connect() as connection:
        rows = connection.execute(
            select(*(getattr(RankStep, c) for c in columns)).where(RankStep.run_id == RUN_ID)
        ).all()
    assert rows
    engine.dispose()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--db", type=Path, help="keep the database here (filled if missing)")
    args = parser.parse_args()
    import streamlit as st

    with tempfile.TemporaryDirectory(prefix="ui-bench-") as tmp:
        path = args.db or Path(tmp) / "telemetry.db"
        url = f"sqlite:///{path}"
        fill_s = 0.0 if path.exists() else timed(lambda: fill(url, args.steps, args.ranks))
        os.environ["SCALETRAIN_DB_URL"] = url

        def cold(work: Callable[[], Any]) -> float:
            st.cache_data.clear()
            st.cache_resource.clear()
            return timed(work)

        baseline = cold(lambda: plain_select(url))
        overview = cold(lambda: build_page(None))
        run_health = cold(lambda: build_page("pages/run_health.py"))
        whole_run = cold(lambda: goodput(connect(url, read_only=True), RUN_ID))
        timed(lambda: build_page("pages/run_health.py"))  # warms the goodput cache
        refresh = min(timed(lambda: build_page("pages/run_health.py")) for _ in range(3))
    result = {
        "run": f"{args.steps} steps x {args.ranks} ranks = {args.steps * args.ranks:,} records",
        "fill_s": round(fill_s, 1),
        "baseline_plain_select_s": round(baseline, 2),
        "overview_page_cold_s": round(overview, 2),
        "run_health_page_cold_s": round(run_health, 2),
        "goodput_alone_s": round(whole_run, 2),
        "run_health_page_goodput_cached_s": round(refresh, 2),
        "ratio_overview_cold_to_baseline": round(overview / baseline, 3),
        "ratio_run_health_cold_to_baseline": round(run_health / baseline, 3),
        "ratio_run_health_goodput_cached_to_baseline": round(refresh / baseline, 4),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
