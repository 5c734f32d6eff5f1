"""The read side of ckptd's data socket: byte ranges of committed files over TCP (OpenRead).

Why it exists: a restore is almost all bytes, and grpcio's Python transport carries ReadFile's
chunks at a fraction of what a loopback socket does (bench/ckptd_restore.py). So the control stays
on gRPC (authentication, authorization, the request's checks, which fail at OpenRead in one line)
and only the bytes take the data socket that uploads use (`ckptd.datapath`), as frames of the
pieces that `Reader.iter_range` yields, each already verified against the file's block CRCs.
Each frame carries its tier and offset and the CRC-32C of each BLOCK_BYTES block of its bytes:
the very CRCs the file was stored with (`BLOCKS`), so ckptd computes no CRC of its own to send
and the client checks every byte against what the writer sent, end to end. A frame that does not
start and end on block boundaries (the ends of an unaligned range) carries one CRC-32C of its
bytes instead (`DATA`).

Both ends live here, so that the wire format has one definition: `ReadPlane` for ckptd's data
socket (`ckptd.datapath.DataPlane` hands it the connections that bring a read's ticket), and
`open_range` and `RangeConnection` for its clients (a trainer's `CkptdClient`, and a ckptd reading
a peer's part, `ckptd.cluster.read_from_peer`). Nothing here imports the store: the cluster
module, which the store imports, reads through it too.

A connection is plain TCP, or TLS when the process has TLS on (`scaletrain.tls`). An SSL socket
takes no MSG_WAITALL and no sendmsg, so both ends move its bytes a record at a time (`receive`,
`_send`) with Python's timeouts (`set_timeout`); a plain one keeps the kernel's.
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import grpc

from ckptd.config import DataLimits
from ckptd.limits import OverShare, Owner, Shares
from ckptd.states import S3
from ckptd.tiers import BLOCK_BYTES
from ckptd.wire import crc32c
from scaletrain.errors import DataLoss, ScaletrainError, Unavailable
from scaletrain.names import TIER_LABELS
from scaletrain.tls import Identity
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc

log = logging.getLogger(__name__)

TICKET_BYTES = 32
# A frame's head: its kind, the tier (common_pb2.Tier) its data was read from, then its offset,
# length and a CRC-32C. A data frame's CRC is that of the data that follows; a blocks frame's is
# that of the block CRCs (one little-endian uint32 per BLOCK_BYTES block of its data, the last
# block possibly short) that follow the head, before the data; its offset is on a block
# boundary. An error frame's offset is the status code, its data a one-line message (at most
# MAX_REASON_BYTES). A source frame's data names the node whose copy serves the frames that
# follow (empty for S3); it comes first, and again whenever that node changes.
READ_FRAME = struct.Struct("<BBxxqII")
DATA, ERROR, SOURCE, BLOCKS = 0, 1, 2, 3
MAX_REASON_BYTES = 4096
# Pieces read ahead of the one being sent, per connection.
READ_AHEAD = 2
# The domain error of each status code an error frame may carry.
_ERRORS = {cls.code.value[0]: cls for cls in ScaletrainError.__subclasses__()}


class Piece(NamedTuple):
    """Bytes of a file as a read serves them, and whose copy served them: the tier, and the node
    whose memory or SSD it was (its own part or a replica it holds; "" for S3).

    `block_crcs` are the file's stored CRC-32Cs of the blocks `data` covers when it starts on a
    block boundary and ends on one or at the file's end (else empty). `done`, when set, must be
    called once nothing reads `data` any more: the piece lends memory (`MemoryTier.read_view`,
    a receive buffer of the memory budget) that is reused after that call, not before."""

    tier: int
    offset: int
    data: bytes | memoryview
    node: str
    block_crcs: bytes = b""
    done: Callable[[], None] | None = None


Pieces = Iterator[Piece]


def source_label(tier: int, node: str) -> str:
    """Whose copy served bytes, as restores report it: "memory@node0", "SSD@node1", "S3"."""
    name = TIER_LABELS.get(tier, f"tier {tier}")
    return name if tier == S3 or not node else f"{name}@{node}"


def describe_sources(sources: Mapping[str, int]) -> str:
    """Where a restore's bytes came from, in a line: "2.10 MB from memory@node0, 0.50 MB from
    S3"."""
    parts = [f"{n / 1e6:.2f} MB from {source}" for source, n in sources.items() if n]
    return ", ".join(parts) or "nothing read"


