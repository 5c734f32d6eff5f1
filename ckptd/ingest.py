"""Receiving one file of a save: a pipeline in which the receiving thread only receives.

The receiving thread (gRPC's, or the data socket's) checks each chunk's size and place in the
file, reserves its bytes in the memory budget (waiting when the budget is full: backpressure)
and hands the chunk to two threads that work side by side: a verifier checks its CRC-32Cs, keeps
the per-block CRCs and keeps the chunk for the memory tier, and a writer appends it to a
temporary SSD file. CRC and file writes release the GIL, so receiving, checking and writing
overlap. A chunk's memory is released once it is verified and written (unless the memory tier
keeps it). The memory copy is complete once the verifier is (`finish`), however far behind the
disk is: a replica counts as held in memory before its SSD copy is durable (`ckptd.replicas`).

The WriteFile (FinishUpload) reply waits for the verifier, not for the disk: every chunk
arrived as the client checksummed it, and the trailer's size and file checksum (the CRC-32C of
the block CRCs, `ckptd.manifest.file_crc32c`) match. Only then does the file join its save; a
commit waits for the disk, because a checkpoint is committed only once it is durable.

Every byte is checked once on each side: a data socket frame carries the CRC-32C of each of its
blocks, which are the CRCs the file keeps at rest; a WriteFile chunk carries one CRC-32C, so
ckptd computes the block CRCs beside it. There is no cryptographic hash of each file: one would
cost more CPU than the transfer itself and protect against nothing the CRCs miss short of
deliberate forgery, which the TLS channel and the tokens guard against.

A chunk whose bytes do not match its CRC, or a file whose bytes do not match its trailer, is bad
input (INVALID_ARGUMENT): the client sent something other than what it described and must send
it again; DATA_LOSS is kept for stored data that no tier can serve intact.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from ckptd.manifest import FileRecord, file_crc32c
from ckptd.metrics import Metrics
from ckptd.states import SSD
from ckptd.tiers import BLOCK_BYTES, BlockCrcs, block_crcs_of
from ckptd.tiers.memory import MemoryBudget, MemoryFile
from ckptd.tiers.ssd import IncomingFile
from ckptd.wire import BlockChunk, Chunk, crc32c
from scaletrain.errors import InvalidArgument, ScaletrainError, Unavailable
from scaletrain.names import TIER_LABELS
from scaletrain.transport import MAX_CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2

# A chunk's bytes: a view into the received message (ckptd.wire), or bytes from protobuf.
Data = bytes | memoryview
# The SSD tier's metrics label, for the bytes and seconds this pipeline's writer spends on it.
_SSD = TIER_LABELS[SSD]


class FileUpload:
    """One file being received. The store's saves create it (`Saves.begin_file`).

    `on_written(upload)` runs in the writer thread once the file is complete, fsynced and closed;
    it decides (under the store's lock) whether the file joins the save's staging dir. Without
    `incoming` (a memory-only checkpoint's file) nothing is written: the memory copy is all.
    """

    def __init__(
        self,
        header: checkpoint_pb2.FileHeader,
        incoming: IncomingFile | None,
        budget: MemoryBudget,
        retain: bool,
        on_written: Callable[[FileUpload], None],
        metrics: Metrics,
        on_settled: Callable[[int], None] | None = None,
    ) -> None:
        """`on_settled(n)`: n more bytes are checked and written (no longer in flight), called
        by the pipeline's threads; the data socket gives them back to their caller's share."""
        self.header = header
        self.path = header.path
        self.incoming = incoming
        self.touched = time.monotonic()
        self._budget = budget
        self._on_written = on_written
        self._on_settled = on_settled
        self._metrics = metrics
        self._lock = threading.Lock()
        self._size = 0
        self._inflight = 0  # reserved bytes not yet verified and written
        self._verified_to = 0  # the verifier is done with bytes [0, _verified_to)
        # Chunks on disk whose memory waits for the verifier: (end, bytes, kept).
        self._unsettled: deque[tuple[int, Data, list[bool]]] = deque()
        self._memory: MemoryFile | None = MemoryFile() if retain else None
        # Kept chunks spilled while the pipeline still ran: recycled when it ends.
        self._spilled: list[MemoryFile] = []
        self._ended = False
        self._error: ScaletrainError | None = None
        self._cancelled = False
        self._crcs = BlockCrcs()
        # A chunk, its bytes, and whether the memory copy kept them (set by the verifier).
        self._to_verify: queue.SimpleQueue[tuple[Chunk | BlockChunk, Data, list[bool]] | None]
        self._to_verify = queue.SimpleQueue()
        self._to_disk: queue.SimpleQueue[tuple[int, Data, list[bool]] | None]
        self._to_disk = queue.SimpleQueue()
        self._written = threading.Event()
        self._verifier = threading.Thread(target=self._verify_loop, daemon=True)
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._verifier.start()
        self._writer.start()

    # -- the gRPC thread -------------------------------------------------------------------------

    def write(self, chunk: checkpoint_pb2.FileChunk | Chunk | BlockChunk) -> None:
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
        if isinstance(chunk, BlockChunk) and chunk.offset % BLOCK_BYTES:
            raise InvalidArgument(
                f"{self.path}: a frame of block CRCs at offset {chunk.offset} does not start on "
                f"a {BLOCK_BYTES}-byte block (only the last frame may hold a partial block)"
            )
        self._budget.reserve(len(data), holding=self._held)
        with self._lock:
            self._inflight += len(data)
        self._size += len(data)
        self.touched = time.monotonic()
        if isinstance(chunk, checkpoint_pb2.FileChunk):
            chunk = Chunk(chunk.offset, memoryview(data), chunk.crc32c)
        kept = [False]
        self._to_verify.put((chunk, data, kept))
        self._to_disk.put((chunk.offset, data, kept))

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
        """Wait for the verifier, check the trailer's size and checksum; the writer goes on in
        the background."""
        self.verified()
        block_crcs = self._crcs.packed()
        checksum = file_crc32c(block_crcs)
        if trailer.size != self._size:
            self._fail(
                InvalidArgument(
                    f"{self.path}: trailer says {trailer.size} bytes, {self._size} were received"
                )
            )
        elif trailer.crc32c != checksum:
            self._fail(
                InvalidArgument(
                    f"{self.path}: the trailer's file CRC-32C {trailer.crc32c:08x} does not match "
                    f"the bytes received ({checksum:08x}); write the file again"
                )
            )
        self._raise_if_failed()
        return FileRecord(
            path=self.path,
            rank=self.header.rank,
            kind=self.header.kind,
            size=self._size,
            block_crcs=block_crcs,
        )

    def end_input(self) -> None:
        """No more chunks: let the writer finish the file."""
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

    def settle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the writer to be done with the file, written or failed
        (a clean stop keeps what it accepted); whether it is."""
        return self._written.wait(timeout_s)

    @property
    def keeps_memory(self) -> bool:
        """Whether the memory copy is still kept (not spilled nor taken)."""
        with self._lock:
            return self._memory is not None

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
                self._spilled.append(memory)  # the verifier may still read them
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
            chunk, data, kept = item
            if not self._cancelled and self._error is None:
                self._verify(chunk)
            with self._lock:
                if self._memory is not None and self._error is None and not self._cancelled:
                    self._memory.append(data)
                    kept[0] = True
                self._verified_to = chunk.offset + len(chunk.data)
            self._settle()

    def _verify(self, chunk: Chunk | BlockChunk) -> None:
        """Check a chunk's CRC-32C(s) and keep its block CRCs."""
        if isinstance(chunk, BlockChunk):
            actual = block_crcs_of(chunk.data)
            pairs = zip(actual, chunk.block_crcs, strict=True)  # datapath sizes the list
            bad = next((i for i, (got, sent) in enumerate(pairs) if got != sent), None)
            if bad is not None:
                self._fail(
                    InvalidArgument(
                        f"{self.path}: CRC-32C mismatch in the block at offset "
                        f"{chunk.offset + bad * BLOCK_BYTES} (sent {chunk.block_crcs[bad]:08x}, "
                        f"received bytes give {actual[bad]:08x})"
                    )
                )
            else:
                self._crcs.extend(actual, len(chunk.data))
            return
        actual_crc = crc32c(chunk.data)
        if actual_crc != chunk.crc32c:
            self._fail(
                InvalidArgument(
                    f"{self.path}: CRC-32C mismatch in chunk at offset {chunk.offset} "
                    f"(sent {chunk.crc32c:08x}, received bytes give {actual_crc:08x})"
                )
            )
        else:
            self._crcs.update(chunk.data)

    def _settle(self, final: bool = False) -> None:
        """Release the memory of written chunks the verifier is done with (all, if `final`);
        the buffers of those not kept go back to the budget for reuse.

        Both threads call it, each after it is done with a chunk.
        """
        released: list[Data] = []
        settled = 0
        with self._lock:
            done_to = self._verified_to
            while self._unsettled and (final or self._unsettled[0][0] <= done_to):
                _end, data, kept = self._unsettled.popleft()
                self._inflight -= len(data)
                settled += len(data)
                if not kept[0]:
                    released.append(data)
        if settled and self._on_settled is not None:
            self._on_settled(settled)
        if released:
            self._budget.release(sum(len(data) for data in released))
            self._budget.recycle(released)

    def _discard_incoming(self) -> None:
        if self.incoming is not None:
            self.incoming.discard()

    def _write_loop(self) -> None:
        started = time.perf_counter()
        while (item := self._to_disk.get()) is not None:
            offset, data, kept = item
            if self.incoming is not None and not self._cancelled and self._error is None:
                try:
                    self.incoming.write(data)
                except OSError as exc:
                    self._fail(Unavailable(f"{self.path}: ckptd cannot write to its SSD: {exc}"))
            with self._lock:
                self._unsettled.append((offset + len(data), data, kept))
            self._settle()
        self._verifier.join()  # finish() or cancel() ended it before ending this loop
        self._settle(final=True)
        try:
            if self._cancelled or self._error is not None:
                self._discard_incoming()
                self.spill()
            else:
                if self.incoming is not None:
                    self.incoming.sync_and_close()
                    self._metrics.bytes.labels(_SSD, "write").inc(self._size)
                    self._metrics.seconds.labels(_SSD, "write").observe(
                        time.perf_counter() - started
                    )
                self._on_written(self)
        except OSError as exc:
            self._fail(Unavailable(f"{self.path}: ckptd cannot write to its SSD: {exc}"))
            self._discard_incoming()
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
