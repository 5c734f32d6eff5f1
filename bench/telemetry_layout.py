"""The PostgreSQL layout of `rank_steps` the service uses, declarative partitioning by run and
step range (`telemetry.partitions`: `PARTITION BY LIST (run_id)`, each run `BY RANGE (step)`,
retention dropping whole ranges), against the plain table it replaced (revision 0005, retention
deleting by primary-key ranges in bounded batches): ingest, the pages and retention, in one
command, on the same rows, in two schemas of one database.

One schema is migrated to revision 0005 (the plain table), the other to the newest revision (the
partitioned one), whose ranges of `--partition-steps` steps the store prepares as the service
does: when the run registers, and the next ones as the steps near the end of what is prepared
(outside the timed writes, as the service's background thread does). Then, with the two layouts
taking turns step by step so that other jobs' load falls on both alike:
  ingest     each step's rows through the service's own write path (`telemetry.ingest.insert_steps`:
             one binary COPY) and its rollup (`telemetry.rollup.write`), as the service stores
             them; records/s of the rank rows
  pages      the rank-row reads of the run page, the two layouts in turn for `--read-rounds`
             rounds, best and median of each: the latest 20 steps of every rank
             (`views.nodes.rank_phases` of all ranks), one node's ranks at 100 steps sampled over
             the window (`views.nodes.rank_steps`)
  retention  everything but the latest `--keep-steps` steps goes, through the service's own
             `Retention.sweep_run` on each: on the plain table batches of 50,000 rows (the
             service's pause between two), then the `VACUUM` that makes the deleted rows' space
             reusable; on the partitioned one a `DROP TABLE` of each range wholly past the window
             (a range straddling it keeps its rows until it is wholly past). Meanwhile a thread
             goes on ingesting the next steps, as the service would: its slowest step is how long
             ingest waited.
and the tables' bytes after retention.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/telemetry_layout.py \
        --db postgresql+psycopg://postgres@127.0.0.1:5432/test
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

from alembic import command
from sqlalchemy import Engine, text

from telemetry import partitions
from telemetry.db import alembic_config, connect, migrate
from telemetry.ingest import insert_steps, step_values, time_format
from telemetry.retention import Retention, RetentionPolicy
from telemetry.rollup import NodeMap, summarise, write
from telemetry.simulated_cluster import Cluster
from telemetry.store import TelemetryStore
from telemetry.views.nodes import rank_phases, rank_steps

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


def migrate_to(engine: Engine, revision: str) -> None:
    """Bring the schema to `revision` ("head": what `telemetry.db.migrate` does)."""
    if revision == "head":
        migrate(engine)
        return
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


class Ingest:
    """Stores the simulated run's steps into one layout as the service does, timing each."""

    def __init__(self, store: TelemetryStore, engine: Engine, cluster: Cluster) -> None:
        self.store, self.engine, self.cluster = store, engine, cluster
        self.partitioned = store.partitioned()
        self.prepared = 0
        self.nodes = NodeMap.of_hosts(
            cluster.ranks, {r: cluster.host(r) for r in range(cluster.ranks)}
        )
        self.seconds: list[float] = []

    def rows(self, step: int) -> tuple[list[tuple[Any, ...]], Any]:
        records = self.cluster.records(step, range(self.cluster.ranks), STARTED)
        rows = [step_values(0, r, time_format("postgresql")) for r in records]
        return rows, summarise(RUN_ID, 0, step, rows, self.nodes)

    def store_step(self, step: int, rows: list[tuple[Any, ...]], summary: Any) -> None:
        if self.partitioned and step + self.store.partition_steps > self.prepared:
            # What the store's background thread does as the steps near the prepared end.
            self.prepared = self.store.prepare_partitions(
                RUN_ID, step + 2 * self.store.partition_steps
            )
        started = time.perf_counter()
        with self.engine.begin() as connection:
            insert_steps(connection, [rows])
            write(connection, [summary])
        self.seconds.append(time.perf_counter() - started)
        if self.partitioned:
            # The store's background thread (statistics of a range a tenth written), untimed.
            self.store.steps_written({RUN_ID: step})
            self.store.wait_for_partitions()

    def during(self, work: Callable[[], Any], first_step: int) -> tuple[Any, list[float]]:
        """Run `work` while a thread stores steps from `first_step` on; (its result, the seconds
        of each step stored meanwhile)."""
        done = threading.Event()
        before = len(self.seconds)

        def keep_ingesting() -> None:
            step = first_step
            while not done.is_set():
                self.store_step(step, *self.rows(step))
                step += 1

        thread = threading.Thread(target=keep_ingesting)
        thread.start()
        try:
            result = work()
        finally:
            done.set()
            thread.join()
        return result, self.seconds[before:]


