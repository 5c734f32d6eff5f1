"""CkptdClient: readable calls to a ckptd over gRPC, for the trainer's DCP writer and reader.

It hides the wire protocol: files go out as CRC-32C'd pieces and a trailer with the size and the
file's checksum (`ckptd.manifest.file_crc32c`), over ckptd's data socket when it offers one to
this client (the fast path), else through WriteFile (`ckptd.upload`); byte ranges come back
verified chunk by chunk, over the same data socket when it is offered (`ckptd.readpath`), else
through ReadFile. Failures arrive as
`scaletrain.errors` exceptions with one-line messages, so callers handle NotFound or DataLoss,
not gRPC status codes.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

import google_crc32c
import grpc

from ckptd.datapath import UNKNOWN_SIZE
from ckptd.readpath import RangeConnection, data_connection, open_range, source_label
from ckptd.upload import Bytes, FileWriter, RpcFile, SocketFile
from ckptd.wire import encode_write_request
from scaletrain.errors import DataLoss, ScaletrainError, Unavailable, error_from_rpc
from scaletrain.security import ClientSecurity
from scaletrain.tls import client_context
from scaletrain.transport import DEFAULT_TIMEOUT_S, make_channel
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

# "0" turns the fast path off: every file goes through WriteFile, every read through ReadFile.
FAST_PATH_ENV = "SCALETRAIN_CKPTD_FAST_PATH"
_log = logging.getLogger(__name__)
# A stream's deadline grows with the bytes it carries, assuming at least this throughput.
_MIN_BYTES_PER_S = 8 << 20


def _stream_timeout(nbytes: int) -> float:
    return DEFAULT_TIMEOUT_S + nbytes / _MIN_BYTES_PER_S


class CkptdClient:
    """A connection to one ckptd. Thread-safe; close it (or use `with`) when done."""

    def __init__(
        self, address: str, security: ClientSecurity | None = None, fast_path: bool | None = None
    ) -> None:
        """`security` (TLS and token) defaults to the environment's (ClientSecurity.from_env).

        `fast_path` (default: on unless $SCALETRAIN_CKPTD_FAST_PATH is "0") moves the bytes of
        files (saved and read) over ckptd's data socket; it turns itself off for good when ckptd
        does not offer it to this client, and they then go through WriteFile and ReadFile.
        """
        self.address = address
        if fast_path is None:
            fast_path = os.environ.get(FAST_PATH_ENV) != "0"
        self.fast_path = fast_path
        # Bytes read so far per copy that served them ("memory@node0", "S3"): what a restore
        # reports it used.
        self.served: Counter[str] = Counter()
        security = security if security is not None else ClientSecurity.from_env()
        self._channel = make_channel(address, security)
        # The data socket speaks TLS when gRPC does, with the same files.
        self._tls = client_context(security.tls) if security.tls is not None else None
        self._stub = checkpoint_pb2_grpc.CheckpointServiceStub(self._channel)
        # WriteFile with a serializer that puts chunk bytes on the wire in one copy (ckptd.wire).
        self._write_file = self._channel.stream_unary(
            "/scaletrain.v1.CheckpointService/WriteFile",
            request_serializer=encode_write_request,
            response_deserializer=checkpoint_pb2.WriteFileResponse.FromString,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CkptdClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _error(self, exc: grpc.RpcError, what: str) -> ScaletrainError:
        return error_from_rpc(exc, f"{what} (ckptd at {self.address})")

    # -- save ------------------------------------------------------------------------------------

    def open_save(
        self,
        run: str,
        step: int,
        world_size: int,
        labels: Mapping[str, str] | None = None,
        retention: checkpoint_pb2.RetentionPolicy | None = None,
        replicas: int = 0,
        memory_only: bool = False,
    ) -> checkpoint_pb2.OpenSaveResponse:
        """Start a save of (run, step) written by `world_size` ranks: its save id, epoch and
        coordinator, which every rank passes to `join_save` on its own node's ckptd.

        `retention` and `replicas` (R), if given, become the run's from now on. `memory_only`:
        a checkpoint kept in memory only (OpenSaveRequest.memory_only).
        """
        request = checkpoint_pb2.OpenSaveRequest(
            ref=checkpoint_pb2.CheckpointRef(run=run, step=step),
            world_size=world_size,
            labels=dict(labels or {}),
            retention=retention,
            replicas=replicas,
            memory_only=memory_only,
        )
        try:
            return self._stub.OpenSave(request, timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._error(exc, f"open save {run}/{step}") from None

    def join_save(
        self,
        opened: checkpoint_pb2.OpenSaveResponse,
        run: str,
        step: int,
        world_size: int,
        memory_only: bool = False,
    ) -> str:
        """Make this ckptd take a rank's files of a save the coordinator opened (on this node or
        another), a memory-only one with `memory_only`; returns the name of the node that holds
        them."""
        request = checkpoint_pb2.JoinSaveRequest(
            save_id=opened.save_id,
            ref=checkpoint_pb2.CheckpointRef(run=run, step=step),
            world_size=world_size,
            epoch=opened.epoch,
            coordinator=opened.coordinator,
            coordinator_address=opened.coordinator_address,
            memory_only=memory_only,
        )
        try:
            return self._stub.JoinSave(request, timeout=DEFAULT_TIMEOUT_S).node
        except grpc.RpcError as exc:
            raise self._error(exc, f"join save {run}/{step}") from None

    def write_file(
        self,
        save_id: str,
        path: str,
        rank: int,
        kind: int,
        data: Bytes | Iterable[Bytes],
    ) -> checkpoint_pb2.WriteFileResponse:
        """Write one file (bytes, or an iterable of buffers of any size) into an open save.

        `kind` is checkpoint_pb2.FILE_KIND_SHARD or FILE_KIND_METADATA. An exception from
        `data` propagates, and ckptd stores nothing of the file.
        """
        whole = isinstance(data, bytes | bytearray | memoryview)
        size = memoryview(data).nbytes if whole else UNKNOWN_SIZE
        with self.open_file(save_id, path, rank, kind, size) as file:
            for piece in [data] if whole else data:
                file.write(piece)
            return file.close()

    def open_file(
        self, save_id: str, path: str, rank: int, kind: int, size: int = UNKNOWN_SIZE
    ) -> FileWriter:
        """Start writing one file into an open save (`size` if known in advance): over ckptd's
        data socket when it offers it to this client, else through WriteFile."""
        header = checkpoint_pb2.FileHeader(save_id=save_id, path=path, rank=rank, kind=kind)
        what = f"write {path}"
        fast = self._socket_file(header, size, what) if self.fast_path else None
        if fast is not None:
            return fast
        timeout = _stream_timeout(size) if size != UNKNOWN_SIZE else None
        return RpcFile(
            header,
            lambda requests: self._write_file(requests, timeout=timeout),
            lambda exc: self._error(exc, what),
        )

    def _socket_file(
        self, header: checkpoint_pb2.FileHeader, size: int, what: str
    ) -> SocketFile | None:
        """The file over the data socket; None (and the fast path off) when ckptd does not
        offer it to this client or it cannot be reached."""
        request = checkpoint_pb2.OpenUploadRequest(header=header, size=size)
        try:
            opened = self._stub.OpenUpload(request, timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise self._error(exc, what) from None
            self.fast_path = False
            return None
        conn = self._data_connection(opened)
        if conn is None:
            return None

        def finish(trailer: checkpoint_pb2.FileTrailer) -> checkpoint_pb2.WriteFileResponse:
            request = checkpoint_pb2.FinishUploadRequest(ticket=opened.ticket, trailer=trailer)
            try:
                return self._stub.FinishUpload(request, timeout=_stream_timeout(trailer.size))
            except grpc.RpcError as exc:
                raise self._error(exc, what) from None

        return SocketFile(conn, opened.ticket, size, finish)

    def _data_connection(self, opened: checkpoint_pb2.OpenUploadResponse) -> socket.socket | None:
        """A connection to the data socket; None (and the fast path off) if it cannot be had
        (the ticket, never presented, expires on its own)."""
        try:
            return data_connection(
                opened.data_host or self._host, opened.data_port, DEFAULT_TIMEOUT_S, self._tls
            )
        except OSError:
            self.fast_path = False
            return None

    @property
    def _host(self) -> str:
        """The host this client reached ckptd at (where its data socket listens by default)."""
        return self.address.rsplit(":", 1)[0].strip("[]")

    def commit(self, save_id: str) -> checkpoint_pb2.CheckpointInfo:
        request = checkpoint_pb2.CommitSaveRequest(save_id=save_id)
        try:
            # Commit fsyncs the whole checkpoint: allow for big ones.
            return self._stub.CommitSave(request, timeout=10 * DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._error(exc, f"commit save {save_id}") from None

    def abort(self, save_id: str, reason: str = "") -> None:
        request = checkpoint_pb2.AbortSaveRequest(save_id=save_id, reason=reason)
        try:
            self._stub.AbortSave(request, timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._error(exc, f"abort save {save_id}") from None

    # -- query -----------------------------------------------------------------------------------

    def get(
        self, run: str, step: int | None = None, node_loss_safe: bool = False
    ) -> checkpoint_pb2.CheckpointInfo:
        """A committed checkpoint; with `step` None the newest committed one of `run` that can
        be restored in full now (with `node_loss_safe`: whose every part is on R nodes)."""
        request = checkpoint_pb2.GetCheckpointRequest(
            ref=checkpoint_pb2.CheckpointRef(run=run, step=step or 0),
            latest=step is None,
            node_loss_safe=node_loss_safe,
        )
        try:
            return self._stub.GetCheckpoint(request, timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            what = f"get latest checkpoint of {run}" if step is None else f"get {run}/{step}"
            raise self._error(exc, what) from None

    # -- read ------------------------------------------------------------------------------------

    def read_stream(
        self, run: str, step: int, path: str, offset: int = 0, length: int = 0, tier: int = 0
    ) -> Iterator[bytes]:
        """Yield the bytes of [offset, offset+length) of a file (length 0: to the end), verified.

        `tier` (common_pb2.Tier) reads only that tier's copy. Raises DataLoss if a chunk fails
        its CRC-32C or arrives out of place. Bad names and ranges raise before the first piece.
        """
        what = f"read {run}/{step}/{path}"
        ref = checkpoint_pb2.CheckpointRef(run=run, step=step)
        fast = self._open_range(ref, path, offset, length, tier, what)
        if fast is not None:
            return self._fast_pieces(fast, ref, path, tier, what)
        request = checkpoint_pb2.ReadFileRequest(
            ref=ref, path=path, offset=offset, length=length, tier=tier
        )
        return self._read_file(request, what)

    def _fast_pieces(
        self,
        fast: RangeConnection,
        ref: checkpoint_pb2.CheckpointRef,
        path: str,
        tier: int,
        what: str,
    ) -> Iterator[bytes]:
        """The pieces of `fast`; if a peer it was sent to fails midway, the rest through the
        node asked, which tries every copy in turn (S3 last)."""
        with fast:
            try:
                yield from fast.pieces()
                return
            except (DataLoss, Unavailable) as exc:
                if not fast.elsewhere:
                    raise
                _log.warning("%s from node %s failed (%s); on through ckptd", what,
                             fast.elsewhere, exc)  # fmt: skip
            finally:
                self.served.update(fast.served)
        pos, end = fast.position, fast.offset + fast.length
        rest = self._open_range(ref, path, pos, end - pos, tier, what, direct=False)
        if rest is not None:
            yield from self._fast_pieces(rest, ref, path, tier, what)
        else:
            request = checkpoint_pb2.ReadFileRequest(
                ref=ref, path=path, offset=pos, length=end - pos, tier=tier
            )
            yield from self._read_file(request, what)

    def _read_file(self, request: checkpoint_pb2.ReadFileRequest, what: str) -> Iterator[bytes]:
        expected = request.offset
        try:
            timeout = _stream_timeout(request.length) if request.length else None
            for reply in self._stub.ReadFile(request, timeout=timeout):
                data = reply.data
                if reply.offset != expected or google_crc32c.value(data) != reply.crc32c:
                    raise DataLoss(f"{what}: chunk at offset {reply.offset} arrived damaged")
                expected += len(data)
                self.served[source_label(reply.tier, reply.node)] += len(data)
                yield data
        except grpc.RpcError as exc:
            raise self._error(exc, what) from None

    def read(
        self, run: str, step: int, path: str, offset: int = 0, length: int = 0
    ) -> bytes | bytearray:
        """The bytes of [offset, offset+length) of a file (length 0: to the end), verified; over
        the data socket they land in the buffer returned, with no copy on the way."""
        what = f"read {run}/{step}/{path}"
        ref = checkpoint_pb2.CheckpointRef(run=run, step=step)
        fast = self._open_range(ref, path, offset, length, 0, what)
        if fast is None:
            return b"".join(self.read_stream(run, step, path, offset, length))
        try:
            return self._receive(fast)
        except (DataLoss, Unavailable) as exc:
            if not fast.elsewhere:
                raise
            _log.warning("%s from node %s failed (%s); again through ckptd", what,
                         fast.elsewhere, exc)  # fmt: skip
        again = self._open_range(ref, path, offset, length, 0, what, direct=False)
        if again is None:
            return b"".join(self.read_stream(run, step, path, offset, length))
        return self._receive(again)

    def _receive(self, fast: RangeConnection) -> bytearray:
        with fast:
            buffer = bytearray(fast.length)
            try:
                fast.read_into(buffer)
            finally:
                self.served.update(fast.served)
            return buffer

    def _open_range(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        path: str,
        offset: int,
        length: int,
        tier: int,
        what: str,
        direct: bool = True,
    ) -> RangeConnection | None:
        """The range on its way over a data socket: with `direct`, a peer's when the node asked
        holds no copy (one hop); None (and the fast path off) when ckptd does not offer its data
        socket to this client or it cannot be reached."""
        if not self.fast_path:
            return None
        request = checkpoint_pb2.OpenReadRequest(
            ref=ref, path=path, offset=offset, length=length, tier=tier, direct=direct
        )
        try:
            timeout_s = _stream_timeout(0)
            fast = open_range(self._stub, request, self._host, timeout_s, what, self._tls)
            if fast is None and direct:  # perhaps the peer's socket alone was out of reach
                request.direct = False
                fast = open_range(self._stub, request, self._host, timeout_s, what, self._tls)
        except grpc.RpcError as exc:
            raise self._error(exc, what) from None
        if fast is None:
            self.fast_path = False
        return fast

    def delete(self, run: str, step: int) -> tuple[list[int], list[int]]:
        """Remove a checkpoint from every tier.

        Returns the tiers (common_pb2.Tier) it left, and those it is still leaving in the
        background (S3); it is invisible from now on either way.
        """
        request = checkpoint_pb2.DeleteCheckpointRequest(
            ref=checkpoint_pb2.CheckpointRef(run=run, step=step)
        )
        try:
            reply = self._stub.DeleteCheckpoint(request, timeout=DEFAULT_TIMEOUT_S)
            return list(reply.tiers), list(reply.pending)
        except grpc.RpcError as exc:
            raise self._error(exc, f"delete {run}/{step}") from None

    def set_replica_rate(self, bytes_s: float) -> float:
        """Have this node copy parts to its peers at `bytes_s` (0: no limit); returns the rate
        it had."""
        request = checkpoint_pb2.SetReplicaRateRequest(bytes_per_s=bytes_s)
        try:
            reply = self._stub.SetReplicaRate(request, timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._error(exc, "set the replica rate") from None
        return reply.previous_bytes_per_s

    def list(
        self, run: str = "", include_uncommitted: bool = False, nodes: bool = False
    ) -> list[checkpoint_pb2.CheckpointInfo]:
        """Checkpoints of `run` (every run if empty), oldest step first; with `nodes`, each with
        every node's part and that node's copies of it (`CheckpointInfo.parts`)."""
        request = checkpoint_pb2.ListCheckpointsRequest(
            run=run, include_uncommitted=include_uncommitted, nodes=nodes
        )
        try:
            reply = self._stub.ListCheckpoints(request, timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._error(exc, "list checkpoints") from None
        return list(reply.checkpoints)
