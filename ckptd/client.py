"""CkptdClient: readable calls to a ckptd over gRPC, for the trainer's DCP writer and reader.

It hides the wire protocol: files go out as header, CRC-32C'd chunks and a size+SHA-256 trailer,
over ckptd's data socket when it offers one to this client (the fast path, `ckptd.datapath`),
else through WriteFile; byte ranges come back verified chunk by chunk. Failures arrive as
`scaletrain.errors` exceptions with one-line messages, so callers handle NotFound or DataLoss,
not gRPC status codes.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping

import google_crc32c
import grpc

from ckptd.datapath import FRAME, timeval
from ckptd.wire import Chunk, crc32c, encode_write_request
from scaletrain.errors import DataLoss, ScaletrainError
from scaletrain.rpc import CHUNK_BYTES, DEFAULT_TIMEOUT_S, error_from_rpc, make_channel
from scaletrain.security import ClientSecurity
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

# "0" turns the fast path off: every file goes through WriteFile.
FAST_PATH_ENV = "SCALETRAIN_CKPTD_FAST_PATH"
# A stream's deadline grows with the bytes it carries, assuming at least this throughput.
_MIN_BYTES_PER_S = 8 << 20

Bytes = bytes | bytearray | memoryview


def _stream_timeout(nbytes: int) -> float:
    return DEFAULT_TIMEOUT_S + nbytes / _MIN_BYTES_PER_S


def _chunks(data: Bytes | Iterable[Bytes]) -> Iterator[memoryview]:
    """Re-cut `data` into CHUNK_BYTES pieces: big buffers are viewed in place, small writes are
    coalesced (the only copy the client makes before the wire; see `ckptd.wire`)."""
    pieces: Iterable[Bytes] = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    pending = bytearray()
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if pending:
            take = min(len(view), CHUNK_BYTES - len(pending))
            pending += view[:take]
            view = view[take:]
            if len(pending) < CHUNK_BYTES:
                continue
            yield memoryview(bytes(pending))
            pending.clear()
        while len(view) >= CHUNK_BYTES:
            yield view[:CHUNK_BYTES]
            view = view[CHUNK_BYTES:]
        pending += view
    if pending:
        yield memoryview(bytes(pending))


class CkptdClient:
    """A connection to one ckptd. Thread-safe; close it (or use `with`) when done."""

    def __init__(
        self, address: str, security: ClientSecurity | None = None, fast_path: bool | None = None
    ) -> None:
        """`security` (TLS and token) defaults to the environment's (ClientSecurity.from_env).

        `fast_path` (default: on unless $SCALETRAIN_CKPTD_FAST_PATH is "0") sends the bytes of
        files given whole over ckptd's data socket; it turns itself off for good when ckptd
        does not offer it to this client, and the files then go through WriteFile.
        """
        self.address = address
        if fast_path is None:
            fast_path = os.environ.get(FAST_PATH_ENV) != "0"
        self.fast_path = fast_path
        self._channel = make_channel(address, security)
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
    ) -> str:
        """Start a save of (run, step) written by `world_size` ranks; returns its save id.

        `retention`, if given, becomes the run's policy from now on.
        """
        request = checkpoint_pb2.OpenSaveRequest(
            ref=checkpoint_pb2.CheckpointRef(run=run, step=step),
            world_size=world_size,
            labels=dict(labels or {}),
            retention=retention,
        )
        try:
            return self._stub.OpenSave(request, timeout=DEFAULT_TIMEOUT_S).save_id
        except grpc.RpcError as exc:
            raise self._error(exc, f"open save {run}/{step}") from None

    def write_file(
        self,
        save_id: str,
        path: str,
        rank: int,
        kind: int,
        data: Bytes | Iterable[Bytes],
    ) -> checkpoint_pb2.WriteFileResponse:
        """Stream one file (bytes, or an iterable of buffers of any size) into an open save.

        `kind` is checkpoint_pb2.FILE_KIND_SHARD or FILE_KIND_METADATA.
        """
        header = checkpoint_pb2.FileHeader(save_id=save_id, path=path, rank=rank, kind=kind)
        if self.fast_path and isinstance(data, bytes | bytearray | memoryview):
            reply = self._upload(header, memoryview(data).cast("B"))
            if reply is not None:
                return reply
        failures: list[BaseException] = []

        def requests() -> Iterator[checkpoint_pb2.WriteFileRequest | Chunk]:
            yield checkpoint_pb2.WriteFileRequest(header=header)
            sha = hashlib.sha256()
            offset = 0
            try:
                for chunk in _chunks(data):
                    sha.update(chunk)
                    yield Chunk(offset, chunk, crc32c(chunk))
                    offset += len(chunk)
            except Exception as exc:  # re-raised below, after the stream ends
                failures.append(exc)
                return
            yield checkpoint_pb2.WriteFileRequest(
                trailer=checkpoint_pb2.FileTrailer(size=offset, sha256=sha.hexdigest())
            )

        timeout = _stream_timeout(len(data)) if isinstance(data, bytes | bytearray) else None
        try:
            return self._write_file(requests(), timeout=timeout)
        except grpc.RpcError as exc:
            if failures:
                raise failures[0] from None
            raise self._error(exc, f"write {path}") from None

    def _upload(
        self, header: checkpoint_pb2.FileHeader, data: memoryview
    ) -> checkpoint_pb2.WriteFileResponse | None:
        """Write a file over the data socket; None (and the fast path off) when ckptd does not
        offer it to this client. The SHA-256 is taken in a thread while the bytes go out (it is
        the slower of the two, and hashlib releases the GIL)."""
        what = f"write {header.path}"
        request = checkpoint_pb2.OpenUploadRequest(header=header, size=len(data))
        try:
            opened = self._stub.OpenUpload(request, timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.fast_path = False
                return None
            raise self._error(exc, what) from None
        host = opened.data_host or self.address.rsplit(":", 1)[0].strip("[]")
        try:
            conn = socket.create_connection((host, opened.data_port), timeout=DEFAULT_TIMEOUT_S)
        except OSError:
            self.fast_path = False  # the ticket, never presented, expires on its own
            return None
        # A frame's head is a small write after a big one: without NODELAY, Nagle holds it
        # until ckptd's delayed ACK, 40 ms a frame. Blocking sends (bounded by SO_SNDTIMEO) hand
        # a whole frame to the kernel in one call, without taking the GIL back in between.
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(None)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(_stream_timeout(0)))
        sha = hashlib.sha256()
        hasher = threading.Thread(target=sha.update, args=(data,), daemon=True)
        hasher.start()
        try:
            with conn:
                conn.sendall(opened.ticket)
                for offset in range(0, len(data), CHUNK_BYTES):
                    piece = data[offset : offset + CHUNK_BYTES]
                    conn.sendall(FRAME.pack(len(piece), crc32c(piece)))
                    conn.sendall(piece)
        except OSError:
            pass  # ckptd dropped the connection: FinishUpload says why
        hasher.join()
        trailer = checkpoint_pb2.FileTrailer(size=len(data), sha256=sha.hexdigest())
        finish = checkpoint_pb2.FinishUploadRequest(ticket=opened.ticket, trailer=trailer)
        try:
            return self._stub.FinishUpload(finish, timeout=_stream_timeout(len(data)))
        except grpc.RpcError as exc:
            raise self._error(exc, what) from None

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

    def get(self, run: str, step: int | None = None) -> checkpoint_pb2.CheckpointInfo:
        """A committed checkpoint; with `step` None the newest committed one of `run`."""
        request = checkpoint_pb2.GetCheckpointRequest(
            ref=checkpoint_pb2.CheckpointRef(run=run, step=step or 0), latest=step is None
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
        its CRC-32C or arrives out of place.
        """
        request = checkpoint_pb2.ReadFileRequest(
            ref=checkpoint_pb2.CheckpointRef(run=run, step=step),
            path=path,
            offset=offset,
            length=length,
            tier=tier,
        )
        what = f"read {run}/{step}/{path}"
        expected = offset
        try:
            timeout = _stream_timeout(length) if length else None
            for reply in self._stub.ReadFile(request, timeout=timeout):
                if reply.offset != expected or google_crc32c.value(reply.data) != reply.crc32c:
                    raise DataLoss(f"{what}: chunk at offset {reply.offset} arrived damaged")
                expected += len(reply.data)
                yield reply.data
        except grpc.RpcError as exc:
            raise self._error(exc, what) from None

    def read(self, run: str, step: int, path: str, offset: int = 0, length: int = 0) -> bytes:
        return b"".join(self.read_stream(run, step, path, offset, length))

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

    def list(
        self, run: str = "", include_uncommitted: bool = False
    ) -> list[checkpoint_pb2.CheckpointInfo]:
        """Checkpoints of `run` (every run if empty), oldest step first."""
        request = checkpoint_pb2.ListCheckpointsRequest(
            run=run, include_uncommitted=include_uncommitted
        )
        try:
            reply = self._stub.ListCheckpoints(request, timeout=DEFAULT_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._error(exc, "list checkpoints") from None
        return list(reply.checkpoints)