def timeval(seconds: float) -> bytes:
    """A `struct timeval` for SO_RCVTIMEO / SO_SNDTIMEO."""
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def set_timeout(conn: socket.socket, seconds: float, option: int) -> None:
    """Bound each wait of `conn` to `seconds`: the kernel's `option` (SO_RCVTIMEO, SO_SNDTIMEO)
    on a plain socket, whose waits stay in the kernel (MSG_WAITALL); Python's timeout, for sends
    and receives alike, on a TLS socket, whose waits OpenSSL's records break up anyway."""
    if isinstance(conn, ssl.SSLSocket):
        conn.settimeout(seconds)
    else:
        conn.setsockopt(socket.SOL_SOCKET, option, timeval(seconds))


def receive(conn: socket.socket, view: memoryview) -> int:
    """Receive into `view`; 0 at the end of the stream. A plain socket waits in the kernel until
    all of `view` is there (MSG_WAITALL); a TLS socket hands over one record at most."""
    if isinstance(conn, ssl.SSLSocket):
        return conn.recv_into(view)
    return conn.recv_into(view, 0, socket.MSG_WAITALL)


def data_connection(
    host: str, port: int, timeout_s: float, tls: ssl.SSLContext | None = None
) -> socket.socket:
    """A connection to a data socket, set up for big frames; raises OSError if none (an
    ssl.SSLError for a failed handshake).

    A frame's head is a small write after a big one: without NODELAY, Nagle holds it until the
    other end's delayed ACK, 40 ms a frame. A plain socket is blocking with kernel timeouts
    (SO_SNDTIMEO, SO_RCVTIMEO) so that a whole frame moves in one call (MSG_WAITALL), without
    taking the GIL back in between. With `tls` (`scaletrain.tls.client_context`) it is a TLS
    socket that checked ckptd's certificate against `host`, as a gRPC channel does, with
    Python's timeout of `timeout_s`.
    """
    conn = socket.create_connection((host, port), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        try:
            return tls.wrap_socket(conn, server_hostname=host)
        except BaseException:
            conn.close()
            raise
    conn.settimeout(None)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(timeout_s))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(timeout_s))
    return conn


# -- ckptd's end -----------------------------------------------------------------------------------

# (offset, length) -> the store's verified pieces of that range of one file.
ReadSpan = Callable[[int, int], Pieces]


class Frame(NamedTuple):
    """A frame as it goes out: its head, the block CRCs (empty but for BLOCKS), its data, and
    the call that gives its data back once sent (`Piece.done`)."""

    head: bytes
    crcs: bytes
    data: bytes | memoryview
    done: Callable[[], None] | None = None


class _ReadTicket:
    def __init__(
        self,
        read: ReadSpan,
        offset: int,
        length: int,
        ttl_s: float,
        owner: Owner,
        identity: Identity | None,
    ) -> None:
        self.read, self.offset, self.length = read, offset, length
        self.deadline = time.monotonic() + ttl_s
        # Whose share of the open reads it holds until it is sent, or expires unused.
        self.owner = owner
        self.identity = identity  # the certificate of the gRPC call that got it (mutual TLS)


