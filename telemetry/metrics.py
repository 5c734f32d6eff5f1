"""Prometheus metrics of the runs reporting to this service, on an HTTP port of their own.

Computed at scrape time from `LiveRuns` (a custom collector, no global registry), so two services
in one process (tests) never share metrics, and a run's series disappear with it from the view.
Ratios (MFU, scores) are plain numbers between 0 and 1; times are seconds, sizes bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scaletrain.serving import HttpEndpoint, serve_http
from telemetry.columns import PHASES
from telemetry.live import LiveRuns

_RUN = ["run_id"]
_RANK = ["run_id", "rank"]


class RunCollector(Collector):
    """Yields the metric families of every run `LiveRuns` follows."""

    def __init__(self, live: LiveRuns) -> None:
        self._live = live

    def collect(self) -> Iterator[Metric]:
        runs = self._live.views()
        info = GaugeMetricFamily(
            "scaletrain_run_info",
            "A run this service receives; labels describe how its MFU is computed",
            labels=[*_RUN, "hardware", "precision", "peak_flops_source"],
        )
        gauges = _gauges(
            "scaletrain_",
            _RUN,
            step="Latest step every rank has reported",
            attempt="Restart generation of the run",
            loss="Mean loss over ranks at the latest complete step",
            grad_norm="Gradient norm at the latest complete step",
            tokens_per_second="Tokens of all ranks over the step's wall time",
            mfu="Model FLOPs utilisation at the latest complete step (0-1)",
            hfu="Hardware FLOPs utilisation, counting recomputation (0-1)",
            peak_flops="Dense peak FLOP/s of one device that MFU divides by",
        )
        records = CounterMetricFamily(
            "scaletrain_records", "Rank-step records received", labels=_RUN
        )
        events = CounterMetricFamily(
            "scaletrain_events", "Events stored, by kind", labels=[*_RUN, "kind"]
        )
        phases = GaugeMetricFamily(
            "scaletrain_rank_phase_seconds",
            "Seconds of each phase of the rank's latest complete step",
            labels=[*_RANK, "phase"],
        )
        scores = GaugeMetricFamily(
            "scaletrain_rank_straggler_score",
            "Straggler scores: relative (vs the median of the other ranks) and individual "
            "(vs the rank's own best); 1 is typical, lower is slower",
            labels=[*_RANK, "score"],
        )
        per_rank = _gauges(
            "scaletrain_rank_",
            _RANK,
            loss="The rank's loss at its latest complete step",
            memory_bytes="Accelerator memory allocated",
            peak_memory_bytes="Peak accelerator memory allocated",
            dropped_records="Records the rank's telemetry client dropped (queue full)",
        )
        for run in runs:
            labels = [run.run_id]
            info.add_metric([*labels, run.hardware, run.precision, run.peak_flops_source], 1.0)
            for name, value in (
                ("step", run.step),
                ("attempt", run.attempt),
                ("loss", run.loss),
                ("grad_norm", run.grad_norm),
                ("tokens_per_second", run.tokens_per_s),
                ("mfu", run.mfu),
                ("hfu", run.hfu),
                ("peak_flops", run.peak_flops),
            ):
                if not math.isnan(value):
                    gauges[name].add_metric(labels, value)
            records.add_metric(labels, run.records)
            for kind, count in sorted(run.events.items()):
                events.add_metric([*labels, kind], count)
            for rank, view in sorted(run.ranks.items()):
                rank_labels = [run.run_id, str(rank)]
                for phase in PHASES:
                    phases.add_metric([*rank_labels, phase], view.phases.get(phase, 0.0))
                if view.scores is not None:
                    scores.add_metric([*rank_labels, "relative"], view.scores.relative)
                    scores.add_metric([*rank_labels, "individual"], view.scores.individual)
                if not math.isnan(view.loss):
                    per_rank["loss"].add_metric(rank_labels, view.loss)
                per_rank["memory_bytes"].add_metric(rank_labels, view.memory_bytes)
                per_rank["peak_memory_bytes"].add_metric(rank_labels, view.peak_memory_bytes)
                per_rank["dropped_records"].add_metric(rank_labels, view.dropped_records)
        yield info
        yield from gauges.values()
        yield records
        yield events
        yield phases
        yield scores
        yield from per_rank.values()


def _gauges(prefix: str, labels: list[str], **docs: str) -> dict[str, GaugeMetricFamily]:
    """Gauge families named prefix + each keyword, documented by its value."""
    return {
        name: GaugeMetricFamily(f"{prefix}{name}", doc, labels=labels) for name, doc in docs.items()
    }


def serve_metrics(live: LiveRuns, listen: str) -> HttpEndpoint:
    """Serve the metrics of `live` over HTTP on `listen` (HOST:PORT, port 0 picks a free one).

    Raises UserError with one line when the address cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(live))
    return serve_http(listen, lambda host, port: start_http_server(port, host, registry))
