"""The telemetry gRPC service: unpacks requests and delegates to `TelemetryStore` and `LiveRuns`.

No rule lives here: validation, idempotence and resume points are the store's, detection and live
figures are `LiveRuns`'s, so they are the same whether a rank reports over the network or a test
calls them directly. What the detectors flag is stored as events like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1.health import HealthServicer
from sqlalchemy import Engine

from scaletrain.errors import ScaletrainError, maps_errors
from scaletrain.guard import Rule
from scaletrain.security import Role
from scaletrain.serving import HttpEndpoint, serve_until_signalled
from scaletrain.transport import add_health, bind, make_server
from scaletrain.v1 import telemetry_pb2, telemetry_pb2_grpc
from telemetry.config import TelemetryConfig
from telemetry.db import connect, migrate
from telemetry.ingest import GroupCommit
from telemetry.live import LiveRuns
from telemetry.metrics import serve_metrics
from telemetry.retention import Retention
from telemetry.rollup import StepSummary
from telemetry.store import TelemetryStore

_log = logging.getLogger(__name__)
SERVICE_NAME = "scaletrain.v1.TelemetryService"


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServiceServicer):
    """TelemetryService over a store; store errors become gRPC status codes via maps_errors."""

    def __init__(self, store: TelemetryStore, live: LiveRuns) -> None:
        self._store = store
        self._live = live
        self._batches: GroupCommit[telemetry_pb2.StepBatch, tuple[int, int]] = GroupCommit(
            self._store_batches
        )

    @maps_errors
    def RegisterRun(
        self, request: telemetry_pb2.RegisterRunRequest, context: grpc.ServicerContext
    ) -> telemetry_pb2.RegisterRunResponse:
        reply = self._store.register_run(request)
        self._store_rollups([], self._live.registered(request, reply.attempt))
        return reply

    @maps_errors
    def ReportSteps(
        self, request_iterator: Iterator[telemetry_pb2.StepBatch], context: grpc.ServicerContext
    ) -> telemetry_pb2.ReportStepsResponse:
        # Each batch is stored as it arrives (with the batches of other streams that arrived at the
        # same time): a long stream holds no lock, and a batch stored before a later one fails is
        # simply a duplicate when resent.
        accepted = duplicates = 0
        for batch in request_iterator:
            stored, repeated = self._batches.submit(batch)
            accepted += stored
            duplicates += repeated
        return telemetry_pb2.ReportStepsResponse(accepted=accepted, duplicates=duplicates)

    @maps_errors
    def ReportEvents(
        self, request: telemetry_pb2.EventBatch, context: grpc.ServicerContext
    ) -> telemetry_pb2.ReportEventsResponse:
        accepted = self._store.add_events(request.events)
        self._live.observe_events(request.events)
        return telemetry_pb2.ReportEventsResponse(accepted=accepted)

    def _store_batches(self, batches: list[telemetry_pb2.StepBatch]) -> list[tuple[int, int]]:
        """Store batches that arrived together, then let the detectors see their rows and store
        the rollups of the steps they completed."""
        results = self._store.add_step_batches(batches)
        for _, _, rows in results:
            observed = self._live.observe_steps(rows)
            self._store_rollups(observed.summaries, observed.incomplete)
            self._store_flags(observed.flags)
        return [(accepted, duplicates) for accepted, duplicates, _ in results]

    def _store_rollups(
        self, summaries: list[StepSummary], incomplete: list[tuple[str, int, int]]
    ) -> None:
        """Store rollups; best effort like the flags: a step left without one is rolled up from
        its rows when the service next starts."""
        try:
            self._store.add_rollups(summaries, incomplete)
        except ScaletrainError as exc:
            _log.warning("telemetry: could not store %d step rollups: %s", len(summaries), exc)

    def _store_flags(self, flags: list[telemetry_pb2.Event]) -> None:
        """Store what the detectors flagged; best effort: the records that raised the flags are
        stored already, and failing their report now would only get them resent."""
        if not flags:
            return
        try:
            self._store.add_events(flags)
        except ScaletrainError as exc:
            _log.warning("telemetry: could not store %d detector events: %s", len(flags), exc)
            return
        self._live.observe_events(flags)

    @maps_errors
    def GetResumePoint(
        self, request: telemetry_pb2.GetResumePointRequest, context: grpc.ServicerContext
    ) -> telemetry_pb2.ResumePoint:
        step = request.step if request.HasField("step") else None
        return self._store.resume_point(request.run_id, step)


def _step_runs(batch: telemetry_pb2.StepBatch) -> set[str]:
    return {record.run_id for record in batch.records} | set(batch.columns.run_id)


# Who may call what: reporting needs a trainer's grant on every run a message names, reading a
# resume point a reader's.
ACCESS_RULES = {
    f"/{SERVICE_NAME}/{method}": rule
    for method, rule in {
        "RegisterRun": Rule(Role.TRAINER, lambda m: [m.run_id]),
        "ReportSteps": Rule(Role.TRAINER, _step_runs),
        "ReportEvents": Rule(Role.TRAINER, lambda m: {event.run_id for event in m.events}),
        "GetResumePoint": Rule(Role.READER, lambda m: [m.run_id]),
    }.items()
}


@dataclass
class RunningTelemetry:
    """A started telemetry service; `stop` ends it and releases the database."""

    server: grpc.Server
    health: HealthServicer
    engine: Engine
    address: str
    port: int
    live: LiveRuns
    retention: Retention
    # The Prometheus endpoint, when the config asked for one.
    metrics: HttpEndpoint | None = None

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let running ones finish for `grace` seconds, then close."""
        if self.metrics is not None:
            self.metrics.stop()
        self.retention.stop()
        self.server.stop(grace).wait()
        self.engine.dispose()


