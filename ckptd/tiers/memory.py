"""The memory tier and the byte budget it shares with the data in flight.

The memory tier exists so that a restore right after a save (the common case after a crash of one
rank) reads at memory speed. Its checkpoints are kept as the very chunks that arrived over the
wire (no joined copy), and they come out of one `MemoryBudget` together with the chunks still
being verified and written to SSD. When the budget is full, the store frees memory (it evicts
checkpoints that a durable tier holds, and spills saves in progress to SSD only), and writers
wait for their chunks to reach the disk: ckptd slows writers down instead of running out of
memory. The tier never decides on its own what to drop; the store does, by the retention rules.

The budget also keeps the receive buffers of the data socket that no chunk uses any more, and
lends them to the next chunks: memory the process touches for the first time costs a page fault
per 4 KiB (about 1 GB/s here, slower than the socket), memory it reuses does not. A buffer comes
back only from a place where nothing else can still read it (see `FileUpload` and `MemoryTier`),
and spare buffers never take memory that chunks need: the bytes reserved and the spare buffers
stay within the budget, the spares giving way first. The buffers are anonymous memory maps,
page-aligned, so the SSD tier writes them around the page cache (`IncomingFile`).
"""

from __future__ import annotations

import bisect
import functools
import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ckptd.tiers import CheckpointKey, page_aligned_buffer
from scaletrain.v1 import common_pb2


class MemoryBudget:
    """A byte budget that blocks a reservation until it fits.

    A caller holding nothing in flight is always granted one reservation, so every stream makes
    progress even when the budget is smaller than one chunk (memory stays bounded by the budget
    plus one chunk per stream).
    """

    def __init__(self, total: int, relieve: Callable[[], None] | None = None) -> None:
        self.total = total
        self._used = 0
        self._cond = threading.Condition()
        self._relieve = relieve
        # Receive buffers that no chunk uses, by size; with the bytes used, within total.
        self._spare: dict[int, list[mmap.mmap]] = {}
        self._spare_bytes = 0

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, n: int, holding: Callable[[], int]) -> None:
        """Reserve `n` bytes, waiting (and asking for relief) while they do not fit.

        `holding()` is what the caller still has in flight; at 0 it is granted regardless.
        """
        while True:
            with self._cond:
                if self._used + n <= self.total or holding() == 0:
                    self._used += n
                    self._trim_spares()  # they give way to chunks, before anything is evicted
                    return
            if self._relieve is not None:
                self._relieve()
            with self._cond:
                if self._used + n <= self.total or holding() == 0:
                    continue
                self._cond.wait(0.05)

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()

    def _trim_spares(self) -> None:
        """Drop spare buffers (under the lock) until they fit beside the bytes reserved."""
        while self._spare and self._used + self._spare_bytes > self.total:
            size = max(self._spare)
            self._spare[size].pop()
            self._spare_bytes -= size
            if not self._spare[size]:
                del self._spare[size]

    def buffer(self, n: int) -> memoryview:
        """`n` bytes to receive a chunk into: a spare buffer of that size (to the page) when
        there is one, else a new page-aligned one; small ones (under a page, a file's tail) are
        plain bytearrays. A stream of saves sends frames of the same sizes (a DCP writer's follow
        its tensors), so buffers of each size come back for the next save."""
        if n < mmap.PAGESIZE:
            return memoryview(bytearray(n))
        size = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._cond:
            pool = self._spare.get(size)
            if pool:
                self._spare_bytes -= size
                buf = pool.pop()
                if not pool:
                    del self._spare[size]
                return memoryview(buf)[:n]
        return memoryview(page_aligned_buffer(size))[:n]

    def recycle(self, chunks: Iterable[bytes | memoryview]) -> None:
        """Take back the buffers of `chunks` that `buffer` lent, while they fit in the budget.

        The caller guarantees that nothing reads these chunks any more.
        """
        with self._cond:
            for data in chunks:
                buf = data.obj if isinstance(data, memoryview) else None
                if not isinstance(buf, mmap.mmap) or len(data) <= len(buf) - mmap.PAGESIZE:
                    continue  # not lent by `buffer`, or a view of part of one
                if self._used + self._spare_bytes + len(buf) <= self.total:
                    self._spare.setdefault(len(buf), []).append(buf)
                    self._spare_bytes += len(buf)


