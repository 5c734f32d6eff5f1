"""A simulated cluster: N ranks on nodes of 8 reporting every step through the real client and
service, with stragglers, a slow node, a silent data corruption and loss spikes at known ranks and
steps, so that ingest, rollups, detection and the UI can be measured and tested at cluster size
without a cluster.

A few processes each speak for many ranks (one TelemetryClient per process carries the records
of all its ranks, as columns), so 16,384 ranks take 4 processes, not 16,384. Paced, each process
reports step s at `started + s * step_s` as a real job would (and says how late it fell behind
that schedule); unpaced, as fast as it can. Records carry simulated times (step s ends at
`started + s * step_s`) either way, so the run looks like a real one to every query.

    cluster = Cluster("sim", ranks=512, steps=20)
    result = simulate("127.0.0.1:50051", cluster, processes=2)
"""

from __future__ import annotations

import math
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import Any

from scaletrain.v1 import telemetry_pb2
from telemetry.client import TelemetryClient, event, rank_step

RANKS_PER_NODE = 8
# How long reporter processes take to start (imports), which a paced run waits for.
_SPAWN_LEAD_S = 5.0
# How much slower than the others a straggler and the ranks of the slow node compute.
STRAGGLER_FACTOR = 1.6
SLOW_NODE_FACTOR = 1.5


@dataclass(frozen=True)
class Faults:
    """What goes wrong, where and when: straggler ranks and a slow node (all its ranks) from step
    `slow_from` on, one SDC (step, rank) and loss spikes (step, rank)."""

    stragglers: tuple[int, ...] = ()
    slow_node: int | None = None
    slow_from: int = 1
    sdc: tuple[int, int] | None = None
    loss_spikes: tuple[tuple[int, int], ...] = ()