def pages(engines: dict[str, Engine], cluster: Cluster, rounds: int) -> dict[str, Any]:
    """The run page's reads of rank rows, each layout's in turn for `rounds` rounds (so that a
    burst of other jobs' load falls on both): per layout and read, the best and the median
    seconds, and the partitioned layout's over the plain one's of each (below 1: faster)."""
    node_ranks = list(range(cluster.ranks_per_node))
    every_rank = list(range(cluster.ranks))
    reads: dict[str, Callable[[Engine], Any]] = {
        "latest_20_steps_of_every_rank": lambda engine: rank_phases(
            engine, RUN_ID, every_rank, window=20
        ),
        "one_node_last_100_steps": lambda engine: rank_steps(
            engine, RUN_ID, node_ranks, max_steps=100
        ),
    }
    seconds: dict[str, dict[str, list[float]]] = {
        layout: {name: [] for name in reads} for layout in engines
    }
    for _ in range(rounds):
        for layout, engine in engines.items():
            for name, read in reads.items():
                started = time.perf_counter()
                read(engine)
                seconds[layout][name].append(time.perf_counter() - started)
    figures: dict[str, Any] = {
        layout: {
            name: {"best_s": round(min(s), 4), "median_s": round(statistics.median(s), 4)}
            for name, s in of_layout.items()
        }
        for layout, of_layout in seconds.items()
    }
    figures["partitioned_over_plain"] = {
        name: {
            statistic: round(
                figures["partitioned"][name][statistic] / figures["plain"][name][statistic], 3
            )
            for statistic in ("best_s", "median_s")
        }
        for name in reads
    }
    return figures


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
    parser.add_argument("--read-rounds", type=int, default=7)
    args = parser.parse_args()
    cluster = Cluster(RUN_ID, ranks=args.ranks, steps=args.steps)
    with schemas(args.db) as engines:
        stores, ingests = {}, {}
        for layout, engine in engines.items():
            migrate_to(engine, "0005" if layout == "plain" else "head")
            stores[layout] = TelemetryStore(engine, partition_steps=args.partition_steps)
            stores[layout].register_run(cluster.registration(STARTED))
            ingests[layout] = Ingest(stores[layout], engine, cluster)
        assert [ingest.partitioned for ingest in ingests.values()] == [False, True]
        for step in range(1, args.steps + 1):
            rows, summary = ingests["plain"].rows(step)
            for ingest in ingests.values():
                ingest.store_step(step, rows, summary)
        for engine in engines.values():
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.exec_driver_sql("ANALYZE")
        read = pages(engines, cluster, args.read_rounds)
        policy = RetentionPolicy(keep_steps=args.keep_steps)

        def plain_retention() -> tuple[int, float, float]:
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

        def partitioned_retention() -> tuple[int, int, float]:
            with engines["partitioned"].connect() as connection:
                ranges_before = {r.name for r in partitions.ranges(connection, RUN_ID)}
            started = time.perf_counter()
            dropped = Retention(stores["partitioned"], policy).sweep_run(RUN_ID, args.ranks)
            seconds = time.perf_counter() - started
            with engines["partitioned"].connect() as connection:
                ranges_after = {r.name for r in partitions.ranges(connection, RUN_ID)}
            return dropped, len(ranges_before - ranges_after), seconds

        after_fill = args.steps + 1
        (deleted, delete_s, vacuum_s), plain_waits = ingests["plain"].during(
            plain_retention, after_fill
        )
        (dropped, ranges_dropped, drop_s), partitioned_waits = ingests["partitioned"].during(
            partitioned_retention, after_fill
        )
        after = pages(engines, cluster, args.read_rounds)
        sizes = {layout: table_bytes(engine) for layout, engine in engines.items()}
    records = args.ranks * args.steps
    fill = {layout: ingest.seconds[: args.steps] for layout, ingest in ingests.items()}

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
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "ingest_records_per_s": {k: round(records / sum(v)) for k, v in fill.items()},
        "ratio_ingest_partitioned_to_plain": round(
            sum(fill["plain"]) / sum(fill["partitioned"]), 3
        ),
        "pages_before_retention": read,
        "pages_after_retention": after,
        "retention": {
            "plain": {
                "rows_deleted": deleted,
                "delete_s": round(delete_s, 2),
                "vacuum_s": round(vacuum_s, 2),
                "ingest": waits(plain_waits, fill["plain"]),
            },
            "partitioned": {
                "partitions_dropped": ranges_dropped,
                "rows_dropped": dropped,
                "sweep_s": round(drop_s, 3),
                "ingest": waits(partitioned_waits, fill["partitioned"]),
            },
        },
        "rank_steps_bytes_after_retention": sizes,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
