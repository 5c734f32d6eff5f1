"""Writing one file into an open save in writes of any size: over ckptd's data socket (the fast
path, `ckptd.datapath`) or through WriteFile. `CkptdClient.open_file` picks one.

A DCP writer hands over a file as it serializes it: headers of a few bytes, then each tensor's
bytes as one view of its storage, and nobody knows the size until the end. Both writers cut that
stream into CHUNK_BYTES pieces the same way (`_Pieces`): whole pieces of a big write go on as
views of it, small writes are gathered in one reused buffer. The data socket sends each piece
before `write` returns, so a view never outlives the write that lent it (the storage may be a
temporary that DCP frees right after) and the socket path copies nothing before the kernel does.
WriteFile's stream is consumed by gRPC's own thread, so that writer copies each piece into the
queue it feeds that thread.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from types import TracebackType

import grpc

from ckptd.datapath import FRAME_LENGTH, UNKNOWN_SIZE, frame_crcs
from ckptd.manifest import file_crc32c
from ckptd.tiers import BLOCK_BYTES, BlockCrcs, block_crcs_of
from ckptd.wire import Chunk, crc32c
from scaletrain.errors import ScaletrainError
from scaletrain.transport import CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2

Bytes = bytes | bytearray | memoryview
Reply = checkpoint_pb2.WriteFileResponse


class _Pieces:
    """Cuts writes of any size into pieces for `emit`, which must be done with each piece when
    it returns: every piece but the last a whole number of BLOCK_BYTES blocks (as the data
    socket wants its frames) and at most CHUNK_BYTES. A big write goes on as views of itself;
    only what does not fill a block (a header, the ends of a tensor) is copied, into one reused
    buffer."""

    def __init__(self, emit: Callable[[memoryview], None]) -> None:
        self._emit = emit
        self._buffer: bytearray | None = None
        self._fill = 0

    def write(self, data: Bytes) -> None:
        view = memoryview(data).cast("B")
        if self._fill % BLOCK_BYTES:  # complete the buffer's last block first
            view = self._gather(view, BLOCK_BYTES - self._fill % BLOCK_BYTES)
        if self._fill == CHUNK_BYTES or (self._fill and len(view) >= BLOCK_BYTES):
            self.flush()
        whole = len(view) - len(view) % BLOCK_BYTES
        if whole and not self._fill:
            for start in range(0, whole, CHUNK_BYTES):
                self._emit(view[start : min(whole, start + CHUNK_BYTES)])
            view = view[whole:]
        while view:
            view = self._gather(view, CHUNK_BYTES - self._fill)
            if self._fill == CHUNK_BYTES:
                self.flush()

    def _gather(self, view: memoryview, room: int) -> memoryview:
        """Append up to `room` bytes of `view` to the buffer; returns the rest."""
        if self._buffer is None:
            self._buffer = bytearray(CHUNK_BYTES)
        take = min(len(view), room)
        self._buffer[self._fill : self._fill + take] = view[:take]
        self._fill += take
        return view[take:]

    def flush(self) -> None:
        if self._fill and self._buffer is not None:
            with memoryview(self._buffer) as buffer:
                self._emit(buffer[: self._fill])
            self._fill = 0


class FileWriter(ABC):
    """One file on its way into an open save: `write` buffers of any size, then `close` for
    WriteFile's reply. Leaving a `with` block on an exception aborts the file: ckptd stores
    nothing of it."""

    size = 0  # bytes written so far

    @abstractmethod
    def write(self, data: Bytes) -> None: ...

    @abstractmethod
    def close(self) -> Reply:
        """End the file and wait for ckptd's verdict; raises its refusal."""

    @abstractmethod
    def abort(self) -> None:
        """End the file without its trailer, so ckptd stores nothing of it."""

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self.abort()


def _send(conn: socket.socket, *buffers: Bytes) -> bool:
    """Send on the data socket; False when ckptd dropped the connection (FinishUpload says why)."""
    try:
        for buffer in buffers:
            conn.sendall(buffer)
    except OSError:
        return False
    return True