def standard_faults(ranks: int, steps: int, ranks_per_node: int = RANKS_PER_NODE) -> Faults:
    """Two stragglers on different nodes, the middle node slow, an SDC and two loss spikes, all
    from the first steps on (so a short run shows every one)."""
    nodes = max(1, ranks // ranks_per_node)
    return Faults(
        stragglers=tuple(sorted({ranks // 3 + 1, (2 * ranks) // 3 + 2} - {0})),
        slow_node=nodes // 2 if nodes > 2 else None,
        slow_from=1,
        sdc=(min(steps, 5), min(ranks - 1, 5)),
        loss_spikes=((min(steps, 3), 0), (min(steps, 8), ranks - 1)),
    )


@dataclass(frozen=True)
class Cluster:
    """A simulated job: `ranks` ranks on nodes of `ranks_per_node`, `steps` steps of `step_s`."""

    run_id: str
    ranks: int
    steps: int
    step_s: float = 2.0
    ranks_per_node: int = RANKS_PER_NODE
    faults: Faults | None = None
    tokens_per_rank: int = 8192
    seed: int = 0
    fault_plan: Faults = field(init=False)

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.steps < 1 or self.ranks_per_node < 1 or not self.step_s > 0:
            raise ValueError("ranks, steps and ranks_per_node must be >= 1 and step_s > 0")
        plan = self.faults or standard_faults(self.ranks, self.steps, self.ranks_per_node)
        object.__setattr__(self, "fault_plan", plan)

    def host(self, rank: int) -> str:
        """The host of `rank`: node-0000, node-0001, ..."""
        return f"node-{rank // self.ranks_per_node:04d}"

    def slow_node_ranks(self) -> list[int]:
        node = self.fault_plan.slow_node
        if node is None:
            return []
        first = node * self.ranks_per_node
        return list(range(first, min(first + self.ranks_per_node, self.ranks)))

    def registration(self, started: float) -> telemetry_pb2.RegisterRunRequest:
        request = telemetry_pb2.RegisterRunRequest(
            run_id=self.run_id,
            name=f"simulated {self.ranks} ranks",
            world_size=self.ranks,
            model_params=8_000_000_000,
            hardware="simulated H100",
            precision="bf16",
            peak_flops=989e12,
            peak_flops_source="datasheet: simulated",
            ranks=[
                telemetry_pb2.RankInfo(rank=rank, host=self.host(rank), device=f"cuda:{rank % 8}")
                for rank in range(self.ranks)
            ],
        )
        request.started_at.FromNanoseconds(int(started * 1e9))
        return request

    def records(self, step: int, ranks: range, started: float) -> list[telemetry_pb2.RankStep]:
        """The records of `ranks` at `step`, deterministic for the cluster's seed."""
        plan = self.fault_plan
        slow = set(plan.stragglers) if step >= plan.slow_from else set()
        slow_node = set(self.slow_node_ranks()) if step >= plan.slow_from else set()
        spikes = set(plan.loss_spikes)
        base_loss = 2.0 + 8.0 / math.sqrt(step)
        ends = int((started + step * self.step_s) * 1e9)
        out = []
        for rank in ranks:
            # The same for a rank and step whichever process reports it: a cheap hash in [0, 1).
            noise = ((step * 2_654_435_761 + rank * 40_503 + self.seed) % 1009) / 1009
            compute = self.step_s * 0.6 * (1 + 0.02 * noise)
            if rank in slow:
                compute *= STRAGGLER_FACTOR
            elif rank in slow_node:
                compute *= SLOW_NODE_FACTOR
            data = 0.01 * self.step_s
            loss = base_loss + 0.01 * noise
            if (step, rank) in spikes:
                loss *= 4
            grad_norm = 1e3 if plan.sdc == (step, rank) else 1.0 + 0.01 * noise
            record = rank_step(
                self.run_id,
                step,
                rank,
                loss=loss,
                grad_norm=grad_norm,
                tokens=self.tokens_per_rank,
                lr=3e-4,
                times={
                    "step": self.step_s,
                    "data": data,
                    "forward": compute / 3,
                    "backward": compute * 0.55,
                    "optimizer": compute * 0.12,
                    "comm_wait": max(self.step_s - compute - data, 0.0),
                    "compute": compute,
                },
                offset=(step * self.ranks * 4, step * 4, 0),
                memory_bytes=60 << 30,
                peak_memory_bytes=(70 << 30) + rank,
                param_checksum=f"{step:08x}{rank:08x}",
            )
            record.time.FromNanoseconds(ends + rank)
            out.append(record)
        return out

    def events(self, step: int, started: float) -> list[telemetry_pb2.Event]:
        """What the trainer would report at `step`: its step guard's SDC and loss spikes, and at
        the last step that the run finished."""
        plan = self.fault_plan
        found = []
        if plan.sdc is not None and plan.sdc[0] == step:
            found.append(
                event(
                    self.run_id,
                    "sdc",
                    step=step,
                    rank=plan.sdc[1],
                    message=f"rank {plan.sdc[1]} on {self.host(plan.sdc[1])}: gradients differ "
                    "on replay",
                    attributes={"stage": "gradients"},
                )
            )
        for spike_step, rank in plan.loss_spikes:
            if spike_step == step:
                found.append(
                    event(
                        self.run_id,
                        "loss_spike",
                        step=step,
                        rank=rank,
                        message=f"loss spike on rank {rank}",
                        attributes={"verdict": "data"},
                    )
                )
        if step == self.steps:
            found.append(event(self.run_id, "run_finished", step=step, message="run finished"))
        for found_event in found:
            found_event.time.FromNanoseconds(int((started + step * self.step_s) * 1e9) + 1)
        return found


@dataclass
class Result:
    """What a simulation delivered: records offered and acknowledged, lost to full queues or
    rejected, how late the paced reporters fell behind schedule, and the reporters' CPU seconds."""

    records: int = 0
    dropped: int = 0
    rejected: int = 0
    max_late_s: float = 0.0
    reporters_cpu_s: float = 0.0
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)


def simulate(
    address: str,
    cluster: Cluster,
    *,
    processes: int = 4,
    paced: bool = False,
    started: float | None = None,
) -> Result:
    """Register the cluster's run and report all its steps from `processes` processes; return
    once the service acknowledged every record (or the reporters gave up).

    Paced, the run starts (step 1 is due at `started + step_s`) a few seconds from now, once the
    reporter processes are up; `wall_s` then runs from that start to the last acknowledgement.
    """
    if started is None:
        started = time.time() + (_SPAWN_LEAD_S + 0.5 * processes if paced else 0.0)
    with TelemetryClient(address) as client:
        client.register_run(cluster.registration(started))
    context = multiprocessing.get_context("spawn")  # gRPC does not survive fork
    bounds = [cluster.ranks * p // processes for p in range(processes + 1)]
    results = context.Queue()
    workers = [
        context.Process(
            target=_report,
            args=(address, cluster, bounds[p], bounds[p + 1], p == 0, paced, started, results),
        )
        for p in range(processes)
        if bounds[p + 1] > bounds[p]
    ]
    began = time.perf_counter() + max(0.0, started - time.time()) if paced else time.perf_counter()
    for worker in workers:
        worker.start()
    total = Result()
    try:
        for _ in workers:
            part = results.get(timeout=cluster.steps * cluster.step_s + 1800)
            total.records += part["records"]
            total.dropped += part["dropped"]
            total.rejected += part["rejected"]
            total.max_late_s = max(total.max_late_s, part["max_late_s"])
            total.reporters_cpu_s += part["cpu_s"]
            if part["problem"]:
                total.problems.append(part["problem"])
    finally:
        for worker in workers:
            worker.join(timeout=60)
    total.wall_s = time.perf_counter() - began
    return total


def _report(
    address: str,
    cluster: Cluster,
    first: int,
    last: int,
    reports_events: bool,
    paced: bool,
    started: float,
    results: Any,
) -> None:
    """One reporter process: ranks first..last-1 of every step, then a flush; puts a summary."""
    ranks = range(first, last)
    # Room for a minute of this process's records; a full queue makes the reporter wait (and fall
    # behind its schedule, which `max_late_s` shows) rather than lose a record.
    per_minute = len(ranks) * max(1, math.ceil(60 / cluster.step_s))
    client = TelemetryClient(
        address, max_queue=max(per_minute, 4 * len(ranks)), batch_size=1024, when_full="wait"
    )
    cpu, late, count, problem = time.process_time(), 0.0, 0, ""
    try:
        for step in range(1, cluster.steps + 1):
            if paced:
                due = started + step * cluster.step_s
                late = max(late, time.time() - due)
                time.sleep(max(0.0, due - time.time()))
            for record in cluster.records(step, ranks, started):
                client.report_step(record)
            count += len(ranks)
            if reports_events:
                for found in cluster.events(step, started):
                    client.report_event(found)
        if not client.flush(timeout_s=1800):
            problem = f"ranks {first}-{last - 1}: not every record was acknowledged"
    finally:
        client.close(timeout_s=60)
    results.put(
        {
            "records": count,
            "dropped": client.dropped,
            "rejected": client.rejected,
            "max_late_s": late,
            "cpu_s": time.process_time() - cpu,
            "problem": problem or client.last_error or "",
        }
    )
