"""How close does the telemetry service's ingest of rank-step records come to a plain bulk insert?

Builds the same rank-step records of a run of R ranks and S steps, then in one command, on the same
database, best of a few runs each:
  (1) baseline: one plain SQLAlchemy Core bulk insert (`INSERT` executemany, one transaction) of the
      rows those records map to, built before the clock starts;
  (2) the service: a `scaletrain telemetry` process on loopback, fed in one of two ways:
      --senders clients (default): one process per rank with its own TelemetryClient (as the
        trainer's ranks do), clocked from the moment every rank starts reporting until every
        client's `flush` returns, i.e. until the service has stored and acknowledged every record;
        on a small machine the ranks' processes compete with the service for the same cores;
      --senders prebuilt: the batches the clients would send (columns of 256 records), built
        before the clock starts like the baseline's rows, streamed by one thread per rank from
        this process: the service's own ingest rate.
It prints both rates and their ratio. Each measurement writes a run of its own into the same tables.
On a shared machine the wall-clock ratio moves with other processes' load, so the command also
prints CPU seconds per record: of the baseline's process, and of the service's process (on Linux),
which do not depend on what else runs (a PostgreSQL server's own work is in neither).

    .venv/bin/python bench/telemetry_ingest.py                       # SQLite in a temporary dir
    .venv/bin/python bench/telemetry_ingest.py --db postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, insert

from scaletrain.app.stack import free_port
from scaletrain.transport import make_channel, wait_until_healthy
from scaletrain.v1 import telemetry_pb2, telemetry_pb2_grpc
from telemetry.client import BATCHES_PER_CALL, TelemetryClient, rank_step
from telemetry.columns import columns_of
from telemetry.db import connect, migrate
from telemetry.ingest import STEP_COLUMNS, step_values
from telemetry.models import RankStep
from telemetry.store import TelemetryStore

# Records per StepBatch, as TelemetryClient sends them by default.
BATCH = 256


def make_records(run_id: str, ranks: int, steps: int) -> list[list[telemetry_pb2.RankStep]]:
    """Per rank, one realistic record per step."""
    started = time.time()
    return [rank_records(run_id, rank, steps, started) for rank in range(ranks)]


def rank_records(
    run_id: str, rank: int, steps: int, started: float
) -> list[telemetry_pb2.RankStep]:
    """One rank's realistic records (every field the trainer fills), stamped as a run of 0.25 s
    steps that began at `started` would stamp them."""
    phases = {"step": 0.25, "data": 0.01, "forward": 0.08, "backward": 0.12, "optimizer": 0.03}
    records = []
    for step in range(1, steps + 1):
        record = rank_step(
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
        record.time.FromNanoseconds(int((started + 0.25 * step) * 1e9) + rank)
        records.append(record)
    return records


def register(store: TelemetryStore, run_id: str, ranks: int) -> None:
    store.register_run(telemetry_pb2.RegisterRunRequest(run_id=run_id, world_size=ranks))


def baseline_seconds(
    engine: Engine, records: list[list[telemetry_pb2.RankStep]]
) -> tuple[float, float]:
    """(wall, CPU) seconds of one Core executemany of the rows, built before the clock starts."""
    rows = [
        dict(zip(STEP_COLUMNS, step_values(0, record), strict=True))
        for per_rank in records
        for record in per_rank
    ]
    started, cpu = time.perf_counter(), time.process_time()
    with engine.begin() as connection:
        connection.execute(insert(RankStep), rows)
    return time.perf_counter() - started, time.process_time() - cpu


def service_seconds(
    address: str, service_pid: int, run_id: str, ranks: int, steps: int
) -> tuple[float, float, float]:
    """(wall seconds, service CPU seconds, clients' CPU seconds): every rank's process reports all
    its records through its client; the clock runs from the moment all of them start until every
    one has its records acknowledged."""
    context = multiprocessing.get_context("spawn")  # gRPC does not survive fork
    ready = context.Barrier(ranks + 1)
    go = context.Event()
    results = context.Queue()
    processes = [
        context.Process(target=report_rank, args=(address, run_id, rank, steps, ready, go, results))
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    try:
        ready.wait(timeout=300)
        started, cpu = time.perf_counter(), cpu_seconds(service_pid)
        go.set()
        outcomes = [results.get(timeout=600) for _ in processes]
        elapsed, cpu = time.perf_counter() - started, cpu_seconds(service_pid) - cpu
    finally:
        for process in processes:
            process.join(timeout=30)
    problems = [outcome for outcome in outcomes if isinstance(outcome, str)]
    if problems:
        raise SystemExit("; ".join(problems))
    return elapsed, cpu, sum(outcomes)


def prebuilt_seconds(
    address: str, service_pid: int, run_id: str, ranks: int, steps: int
) -> tuple[float, float, float]:
    """(wall seconds, service CPU seconds, 0.0): one thread per rank streams that rank's batches
    exactly as its client would (columns of BATCH records, BATCHES_PER_CALL per call)."""
    started_at = time.time()
    calls = [
        [
            [
                telemetry_pb2.StepBatch(columns=columns_of(records[start : start + BATCH]))
                for start in range(first, min(first + BATCH * BATCHES_PER_CALL, steps), BATCH)
            ]
            for first in range(0, steps, BATCH * BATCHES_PER_CALL)
        ]
        for records in (rank_records(run_id, r, steps, started_at) for r in range(ranks))
    ]
    accepted: list[int] = []
    with make_channel(address) as channel:
        stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)

        def send(rank_calls: list[list[telemetry_pb2.StepBatch]]) -> None:
            for batches in rank_calls:
                accepted.append(stub.ReportSteps(iter(batches), timeout=600).accepted)

        senders = [threading.Thread(target=send, args=(rank_calls,)) for rank_calls in calls]
        started, cpu = time.perf_counter(), cpu_seconds(service_pid)
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        elapsed, cpu = time.perf_counter() - started, cpu_seconds(service_pid) - cpu
    if sum(accepted) != ranks * steps:
        raise SystemExit(f"the service accepted {sum(accepted)} of {ranks * steps} records")
    return elapsed, cpu, 0.0


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used: Linux's /proc; NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report_rank(
    address: str,
    run_id: str,
    rank: int,
    steps: int,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    """One rank: build its records, wait for the start, report them all, wait for delivery; put
    the CPU seconds that took (or what went wrong)."""
    records = rank_records(run_id, rank, steps, time.time())
    client = TelemetryClient(address, max_queue=steps + 1)
    ready.wait()
    go.wait()
    cpu = time.process_time()
    for record in records:
        client.report_step(record)
    delivered = client.flush(timeout_s=600)
    cpu = time.process_time() - cpu
    lost = client.dropped + client.rejected
    client.close(timeout_s=5)
    results.put(
        cpu if delivered and not lost else f"rank {rank}: delivered={delivered}, lost {lost}"
    )


@contextlib.contextmanager
def service(db_url: str) -> Iterator[tuple[str, int]]:
    """`scaletrain telemetry` as its own process, as deployed; yields its address and pid."""
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "telemetry", "--listen", address, "--db", db_url],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until_healthy(address, timeout_s=60)
        yield address, process.pid
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
    parser.add_argument(
        "--senders",
        choices=("clients", "prebuilt"),
        default="clients",
        help="one TelemetryClient process per rank, or prebuilt batches (see above)",
    )
    args = parser.parse_args()
    with database(args.db) as url:
        engine = connect(url)
        migrate(engine)
        store = TelemetryStore(engine)
        base: list[tuple[float, float]] = []
        served: list[tuple[float, float, float]] = []
        with service(url) as (address, pid):
            for _ in range(args.runs):
                for timings, measure in ((base, "baseline"), (served, "service")):
                    run_id = f"bench-{measure}-{uuid.uuid4().hex[:8]}"
                    register(store, run_id, args.ranks)
                    if measure == "baseline":
                        records = make_records(run_id, args.ranks, args.steps)
                        timings.append(baseline_seconds(engine, records))
                    else:
                        measure_service = (
                            service_seconds if args.senders == "clients" else prebuilt_seconds
                        )
                        timings.append(
                            measure_service(address, pid, run_id, args.ranks, args.steps)
                        )
        engine.dispose()
    count = args.ranks * args.steps
    kind = "postgresql" if args.db else "sqlite"
    base_wall, base_cpu = min(wall for wall, _ in base), min(cpu for _, cpu in base)
    served_wall = min(wall for wall, _, _ in served)
    served_cpu = min(cpu for _, cpu, _ in served)
    clients_cpu = min(cpu for _, _, cpu in served)
    print(
        f"database: {kind}, {count} rank-step records per run ({args.ranks} ranks), "
        f"senders: {args.senders}"
    )
    print(
        f"plain Core bulk insert: {count / base_wall:9,.0f} records/s, "
        f"{base_cpu / count * 1e6:5.1f} us CPU/record"
    )
    print(
        f"telemetry service:      {count / served_wall:9,.0f} records/s, "
        f"{served_cpu / count * 1e6:5.1f} us CPU/record in the service, "
        f"{clients_cpu / count * 1e6:5.1f} in the ranks' clients"
    )
    print(
        f"ratio service/bulk insert: {base_wall / served_wall:.2f} (wall clock), "
        f"{base_cpu / served_cpu:.2f} (CPU time)"
    )


if __name__ == "__main__":
    main()