class SocketFile(FileWriter):
    """A file over the data socket: frames of a piece each, with its blocks' CRC-32Cs (from which
    the file's checksum follows), sent before `write` returns; FinishUpload ends it."""

    def __init__(
        self,
        conn: socket.socket,
        ticket: bytes,
        size: int,
        finish: Callable[[checkpoint_pb2.FileTrailer], Reply],
    ) -> None:
        self._conn, self._announced, self._finish = conn, size, finish
        self._blocks = BlockCrcs()
        self._pieces = _Pieces(self._frame)
        self._dropped = not _send(conn, ticket)

    def _frame(self, piece: memoryview) -> None:
        if self._dropped:
            return  # FinishUpload will say why ckptd dropped the connection
        crcs = block_crcs_of(piece)
        self._blocks.extend(crcs, len(piece))  # pieces start on a block (`_Pieces`)
        head = FRAME_LENGTH.pack(len(piece)) + frame_crcs(len(piece)).pack(*crcs)
        self._dropped = not _send(self._conn, head, piece)

    def write(self, data: Bytes) -> None:
        self._pieces.write(data)
        self.size += memoryview(data).nbytes

    def close(self) -> Reply:
        self._pieces.flush()
        if self._announced == UNKNOWN_SIZE and not self._dropped:
            _send(self._conn, FRAME_LENGTH.pack(0))
        self._conn.close()
        checksum = file_crc32c(self._blocks.packed())
        return self._finish(checkpoint_pb2.FileTrailer(size=self.size, crc32c=checksum))

    def abort(self) -> None:
        """Hang up short of the end, then wait (through FinishUpload, with a trailer that no file
        matches) until ckptd has dropped the file, as an aborted WriteFile waits for its reply:
        a commit right after must not find the file still being received."""
        self._conn.close()
        with contextlib.suppress(ScaletrainError):
            self._finish(checkpoint_pb2.FileTrailer(size=-1))


_ABORT = object()


class RpcFile(FileWriter):
    """A file through WriteFile, streamed by gRPC from a bounded queue (a slow ckptd slows the
    writer instead of the file piling up in memory); errors surface on the next write or close."""

    def __init__(
        self,
        header: checkpoint_pb2.FileHeader,
        call: Callable[[Iterator[checkpoint_pb2.WriteFileRequest | Chunk]], Reply],
        error: Callable[[grpc.RpcError], ScaletrainError],
    ) -> None:
        self._header, self._call, self._error_of = header, call, error
        self._queue: queue.Queue[bytes | object | None] = queue.Queue(maxsize=4)
        self._pieces = _Pieces(lambda piece: self._put(bytes(piece)))
        self._reply: Reply | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _requests(self) -> Iterator[checkpoint_pb2.WriteFileRequest | Chunk]:
        yield checkpoint_pb2.WriteFileRequest(header=self._header)
        blocks = BlockCrcs()
        offset = 0
        while (piece := self._queue.get()) is not None:
            if not isinstance(piece, bytes):
                return  # aborted: the stream ends without its trailer, ckptd stores nothing
            blocks.update(piece)
            yield Chunk(offset, memoryview(piece), crc32c(piece))
            offset += len(piece)
        checksum = file_crc32c(blocks.packed())
        yield checkpoint_pb2.WriteFileRequest(
            trailer=checkpoint_pb2.FileTrailer(size=offset, crc32c=checksum)
        )

    def _run(self) -> None:
        try:
            self._reply = self._call(self._requests())
        except grpc.RpcError as exc:
            self._error = self._error_of(exc)
        except BaseException as exc:  # raised in the writer's thread by the next write or close
            self._error = exc
        while not self._queue.empty():  # unblock a writer waiting on a full queue
            self._queue.get_nowait()

    def _put(self, item: bytes | object | None) -> None:
        while self._thread.is_alive():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, data: Bytes) -> None:
        self._raise_if_failed()
        self._pieces.write(data)
        self.size += memoryview(data).nbytes

    def close(self) -> Reply:
        self._pieces.flush()
        self._put(None)
        self._thread.join()
        self._raise_if_failed()
        assert self._reply is not None
        return self._reply

    def abort(self) -> None:
        self._put(_ABORT)
        self._thread.join()
