"""ckptd's data socket: the fast path of WriteFile (OpenUpload, then FinishUpload), and of
ReadFile (OpenRead, `ckptd.readpath`).

Why it exists: grpcio's Python transport moves bytes at a fraction of what a plain loopback socket
does (bench/ckptd_ingest.py), and a save is almost all bytes. So the control stays on gRPC
(authentication, authorization, the header's checks, the trailer's check, the reply) and only the
bytes of one file take a TCP socket (TLS when gRPC has it), into the same `FileUpload` pipeline as
WriteFile: CRC-32C per block, the file's checksum, memory budget and backpressure, SSD write. A
file joins its save only through FinishUpload's trailer, exactly as with WriteFile's trailer.
Frames are received into buffers the memory budget lends and takes back (`MemoryBudget.buffer`),
so a steady stream of saves does not touch fresh memory.

The socket trusts nothing it did not issue: a connection must open with a ticket that OpenUpload
issued (32 random bytes) less than `ttl_s` ago and that no connection used before; it carries
exactly the bytes announced, never more. A file whose size is not known in advance (a DCP writer's
stream, `UNKNOWN_SIZE`) ends with an empty frame, and the save's byte limit bounds it. Any failure
drops the connection and stores nothing; FinishUpload reports the reason in one line.

One bad client must not stall the node (`ckptd.limits`, `CkptdConfig.limits`): pending uploads and
bytes in flight count per caller, per run and in all; an upload whose connection sends a bad frame,
closes early or goes silent past `read_timeout_s` gives its slot back the moment it fails; a
connection that brings no ticket within `ticket_wait_s` is closed, and past the waiting limits the
oldest such connection makes room for the new one (a real client sends its ticket at once).
Refusals are counted (`ckptd_refused_connections_total{reason}`) and logged a few times, not once
per connection (`scaletrain.throttle`).

A read's ticket (OpenRead's, kept by the `ReadPlane`) opens the same socket the other way: the
connection then receives the range's frames (`ckptd.readpath`). Tickets of both kinds are 32
random bytes from one generator, so a connection's ticket names one of them or none, never both.

With TLS on (`ServerSecurity.tls`) the socket speaks TLS with gRPC's files and rules
(`scaletrain.tls`), so it may serve callers on other nodes (peer reads, replicas, spares) as
safely as gRPC does. The accept loop does each handshake without blocking, within the time a
ticket may take; a handshake that fails (a wrong CA, a plaintext client) is refused and counted
(`tls`). The ticket stays the authorization; with mutual TLS the connection's certificate must
also name the client the ticket was issued to over gRPC (`identity`), so a ticket that leaks is
worth nothing to another holder of a certificate. The certificate files are checked once a
second: new connections get a renewed certificate, open ones finish on theirs.
"""

from __future__ import annotations

import errno
import logging
import mmap
import secrets
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator

from ckptd.config import DataLimits
from ckptd.limits import OverShare, Owner, Shares
from ckptd.manifest import FileRecord
from ckptd.names import key_of
from ckptd.readpath import TICKET_BYTES, Pieces, ReadPlane, _ReadTicket, receive, set_timeout
from ckptd.reads import READ_PIECE_BYTES
from ckptd.store import CheckpointStore
from ckptd.tiers import BLOCK_BYTES
from ckptd.wire import BlockChunk
from scaletrain.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ScaletrainError,
    UserError,
)
from scaletrain.guard import Caller
from scaletrain.security import ServerSecurity
from scaletrain.throttle import Throttled
from scaletrain.tls import Identity, reloading_server_context, socket_identity
from scaletrain.transport import MAX_CHUNK_BYTES
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
    """The connection ended, or went quiet past its deadline (`silent`), before the bytes
    expected."""

    def __init__(self, silent: bool = False) -> None:
        super().__init__()
        self.silent = silent


Buffer = bytearray | memoryview | mmap.mmap


