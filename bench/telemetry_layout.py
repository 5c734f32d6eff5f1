"""Which PostgreSQL layout of `rank_steps` serves ingest, the pages and retention better: today's
plain table, whose retention deletes by primary-key ranges in bounded batches
(`telemetry.retention`), or declarative partitioning by run and step range, whose retention drops
whole partitions? Both in one command, on the same rows, in two schemas of one database.

Each schema is migrated to today's schema; in the partitioned one `rank_steps` is then replaced by
a table `PARTITION BY RANGE (run_id, step)` with one partition per `--partition-steps` steps (same
columns, same primary key, which includes the partition key as PostgreSQL requires). Then, with
the two layouts taking turns step by step so that other jobs' load falls on both alike:
  ingest     each step's rows through the service's own write path (`telemetry.ingest.insert_steps`:
             one binary COPY) and its rollup (`telemetry.rollup.write`), as the service stores
             them; records/s of the rank rows
  pages      the rank-row reads of the run page, best of 3: the latest 20 steps of every rank
             (`views.rank_phases` of all ranks), one node's ranks at 100 steps sampled over the
             window (`views.rank_steps`)
  retention  everything but the latest `--keep-steps` steps goes: the plain table through
             `Retention.sweep_run` (batches of 50,000 rows, the service's pause between two), then
             the `VACUUM` that makes the deleted rows' space reusable; the partitioned one by
             `DROP TABLE` of each partition wholly below the window (a partition straddling it
             keeps its rows until it is wholly below). Meanwhile a thread goes on ingesting the
             next steps, as the service would: its slowest step is how long ingest waited.
and the tables' bytes after retention.

    nice -n 10 .venv/bin/python bench/telemetry_layout.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Engine, text

from telemetry import views
from telemetry.db import connect, migrate
from telemetry.ingest import insert_steps, step_values, time_format
from telemetry.retention import Retention, RetentionPolicy
from telemetry.rollup import NodeMap, summarise, write
from telemetry.simulated_cluster import Cluster
from telemetry.store import TelemetryStore

RUN_ID = "layout"
STARTED = 1_780_000_000.0
LAYOUTS = ("plain", "partitioned")


@contextlib.contextmanager
def schemas(url: str) -> Iterator[dict[str, Engine]]:
    """An engine per layout, each on a fresh schema of its own, dropped afterwards."""
    admin = connect(url)
    names = {layout: f"telemetry_layout_{layout}_{os.getpid()}" for layout in LAYOUTS}
    with admin.begin() as connection:
        for name in names.values():
            connection.exec_driver_sql(f'CREATE SCHEMA "{name}"')
    engines = {
        layout: connect(
            admin.url.update_query_dict({"options": f"-csearch_path={name}"}).render_as_string(
                hide_password=False
            )
        )
        for layout, name in names.items()
    }
    try:
        yield engines
    finally:
        for engine in engines.values():
            engine.dispose()
        with admin.begin() as connection:
            for name in names.values():
                connection.exec_driver_sql(f'DROP SCHEMA "{name}" CASCADE')
        admin.dispose()


def partition(engine: Engine, steps: int, per_partition: int) -> list[tuple[str, int]]:
    """Replace the empty rank_steps by the partitioned layout; (partition, last step) of each."""
    made = []
    with engine.begin() as connection:
        connection.exec_driver_sql("ALTER TABLE rank_steps RENAME TO rank_steps_plain")
        connection.exec_driver_sql(
            "CREATE TABLE rank_steps (LIKE rank_steps_plain INCLUDING DEFAULTS, "
            "PRIMARY KEY (run_id, step, rank, attempt), "
            "FOREIGN KEY (run_id) REFERENCES runs (run_id) ON DELETE CASCADE) "
            "PARTITION BY RANGE (run_id, step)"
        )
        connection.exec_driver_sql("DROP TABLE rank_steps_plain")
        for first in range(1, steps + 1, per_partition):
            name = f"rank_steps_{first:08d}"
            connection.exec_driver_sql(
                f"CREATE TABLE {name} PARTITION OF rank_steps FOR VALUES "
                f"FROM ('{RUN_ID}', {first}) TO ('{RUN_ID}', {first + per_partition})"
            )
            made.append((name, first + per_partition - 1))
    return made


class Ingest:
    """Stores the simulated run's steps into one layout as the service does, timing each."""

    def __init__(self, engine: Engine, cluster: Cluster) -> None:
        self.engine, self.cluster = engine, cluster
        self.nodes = NodeMap.of_hosts(
            cluster.ranks, {r: cluster.host(r) for r in range(cluster.ranks)}
        )
        self.seconds: list[float] = []

    def rows(self, step: int) -> tuple[list[tuple[Any, ...]], Any]:
        records = self.cluster.records(step, range(self.cluster.ranks), STARTED)
        rows = [step_values(0, r, time_format("postgresql")) for r in records]
        return rows, summarise(RUN_ID, 0, step, rows, self.nodes)

    def store(self, rows: list[tuple[Any, ...]], summary: Any) -> None:
        started = time.perf_counter()
        with self.engine.begin() as connection:
            insert_steps(connection, [rows])
            write(connection, [summary])
        self.seconds.append(time.perf_counter() - started)

    def during(self, work: Callable[[], Any], first_step: int) -> tuple[Any, list[float]]:
        """Run `work` while a thread stores steps from `first_step` on; (its result, the seconds
        of each step stored meanwhile)."""
        done = threading.Event()
        before = len(self.seconds)

        def keep_ingesting() -> None:
            step = first_step
            while not done.is_set():
                self.store(*self.rows(step))
                step += 1

        thread = threading.Thread(target=keep_ingesting)
        thread.start()
        try:
            result = work()
        finally:
            done.set()
            thread.join()
        return result, self.seconds[before:]


