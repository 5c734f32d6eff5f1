"""How a file written in pieces of any size is cut for the wire (`ckptd.upload`)."""

from __future__ import annotations

import os
import random

from ckptd.tiers import BLOCK_BYTES
from ckptd.upload import _Pieces
from scaletrain.transport import CHUNK_BYTES


def _cut(writes: list[bytes]) -> list[bytes]:
    pieces: list[bytes] = []
    cutter = _Pieces(lambda piece: pieces.append(bytes(piece)))
    for data in writes:
        cutter.write(data)
    cutter.flush()
    return pieces


def test_writes_of_any_size_become_whole_blocks_up_to_a_chunk_with_nothing_lost() -> None:
    rng = random.Random(0)
    choices = [1, 17, 4096, BLOCK_BYTES - 1, BLOCK_BYTES, 3 * BLOCK_BYTES + 5]
    choices += [CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 77]
    sizes = [rng.choice(choices) for _ in range(60)]
    writes = [os.urandom(size) for size in sizes]
    pieces = _cut(writes)
    assert b"".join(pieces) == b"".join(writes)
    assert all(len(p) % BLOCK_BYTES == 0 and 0 < len(p) <= CHUNK_BYTES for p in pieces[:-1])
    assert 0 < len(pieces[-1]) <= CHUNK_BYTES


def test_a_big_write_goes_on_as_views_of_itself_after_completing_a_block() -> None:
    """Only the bytes that do not fill a block are copied: a tensor after a small header costs
    at most a block's copy at each end."""
    header, tensor = os.urandom(100), bytearray(os.urandom(3 * CHUNK_BYTES + 1000))
    seen: list[tuple[object, int]] = []
    cutter = _Pieces(lambda piece: seen.append((piece.obj, len(piece))))
    cutter.write(header)
    cutter.write(tensor)
    cutter.flush()
    copied = sum(n for owner, n in seen if owner is not tensor)
    assert copied < 2 * BLOCK_BYTES + len(header)
    assert sum(n for _, n in seen) == len(header) + len(tensor)