def _recv_into(conn: socket.socket, buffer: Buffer, deadline: float) -> None:
    """Fill `buffer` by `deadline` (time.monotonic()). A plain socket waits in the kernel for all
    of it (MSG_WAITALL on a blocking socket, SO_RCVTIMEO set to the time left): a thread that
    took the GIL back after each piece the socket delivers would wait for it behind the hashing
    threads again and again. A TLS socket hands over a record at a time (`receive`)."""
    view, got = memoryview(buffer), 0
    try:
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Short(silent=True)
            set_timeout(conn, max(left, 0.001), socket.SO_RCVTIMEO)
            n = receive(conn, view[got:])
            if n == 0:
                raise _Short
            got += n
    except TimeoutError:  # a TLS socket's timeout
        raise _Short(silent=True) from None
    except OSError as exc:  # a timeout (EAGAIN) or a reset: the bytes did not come
        raise _Short(silent=exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)) from None


def read_frames(
    recv: Callable[[Buffer], None], path: str, size: int, buffer: Callable[[int], memoryview]
) -> Iterator[BlockChunk]:
    """The frames of one upload's bytes as `recv` fills buffers from its connection, each checked
    against the frame limit and the size announced (InvalidArgument, in one line), with its data
    in a buffer from `buffer(length)`. Ends with the size announced, or with the empty frame of
    an upload of `UNKNOWN_SIZE`; `recv` raises when bytes do not come. It checks the framing
    only: the CRC-32Cs and the blocks' alignment are the pipeline's (`ckptd.ingest`).

    The data socket's connections and the fuzzer (`tests/fuzz`) both read through it, so the
    parser that faces the network is the one that is fuzzed."""
    head = bytearray(FRAME_LENGTH.size)
    offset = 0
    while offset < size or size == UNKNOWN_SIZE:
        recv(head)
        (length,) = FRAME_LENGTH.unpack(head)
        if length == 0 and size == UNKNOWN_SIZE:
            return
        if not 0 < length <= MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"{path}: data frame of {length} bytes at offset {offset}; a frame holds 1 to "
                f"{MAX_CHUNK_BYTES} bytes"
            )
        if size != UNKNOWN_SIZE and offset + length > size:
            raise InvalidArgument(
                f"{path}: data frame at offset {offset} runs past the {size} bytes announced"
            )
        crc_format = frame_crcs(length)
        crcs = bytearray(crc_format.size)
        recv(crcs)
        data = buffer(length)
        recv(data)
        yield BlockChunk(offset, data, crc_format.unpack(crcs))
        offset += length


class _Ticket:
    """One announced file: its header and size, and the hand-over between the connection that
    brings its bytes and the FinishUpload call that brings its trailer."""

    def __init__(
        self,
        header: checkpoint_pb2.FileHeader,
        size: int,
        ttl_s: float,
        owner: Owner,
        identity: Identity | None,
    ) -> None:
        self.header, self.size, self.owner = header, size, owner
        self.identity = identity  # the certificate of the gRPC call that got it (mutual TLS)
        self.holds_slot = True  # counted in the upload shares until it ends or fails
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


class _Waiting:
    """A data connection that has not brought its whole ticket yet (the accept loop's)."""

    def __init__(self, conn: socket.socket, peer: tuple, handshaking: bool) -> None:
        self.conn, self.peer, self.host = conn, peer, str(peer[0])
        self.since = time.monotonic()
        self.ticket = bytearray()
        self.handshaking = handshaking  # its TLS handshake comes first
        self.events = selectors.EVENT_READ  # what the accept loop waits for from it


def _decrypted(conn: socket.socket) -> int:
    """Bytes a TLS socket has decrypted and not handed over: the selector does not see them."""
    return conn.pending() if isinstance(conn, ssl.SSLSocket) else 0


def _tls_error(exc: OSError) -> str:
    """A failed handshake in a few words ("certificate verify failed", "wrong version number")."""
    reason = getattr(exc, "verify_message", None) or getattr(exc, "reason", None)
    return str(reason or exc.strerror or exc)


