"""Receiving one file of a save: a pipeline in which the receiving thread only receives.

The receiving thread (gRPC's, or the data socket's) checks each chunk's size and place in the
file, reserves its bytes in the memory budget (waiting when the budget is full: backpressure)
and hands the chunk to three threads that work side by side: a verifier checks its CRC-32C and
feeds the per-block CRCs, a hasher feeds the file's SHA-256, and a writer appends it to a
temporary SSD file and keeps it for the memory tier. CRC, SHA-256 and file writes release the
GIL, so receiving, checking, hashing and writing overlap. A chunk's memory is released once it
is verified, hashed and written (unless the memory tier keeps it).

The WriteFile (FinishUpload) reply waits only for the verifier: every chunk arrived as the
client checksummed it, and the trailer's size matches. The SHA-256 takes longer than the bytes
take to arrive (one serial stream, slower than a loopback socket), so it is checked after the
reply and before the file can count: the writer compares it with the trailer's once the file is
on disk, and only a file that matches joins the save's staging dir. A commit waits for that (it
waits for the disk anyway, because a checkpoint is committed only once it is durable), and a
file whose bytes do not match its SHA-256 makes the commit fail, naming the file, which is
discarded and must be written again; nothing committed before is touched.

A chunk whose bytes do not match its CRC, or a file whose bytes do not match its trailer, is bad
input (INVALID_ARGUMENT): the client sent something other than what it described and must send
it again; DATA_LOSS is kept for stored data that no tier can serve intact.
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable

from ckptd.manifest import FileRecord
from ckptd.metrics import Metrics
from ckptd.tiers import BlockCrcs
from ckptd.tiers.memory import MemoryBudget, MemoryFile
from ckptd.tiers.ssd import IncomingFile
from ckptd.wire import Chunk, crc32c
from scaletrain.errors import InvalidArgument, ScaletrainError, Unavailable
from scaletrain.rpc import MAX_CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# A chunk's bytes: a view into the received message (ckptd.wire), or bytes from protobuf.
Data = bytes | memoryview


class FileUpload:
    """One file being received. The store creates it (`CheckpointStore.begin_file`).

    `on_written(upload)` runs in the writer thread once the file is complete, fsynced and closed;
    it decides (under the store's lock) whether the file joins the save's staging dir.
    """

    def __init__(
        self,
        header: checkpoint_pb2.FileHeader,
        incoming: IncomingFile,
        budget: MemoryBudget,
        retain: bool,
        on_written: Callable[[FileUpload], None],
        metrics: Metrics,
    ) -> None:
        self.header = header
        self.path = header.path
        self.incoming = incoming
        self.touched = time.monotonic()
        self._budget = budget
        self._on_written = on_written
        self._metrics = metrics
        self._lock = threading.Lock()
        self._size = 0
        self._inflight = 0  # reserved bytes not yet verified, hashed and written
        self._verified_to = 0  # the verifier is done with bytes [0, _verified_to)
        self._hashed_to = 0  # the hasher is done with bytes [0, _hashed_to)
        # Chunks on disk whose memory waits for the verifier or the hasher: (end, bytes, kept).
        self._unsettled: deque[tuple[int, Data, bool]] = deque()
        self._memory: MemoryFile | None = MemoryFile() if retain else None
        # Kept chunks spilled while the pipeline still ran: recycled when it ends.
        self._spilled: list[MemoryFile] = []
        self._ended = False
        self._error: ScaletrainError | None = None
        self._cancelled = False
        self._sha = hashlib.sha256()
        self._expected_sha: str | None = None  # the trailer's, once `finish` has it
        self._crcs = BlockCrcs()
        self._to_verify: queue.SimpleQueue[tuple[int, Data, int] | None] = queue.SimpleQueue()
        self._to_hash: queue.SimpleQueue[tuple[int, Data] | None] = queue.SimpleQueue()
        self._to_disk: queue.SimpleQueue[tuple[int, Data] | None] = queue.SimpleQueue()
        self._written = threading.Event()
        self._verifier = threading.Thread(target=self._verify_loop, daemon=True)
        self._hasher = threading.Thread(target=self._hash_loop, daemon=True)
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._verifier.start()
        self._hasher.start()
        self._writer.start()

    # -- the gRPC thread -------------------------------------------------------------------------

    def write(self, chunk: checkpoint_pb2.FileChunk | Chunk) -> None:
        self._raise_if_failed()
        data = chunk.data  # protobuf copies the bytes at every access: take them once
        if len(data) > MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"{self.path}: chunk of {len(data)} bytes at offset {chunk.offset} is over "
                f"the limit of {MAX_CHUNK_BYTES} bytes"
            )
        if chunk.offset != self._size:
            raise InvalidArgument(
                f"{self.path}: chunk at offset {chunk.offset}, expected {self._size} "
                "(chunks must arrive in order without gaps)"
            )
        self._budget.reserve(len(data), holding=self._held)
        with self._lock:
            self._inflight += len(data)
        self._size += len(data)
        self.touched = time.monotonic()
        self._to_verify.put((chunk.offset, data, chunk.crc32c))
        self._to_hash.put((chunk.offset, data))
        self._to_disk.put((chunk.offset, data))

    @property
    def size(self) -> int:
        """Bytes received so far."""
        return self._size

    def verified(self) -> None:
        """Wait until every chunk so far is verified; raise what the verifier found wrong."""
        self._to_verify.put(None)
        self._verifier.join()
        self._raise_if_failed()

    def _held(self) -> int:
        """Bytes this file holds in the budget: in flight to the disk, or kept for memory."""
        with self._lock:
            return self._inflight + (self._memory.size if self._memory is not None else 0)

    def finish(self, trailer: checkpoint_pb2.FileTrailer) -> FileRecord:
        """Wait for the verifier, check the trailer's size; the hasher and the writer go on in
        the background, and the writer checks the trailer's SHA-256 (see the module doc)."""
        self.verified()
        if trailer.size != self._size:
            self._fail(
                InvalidArgument(
                    f"{self.path}: trailer says {trailer.size} bytes, {self._size} were received"
                )
            )
        expected = trailer.sha256.lower()
        if not _SHA256_HEX.fullmatch(expected):
            self._fail(InvalidArgument(f"{self.path}: the trailer's SHA-256 is not 64 hex digits"))
        self._raise_if_failed()
        self._expected_sha = expected
        return FileRecord(
            path=self.path,
            rank=self.header.rank,
            kind=self.header.kind,
            size=self._size,
            sha256=self._expected_sha,
            block_crcs=self._crcs.packed(),
        )

    def end_input(self) -> None:
        """No more chunks: let the hasher and the writer finish the file."""
        self._to_hash.put(None)
        self._to_disk.put(None)

    def cancel(self) -> None:
        """Drop the file: what was received is discarded and its memory released."""
        self._cancelled = True
        self._to_verify.put(None)
        self._verifier.join()
        self.end_input()
        self._writer.join()

    # -- the store, at commit --------------------------------------------------------------------

    def wait_written(self) -> None:
        """Block until the file is on disk (or failed); raise its error."""
        self._written.wait()
        self._raise_if_failed()

    def take_memory(self) -> MemoryFile | None:
        """Hand the kept chunks (still reserved in the budget) to the caller."""
        with self._lock:
            memory, self._memory = self._memory, None
            return memory

    def spill(self) -> int:
        """Stop keeping chunks for the memory tier and release those kept; returns the bytes."""
        with self._lock:
            memory, self._memory = self._memory, None
            kept = memory.size if memory is not None else 0
            if memory is not None and not self._ended:
                self._spilled.append(memory)  # the hasher may still read them
                memory = None
        if kept:
            self._budget.release(kept)
        if memory is not None:
            self._budget.recycle(memory.chunks)
        return kept

    # -- the pipeline threads --------------------------------------------------------------------

    def _fail(self, error: ScaletrainError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _verify_loop(self) -> None:
        while (item := self._to_verify.get()) is not None:
            offset, data, crc = item
            if not self._cancelled and self._error is None:
                actual = crc32c(data)
                if actual != crc:
                    self._fail(
                        InvalidArgument(
                            f"{self.path}: CRC-32C mismatch in chunk at offset {offset} "
                            f"(sent {crc:08x}, received bytes give {actual:08x})"
                        )
                    )
                else:
                    self._crcs.update(data)
            with self._lock:
                self._verified_to = offset + len(data)
            self._settle()

    def _hash_loop(self) -> None:
        while (item := self._to_hash.get()) is not None:
            offset, data = item
            if not self._cancelled and self._error is None:
                self._sha.update(data)
            with self._lock:
                self._hashed_to = offset + len(data)
            self._settle()

    def _settle(self, final: bool = False) -> None:
        """Release the memory of written chunks the verifier and the hasher are done with (all,
        if `final`); the buffers of those not kept go back to the budget for reuse.

        The three threads call it, each after it is done with a chunk.
        """
        released: list[Data] = []
        with self._lock:
            done_to = min(self._verified_to, self._hashed_to)
            while self._unsettled and (final or self._unsettled[0][0] <= done_to):
                _end, data, kept = self._unsettled.popleft()
                self._inflight -= len(data)
                if not kept:
                    released.append(data)
        if released:
            self._budget.release(sum(len(data) for data in released))
            self._budget.recycle(released)

    def _check_sha256(self) -> None:
        """After the hasher: a file whose bytes do not match its trailer's SHA-256 fails."""
        digest = self._sha.hexdigest()
        if self._expected_sha is not None and self._expected_sha != digest:
            self._fail(
                InvalidArgument(
                    f"{self.path}: SHA-256 mismatch (trailer {self._expected_sha[:16]}..., "
                    f"received bytes give {digest[:16]}...); the file was discarded, write it "
                    "again"
                )
            )

    def _write_loop(self) -> None:
        started = time.perf_counter()
        while (item := self._to_disk.get()) is not None:
            offset, data = item
            kept = False
            if not self._cancelled and self._error is None:
                try:
                    self.incoming.write(data)
                except OSError as exc:
                    self._fail(Unavailable(f"{self.path}: ckptd cannot write to its SSD: {exc}"))
                with self._lock:
                    if self._memory is not None and self._error is None:
                        self._memory.append(data)
                        kept = True
            with self._lock:
                self._unsettled.append((offset + len(data), data, kept))
            self._settle()
        self._verifier.join()  # finish() or cancel() ended it before ending this loop
        self._hasher.join()  # end_input() ended it with this loop
        if not self._cancelled and self._error is None:
            self._check_sha256()
        self._settle(final=True)
        try:
            if self._cancelled or self._error is not None:
                self.incoming.discard()
                self.spill()
            else:
                self.incoming.sync_and_close()
                self._metrics.bytes.labels("SSD", "write").inc(self._size)
                self._metrics.seconds.labels("SSD", "write").observe(time.perf_counter() - started)
                self._on_written(self)
        except OSError as exc:
            self._fail(Unavailable(f"{self.path}: ckptd cannot write to its SSD: {exc}"))
            self.incoming.discard()
            self.spill()
        except ScaletrainError as exc:
            self._fail(exc)
            self.spill()
        finally:
            with self._lock:
                self._ended = True
                spilled, self._spilled = self._spilled, []
            self._budget.recycle(chunk for memory in spilled for chunk in memory.chunks)
            self._written.set()
