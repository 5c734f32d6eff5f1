"""ckptd's data socket: the same-host fast path of WriteFile (OpenUpload, then FinishUpload),
and of ReadFile (OpenRead, `ckptd.readpath`).

Why it exists: grpcio's Python transport moves bytes at a fraction of what a plain loopback socket
does (bench/ckptd_ingest.py), and a save is almost all bytes. So the control stays on gRPC
(authentication, authorization, the header's checks, the trailer's check, the reply) and only the
bytes of one file take a plain TCP socket, into the same `FileUpload` pipeline as WriteFile:
CRC-32C per block, the file's checksum, memory budget and backpressure, SSD write. A file joins its
save only through FinishUpload's trailer, exactly as with WriteFile's trailer. Frames are received
into buffers the memory budget lends and takes back (`MemoryBudget.buffer`), so a steady stream of
saves does not touch fresh memory.

The socket trusts nothing it did not issue: a connection must open with a ticket that OpenUpload
issued (32 random bytes) less than `ttl_s` ago and that no connection used before; it carries
exactly the bytes announced, never more. A file whose size is not known in advance (a DCP writer's
stream, `UNKNOWN_SIZE`) ends with an empty frame, and the save's byte limit bounds it. Any failure
drops the connection and stores nothing; FinishUpload reports the reason in one line.

A read's ticket (OpenRead's, kept by the `ReadPlane`) opens the same socket the other way: the
connection then receives the range's frames (`ckptd.readpath`). Tickets of both kinds are 32
random bytes from one generator, so a connection's ticket names one of them or none, never both.
"""

from __future__ import annotations

import logging
import mmap
import secrets
import socket
import struct
import threading
import time

from ckptd.manifest import FileRecord
from ckptd.names import key_of
from ckptd.readpath import TICKET_BYTES, Pieces, ReadPlane, timeval
from ckptd.reads import READ_PIECE_BYTES
from ckptd.store import CheckpointStore
from ckptd.tiers import BLOCK_BYTES
from ckptd.wire import BlockChunk
from scaletrain.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ScaletrainError,
    UserError,
)
from scaletrain.rpc import MAX_CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2

log = logging.getLogger(__name__)

# OpenUpload's size for a file whose bytes end with an empty frame.
UNKNOWN_SIZE = -1
# A frame's head: the length of its data (little-endian uint32), then the CRC-32C of each
# BLOCK_BYTES block of the data (`frame_crcs`).
FRAME_LENGTH = struct.Struct("<I")


def frame_crcs(length: int) -> struct.Struct:
    """The block CRCs of a frame of `length` bytes, as they follow its length on the wire."""
    return struct.Struct(f"<{-(-length // BLOCK_BYTES)}I")


class _Short(Exception):
    """The connection ended (or went quiet) before the bytes expected."""


def _recv_into(conn: socket.socket, buffer: bytearray | memoryview | mmap.mmap) -> None:
    """Fill `buffer`, waiting in the kernel for all of it (MSG_WAITALL on a blocking socket): a
    thread that took the GIL back after each piece the socket delivers would wait for it behind
    the hashing threads again and again."""
    view, got = memoryview(buffer), 0
    try:
        while got < len(view):
            n = conn.recv_into(view[got:], 0, socket.MSG_WAITALL)
            if n == 0:
                raise _Short
            got += n
    except OSError:  # a timeout or a reset: the bytes did not come
        raise _Short from None


class _Ticket:
    """One announced file: its header and size, and the hand-over between the connection that
    brings its bytes and the FinishUpload call that brings its trailer."""

    def __init__(self, header: checkpoint_pb2.FileHeader, size: int, ttl_s: float) -> None:
        self.header, self.size = header, size
        self.issued = time.monotonic()
        self.deadline = self.issued + ttl_s
        self.claimed = False  # a connection presented it (it is good for one)
        self.finishing = False  # a FinishUpload named it (it is good for one)
        self.connected = threading.Event()
        self.trailer: checkpoint_pb2.FileTrailer | None = None
        self.trailer_given = threading.Event()
        self.done = threading.Event()
        self.done_at = 0.0
        self.record: FileRecord | None = None
        self.error: ScaletrainError | None = None