class MemoryFile:
    """One file as the list of chunks it arrived in (views into the received messages, often);
    reads gather the pieces of a range."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._chunks: list[bytes | memoryview] = []
        self.size = 0

    def append(self, data: bytes | memoryview) -> None:
        self._starts.append(self.size)
        self._chunks.append(data)
        self.size += len(data)

    @property
    def chunks(self) -> list[bytes | memoryview]:
        return self._chunks

    def read(self, offset: int, length: int) -> bytes:
        end = min(self.size, offset + length)
        if offset >= end:
            return b""
        i = bisect.bisect_right(self._starts, offset) - 1
        pieces = []
        while offset < end:
            chunk, start = self._chunks[i], self._starts[i]
            take = chunk[offset - start : end - start]
            pieces.append(take)
            offset += len(take)
            i += 1
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)

    def view(self, offset: int, length: int) -> memoryview | None:
        """Bytes [offset, offset+length) as a view of the chunk that holds them all; None when
        they span chunks (or the file ends before them)."""
        if length <= 0 or offset + length > self.size:
            return None
        i = bisect.bisect_right(self._starts, offset) - 1
        chunk, start = self._chunks[i], self._starts[i]
        if offset + length > start + len(chunk):
            return None
        return memoryview(chunk).cast("B")[offset - start : offset + length - start]


class MemoryTier:
    """Committed checkpoints held in process memory; their bytes are already in the budget."""

    tier = common_pb2.TIER_MEMORY

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        # Insertion order is commit order: the first entry is the oldest.
        self._checkpoints: OrderedDict[CheckpointKey, dict[str, MemoryFile]] = OrderedDict()
        # Views lent (`read_view`) and not yet given back, per checkpoint's files (by id), and
        # the files dropped while some were out: their buffers are recycled by the last return.
        self._lent: dict[int, int] = {}
        self._retired: dict[int, dict[str, MemoryFile]] = {}

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(_size(files) for files in self._checkpoints.values())

    def put(self, key: CheckpointKey, files: dict[str, MemoryFile]) -> None:
        """Keep `files` (reserved in the budget by the caller, released by `delete`)."""
        with self._lock:
            old = self._checkpoints.pop(key, None)
            self._checkpoints[key] = files
        if old is not None:
            self._drop(old)

    def has(self, key: CheckpointKey) -> bool:
        with self._lock:
            return key in self._checkpoints

    def read_range(self, key: CheckpointKey, path: str, offset: int, length: int) -> bytes:
        with self._lock:
            files = self._checkpoints.get(key)
            if files is None or path not in files:
                raise FileNotFoundError(f"{key}/{path} is not in memory")
            # Copied under the lock: once `delete` takes a file out, no read is still in it,
            # and its buffers can receive other chunks.
            return files[path].read(offset, length)

    def read_view(
        self, key: CheckpointKey, path: str, offset: int, length: int
    ) -> tuple[bytes | memoryview, Callable[[], None] | None]:
        """Like `read_range`, without the copy where the range lies in one chunk (a data socket
        upload's 4 MiB frames hold a read's 4 MiB pieces exactly): a view into it, and the call
        that gives it back, which the caller makes once nothing reads the view any more.

        Why a loan and not a copy: copying a piece into fresh memory costs more CPU than sending
        it. The loan keeps the chunk's buffer from being recycled (`MemoryBudget.recycle`) into
        another upload while it is out: a checkpoint dropped meanwhile gives its bytes back to
        the budget at once (the views still out, a few pieces per connection, are briefly over
        it) and its buffers to the budget's spares only when the last view comes back. A view
        never given back costs only that reuse, never a wrong byte."""
        with self._lock:
            files = self._checkpoints.get(key)
            if files is None or path not in files:
                raise FileNotFoundError(f"{key}/{path} is not in memory")
            view = files[path].view(offset, length)
            if view is None:
                return files[path].read(offset, length), None
            return view, self._lend(files)

    def pin(self, key: CheckpointKey) -> Callable[[], None]:
        """Keep the buffers of `key`'s files from being recycled until the call returned (as a
        view lent by `read_view` does): for a copy put here while its SSD writer still reads
        them (`ckptd.holding`)."""
        with self._lock:
            return self._lend(self._checkpoints[key])

    def _lend(self, files: dict[str, MemoryFile]) -> Callable[[], None]:
        """Count one more loan of `files` (under the lock); returns the call that ends it."""
        self._lent[id(files)] = self._lent.get(id(files), 0) + 1
        return functools.partial(self._give_back, files)

    def _give_back(self, files: dict[str, MemoryFile]) -> None:
        with self._lock:
            left = self._lent.pop(id(files)) - 1
            if left:
                self._lent[id(files)] = left
                return
            retired = self._retired.pop(id(files), None)
        if retired is not None:
            self.budget.recycle(chunk for f in retired.values() for chunk in f.chunks)

    def delete(self, key: CheckpointKey) -> bool:
        with self._lock:
            files = self._checkpoints.pop(key, None)
        if files is None:
            return False
        self._drop(files)
        return True

    def _drop(self, files: dict[str, MemoryFile]) -> None:
        with self._lock:
            lent = id(files) in self._lent
            if lent:
                self._retired[id(files)] = files
        if not lent:
            release(files, self.budget)
            return
        self.budget.release(_size(files))

    def list(self) -> list[CheckpointKey]:
        """Checkpoints held, oldest commit first."""
        with self._lock:
            return list(self._checkpoints)


def _size(files: dict[str, MemoryFile]) -> int:
    return sum(f.size for f in files.values())


def release(files: dict[str, MemoryFile], budget: MemoryBudget) -> None:
    """Give a memory copy's bytes back to `budget` (and its buffers, for reuse)."""
    budget.release(_size(files))
    budget.recycle(chunk for f in files.values() for chunk in f.chunks)
