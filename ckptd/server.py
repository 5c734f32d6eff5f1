"""The gRPC face of ckptd: a thin servicer over CheckpointStore, and the process around it.

The servicer only translates messages; every rule lives in the store. Tier commits are reported
to telemetry from here (the store just calls an observer), because reporting is a network concern
and the store must stay usable offline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import google_crc32c
import grpc
from grpc_health.v1.health import HealthServicer

from ckptd import logs
from ckptd.catalog import Coordination
from ckptd.config import CkptdConfig
from ckptd.datapath import DataPlane
from ckptd.manifest import FileRecord
from ckptd.metrics import serve_metrics
from ckptd.retention import RetentionPolicy
from ckptd.store import CheckpointStore, TierCommit
from ckptd.wire import decode_write_request
from scaletrain.errors import InvalidArgument, maps_errors
from scaletrain.guard import Limits, Rule, caller_of
from scaletrain.names import TIER_LABELS
from scaletrain.security import ALL_RUNS, Role, ServerSecurity, TokenTable
from scaletrain.serving import HttpEndpoint, serve_until_signalled
from scaletrain.tls import call_identity
from scaletrain.transport import CHUNK_BYTES, add_health, bind, make_server
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc, telemetry_pb2
from telemetry.client import TelemetryClient, event

log = logging.getLogger(__name__)

SERVICE_NAME = "scaletrain.v1.CheckpointService"
CLUSTER_SERVICE_NAME = "scaletrain.v1.ClusterService"
# Tier-commit events queued for telemetry: a few per save, so an outage drops only the oldest.
_TELEMETRY_QUEUE = 1000


def _written(record: FileRecord) -> checkpoint_pb2.WriteFileResponse:
    """WriteFile's (and FinishUpload's) answer for a file that joined its save."""
    return checkpoint_pb2.WriteFileResponse(
        path=record.path, size=record.size, crc32c=record.crc32c
    )


class CheckpointServicer(checkpoint_pb2_grpc.CheckpointServiceServicer):
    """CheckpointService over a CheckpointStore."""

    def __init__(
        self,
        store: CheckpointStore,
        data: DataPlane | None = None,
        tokens: TokenTable | None = None,
    ) -> None:
        """`data`: the data socket of the fast path (None: off), which speaks TLS when gRPC does
        and so serves every caller gRPC serves; `tokens`: the server's tokens, whose holders are
        the callers uploads count against (None: hosts)."""
        self._store = store
        self._saves, self._member, self._reader = store.saves, store.member, store.reader
        self._data = data
        self._tokens = tokens

    @maps_errors
    def OpenSave(
        self, request: checkpoint_pb2.OpenSaveRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.OpenSaveResponse:
        retention = (
            RetentionPolicy.from_proto(request.retention) if request.HasField("retention") else None
        )
        save_id = self._saves.open_save(
            request.ref,
            request.world_size,
            dict(request.labels),
            retention,
            request.replicas,
            memory_only=request.memory_only,
        )
        coordination = self._saves.coordination(save_id)
        return checkpoint_pb2.OpenSaveResponse(
            save_id=save_id,
            epoch=coordination.epoch,
            coordinator=coordination.coordinator,
            coordinator_address=coordination.coordinator_address,
        )

    @maps_errors
    def JoinSave(
        self, request: checkpoint_pb2.JoinSaveRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.JoinSaveResponse:
        coordination = Coordination(request.epoch, request.coordinator, request.coordinator_address)
        self._member.join_save(
            request.save_id, request.ref, request.world_size, coordination, request.memory_only
        )
        return checkpoint_pb2.JoinSaveResponse(node=self._store.node)

    @maps_errors
    def WriteFile(
        self,
        request_iterator: Iterator[checkpoint_pb2.WriteFileRequest],
        context: grpc.ServicerContext,
    ) -> checkpoint_pb2.WriteFileResponse:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("WriteFile stream must start with a header")
        path = first.header.path
        with self._saves.begin_file(first.header) as stream:
            for message in request_iterator:
                part = message.WhichOneof("part")
                if part == "chunk":
                    stream.write(message.chunk)
                elif part == "trailer":
                    if next(request_iterator, None) is not None:
                        raise InvalidArgument(f"{path}: messages after the trailer")
                    return _written(stream.finish(message.trailer))
                else:
                    raise InvalidArgument(f"{path}: a second header or an empty message")
            stream.upload.verified()  # a bad chunk is the better reason to report
        raise InvalidArgument(f"{path}: stream ended without a trailer")

    @maps_errors
    def OpenUpload(
        self, request: checkpoint_pb2.OpenUploadRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.OpenUploadResponse:
        data = self._data_plane(context)
        caller, identity = caller_of(context, self._tokens), call_identity(context)
        return checkpoint_pb2.OpenUploadResponse(
            ticket=data.issue(request.header, request.size, caller, identity),
            data_port=data.port,
            ticket_ttl_s=data.ttl_s,
        )

    @maps_errors
    def FinishUpload(
        self, request: checkpoint_pb2.FinishUploadRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.WriteFileResponse:
        return _written(self._data_plane(context).finish(request.ticket, request.trailer))

    @maps_errors
    def OpenRead(
        self, request: checkpoint_pb2.OpenReadRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.OpenReadResponse:
        data = self._data_plane(context)
        if request.direct:
            elsewhere = self._reader.open_elsewhere(request)
            if elsewhere is not None:
                return elsewhere
        caller, identity = caller_of(context, self._tokens), call_identity(context)
        ticket, offset, length = data.open_read(request, caller, identity)
        return checkpoint_pb2.OpenReadResponse(
            ticket=ticket,
            data_port=data.port,
            ticket_ttl_s=data.ttl_s,
            offset=offset,
            length=length,
        )

    def _data_plane(self, context: grpc.ServicerContext) -> DataPlane:
        """The data socket, or UNIMPLEMENTED (the client then falls back to WriteFile)."""
        if self._data is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "ckptd runs without a data socket")
        assert self._data is not None  # abort raised
        return self._data

    @maps_errors
    def CommitSave(
        self, request: checkpoint_pb2.CommitSaveRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.CheckpointInfo:
        return self._saves.commit(request.save_id)

    @maps_errors
    def AbortSave(
        self, request: checkpoint_pb2.AbortSaveRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.AbortSaveResponse:
        self._saves.abort(request.save_id, request.reason)
        return checkpoint_pb2.AbortSaveResponse()

    @maps_errors
    def ListCheckpoints(
        self, request: checkpoint_pb2.ListCheckpointsRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.ListCheckpointsResponse:
        infos = self._member.checkpoints(request.run, request.include_uncommitted, request.nodes)
        return checkpoint_pb2.ListCheckpointsResponse(checkpoints=infos)

    @maps_errors
    def GetCheckpoint(
        self, request: checkpoint_pb2.GetCheckpointRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.CheckpointInfo:
        return self._member.checkpoint(
            request.ref, latest=request.latest, node_loss_safe=request.node_loss_safe
        )

    @maps_errors
    def ReadFile(
        self, request: checkpoint_pb2.ReadFileRequest, context: grpc.ServicerContext
    ) -> Iterator[checkpoint_pb2.ReadFileResponse]:
        pieces = self._reader.iter_range(
            request.ref,
            request.path,
            request.offset,
            request.length,
            piece_bytes=CHUNK_BYTES,
            tier=request.tier,
            local_only=request.local_only,
        )
        for piece in pieces:
            yield checkpoint_pb2.ReadFileResponse(
                offset=piece.offset,
                data=piece.data,
                crc32c=google_crc32c.value(piece.data),
                tier=piece.tier,
                node=piece.node,
            )

    @maps_errors
    def DeleteCheckpoint(
        self, request: checkpoint_pb2.DeleteCheckpointRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.DeleteCheckpointResponse:
        removed, pending = self._store.delete(request.ref, request.local_only)
        return checkpoint_pb2.DeleteCheckpointResponse(tiers=removed, pending=pending)

    @maps_errors
    def SetReplicaRate(
        self, request: checkpoint_pb2.SetReplicaRateRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.SetReplicaRateResponse:
        before = self._store.holding.set_replica_rate(request.bytes_per_s)
        return checkpoint_pb2.SetReplicaRateResponse(previous_bytes_per_s=before)


class ClusterServicer(checkpoint_pb2_grpc.ClusterServiceServicer):
    """ClusterService (ckptd to ckptd) over the store: the participant's half of the commit."""

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store
        self._member = store.member

    @maps_errors
    def Hello(
        self, request: checkpoint_pb2.HelloRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.HelloResponse:
        peers = self._store.peers
        problem = peers.conflict(request.node, request.instance, request.address)
        if problem and request.instance != peers.instance:
            log.error("a ckptd at %s says hello: %s", request.address, problem)
        else:
            peers.heard(request.node, request.address, request.zone)
        return checkpoint_pb2.HelloResponse(
            node=peers.node, address=peers.address, instance=peers.instance, zone=peers.zone
        )

    @maps_errors
    def Prepare(
        self, request: checkpoint_pb2.PrepareRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.PrepareResponse:
        world_size, files = self._member.prepare(
            request.save_id, request.ref, request.epoch, request.coordinator
        )
        return checkpoint_pb2.PrepareResponse(
            node=self._store.node, world_size=world_size, files=[f.to_wire() for f in files]
        )

    @maps_errors
    def Decide(
        self, request: checkpoint_pb2.DecideRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.DecideResponse:
        self._member.decide(request)
        return checkpoint_pb2.DecideResponse()

    @maps_errors
    def Outcome(
        self, request: checkpoint_pb2.OutcomeRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.OutcomeResponse:
        outcome, manifest = self._member.outcome(request.save_id, request.ref, request.epoch)
        return checkpoint_pb2.OutcomeResponse(
            outcome=outcome, manifest=manifest.to_wire() if manifest is not None else None
        )

    @maps_errors
    def Catalog(
        self, request: checkpoint_pb2.CatalogRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.CatalogResponse:
        return checkpoint_pb2.CatalogResponse(
            node=self._store.node,
            entries=self._member.catalog_entries(request.run),
            latest_safe=self._member.latest_safe_steps(request.run),
            policies=self._member.policies(request.run),
        )

    @maps_errors
    def OfferReplica(
        self, request: checkpoint_pb2.OfferReplicaRequest, context: grpc.ServicerContext
    ) -> checkpoint_pb2.OfferReplicaResponse:
        queued = self._store.holding.offer_replica(request.ref, request.owner, request.sender)
        return checkpoint_pb2.OfferReplicaResponse(queued=queued)


class PeerSync:
    """Resolves in-doubt saves and learns missed commits from the peers, every few seconds."""

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-peers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self._store.config.cluster.sync_interval_s
        while True:
            try:
                self._store.peers.greet(strict=False)
                self._store.member.sync_with_peers()
            except Exception:  # a round that fails is tried again next time
                log.exception("syncing with the peers failed")
            if self._stop.wait(interval):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10.0)


def access_rules(store: CheckpointStore, data: DataPlane | None = None) -> dict[str, Rule]:
    """Who may call what: reading needs a reader's grant on the run, saving a trainer's, deleting
    an admin's. Writes to an open save are checked against the run the save was opened for (an
    upload's ticket, against the run of the save it was issued for)."""

    def of_save(save_id: str) -> list[str]:
        run = store.saves.run_of_save(save_id)
        return [run] if run is not None else []  # an unknown save: NOT_FOUND tells no secret

    def write_file(message: checkpoint_pb2.WriteFileRequest) -> list[str]:
        return of_save(message.header.save_id) if message.WhichOneof("part") == "header" else []

    rules = {
        "OpenSave": Rule(Role.TRAINER, lambda m: [m.ref.run]),
        "WriteFile": Rule(Role.TRAINER, write_file),
        "OpenUpload": Rule(Role.TRAINER, lambda m: of_save(m.header.save_id)),
        "FinishUpload": Rule(Role.TRAINER, lambda m: data.run_of(m.ticket) if data else []),
        "CommitSave": Rule(Role.TRAINER, lambda m: of_save(m.save_id)),
        "AbortSave": Rule(Role.TRAINER, lambda m: of_save(m.save_id)),
        "ListCheckpoints": Rule(Role.READER, lambda m: [m.run or ALL_RUNS]),
        "GetCheckpoint": Rule(Role.READER, lambda m: [m.ref.run]),
        "ReadFile": Rule(Role.READER, lambda m: [m.ref.run]),
        "OpenRead": Rule(Role.READER, lambda m: [m.ref.run]),
        "DeleteCheckpoint": Rule(Role.ADMIN, lambda m: [m.ref.run]),
        "JoinSave": Rule(Role.TRAINER, lambda m: [m.ref.run]),
        "SetReplicaRate": Rule(Role.ADMIN, lambda m: [ALL_RUNS]),
    }
    # Peers: a ckptd's own service token (a trainer's grant on every run) may vote and decide.
    cluster = {
        "Hello": Rule(Role.READER, lambda m: [ALL_RUNS]),
        "Prepare": Rule(Role.TRAINER, lambda m: [m.ref.run]),
        "Decide": Rule(Role.TRAINER, lambda m: [m.ref.run]),
        "Outcome": Rule(Role.READER, lambda m: [m.ref.run]),
        "Catalog": Rule(Role.READER, lambda m: [m.run or ALL_RUNS]),
        "OfferReplica": Rule(Role.TRAINER, lambda m: [m.ref.run]),
    }
    return {f"/{SERVICE_NAME}/{method}": rule for method, rule in rules.items()} | {
        f"/{CLUSTER_SERVICE_NAME}/{method}": rule for method, rule in cluster.items()
    }


def tier_commit_event(commit: TierCommit) -> telemetry_pb2.Event:
    """The telemetry event of a checkpoint committed on a tier, or of a copy found damaged there."""
    copy = f" (a copy of {commit.replica_of}'s part)" if commit.replica_of else ""
    where = f"{TIER_LABELS[commit.tier]} of {commit.node}{copy}"
    if commit.failed:
        kind = "checkpoint_failed"
        message = f"damaged copy on {where}: {commit.failed}; reads use the next copy"
    else:
        kind, message = "checkpoint_committed", f"checkpoint committed on {where}"
    return event(
        commit.run,
        kind,
        step=commit.step,
        message=message,
        tier=commit.tier,
        bytes=commit.bytes,
        seconds=commit.seconds,
        node=commit.node,
        replica_of=commit.replica_of,
    )


class RunningCkptd:
    """A started ckptd: its address, its store, and how to stop it."""

    def __init__(
        self,
        server: grpc.Server,
        health: HealthServicer,
        store: CheckpointStore,
        telemetry: TelemetryClient | None,
        host: str,
        port: int,
        metrics: HttpEndpoint | None = None,
        data: DataPlane | None = None,
    ) -> None:
        self.address = f"{host}:{port}"
        self.port = port
        self.store = store
        self.health = health
        self._server = server
        self._telemetry = telemetry
        self._metrics = metrics
        self.data = data
        # Talks to the peers in the background, once they greeted this ckptd (None: no peers).
        self.sync: PeerSync | None = None
        self.metrics_port = metrics.port if metrics is not None else None

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, let calls in flight (and an S3 upload) finish within `grace`."""
        if self.sync is not None:
            self.sync.close()
        self._server.stop(grace).wait()
        self.store.peers.close()
        if self.data is not None:
            self.data.close()
        if self._metrics is not None:
            self._metrics.stop()
        self.store.close(timeout_s=grace)
        if self._telemetry is not None:
            self._telemetry.close(timeout_s=grace)


def start(config: CkptdConfig) -> RunningCkptd:
    """Open the store on `config.data_dir` and serve it on `config.listen` (port 0: any free)."""
    # Tier commits go to telemetry best effort: a slow or absent service costs a save nothing
    # (a full queue drops the oldest events, counted and logged).
    telemetry = (
        TelemetryClient(config.telemetry, max_queue=_TELEMETRY_QUEUE) if config.telemetry else None
    )
    try:
        store = CheckpointStore(
            config,
            on_tier_commit=None
            if telemetry is None
            else lambda commit: telemetry.report_event(tier_commit_event(commit)),
        )
    except BaseException:
        if telemetry is not None:
            telemetry.close(0)
        raise
    security = config.security if config.security is not None else ServerSecurity.from_env()
    host = config.listen.rsplit(":", 1)[0]
    data: DataPlane | None = None
    metrics: HttpEndpoint | None = None
    try:
        if config.data_socket:
            # Beside gRPC, on its host and with its TLS: a plaintext one is on loopback unless
            # plaintext is allowed, as `bind` refuses gRPC in plaintext anywhere else.
            data = DataPlane(store, host, ttl_s=config.upload_ticket_ttl_s,
                             limits=config.limits, security=security)  # fmt: skip
        limits = Limits(
            calls_per_client=config.limits.calls_per_client, log_every_s=config.limits.log_every_s
        )
        server = make_server(policy=access_rules(store, data), security=security, limits=limits)
        servicer = CheckpointServicer(store, data, security.tokens)
        checkpoint_pb2_grpc.add_CheckpointServiceServicer_to_server(servicer, server)
        # WriteFile again, with a deserializer that hands chunk bytes over as views (ckptd.wire).
        server.add_registered_method_handlers(
            SERVICE_NAME,
            {
                "WriteFile": grpc.stream_unary_rpc_method_handler(
                    servicer.WriteFile,
                    request_deserializer=decode_write_request,
                    response_serializer=checkpoint_pb2.WriteFileResponse.SerializeToString,
                )
            },
        )
        checkpoint_pb2_grpc.add_ClusterServiceServicer_to_server(ClusterServicer(store), server)
        health = add_health(server, SERVICE_NAME)
        port = bind(server, config.listen)
        store.peers.set_address(f"{host}:{port}")
        if config.metrics_listen is not None:
            metrics = serve_metrics(store.metrics, config.metrics_listen)
    except BaseException:
        if data is not None:
            data.close()
        store.close(0)
        if telemetry is not None:
            telemetry.close(0)
        raise
    server.start()
    running = RunningCkptd(server, health, store, telemetry, host, port, metrics, data)
    if store.peers.enabled:
        try:
            # Serving already, so that a peer list naming this very process gets its answer.
            store.peers.greet(strict=True)  # a peer list naming this node, a node name in use
        except BaseException:
            running.stop(0)
            raise
        running.sync = PeerSync(store)
    return running


def serve(config: CkptdConfig, grace: float = 5.0, log_format: str = "json") -> None:
    """Run ckptd in the foreground until SIGTERM or SIGINT, then stop cleanly."""
    logs.configure(log_format)
    running = start(config)
    line = f"ckptd listening on {running.address}"
    if running.metrics_port is not None:
        line += f", metrics on port {running.metrics_port}"
    log.info(
        "ckptd started on %s",
        running.address,
        extra={"data_dir": str(config.data_dir), "s3": config.s3 is not None},
    )
    serve_until_signalled(running, [line], name="ckptd", grace=grace, log=log)