def spans_of(offset: int, length: int, piece_bytes: int) -> list[tuple[int, int]]:
    """[offset, offset+length) cut at multiples of `piece_bytes`, as the store cuts its pieces
    (so that a peer asked for one span serves it as one piece)."""
    spans, pos, end = [], offset, offset + length
    while pos < end:
        stop = min(end, (pos // piece_bytes + 1) * piece_bytes)
        spans.append((pos, stop - pos))
        pos = stop
    return spans


def data_frame(piece: Piece) -> Frame:
    """A piece as a BLOCKS frame with its stored block CRCs, else (an unaligned one) as a DATA
    frame with a CRC-32C computed here."""
    if piece.block_crcs:
        head = READ_FRAME.pack(
            BLOCKS, piece.tier, piece.offset, len(piece.data), crc32c(piece.block_crcs)
        )
        return Frame(head, piece.block_crcs, piece.data, piece.done)
    head = READ_FRAME.pack(DATA, piece.tier, piece.offset, len(piece.data), crc32c(piece.data))
    return Frame(head, b"", piece.data, piece.done)


def _small_frame(kind: int, tier: int, offset: int, raw: bytes) -> Frame:
    return Frame(READ_FRAME.pack(kind, tier, offset, len(raw), crc32c(raw)), b"", raw)


def _error_frame(exc: Exception, peer: object) -> Frame:
    if isinstance(exc, ScaletrainError):
        code, message = exc.code.value[0], " ".join(str(exc).split())
    else:  # a bug or a broken tier: the client still gets one line
        log.error("serving a read to %s failed", peer, exc_info=exc)
        code, message = grpc.StatusCode.INTERNAL.value[0], f"ckptd failed: {exc}"
    return _small_frame(ERROR, 0, code, message.encode()[:MAX_REASON_BYTES])


def _send(conn: socket.socket, frame: Frame) -> None:
    """Send a frame in as few calls as the kernel takes it (no copy of its bytes). A TLS socket
    has no sendmsg: its head and block CRCs (a few hundred bytes) go in one record, its data
    after them, in place."""
    if isinstance(conn, ssl.SSLSocket):
        conn.sendall(frame.head + frame.crcs)
        conn.sendall(memoryview(frame.data).cast("B"))
        return
    views = [memoryview(b) for b in (frame.head, frame.crcs) if b]
    views.append(memoryview(frame.data).cast("B"))
    while views:
        sent = conn.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views:
            views[0] = views[0][sent:]


class ReadPlane:
    """The read side of a data socket: the ranges OpenRead checked and nobody fetched yet, by
    ticket (each good for one connection within `ttl_s` of its issue).

    A range is read by a thread of its own READ_AHEAD pieces ahead of the one being sent (one
    walk over the range, so that a range a peer serves comes over one connection to it, not one
    per piece): a peer's bytes, an SSD read and the CRC-32Cs (which release the GIL) of the next
    pieces overlap the send of this one. Pieces go out in order, and each piece's memory is
    given back as soon as it is sent.
    """

    def __init__(self, ttl_s: float, limits: DataLimits) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._tickets: dict[bytes, _ReadTicket] = {}
        # A read holds one from its ticket until it is sent (or the ticket expires unused).
        self._open = Shares(
            "reads open", limits.reads_per_caller, limits.reads_per_run, limits.reads
        )

    def issue(
        self,
        read: ReadSpan,
        offset: int,
        length: int,
        what: str,
        owner: Owner,
        identity: Identity | None = None,
    ) -> bytes:
        """A ticket for the pieces of [offset, offset+length), as `read` serves them, once the
        caller, its run and the node have room for one more open read (OverShare otherwise).
        `identity`: the caller's client certificate (mutual TLS)."""
        with self._lock:
            self._drop_expired()
            try:
                self._open.take(owner)
            except OverShare as exc:
                raise OverShare(exc.scope, f"{what}: {exc}") from None
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._tickets[ticket] = _ReadTicket(read, offset, length, self.ttl_s, owner, identity)
        return ticket

    def held(self, owner: Owner) -> dict[str, int]:
        """The open reads `owner`'s caller, its run and the node hold (for tests)."""
        return self._open.held(owner)

    def claim(self, ticket: bytes) -> _ReadTicket | None:
        """The read a ticket that is known, unused and in time stands for (it is then used; its
        share is given back once `send` is done with it)."""
        with self._lock:
            found = self._tickets.pop(ticket, None)
        if found is not None and time.monotonic() > found.deadline:
            self._open.give(found.owner)
            return None
        return found

    def drop_expired(self) -> None:
        with self._lock:
            self._drop_expired()

    def _drop_expired(self) -> None:
        """Forget (under the lock) the tickets never presented in time."""
        now = time.monotonic()
        for ticket in [t for t, found in self._tickets.items() if now > found.deadline]:
            self._open.give(self._tickets.pop(ticket).owner)

    def refuse(self, conn: socket.socket, found: _ReadTicket, error: ScaletrainError) -> None:
        """End a claimed read with `error` as its only frame, and give its share back."""
        try:
            _send(conn, _error_frame(error, None))
        except OSError:
            pass  # the client hung up: it learns nothing, and needs to
        finally:
            self._open.give(found.owner)

    def send(self, conn: socket.socket, found: _ReadTicket, peer: object) -> None:
        """Send the range's frames in order; a piece that fails ends the range with an error
        frame saying why. A client that hangs up just ends it (and the reading ahead)."""
        frames: queue.Queue[Frame | None] = queue.Queue(READ_AHEAD)
        stop = threading.Event()
        reader = threading.Thread(
            target=_read_ahead, args=(found, frames, stop, peer), name="ckptd-read", daemon=True
        )
        reader.start()
        try:
            while (frame := frames.get()) is not None:
                try:
                    _send(conn, frame)
                finally:
                    if frame.done is not None:
                        frame.done()
        except OSError as exc:
            log.info("a read's connection from %s ended early: %s", peer, exc)
        finally:
            stop.set()
            reader.join()  # done at its next piece: it puts nothing once stopped
            while not frames.empty():
                left = frames.get_nowait()
                if left is not None and left.done is not None:
                    left.done()
            self._open.give(found.owner)


def _read_ahead(
    found: _ReadTicket, frames: queue.Queue[Frame | None], stop: threading.Event, peer: object
) -> None:
    """Put the range's frames into `frames` (then None), until `stop`; a source frame before
    each change of the node whose copy serves them, an error frame at the first failure."""

    def put(frame: Frame | None) -> bool:
        while not stop.is_set():
            try:
                frames.put(frame, timeout=0.1)
                return True
            except queue.Full:
                continue
        if frame is not None and frame.done is not None:
            frame.done()
        return False

    node: str | None = None
    try:
        for piece in found.read(found.offset, found.length):
            if piece.node != node:
                node = piece.node
                if not put(_small_frame(SOURCE, piece.tier, piece.offset, node.encode())):
                    return
            if not put(data_frame(piece)):
                return
    except Exception as exc:
        put(_error_frame(exc, peer))
    put(None)


# -- a client's end --------------------------------------------------------------------------------


class RangeConnection:
    """One range arriving over a data socket: `pieces()` or `read_into()`, once. Raises DataLoss
    for a frame that fails its CRC-32C or arrives out of place, the domain error of an error
    frame, and Unavailable when the connection ends or goes quiet before the range does."""

    def __init__(
        self, conn: socket.socket, opened: checkpoint_pb2.OpenReadResponse, what: str
    ) -> None:
        self._conn, self._what = conn, what
        self._tls = isinstance(conn, ssl.SSLSocket)
        self.offset, self.length = opened.offset, opened.length
        self._pos = opened.offset
        self.tier = 0  # the tier of the last frame received
        self.node = ""  # the node whose copy served it
        # The peer whose data socket this is, when the node asked sent the caller there
        # (OpenReadRequest.direct); "" for the node asked.
        self.elsewhere = opened.node
        self._crc = 0  # the last frame's CRC-32C, and its block CRCs (BLOCKS frames)
        self._block_crcs: tuple[int, ...] | None = None
        # Bytes received per copy that served them (`source_label`).
        self.served: Counter[str] = Counter()

    def close(self) -> None:
        self._conn.close()

    @property
    def position(self) -> int:
        """The offset up to which the range has arrived, verified."""
        return self._pos

    def __enter__(self) -> RangeConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _fill(self, view: memoryview) -> None:
        got = 0
        try:
            while got < len(view):
                n = receive(self._conn, view[got:])
                if n == 0:
                    break
                got += n
        except OSError:  # a timeout or a reset
            pass
        if got < len(view):
            done = self._pos - self.offset
            raise Unavailable(
                f"{self._what}: the data connection ended after {done} of {self.length} bytes"
            )

    def _head(self) -> int:
        """The next data frame's head (and its block CRCs), checked; returns its length (its
        data follows)."""
        head = bytearray(READ_FRAME.size)
        self._fill(memoryview(head))
        kind, tier, offset, length, crc = READ_FRAME.unpack(head)
        while kind == SOURCE and length <= MAX_REASON_BYTES:
            raw = bytearray(length)
            self._fill(memoryview(raw))
            if crc32c(raw) != crc:
                raise DataLoss(f"{self._what}: a source frame arrived damaged")
            self.node = raw.decode(errors="replace")
            self._fill(memoryview(head))
            kind, tier, offset, length, crc = READ_FRAME.unpack(head)
        if kind == ERROR and length <= MAX_REASON_BYTES:
            raw = bytearray(length)
            self._fill(memoryview(raw))
            message = raw.decode(errors="replace") if crc32c(raw) == crc else "a damaged reason"
            raise _ERRORS.get(offset, ScaletrainError)(f"{self._what}: {message}")
        if (
            kind not in (DATA, BLOCKS)
            or offset != self._pos
            or not 0 < length <= self.offset + self.length - offset
            or (kind == BLOCKS and offset % BLOCK_BYTES)
        ):
            raise DataLoss(f"{self._what}: a frame of {length} bytes at {offset} is out of place")
        self.tier, self._crc, self._block_crcs = tier, crc, None
        if kind == BLOCKS:
            raw = bytearray(4 * -(-length // BLOCK_BYTES))
            self._fill(memoryview(raw))
            if crc32c(raw) != crc:
                raise DataLoss(f"{self._what}: the frame at offset {offset} arrived damaged")
            self._block_crcs = struct.unpack(f"<{len(raw) // 4}I", raw)
        return length

    def _check(self, data: bytes | memoryview, verify: bool = True) -> None:
        """Take a frame's bytes: checked against its block CRCs (or its one CRC-32C) unless not
        `verify`."""
        if verify and not self._intact(memoryview(data)):
            raise DataLoss(f"{self._what}: the frame at offset {self._pos} arrived damaged")
        self._pos += len(data)
        self.served[source_label(self.tier, self.node)] += len(data)

    def _intact(self, data: memoryview) -> bool:
        if self._block_crcs is None:
            return crc32c(data) == self._crc
        return all(
            crc32c(data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]) == expected
            for i, expected in enumerate(self._block_crcs)
        )

    def pieces(self) -> Iterator[bytes]:
        """Yield the range frame by frame, each piece verified, in a buffer of its own."""
        while self._pos < self.offset + self.length:
            length = self._head()
            if self._tls:  # an SSL socket takes no flags
                data: bytes | bytearray = bytearray(length)
                self._fill(memoryview(data))
            else:
                data = self._conn.recv(length, socket.MSG_WAITALL)  # filled in place, not copied
                if len(data) < length:
                    rest = bytearray(length - len(data))
                    self._fill(memoryview(rest))
                    data += rest
            self._check(data)
            yield data

    def frames_into(
        self, alloc: Callable[[int], memoryview], verify: bool = True
    ) -> Iterator[tuple[int, memoryview]]:
        """Yield (offset, bytes) of each frame, received into a buffer of `alloc(length)` (the
        memory budget's page-aligned ones, which the SSD writes as they are). Without `verify`
        the frame's CRC-32Cs are not checked: for a caller that checks every block against the
        block CRCs of its own manifest anyway (a replica being made, a piece relayed)."""
        while self._pos < self.offset + self.length:
            length = self._head()
            offset, view = self._pos, alloc(length)
            self._fill(view)
            self._check(view, verify)
            yield offset, view

    def read_into(self, buffer: bytearray) -> None:
        """Receive the whole range into `buffer` (of its length), every frame verified."""
        view = memoryview(buffer)
        while self._pos < self.offset + self.length:
            length = self._head()
            frame = view[self._pos - self.offset :][:length]
            self._fill(frame)
            self._check(frame)


def open_range(
    stub: checkpoint_pb2_grpc.CheckpointServiceStub,
    request: checkpoint_pb2.OpenReadRequest,
    default_host: str,
    timeout_s: float,
    what: str,
    tls: ssl.SSLContext | None = None,
) -> RangeConnection | None:
    """OpenRead, connect (over TLS with `tls`) and present the ticket: the range on its way;
    None when ckptd does not offer its data socket to this caller (UNIMPLEMENTED) or it cannot
    be reached, and ReadFile must serve it. Other refusals raise grpc.RpcError."""
    try:
        opened = stub.OpenRead(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        return None
    host = opened.data_host or default_host
    try:
        conn = data_connection(host, opened.data_port, timeout_s, tls)
    except ssl.SSLError as exc:  # gRPC took the same files: a data socket of another config
        log.warning("%s: no TLS with the data socket at %s (%s); through ReadFile", what, host,
                    exc)  # fmt: skip
        return None
    except OSError:
        return None  # the ticket, never presented, expires on its own
    try:
        conn.sendall(opened.ticket)
    except OSError:
        conn.close()
        return None
    return RangeConnection(conn, opened, what)
