"""Small pure pieces of ckptd: names, block checksums, configuration, the chunk wire format."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import google_crc32c
import pytest

from ckptd.config import CkptdConfig, S3Config
from ckptd.manifest import data_crc32c, file_crc32c
from ckptd.names import check_path, check_run
from ckptd.tiers import (
    BLOCK_BYTES,
    BlockCrcs,
    CheckpointKey,
    block_crcs_of,
    block_span,
    first_bad_block,
    page_aligned_buffer,
)
from ckptd.tiers.memory import MemoryBudget, MemoryFile, MemoryTier
from ckptd.tiers.ssd import IncomingFile
from ckptd.wire import Chunk, crc32c, decode_write_request, encode_write_request
from scaletrain.errors import InvalidArgument
from scaletrain.transport import CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2


@pytest.mark.parametrize("run", ["llama-8b", "run_1", "exp.2026-11-30T12:00", "a"])
def test_ordinary_run_names_are_accepted(run: str) -> None:
    assert check_run(run) == run


@pytest.mark.parametrize(
    "run", ["", "..", ".", "a/b", "a\\b", "/abs", "x\x00y", "-flag", "a b", "x" * 129]
)
def test_run_names_that_could_escape_or_confuse_are_rejected_in_one_line(run: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_run(run)
    assert "\n" not in str(err.value) and "run name" in str(err.value)


@pytest.mark.parametrize("path", [".metadata", "__0_0.distcp", "sub/__1_0.distcp"])
def test_dcp_file_names_are_accepted(path: str) -> None:
    assert check_path(path) == path


@pytest.mark.parametrize(
    "path",
    ["", "../x", "a/../../b", "/etc/passwd", "a//b", "./x", "x\x00", "a\\b", "_COMMITTED"],
)
def test_file_paths_outside_the_checkpoint_dir_or_reserved_are_rejected(path: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_path(path)
    assert "\n" not in str(err.value)


def test_block_crcs_find_the_one_flipped_byte_whatever_the_write_sizes() -> None:
    data = bytes(range(256)) * (3 * BLOCK_BYTES // 256) + b"tail"
    crcs = BlockCrcs()
    for i in range(0, len(data), 100_003):  # writes that straddle block boundaries
        crcs.update(data[i : i + 100_003])
    packed = crcs.packed()
    assert len(packed) == 4 * 4  # three full blocks and a short one
    assert first_bad_block(data, 0, packed) is None
    damaged = bytearray(data)
    damaged[2 * BLOCK_BYTES + 7] ^= 1
    assert first_bad_block(bytes(damaged), 0, packed) == 2
    start, end = block_span(2 * BLOCK_BYTES + 5, 10, len(data))
    assert (start, end) == (2 * BLOCK_BYTES, 3 * BLOCK_BYTES)
    assert first_bad_block(bytes(damaged[start:end]), start, packed) == 2
    assert block_span(len(data) - 2, 2, len(data)) == (3 * BLOCK_BYTES, len(data))


def test_block_crcs_taken_per_frame_equal_those_taken_per_chunk() -> None:
    """The data socket's frames carry block CRCs, WriteFile's chunks one CRC each: a file has
    the same block CRCs, and so the same checksum, whichever way it came."""
    data = os.urandom(2 * CHUNK_BYTES + 12345)
    per_chunk, per_frame = BlockCrcs(), BlockCrcs()
    for i in range(0, len(data), 1_000_000):
        per_chunk.update(data[i : i + 1_000_000])
    for i in range(0, len(data), CHUNK_BYTES):
        frame = data[i : i + CHUNK_BYTES]
        per_frame.extend(block_crcs_of(frame), len(frame))
    assert per_frame.packed() == per_chunk.packed()
    assert file_crc32c(per_frame.packed()) == data_crc32c(data)


def test_s3_config_never_shows_its_secret_and_reads_credentials_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    config = S3Config.from_env("http://127.0.0.1:9000", bucket="ckpts")
    assert (config.access_key_id, config.secret_access_key) == ("AKIDEXAMPLE", "very-secret-value")
    assert "very-secret-value" not in repr(config)
    assert "very-secret-value" not in repr(CkptdConfig(data_dir="/tmp/x", s3=config))


def test_a_negative_memory_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        CkptdConfig(data_dir="/tmp/x", memory_budget_bytes=-1)


@pytest.mark.parametrize(
    ("offset", "size", "crc"), [(0, 0, 0), (0, 10, 0), (5, 1, 7), (1 << 40, 300_000, 0xFFFFFFFF)]
)
def test_a_chunk_encoded_by_hand_is_the_protobuf_message_and_decodes_to_the_same_fields(
    offset: int, size: int, crc: int
) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    wire = encode_write_request(Chunk(offset, memoryview(data), crc))
    parsed = checkpoint_pb2.WriteFileRequest.FromString(wire)
    assert (parsed.chunk.offset, parsed.chunk.data, parsed.chunk.crc32c) == (offset, data, crc)
    decoded = decode_write_request(wire)
    assert decoded.WhichOneof("part") == "chunk"
    assert (decoded.chunk.offset, bytes(decoded.chunk.data), decoded.chunk.crc32c) == (
        offset,
        data,
        crc,
    )
    assert crc32c(memoryview(data)) == google_crc32c.value(data)


def test_messages_that_are_not_a_canonical_chunk_are_decoded_by_protobuf() -> None:
    header = checkpoint_pb2.WriteFileRequest(header=checkpoint_pb2.FileHeader(path="x", rank=1))
    assert decode_write_request(header.SerializeToString()) == header
    chunk = checkpoint_pb2.FileChunk(offset=3, data=b"abc", crc32c=9).SerializeToString()
    reordered = b"\x12" + bytes([len(chunk) + 2]) + b"\x18\x01" + chunk  # an unknown field first
    assert decode_write_request(reordered).chunk.data == b"abc"


def test_receive_buffers_are_reused_by_size_within_the_memory_budget_and_give_way() -> None:
    budget = MemoryBudget(3 * CHUNK_BYTES)
    first = budget.buffer(CHUNK_BYTES)
    budget.recycle([first, memoryview(bytearray(CHUNK_BYTES))[:10], b"x" * 10, first[:10]])
    assert budget.buffer(CHUNK_BYTES).obj is first.obj  # only a whole buffer it lent comes back
    assert budget.buffer(CHUNK_BYTES).obj is not first.obj

    frame = budget.buffer(BLOCK_BYTES + 5)  # a frame of another size: a buffer of its own
    assert len(frame) == BLOCK_BYTES + 5 and len(frame.obj) == BLOCK_BYTES + mmap.PAGESIZE
    budget.recycle([frame])
    assert budget.buffer(CHUNK_BYTES).obj is not frame.obj
    again = budget.buffer(BLOCK_BYTES + 100)  # the same size to the page
    assert again.obj is frame.obj and len(again) == BLOCK_BYTES + 100

    budget.recycle([first, budget.buffer(CHUNK_BYTES)])
    budget.reserve(2 * CHUNK_BYTES, holding=lambda: 0)  # leaves room for one spare buffer only
    kept = budget.buffer(CHUNK_BYTES)
    assert budget.buffer(CHUNK_BYTES).obj is not kept.obj  # the other spare gave way
    other = budget.buffer(CHUNK_BYTES)
    budget.recycle([kept, other])  # room for one beside the reserved
    assert budget.buffer(CHUNK_BYTES).obj is kept.obj
    assert budget.buffer(CHUNK_BYTES).obj is not other.obj
    assert isinstance(budget.buffer(100).obj, bytearray)  # a tail under a page is not pooled


def test_a_memory_read_lent_as_a_view_keeps_its_buffer_from_new_uploads_until_given_back() -> None:
    budget = MemoryBudget(4 * CHUNK_BYTES)
    tier, key = MemoryTier(budget), CheckpointKey("run", 1)
    chunk = budget.buffer(CHUNK_BYTES)
    chunk[:] = os.urandom(CHUNK_BYTES)
    budget.reserve(CHUNK_BYTES + 4, holding=lambda: 0)  # the file's bytes, as a save's are
    file = MemoryFile()
    file.append(chunk)
    file.append(b"tail")
    tier.put(key, {"f": file})

    view, give_back = tier.read_view(key, "f", BLOCK_BYTES, BLOCK_BYTES)
    assert give_back is not None and view.obj is chunk.obj  # no copy
    assert view == chunk[BLOCK_BYTES : 2 * BLOCK_BYTES]
    across, none = tier.read_view(key, "f", CHUNK_BYTES - 2, 6)  # spans two chunks: a copy
    assert (across, none) == (bytes(chunk[-2:]) + b"tail", None)

    tier.delete(key)  # while the view is out: its bytes leave the budget, its buffer stays
    assert budget.used == 0
    assert budget.buffer(CHUNK_BYTES).obj is not chunk.obj
    give_back()  # the last view back: now the buffer may receive another chunk
    assert budget.buffer(CHUNK_BYTES).obj is chunk.obj


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_an_incoming_file_holds_exactly_its_bytes_whatever_their_alignment(
    tmp_path: Path, where: str
) -> None:
    """Aligned receive buffers go to disk around the page cache, other bytes through a bounce
    buffer, the last page padded then cut; where O_DIRECT is refused, through the page cache."""
    directory = tmp_path if where == "disk" else Path("/dev/shm")
    if not directory.is_dir():
        pytest.skip("no /dev/shm")
    path = directory / f"incoming-{os.getpid()}"
    aligned = MemoryBudget(total=CHUNK_BYTES).buffer(CHUNK_BYTES)
    aligned[:] = os.urandom(CHUNK_BYTES)
    pieces = [
        memoryview(aligned),
        os.urandom(1000),  # read-only and unaligned: through the bounce buffer
        memoryview(aligned)[: 3 * mmap.PAGESIZE],  # aligned, but after unaligned bytes
        os.urandom((1 << 20) + 17),  # fills the bounce buffer, then a partial page
    ]
    incoming = IncomingFile(path)
    for piece in pieces:
        incoming.write(piece)
    incoming.sync_and_close()
    try:
        assert path.read_bytes() == b"".join(bytes(piece) for piece in pieces)
    finally:
        path.unlink()


def test_a_full_disk_at_the_last_flush_is_an_oserror_for_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while the bounce buffer is flushed must reach the writer as the OSError it is (its
    traceback holding a view of the buffer once made closing it raise BufferError, which killed
    ckptd's writer thread)."""
    incoming = IncomingFile(tmp_path / "full")
    incoming.write(os.urandom(5000))  # waits in the bounce buffer (or is written at once)

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    incoming._fill = incoming._fill or 5000  # something left to flush, whatever the filesystem
    if incoming._bounce is None:
        incoming._bounce = page_aligned_buffer(1 << 20)
    with pytest.raises(OSError, match="No space left"):
        incoming.sync_and_close()


def test_a_discarded_incoming_file_leaves_nothing(tmp_path: Path) -> None:
    incoming = IncomingFile(tmp_path / "partial")
    incoming.write(os.urandom(5000))
    incoming.discard()
    assert not any(tmp_path.iterdir())
