"""Does the telemetry service keep up with a cluster? 16,384 ranks at a 2 s step (8,192 records/s)
for 10 minutes, through the real client and service, no record dropped, memory bounded.

A `scaletrain telemetry` process (as deployed, default retention) receives a simulated cluster
(`telemetry.simulated_cluster`: nodes of 8, stragglers, a slow node, an SDC, loss spikes) from a
few reporter processes, each speaking for many ranks, paced as a real job: step s is reported at
start + s x step. In the same command, first, the baseline: one plain Core bulk insert of
`--baseline-steps` steps of the same rows into the same database (what the database takes at
most). It prints the offered and the stored rate, their ratio (1.0: kept up), how far the
reporters fell behind their schedule and how long after the last step's due time the service had
acknowledged everything, records dropped or rejected, the service's memory (RSS) after the first
minute and at its peak, every step rolled up, the findings, and the offered rate over the
baseline's (the share of the database's capacity the cluster uses).

`--unpaced` drops the schedule: the reporters send every step as fast as the service acknowledges
them (their queues full, waiting for room), so the stored rate is the most the service takes at
this cluster's shape, and its ratio to the offered rate the headroom over a 2 s step.

    nice -n 10 .venv/bin/python bench/telemetry_cluster.py --db postgresql+psycopg://postgres@127.0.0.1:5432/bench_telemetry
    .venv/bin/python bench/telemetry_cluster.py --ranks 512 --duration-s 20   # SQLite, small
    .venv/bin/python bench/telemetry_cluster.py --duration-s 120 --unpaced --db ...  # headroom
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from sqlalchemy import func, select
from telemetry_ingest import baseline_seconds, cpu_seconds, database, service

from telemetry import queries
from telemetry.db import connect, migrate
from telemetry.models import RankStep, StepRollup
from telemetry.simulated_cluster import Cluster, simulate
from telemetry.store import TelemetryStore


class MemoryWatch:
    """The RSS of a process and the machine's 1-minute load average, sampled every `every_s`
    seconds in a thread: on a shared machine the load says how much of it the run had."""

    def __init__(self, pid: int, every_s: float = 1.0) -> None:
        self.samples: list[tuple[float, int]] = []
        self.loads: list[float] = []
        self._pid, self._every_s = pid, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            for line in Path(f"/proc/{self._pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kib = int(line.split()[1])
                    self.samples.append((time.perf_counter() - self._started, kib * 1024))
            self.loads.append(float(Path("/proc/loadavg").read_text().split()[0]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def mib_after(self, seconds: float) -> float:
        later = [rss for at, rss in self.samples if at >= seconds] or [0]
        return round(later[0] / 2**20, 1)

    def peak_mib(self) -> float:
        return round(max((rss for _, rss in self.samples), default=0) / 2**20, 1)

    def load_range(self) -> str:
        """The lowest, median and highest 1-minute load average seen."""
        loads = sorted(self.loads) or [0.0]
        return f"{loads[0]:.1f} / {loads[len(loads) // 2]:.1f} / {loads[-1]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", help="PostgreSQL URL (default: SQLite in a temporary directory)")
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--step-s", type=float, default=2.0)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--processes", type=int, default=4, help="reporter processes")
    parser.add_argument("--baseline-steps", type=int, default=10)
    parser.add_argument("--unpaced", action="store_true", help="as fast as the service takes it")
    args = parser.parse_args()
    steps = max(1, round(args.duration_s / args.step_s))
    run_id = f"cluster-{args.ranks}-{int(time.time())}"
    cluster = Cluster(run_id, ranks=args.ranks, steps=steps, step_s=args.step_s)
    with database(args.db) as url:
        engine = connect(url)
        migrate(engine)
        store = TelemetryStore(engine)
        base = Cluster(f"{run_id}-baseline", ranks=args.ranks, steps=args.baseline_steps)
        store.register_run(base.registration(time.time()))
        rows = [base.records(s, range(args.ranks), time.time()) for s in range(1, base.steps + 1)]
        base_wall, _ = baseline_seconds(engine, rows)
        with service(url) as (address, pid):
            memory = MemoryWatch(pid)
            cpu = cpu_seconds(pid)
            result = simulate(address, cluster, processes=args.processes, paced=not args.unpaced)
            cpu = cpu_seconds(pid) - cpu
            memory.stop()
            with engine.connect() as connection:
                stored = connection.execute(
                    select(func.count()).where(RankStep.run_id == run_id)
                ).scalar()
                rolled = connection.execute(
                    select(func.count()).where(StepRollup.run_id == run_id)
                ).scalar()
            findings = queries.events(engine, run_id, kinds=["straggler"])
        engine.dispose()
    offered = args.ranks / args.step_s
    schedule_s = steps * args.step_s
    # Unpaced, the run takes as long as the service needs; paced, at least its schedule.
    elapsed = result.wall_s if args.unpaced else max(result.wall_s, schedule_s)
    report = {
        "database": "postgresql" if args.db else "sqlite",
        "cluster": f"{args.ranks} ranks, {steps} steps of {args.step_s} s ({schedule_s:.0f} s)",
        "offered_records_per_s": round(offered),
        "stored_records_per_s": round(stored / elapsed),
        "ratio_stored_to_offered": round(stored / elapsed / offered, 3),
        "records_offered": result.records,
        "records_stored": stored,
        "dropped": result.dropped,
        "rejected": result.rejected,
        "reporters_max_behind_schedule_s": round(result.max_late_s, 2),
        "acknowledged_after_last_due_s": round(result.wall_s - schedule_s, 2),
        "steps_rolled_up": f"{rolled} of {steps}",
        "service_cpu_us_per_record": round(cpu / max(stored, 1) * 1e6, 1),
        "service_rss_mib_after_60s": memory.mib_after(60),
        "service_rss_mib_peak": memory.peak_mib(),
        "load_average_min_median_max": memory.load_range(),
        "findings": sorted(findings["message"].str.split(" computes").str[0]),
        "baseline_bulk_insert_records_per_s": round(args.ranks * base.steps / base_wall),
        "ratio_offered_to_baseline": round(offered / (args.ranks * base.steps / base_wall), 3),
        "problems": result.problems,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
