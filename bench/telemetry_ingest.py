"""How close does the telemetry service's ingest of rank-step records come to a plain bulk insert?

Builds the same rank-step records of a run of R ranks and S steps, then in one command, on the same
database, best of a few runs each:
  (1) baseline: one plain SQLAlchemy Core bulk insert (`INSERT` executemany, one transaction) of the
      rows those records map to, built before the clock starts;
  (2) the service: a `scaletrain telemetry` process on loopback, fed by one TelemetryClient per rank
      (as the trainer does), clocked from the first `report_step` until every client's `flush`
      returns, i.e. until the service has stored and acknowledged every record.
It prints both rates and their ratio. Each measurement writes a run of its own into the same tables.

    .venv/bin/python bench/telemetry_ingest.py                       # SQLite in a temporary dir
    .venv/bin/python bench/telemetry_ingest.py --db postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, insert

from scaletrain.rpc import wait_until_healthy
from scaletrain.stack import free_port
from scaletrain.v1 import telemetry_pb2
from telemetry.client import TelemetryClient, rank_step
from telemetry.db import connect, migrate
from telemetry.ingest import STEP_COLUMNS, step_values
from telemetry.models import RankStep
from telemetry.store import TelemetryStore


def make_records(run_id: str, ranks: int, steps: int) -> list[list[telemetry_pb2.RankStep]]:
    """Per rank, one realistic record per step (every field the trainer fills), stamped as a run
    of 0.25 s steps would stamp them."""
    phases = {"step": 0.25, "data": 0.01, "forward": 0.08, "backward": 0.12, "optimizer": 0.03}
    started = time.time()
    records = [
        [
            rank_step(
                run_id,
                step,
                rank,
                loss=2.0 + 1.0 / (step + 1),
                grad_norm=0.7,
                tokens=4096,
                lr=3e-4,
                times={**phases, "compute": 0.09, "comm_wait": 0.002},
                offset=((step + 1) * 64, (step + 1) * 64 + rank * 8, 0),
                memory_bytes=1 << 30,
                peak_memory_bytes=1 << 31,
                param_checksum=f"{step * 7919 + rank:016x}",
            )
            for step in range(1, steps + 1)
        ]
        for rank in range(ranks)
    ]
    for per_rank in records:
        for record in per_rank:
            record.time.FromNanoseconds(int((started + 0.25 * record.step) * 1e9) + record.rank)
    return records


def register(store: TelemetryStore, run_id: str, ranks: int) -> None:
    store.register_run(telemetry_pb2.RegisterRunRequest(run_id=run_id, world_size=ranks))


def baseline_seconds(engine: Engine, records: list[list[telemetry_pb2.RankStep]]) -> float:
    """One Core executemany of the rows, built before the clock starts."""
    rows = [
        dict(zip(STEP_COLUMNS, step_values(0, record), strict=True))
        for per_rank in records
        for record in per_rank
    ]
    started = time.perf_counter()
    with engine.begin() as connection:
        connection.execute(insert(RankStep), rows)
    return time.perf_counter() - started


def service_seconds(address: str, records: list[list[telemetry_pb2.RankStep]]) -> float:
    """Every rank's client reports all its records; the clock stops when all are acknowledged."""
    clients = [TelemetryClient(address, max_queue=len(records[0]) + 1) for _ in records]
    try:
        started = time.perf_counter()
        reporters = [
            threading.Thread(target=lambda c=client, rs=per_rank: [c.report_step(r) for r in rs])
            for client, per_rank in zip(clients, records, strict=True)
        ]
        for thread in reporters:
            thread.start()
        for thread in reporters:
            thread.join()
        if not all(client.flush(timeout_s=600) for client in clients):
            raise SystemExit("the service did not acknowledge every record")
        elapsed = time.perf_counter() - started
        dropped = sum(client.dropped + client.rejected for client in clients)
        if dropped:
            raise SystemExit(f"{dropped} records were dropped or rejected")
        return elapsed
    finally:
        for client in clients:
            client.close(timeout_s=5)


@contextlib.contextmanager
def service(db_url: str) -> Iterator[str]:
    """`scaletrain telemetry` as its own process, as deployed; yields its address."""
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "telemetry", "--listen", address, "--db", db_url],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until_healthy(address, timeout_s=60)
        yield address
    finally:
        process.terminate()
        process.wait(30)


@contextlib.contextmanager
def database(url: str | None) -> Iterator[str]:
    """The URL to benchmark: a fresh SQLite file, or a fresh schema in the given PostgreSQL."""
    if url is None:
        with tempfile.TemporaryDirectory(prefix="telemetry-bench-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'telemetry.db'}"
        return
    admin = connect(url)
    schema = f"telemetry_bench_{os.getpid()}"
    with admin.begin() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        scoped = admin.url.update_query_dict({"options": f"-csearch_path={schema}"})
        yield scoped.render_as_string(hide_password=False)
    finally:
        with admin.begin() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="PostgreSQL URL (default: SQLite in a temporary directory)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5000, help="records per rank")
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs each")
    args = parser.parse_args()
    with database(args.db) as url:
        engine = connect(url)
        migrate(engine)
        store = TelemetryStore(engine)
        base, served = [], []
        with service(url) as address:
            for _ in range(args.runs):
                for timings, measure in ((base, "baseline"), (served, "service")):
                    run_id = f"bench-{measure}-{uuid.uuid4().hex[:8]}"
                    register(store, run_id, args.ranks)
                    records = make_records(run_id, args.ranks, args.steps)
                    if measure == "baseline":
                        timings.append(baseline_seconds(engine, records))
                    else:
                        timings.append(service_seconds(address, records))
        engine.dispose()
    count = args.ranks * args.steps
    kind = "postgresql" if args.db else "sqlite"
    print(f"database: {kind}, {count} rank-step records per run ({args.ranks} ranks)")
    print(f"plain Core bulk insert: {count / min(base):9,.0f} records/s")
    print(f"telemetry service:      {count / min(served):9,.0f} records/s")
    print(f"ratio service/bulk insert: {min(base) / min(served):.2f}")


if __name__ == "__main__":
    main()