def _expired(found: _Ticket, now: float) -> bool:
    if found.finishing:
        return False
    if not found.claimed:
        return now > found.deadline
    return found.done.is_set() and now > found.done_at + (found.deadline - found.issued)


class DataPlane:
    """The data socket of one ckptd (listening from the start) and the tickets it accepts."""

    def __init__(
        self,
        store: CheckpointStore,
        host: str,
        ttl_s: float = 30.0,
        idle_s: float = 120.0,
        max_tickets: int = 256,
    ) -> None:
        self._store = store
        self.ttl_s = ttl_s
        self._idle_s = idle_s
        self._max_tickets = max_tickets
        try:
            bare = host.strip("[]")
            family = socket.AF_INET6 if ":" in bare else socket.AF_INET
            self._listener = socket.create_server((bare, 0), family=family)
        except OSError as exc:
            raise UserError(f"cannot open ckptd's data socket on {host}: {exc}") from None
        self._listener.settimeout(1.0)  # wakes the accept loop to drop expired tickets
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._tickets: dict[bytes, _Ticket] = {}
        self._reads = ReadPlane(ttl_s, max_tickets)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ckptd-data", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self._listener.close()

    # -- the gRPC side ---------------------------------------------------------------------------

    def issue(self, header: checkpoint_pb2.FileHeader, size: int) -> bytes:
        """A ticket for `size` bytes of the file `header` names, once the header passes."""
        if size < UNKNOWN_SIZE:
            raise InvalidArgument(
                f"{header.path}: size must be >= 0, or {UNKNOWN_SIZE} when not known, got {size}"
            )
        self._store.check_header(header)
        with self._lock:
            self._drop_expired()
            if len(self._tickets) >= self._max_tickets:
                raise ResourceExhausted(
                    f"{header.path}: {self._max_tickets} uploads already wait for their bytes"
                )
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._tickets[ticket] = _Ticket(header, size, self.ttl_s)
        return ticket

    def open_read(self, request: checkpoint_pb2.OpenReadRequest) -> tuple[bytes, int, int]:
        """A ticket for a range of a committed file once the request passes ReadFile's checks
        (they raise here, in one line), and the range's offset and length."""

        def read(offset: int, length: int) -> Pieces:
            return self._store.iter_range(
                request.ref,
                request.path,
                offset,
                length,
                piece_bytes=READ_PIECE_BYTES,
                tier=request.tier,
                local_only=request.local_only,
                lend=True,  # the ReadPlane gives each piece back once it is sent
            )

        read(request.offset, request.length)  # checks the request, reads nothing
        record = self._store.catalog.file(key_of(request.ref), request.path)
        assert record is not None  # iter_range found it
        offset, length = request.offset, request.length or record.size - request.offset
        return self._reads.issue(read, offset, length, request.path), offset, length

    def run_of(self, ticket: bytes) -> list[str]:
        """The run a ticket's upload writes to (to authorize FinishUpload); none if unknown."""
        with self._lock:
            found = self._tickets.get(ticket)
        run = self._store.run_of_save(found.header.save_id) if found is not None else None
        return [run] if run is not None else []

    def finish(self, ticket: bytes, trailer: checkpoint_pb2.FileTrailer) -> FileRecord:
        """End an upload with its trailer, as WriteFile's trailer ends a stream; raise why the
        bytes were refused."""
        with self._lock:
            found = self._tickets.get(ticket)
            if found is None or found.finishing:
                raise FailedPrecondition("unknown, used or expired upload ticket")
            found.finishing = True
        path = found.header.path
        if not found.connected.wait(max(0.0, found.deadline - time.monotonic())):
            with self._lock:
                unclaimed = not found.claimed
                if unclaimed:
                    del self._tickets[ticket]
            if unclaimed:
                raise FailedPrecondition(
                    f"{path}: no data connection brought the ticket within {self.ttl_s:g}s; "
                    "nothing was stored"
                )
        found.trailer = trailer
        found.trailer_given.set()
        found.done.wait()
        with self._lock:
            self._tickets.pop(ticket, None)
        if found.error is not None:
            raise found.error
        assert found.record is not None
        return found.record

    def _drop_expired(self) -> None:
        """Forget (under the lock) tickets never presented in time, and the outcomes of uploads
        nobody asked for in time; neither holds anything else."""
        now = time.monotonic()
        for ticket in [t for t, found in self._tickets.items() if _expired(found, now)]:
            del self._tickets[ticket]

    # -- the data socket -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                with self._lock:
                    self._drop_expired()
                self._reads.drop_expired()
                continue
            except OSError:
                if self._closed.is_set():
                    return
                raise
            threading.Thread(
                target=self._serve, args=(conn, peer), name="ckptd-data-conn", daemon=True
            ).start()

    def _claim(self, ticket: bytes) -> _Ticket | None:
        with self._lock:
            found = self._tickets.get(ticket)
            if found is None or found.claimed or time.monotonic() > found.deadline:
                return None
            found.claimed = True
        found.connected.set()
        return found

    def _serve(self, conn: socket.socket, peer: object) -> None:
        with conn:
            conn.settimeout(None)  # blocking, for MSG_WAITALL; the kernel enforces idleness
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(self._idle_s))
            raw = bytearray(TICKET_BYTES)
            try:
                _recv_into(conn, raw)
            except _Short:
                return
            ticket = bytes(raw)
            read = self._reads.claim(ticket)
            if read is not None:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(self._idle_s))
                self._reads.send(conn, read, peer)
                return
            found = self._claim(ticket)
            if found is None:
                log.warning("refused a data connection from %s: unknown, used or expired ticket",
                            peer)  # fmt: skip
                return
            try:
                found.record = self._receive(conn, found)
            except ScaletrainError as exc:
                found.error = exc
            finally:
                found.done_at = time.monotonic()
                found.done.set()

    def _receive(self, conn: socket.socket, found: _Ticket) -> FileRecord:
        """Take the announced bytes into a new file of the save, then wait for the trailer."""
        path, size = found.header.path, found.size
        announced = f"the {size} bytes announced" if size != UNKNOWN_SIZE else "its end"
        with self._store.begin_file(found.header) as stream:
            head = bytearray(FRAME_LENGTH.size)
            offset = 0
            try:
                while offset < size or size == UNKNOWN_SIZE:
                    _recv_into(conn, head)
                    (length,) = FRAME_LENGTH.unpack(head)
                    if length == 0 and size == UNKNOWN_SIZE:
                        break
                    if not 0 < length <= MAX_CHUNK_BYTES:
                        raise InvalidArgument(
                            f"{path}: data frame of {length} bytes at offset {offset}; a frame "
                            f"holds 1 to {MAX_CHUNK_BYTES} bytes"
                        )
                    if size != UNKNOWN_SIZE and offset + length > size:
                        raise InvalidArgument(
                            f"{path}: data frame at offset {offset} runs past the {size} "
                            "bytes announced"
                        )
                    crc_format = frame_crcs(length)
                    crcs = bytearray(crc_format.size)
                    _recv_into(conn, crcs)
                    data = self._store.budget.buffer(length)
                    _recv_into(conn, data)
                    block_crcs = crc_format.unpack(crcs)
                    stream.write(BlockChunk(offset, memoryview(data), block_crcs))
                    offset += length
            except _Short:
                stream.upload.verified()  # a bad chunk is the better reason to report
                raise InvalidArgument(
                    f"{path}: the data connection ended after {offset} bytes, before {announced}"
                ) from None
            if not found.trailer_given.wait(self.ttl_s):
                raise FailedPrecondition(
                    f"{path}: no FinishUpload within {self.ttl_s:g}s of the data; "
                    "nothing was stored"
                )
            assert found.trailer is not None
            return stream.finish(found.trailer)
