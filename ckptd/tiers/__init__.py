"""The storage tiers of ckptd (memory -> SSD -> S3) and what they share.

Every tier holds committed checkpoints under the same key and answers the same questions (has,
read a byte range, delete, list); only `put` differs, because each tier is filled from the form the
bytes naturally have there (buffers, a staged directory, SSD files). Integrity is checked the same
way on every tier: each file carries one CRC-32C per BLOCK_BYTES block, recorded when the file
arrived, so a read of any byte range verifies only the blocks it touches instead of the whole file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Protocol

from ckptd.wire import crc32c

# Verification granularity: a small read costs at most one block of extra I/O.
BLOCK_BYTES = 256 * 1024


@dataclass(frozen=True, order=True)
class CheckpointKey:
    """A checkpoint's identity on every tier; names are validated by the store before use."""

    run: str
    step: int

    def __str__(self) -> str:
        return f"{self.run}/{self.step}"


class Tier(Protocol):
    """What the store asks of every tier once a checkpoint is committed there."""

    tier: int  # a common_pb2.Tier value

    def has(self, key: CheckpointKey) -> bool: ...

    def read_range(self, key: CheckpointKey, path: str, offset: int, length: int) -> bytes: ...

    def delete(self, key: CheckpointKey) -> bool: ...

    def list(self) -> list[CheckpointKey]: ...


def page_aligned_buffer(size: int) -> mmap.mmap:
    """`size` bytes of private anonymous memory, page-aligned (for O_DIRECT writes).

    MAP_PRIVATE: Python's default for an anonymous map is MAP_SHARED, which the kernel backs with
    shmem, whose pages cost several times more to fault in than plain process memory.
    """
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def block_crcs_of(data: bytes | memoryview) -> list[int]:
    """The CRC-32C of each BLOCK_BYTES block of `data` (the last may be short)."""
    view = memoryview(data)
    return [crc32c(view[i : i + BLOCK_BYTES]) for i in range(0, len(view), BLOCK_BYTES)]


class BlockCrcs:
    """Accumulates the CRC-32C of each BLOCK_BYTES block of a file as its bytes stream in."""

    def __init__(self) -> None:
        self._done: list[int] = []
        self._crc = 0
        self._fill = 0

    def extend(self, crcs: list[int], nbytes: int) -> None:
        """Take the block CRCs (`block_crcs_of`) of the next `nbytes` bytes, which start at a
        block boundary."""
        assert self._fill == 0, "extend() needs the bytes so far to end on a block boundary"
        short = nbytes % BLOCK_BYTES
        if short:
            *crcs, self._crc = crcs
            self._fill = short
        self._done.extend(crcs)

    def update(self, data: bytes | memoryview) -> None:
        pos = 0
        while pos < len(data):
            take = min(len(data) - pos, BLOCK_BYTES - self._fill)
            self._crc = crc32c(data[pos : pos + take], self._crc)
            self._fill += take
            pos += take
            if self._fill == BLOCK_BYTES:
                self._done.append(self._crc)
                self._crc = 0
                self._fill = 0

    def packed(self) -> bytes:
        """The CRCs as little-endian uint32s, one per block (the last block may be short)."""
        crcs = [*self._done, self._crc] if self._fill else self._done
        return struct.pack(f"<{len(crcs)}I", *crcs)


def block_span(offset: int, length: int, size: int) -> tuple[int, int]:
    """The block-aligned byte range [start, end) that covers [offset, offset+length) of a file."""
    start = offset // BLOCK_BYTES * BLOCK_BYTES
    end = min(size, -(-(offset + length) // BLOCK_BYTES) * BLOCK_BYTES)
    return start, end


def first_bad_block(data: bytes, start: int, packed_crcs: bytes) -> int | None:
    """Index of the first block of `data` (read from block-aligned `start`) whose CRC differs.

    Each block is checked in place (a view, not a copy) and without the GIL (`crc32c`): every
    read runs this over all its bytes, beside the thread that sends the previous piece."""
    first = start // BLOCK_BYTES
    view = memoryview(data)
    for i in range(0, len(view), BLOCK_BYTES):
        block = first + i // BLOCK_BYTES
        (expected,) = struct.unpack_from("<I", packed_crcs, 4 * block)
        if crc32c(view[i : i + BLOCK_BYTES]) != expected:
            return block
    return None
