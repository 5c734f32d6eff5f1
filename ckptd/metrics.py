"""Prometheus metrics of one ckptd: bytes and seconds per tier, queue depth, failures, the
reachability of its peers, the time each phase of a cluster-wide commit takes, and the replicas
it holds and still owes.

Each store has its own registry (several stores can live in one test process), served over HTTP
by `serve_metrics` when ckptd runs with --metrics HOST:PORT. Names follow Prometheus conventions:
counters end in `_total`, units are bytes and seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from scaletrain.names import TIER_LABELS
from scaletrain.serving import HttpEndpoint, serve_http

_SECONDS_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The metric families of ckptd; labels: tier (memory|SSD|S3), op (write|read|delete)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.bytes = Counter(
            "ckptd_tier_bytes",
            "Bytes moved per tier and operation",
            ["tier", "op"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "ckptd_tier_seconds",
            "Seconds per tier operation (a file write, a commit, an upload)",
            ["tier", "op"],
            buckets=_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.failures = Counter(
            "ckptd_failures",
            "Failed tier operations and damaged copies found",
            ["tier", "op"],
            registry=self.registry,
        )
        self.commits = Counter(
            "ckptd_commits", "Checkpoints committed per tier", ["tier"], registry=self.registry
        )
        self.queue_depth = Gauge(
            "ckptd_s3_queue_depth",
            "S3 jobs (uploads, removals) waiting or running",
            registry=self.registry,
        )
        self.memory_used = Gauge(
            "ckptd_memory_used_bytes",
            "Memory budget in use (memory tier plus data in flight)",
            registry=self.registry,
        )
        self.memory_budget = Gauge(
            "ckptd_memory_budget_bytes", "Memory budget", registry=self.registry
        )
        self.open_saves = Gauge("ckptd_open_saves", "Saves in progress", registry=self.registry)
        self.peer_reachable = Gauge(
            "ckptd_peer_reachable",
            "1 if the peer answered the last time it was asked",
            ["peer"],
            registry=self.registry,
        )
        self.commit_phase = Histogram(
            "ckptd_commit_phase_seconds",
            "Seconds of each phase of a commit: local (own part durable), prepare (every "
            "peer's vote), decide (own marker, the decision), notify (peers told)",
            ["phase"],
            buckets=_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.replication_lag = Gauge(
            "ckptd_replication_lag_seconds",
            "Age of the oldest committed part this node should hold a copy of and does not "
            "yet (0: every copy it owes is made)",
            registry=self.registry,
        )
        self.refused_connections = Counter(
            "ckptd_refused_connections",
            "Data socket connections dropped, by reason: bad_ticket (unknown, used or expired), "
            "no_ticket (none within --ticket-wait-s, or closed first), evicted (the oldest "
            "waiting for a ticket, past the waiting limit), bad_frame, cut (closed or silent "
            "mid-upload), over_limit (bytes in flight past a share for too long), tls (a "
            "failed TLS handshake, or TLS to a plaintext socket), identity (mutual TLS: the "
            "certificate of another client than the ticket's)",
            ["reason"],
            registry=self.registry,
        )
        self.refused_uploads = Counter(
            "ckptd_refused_uploads",
            "OpenUpload calls refused for a full share, by scope: caller, run, node",
            ["scope"],
            registry=self.registry,
        )
        self.refused_reads = Counter(
            "ckptd_refused_reads",
            "OpenRead calls refused for a full share, by scope: caller, run, node",
            ["scope"],
            registry=self.registry,
        )
        self.replica_bytes = Gauge(
            "ckptd_replica_bytes",
            "Bytes of other nodes' parts this node holds, per tier",
            ["tier"],
            registry=self.registry,
        )

    def watch(
        self,
        queue_depth: Callable[[], int],
        memory_used: Callable[[], int],
        memory_budget: int,
        open_saves: Callable[[], int],
    ) -> None:
        """Read the gauges from live state at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.memory_used.set_function(memory_used)
        self.memory_budget.set(memory_budget)
        self.open_saves.set_function(open_saves)

    @contextmanager
    def timed(self, tier: int, op: str, nbytes: int = 0) -> Iterator[None]:
        """Count `nbytes` and the seconds of the block; a raising block counts as a failure."""
        name = TIER_LABELS[tier]
        started = perf_counter()
        try:
            yield
        except BaseException:
            self.failures.labels(name, op).inc()
            raise
        self.seconds.labels(name, op).observe(perf_counter() - started)
        if nbytes:
            self.bytes.labels(name, op).inc(nbytes)

    def failed(self, tier: int, op: str) -> None:
        self.failures.labels(TIER_LABELS[tier], op).inc()


def serve_metrics(metrics: Metrics, listen: str) -> HttpEndpoint:
    """Serve /metrics on `listen` (HOST:PORT, port 0 picks one); UserError in one line when the
    address is malformed or cannot be bound."""
    registry = metrics.registry
    return serve_http(listen, lambda host, port: start_http_server(port, host, registry))