def best_of(work: Callable[[], Any], times: int = 3) -> float:
    best = float("inf")
    for _ in range(times):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def pages(engine: Engine, cluster: Cluster) -> dict[str, float]:
    """The run page's reads of rank rows, best of 3 each."""
    node_ranks = list(range(cluster.ranks_per_node))
    every_rank = list(range(cluster.ranks))
    return {
        "latest_20_steps_of_every_rank_s": best_of(
            lambda: views.rank_phases(engine, RUN_ID, every_rank, window=20)
        ),
        "one_node_last_100_steps_s": best_of(
            lambda: views.rank_steps(engine, RUN_ID, node_ranks, max_steps=100)
        ),
    }


def drop_partitions(engine: Engine, made: list[tuple[str, int]], horizon: int) -> list[float]:
    """Seconds of each DROP of a partition whose every step is below the horizon."""
    seconds = []
    for name, last in made:
        if last < horizon:
            started = time.perf_counter()
            with engine.begin() as connection:
                connection.exec_driver_sql(f"DROP TABLE {name}")
            seconds.append(time.perf_counter() - started)
    return seconds


def table_bytes(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(
            connection.execute(
                text(
                    "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = current_schema() AND c.relname LIKE 'rank_steps%' "
                    "AND c.relkind = 'r'"
                )
            ).scalar_one()
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="PostgreSQL URL")
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--keep-steps", type=int, default=80)
    parser.add_argument("--partition-steps", type=int, default=40)
    args = parser.parse_args()
    cluster = Cluster(RUN_ID, ranks=args.ranks, steps=args.steps)
    horizon = args.steps - args.keep_steps
    with schemas(args.db) as engines:
        stores, ingests = {}, {}
        made: list[tuple[str, int]] = []
        for layout, engine in engines.items():
            migrate(engine)
            if layout == "partitioned":
                # Room for the steps ingested during retention too.
                made = partition(engine, 2 * args.steps, args.partition_steps)
            stores[layout] = TelemetryStore(engine)
            stores[layout].register_run(cluster.registration(STARTED))
            ingests[layout] = Ingest(engine, cluster)
        for step in range(1, args.steps + 1):
            rows, summary = ingests["plain"].rows(step)
            for ingest in ingests.values():
                ingest.store(rows, summary)
        for engine in engines.values():
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.exec_driver_sql("ANALYZE")
        read = {layout: pages(engine, cluster) for layout, engine in engines.items()}

        def plain_retention() -> tuple[int, float, float]:
            policy = RetentionPolicy(keep_steps=args.keep_steps)
            started = time.perf_counter()
            deleted = Retention(stores["plain"], policy).sweep_run(RUN_ID, args.ranks)
            deleted_at = time.perf_counter()
            with (
                engines["plain"]
                .connect()
                .execution_options(isolation_level="AUTOCOMMIT") as connection
            ):
                connection.exec_driver_sql("VACUUM rank_steps")
            return deleted, deleted_at - started, time.perf_counter() - deleted_at

        after_fill = args.steps + 1
        (deleted, delete_s, vacuum_s), plain_waits = ingests["plain"].during(
            plain_retention, after_fill
        )
        drops, partitioned_waits = ingests["partitioned"].during(
            lambda: drop_partitions(engines["partitioned"], made, horizon + 1), after_fill
        )
        after = {layout: pages(engine, cluster) for layout, engine in engines.items()}
        sizes = {layout: table_bytes(engine) for layout, engine in engines.items()}
    records = args.ranks * args.steps
    fill = {layout: ingest.seconds[: args.steps] for layout, ingest in ingests.items()}

    def rounded(figures: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        return {k: {name: round(s, 4) for name, s in v.items()} for k, v in figures.items()}

    def waits(seconds: list[float], fill_seconds: list[float]) -> dict[str, Any]:
        return {
            "steps_ingested_meanwhile": len(seconds),
            "slowest_step_s": round(max(seconds, default=0.0), 3),
            "median_step_s": round(statistics.median(seconds), 3) if seconds else None,
            "median_step_before_s": round(statistics.median(fill_seconds), 3),
        }

    report = {
        "rows": f"{args.ranks} ranks x {args.steps} steps = {records:,} per layout, "
        f"partitions of {args.partition_steps} steps, keep {args.keep_steps}",
        "ingest_records_per_s": {k: round(records / sum(v)) for k, v in fill.items()},
        "ratio_ingest_partitioned_to_plain": round(
            sum(fill["plain"]) / sum(fill["partitioned"]), 3
        ),
        "pages_before_retention_s": rounded(read),
        "pages_after_retention_s": rounded(after),
        "retention": {
            "plain": {
                "rows_deleted": deleted,
                "delete_s": round(delete_s, 2),
                "vacuum_s": round(vacuum_s, 2),
                "ingest": waits(plain_waits, fill["plain"]),
            },
            "partitioned": {
                "partitions_dropped": len(drops),
                "rows_dropped": len(drops) * args.partition_steps * args.ranks,
                "drop_s": round(sum(drops), 3),
                "longest_drop_s": round(max(drops, default=0.0), 3),
                "ingest": waits(partitioned_waits, fill["partitioned"]),
            },
        },
        "rank_steps_bytes_after_retention": sizes,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