class DataPlane:
    """The data socket of one ckptd (listening from the start) and the tickets it accepts."""

    def __init__(
        self,
        store: CheckpointStore,
        host: str,
        ttl_s: float = 30.0,
        limits: DataLimits | None = None,
        idle_s: float = 120.0,
        security: ServerSecurity | None = None,
    ) -> None:
        """`idle_s`: how long a read's client may leave its frames unreceived; `security`: TLS
        (and client certificates) as gRPC has them (None or no `tls`: plaintext)."""
        self._store = store
        self.ttl_s = ttl_s
        self._idle_s = idle_s
        self.limits = limits = limits if limits is not None else DataLimits()
        self._uploads = Shares(
            "uploads waiting for their bytes",
            limits.uploads_per_caller,
            limits.uploads_per_run,
            limits.uploads,
        )
        self._flight = Shares(
            "in flight",
            limits.flight_bytes_per_caller,
            limits.flight_bytes_per_run,
            limits.flight_bytes,
            shown=lambda n: f"{n / (1 << 20):.0f} MiB",
        )
        self._refused = store.metrics.refused_connections
        self._warnings = Throttled(log, limits.log_every_s)
        tls = security.tls if security is not None else None
        self._client_auth = tls is not None and security is not None and security.client_auth
        self._tls = reloading_server_context(tls, self._client_auth) if tls else None
        try:
            bare = host.strip("[]")
            family = socket.AF_INET6 if ":" in bare else socket.AF_INET
            self._listener = socket.create_server((bare, 0), family=family, backlog=1024)
        except OSError as exc:
            raise UserError(f"cannot open ckptd's data socket on {host}: {exc}") from None
        self._listener.setblocking(False)  # the accept loop selects on it
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._tickets: dict[bytes, _Ticket] = {}
        # Uploads whose connection failed, oldest first: FinishUpload may still ask why.
        self._failed: deque[bytes] = deque()
        # Connections waiting for their ticket, oldest first (the accept loop's alone), and how
        # many of them each host has.
        self._waiting: OrderedDict[int, _Waiting] = OrderedDict()
        self._hosts: Counter[str] = Counter()
        self._reads = ReadPlane(ttl_s, limits)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ckptd-data", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self._listener.close()

    # -- the gRPC side ---------------------------------------------------------------------------

    def issue(
        self,
        header: checkpoint_pb2.FileHeader,
        size: int,
        caller: Caller,
        identity: Identity | None = None,
    ) -> bytes:
        """A ticket for `size` bytes of the file `header` names, once the header passes and the
        caller, the save's run and the node have room for one more upload. `identity`: the
        caller's client certificate, which the connection must show too (mutual TLS)."""
        if size < UNKNOWN_SIZE:
            raise InvalidArgument(
                f"{header.path}: size must be >= 0, or {UNKNOWN_SIZE} when not known, got {size}"
            )
        self._store.saves.check_header(header)
        run = self._store.saves.run_of_save(header.save_id) or ""
        owner = Owner(caller.key, caller.label, run)
        with self._lock:
            self._drop_expired()
            try:
                self._uploads.take(owner)
            except OverShare as exc:
                self._store.metrics.refused_uploads.labels(exc.scope).inc()
                raise OverShare(exc.scope, f"{header.path}: {exc}") from None
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._tickets[ticket] = _Ticket(header, size, self.ttl_s, owner, identity)
        return ticket

    def held(self, owner: Owner) -> dict[str, int]:
        """The uploads `owner`'s caller, its run and the node hold (for tests and benchmarks)."""
        return self._uploads.held(owner)

    def reads_held(self, owner: Owner) -> dict[str, int]:
        """The open reads `owner`'s caller, its run and the node hold (for tests)."""
        return self._reads.held(owner)

    def open_read(
        self,
        request: checkpoint_pb2.OpenReadRequest,
        caller: Caller,
        identity: Identity | None = None,
    ) -> tuple[bytes, int, int]:
        """A ticket for a range of a committed file once the request passes ReadFile's checks
        (they raise here, in one line) and the caller, the run and the node have room for one
        more open read, and the range's offset and length. `identity` as for `issue`."""

        def read(offset: int, length: int) -> Pieces:
            return self._store.reader.iter_range(
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
        owner = Owner(caller.key, caller.label, request.ref.run)
        try:
            ticket = self._reads.issue(read, offset, length, request.path, owner, identity)
        except OverShare as exc:
            self._store.metrics.refused_reads.labels(exc.scope).inc()
            raise
        return ticket, offset, length

    def run_of(self, ticket: bytes) -> list[str]:
        """The run a ticket's upload writes to (to authorize FinishUpload); none if unknown."""
        with self._lock:
            found = self._tickets.get(ticket)
        run = self._store.saves.run_of_save(found.header.save_id) if found is not None else None
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
        try:
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
        finally:
            with self._lock:
                self._tickets.pop(ticket, None)
                self._free(found)
        if found.error is not None:
            raise found.error
        assert found.record is not None
        return found.record

    def _free(self, found: _Ticket) -> None:
        """Give an upload's slot back (under the lock), once."""
        if found.holds_slot:
            found.holds_slot = False
            self._uploads.give(found.owner)

    def _failed_upload(self, ticket: bytes, found: _Ticket, error: ScaletrainError) -> None:
        """An upload's connection failed: its slot is free at once; its reason is kept (for the
        newest `limits.uploads` failures, and the ticket's lifetime) for FinishUpload."""
        found.error = error
        with self._lock:
            self._free(found)
            self._failed.append(ticket)
            while len(self._failed) > self.limits.uploads:
                old = self._failed.popleft()
                kept = self._tickets.get(old)
                if kept is not None and not kept.finishing:
                    del self._tickets[old]

    def _drop_expired(self) -> None:
        """Forget (under the lock) tickets never presented in time, and the outcomes of uploads
        nobody asked for in time; neither holds anything else."""
        now = time.monotonic()
        for ticket in [t for t, found in self._tickets.items() if _expired(found, now)]:
            self._free(self._tickets.pop(ticket))
        while self._failed and self._failed[0] not in self._tickets:
            self._failed.popleft()

    # -- the data socket -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        """Accept connections and read their tickets, all in this one thread: a connection costs
        a thread of its own only once its ticket is good, so idle connections and connections of
        garbage cost ckptd almost nothing. Once a second, expired tickets are dropped, the
        warnings' counts written and the TLS files checked for a renewed certificate."""
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        tidied = time.monotonic()
        try:
            while not self._closed.is_set():
                for key, _ in selector.select(timeout=0.2):
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    else:
                        self._advance(selector, key.data)
                now = time.monotonic()
                self._close_idle(selector, now)
                if now - tidied >= 1.0:
                    tidied = now
                    with self._lock:
                        self._drop_expired()
                    self._reads.drop_expired()
                    self._warnings.flush()
                    if self._tls is not None:
                        self._tls.refresh()
        finally:
            for waiting in list(self._waiting.values()):
                self._forget(selector, waiting)
            selector.close()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        """Take every connection the listener has, each to wait for its ticket; past the
        waiting limits (for its host, then in all), the oldest waiting one is closed: a real
        client sends its ticket as it connects, so the oldest are the ones that never will."""
        limits = self.limits
        while True:
            try:
                conn, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                if self._closed.is_set():
                    return
                raise
            conn.setblocking(False)
            if self._tls is not None:  # the handshake happens in `_advance`, never blocking
                try:
                    conn = self._tls.value.wrap_socket(
                        conn, server_side=True, do_handshake_on_connect=False
                    )
                except OSError as exc:  # gone already
                    conn.close()
                    self._refuse("tls", "refused a data connection from %s: %s", peer, exc)
                    continue
            waiting = _Waiting(conn, peer, handshaking=self._tls is not None)
            oldest = None
            if self._hosts[waiting.host] >= limits.waiting_connections_per_host:
                oldest = next(w for w in self._waiting.values() if w.host == waiting.host)
            elif len(self._waiting) >= limits.waiting_connections:
                oldest = next(iter(self._waiting.values()))
            if oldest is not None:
                self._forget(selector, oldest)
                self._refuse(
                    "evicted",
                    "closed a data connection from %s that brought no ticket: too "
                    "many connections wait for theirs",
                    oldest.peer,
                )
            self._waiting[id(waiting)] = waiting
            self._hosts[waiting.host] += 1
            selector.register(conn, selectors.EVENT_READ, waiting)
            self._advance(selector, waiting)  # a client's first bytes are usually there already

    def _forget(
        self, selector: selectors.BaseSelector, waiting: _Waiting, close: bool = True
    ) -> None:
        """A waiting connection is done waiting: closed, or handed on (`close` False)."""
        del self._waiting[id(waiting)]
        self._hosts[waiting.host] -= 1
        if not self._hosts[waiting.host]:
            del self._hosts[waiting.host]
        selector.unregister(waiting.conn)
        if close:
            waiting.conn.close()

    def _close_idle(self, selector: selectors.BaseSelector, now: float) -> None:
        """Close connections that brought no ticket (with TLS: finished no handshake and sent no
        ticket) within `ticket_wait_s`."""
        wait_s = self.limits.ticket_wait_s
        while self._waiting:
            oldest = next(iter(self._waiting.values()))
            if now - oldest.since < wait_s:
                return
            self._forget(selector, oldest)
            what = "finished no TLS handshake" if oldest.handshaking else "brought no ticket"
            self._refuse("no_ticket", "closed a data connection from %s: it %s within %gs",
                         oldest.peer, what, wait_s)  # fmt: skip

    def _advance(self, selector: selectors.BaseSelector, waiting: _Waiting) -> None:
        """Take a waiting connection as far as its bytes go: its TLS handshake, then its ticket."""
        if waiting.handshaking and not self._handshake(selector, waiting):
            return
        self._read_ticket(selector, waiting)

    def _watch(self, selector: selectors.BaseSelector, waiting: _Waiting, events: int) -> None:
        if events != waiting.events:
            selector.modify(waiting.conn, events, waiting)
            waiting.events = events

    def _handshake(self, selector: selectors.BaseSelector, waiting: _Waiting) -> bool:
        """Go on with a connection's TLS handshake as far as it can without blocking; True once
        it is done. A failed one closes the connection (counted as `tls`)."""
        conn = waiting.conn
        assert isinstance(conn, ssl.SSLSocket)
        try:
            conn.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(selector, waiting, selectors.EVENT_READ)
            return False
        except ssl.SSLWantWriteError:
            self._watch(selector, waiting, selectors.EVENT_WRITE)
            return False
        except OSError as exc:  # ssl.SSLError included: a bad certificate, not TLS at all
            self._forget(selector, waiting)
            self._refuse("tls", "refused a data connection from %s: its TLS handshake failed "
                         "(%s)", waiting.peer, _tls_error(exc))  # fmt: skip
            return False
        waiting.handshaking = False
        self._watch(selector, waiting, selectors.EVENT_READ)
        return True

    def _read_ticket(self, selector: selectors.BaseSelector, waiting: _Waiting) -> None:
        """Read what a waiting connection has of its ticket; with all of it, hand the connection
        to a thread of its own (a read's or an upload's), or close it for a bad ticket."""
        conn = waiting.conn
        while len(waiting.ticket) < TICKET_BYTES:
            if waiting.ticket and not _decrypted(conn):
                return  # the selector says when more comes
            try:
                got = conn.recv(TICKET_BYTES - len(waiting.ticket))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return
            except ssl.SSLWantWriteError:  # TLS has something to say first
                self._watch(selector, waiting, selectors.EVENT_WRITE)
                return
            except OSError:
                got = b""
            if not got:
                self._forget(selector, waiting)
                self._refuse("no_ticket", "closed a data connection from %s: it hung up before "
                             "its ticket", waiting.peer)  # fmt: skip
                return
            waiting.ticket += got
        ticket = bytes(waiting.ticket)
        read = self._reads.claim(ticket)
        found = self._claim(ticket) if read is None else None
        if read is None and found is None:
            self._forget(selector, waiting)
            if self._tls is None and ticket.startswith(b"\x16\x03"):  # a TLS ClientHello
                self._refuse("tls", "refused a data connection from %s: it speaks TLS, the data "
                             "socket plaintext (is TLS on for ckptd?)", waiting.peer)  # fmt: skip
            else:
                self._refuse("bad_ticket", "refused a data connection from %s: unknown, used "
                             "or expired ticket", waiting.peer)  # fmt: skip
            return
        self._forget(selector, waiting, close=False)
        conn.setblocking(True)  # for MSG_WAITALL; timeouts bound each wait
        serve = self._send_read if read is not None else self._serve_upload
        threading.Thread(
            target=serve, args=(conn, waiting.peer, read or (ticket, found)),
            name="ckptd-data-conn", daemon=True,
        ).start()  # fmt: skip

    def _stranger(self, conn: socket.socket, issued_to: Identity | None) -> str | None:
        """Why a connection may not spend a ticket with mutual TLS: its certificate names
        another client than the gRPC call the ticket was issued to; None when it may."""
        if not self._client_auth:
            return None
        assert isinstance(conn, ssl.SSLSocket)
        shown = socket_identity(conn)
        if shown == issued_to:
            return None
        return (
            f"the data connection's client certificate names {shown}, the ticket was issued "
            f"to {issued_to}"
        )

    def _send_read(self, conn: socket.socket, peer: object, read: _ReadTicket) -> None:
        with conn:
            set_timeout(conn, self._idle_s, socket.SO_SNDTIMEO)
            stranger = self._stranger(conn, read.identity)
            if stranger is not None:
                self._refuse("identity", "refused a read to %s: %s", peer, stranger)
                self._reads.refuse(conn, read, PermissionDenied(stranger))
                return
            self._reads.send(conn, read, peer)

    def _refuse(self, reason: str, message: str, *args: object) -> None:
        self._refused.labels(reason).inc()
        self._warnings.warning(reason, message, *args)

    def _claim(self, ticket: bytes) -> _Ticket | None:
        with self._lock:
            found = self._tickets.get(ticket)
            if found is None or found.claimed or time.monotonic() > found.deadline:
                return None
            found.claimed = True
        found.connected.set()
        return found

    def _serve_upload(
        self, conn: socket.socket, peer: object, claimed: tuple[bytes, _Ticket]
    ) -> None:
        ticket, found = claimed
        with conn:
            try:
                stranger = self._stranger(conn, found.identity)
                if stranger is not None:
                    error = PermissionDenied(f"{found.header.path}: {stranger}")
                    raise self._dropped("identity", found, peer, error)
                found.record = self._receive(conn, found, peer)
            except ScaletrainError as exc:
                self._failed_upload(ticket, found, exc)
            finally:
                found.done_at = time.monotonic()
                found.done.set()

    def _dropped(
        self, reason: str, found: _Ticket, peer: object, error: ScaletrainError
    ) -> ScaletrainError:
        """Count and log (throttled) an upload whose connection failed; returns `error`."""
        self._refuse(reason, "dropped an upload of %s from %s: %s", found.owner.label, peer, error)
        return error

    def _receive(self, conn: socket.socket, found: _Ticket, peer: object) -> FileRecord:
        """Take the announced bytes into a new file of the save, then wait for the trailer.

        Each frame must arrive within `read_timeout_s` of the one before, and takes its bytes from
        the caller's and the run's share of bytes in flight first (the pipeline gives them back
        as it checks and writes them)."""
        path, size, owner = found.header.path, found.size, found.owner
        announced = f"the {size} bytes announced" if size != UNKNOWN_SIZE else "its end"
        timeout_s = self.limits.read_timeout_s
        pending = [0]  # bytes of the frame being received: taken, not yet the pipeline's

        def recv(buffer: Buffer) -> None:
            _recv_into(conn, buffer, frame_deadline[0])

        def buffer(length: int) -> memoryview:
            self._flight.take(owner, length, wait_s=timeout_s)
            pending[0] = length
            frame_deadline[0] = time.monotonic() + timeout_s  # the wait was ckptd's, not theirs
            return self._store.budget.buffer(length)

        frame_deadline = [time.monotonic() + timeout_s]
        received = 0
        with self._store.saves.begin_file(
            found.header, lambda n: self._flight.give(owner, n)
        ) as stream:
            try:
                for chunk in read_frames(recv, path, size, buffer):
                    stream.write(chunk)
                    pending[0] = 0
                    received += len(chunk.data)
                    frame_deadline[0] = time.monotonic() + timeout_s
            except _Short as short:
                how = f"went silent for {timeout_s:g}s" if short.silent else "ended"
                cut = f"the data connection {how} after {received} bytes, before {announced}"
                error, reason = InvalidArgument(f"{path}: {cut}"), "cut"
                try:
                    stream.upload.verified()  # a bad chunk is the better reason to report
                except InvalidArgument as bad:
                    error, reason = bad, "bad_frame"
                raise self._dropped(reason, found, peer, error) from None
            except InvalidArgument as exc:
                raise self._dropped("bad_frame", found, peer, exc) from None
            except OverShare as exc:
                raise self._dropped("over_limit", found, peer, exc) from None
            finally:
                if pending[0]:
                    self._flight.give(owner, pending[0])
            if not found.trailer_given.wait(self.ttl_s):
                late = (
                    f"{path}: no FinishUpload within {self.ttl_s:g}s of the data; "
                    "nothing was stored"
                )
                raise self._dropped("cut", found, peer, FailedPrecondition(late))
            assert found.trailer is not None
            return stream.finish(found.trailer)