def start(config: TelemetryConfig) -> RunningTelemetry:
    """Migrate the database to the current schema, roll up the steps that have rank rows and no
    rollup (a database from before rollups, steps pending when the service last stopped), start
    retention and serve on `config.listen`.

    Raises UserError (one line) when the database URL is bad or the address cannot be bound.
    """
    engine = connect(config.db_url)
    server: grpc.Server | None = None
    metrics = None
    try:
        migrate(engine)
        store = TelemetryStore(engine, partition_steps=config.partition_steps)
        store.roll_up()
        live = LiveRuns(store.run_info, store.nodes_of)
        server = make_server(policy=ACCESS_RULES, security=config.security)
        telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(
            TelemetryServicer(store, live), server
        )
        health = add_health(server, SERVICE_NAME)
        port = bind(server, config.listen)
        if config.metrics_listen is not None:
            metrics = serve_metrics(live, config.metrics_listen)
    except BaseException:
        if server is not None:
            server.stop(None)
        engine.dispose()
        raise
    server.start()
    retention = Retention(store, config.retention)
    retention.start()
    host = config.listen.rpartition(":")[0]
    return RunningTelemetry(
        server=server,
        health=health,
        engine=engine,
        address=f"{host}:{port}",
        port=port,
        live=live,
        retention=retention,
        metrics=metrics,
    )


def serve(config: TelemetryConfig) -> None:
    """Run the service in the foreground until SIGTERM or SIGINT, then stop cleanly.

    Prints one line, `telemetry listening on HOST:PORT`, once it accepts calls, so a parent
    process (or a person) can learn the port that `listen` with port 0 picked; with a metrics
    endpoint, a second line `metrics on http://HOST:PORT/metrics`.
    """
    running = start(config)
    lines = [f"telemetry listening on {running.address}"]
    if running.metrics is not None:
        lines.append(f"metrics on http://{running.metrics.address}/metrics")
    serve_until_signalled(running, lines, name="telemetry", grace=5.0, log=_log)
