"""WriteFile chunks on the wire without the copies protobuf makes, in both directions.

A 4 MiB chunk through generated protobuf code is copied into the message, again when serialized,
again when parsed and again when its `data` is read, each time into fresh memory (page faults:
~0.5 GB/s on the project's machines). Chunks are most of ckptd's bytes, so they take a shortcut:
the client writes a chunk message's few header bytes and the caller's buffer straight into one
wire message, and the server decodes it into a `ChunkRequest` whose `data` is a view into the
received message. The bytes on the wire are exactly the `WriteFileRequest{chunk: FileChunk}` of
checkpoint.proto, so either end may use plain protobuf; any message that is not a chunk in the
canonical encoding (headers, trailers, other field orders) is decoded by protobuf itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c as _crc32c

from scaletrain.v1 import checkpoint_pb2

# Field 2 of WriteFileRequest (chunk) and fields 1, 2, 3 of FileChunk, as wire tags.
_TAG_CHUNK, _TAG_OFFSET, _TAG_DATA, _TAG_CRC = 0x12, 0x08, 0x12, 0x1D


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C of `data` following `crc` (the CRC of the bytes before it, if any).

    The `crc32c` package reads any buffer in place and releases the GIL while it computes
    (google_crc32c takes only bytes, so a view would be copied out, and it keeps the GIL below
    1 MB): checking a chunk costs no copy and does not stall the thread receiving the next.
    """
    return _crc32c.crc32c(data, crc)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ValueError("truncated varint")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


@dataclass(frozen=True)
class Chunk:
    """A FileChunk (same field names) whose `data` is a view: of the caller's buffer when sent,
    of the received message when decoded."""

    offset: int
    data: memoryview
    crc32c: int


@dataclass(frozen=True)
class BlockChunk:
    """A chunk checksummed per block (the data socket's frames, `ckptd.datapath`): `offset` is
    a multiple of BLOCK_BYTES and `block_crcs` has the CRC-32C of each block of `data`, which
    are exactly the CRCs a file keeps at rest, so ckptd checks each byte once."""

    offset: int
    data: memoryview
    block_crcs: tuple[int, ...]


@dataclass(frozen=True)
class ChunkRequest:
    """A received WriteFileRequest holding a chunk, as the servicer reads messages."""

    chunk: Chunk

    def WhichOneof(self, group: str) -> str:
        return "chunk"


def encode_write_request(request: checkpoint_pb2.WriteFileRequest | Chunk) -> bytes:
    """Serializer of the WriteFile stream: chunks by hand (one copy), the rest by protobuf."""
    if not isinstance(request, Chunk):
        return request.SerializeToString()
    inner_head = bytes([_TAG_OFFSET]) + _varint(request.offset) + bytes([_TAG_DATA])
    inner_head += _varint(len(request.data))
    crc = bytes([_TAG_CRC]) + struct.pack("<I", request.crc32c)
    inner_len = len(inner_head) + len(request.data) + len(crc)
    head = bytes([_TAG_CHUNK]) + _varint(inner_len) + inner_head
    return b"".join((head, request.data, crc))


def decode_write_request(raw: bytes) -> checkpoint_pb2.WriteFileRequest | ChunkRequest:
    """Deserializer of the WriteFile stream: a canonical chunk as a view, anything else by
    protobuf (which also reports a malformed message)."""
    try:
        return _decode_chunk(raw)
    except ValueError:
        return checkpoint_pb2.WriteFileRequest.FromString(raw)


def _decode_chunk(raw: bytes) -> ChunkRequest:
    if not raw or raw[0] != _TAG_CHUNK:
        raise ValueError("not a chunk")
    length, pos = _read_varint(raw, 1)
    if pos + length != len(raw):
        raise ValueError("not one chunk")
    offset = crc = 0
    data = memoryview(b"")
    while pos < len(raw):
        tag = raw[pos]
        if tag == _TAG_OFFSET:
            offset, pos = _read_varint(raw, pos + 1)
        elif tag == _TAG_DATA:
            size, pos = _read_varint(raw, pos + 1)
            if pos + size > len(raw):
                raise ValueError("truncated data")
            data = memoryview(raw)[pos : pos + size]
            pos += size
        elif tag == _TAG_CRC and pos + 5 <= len(raw):
            (crc,) = struct.unpack_from("<I", raw, pos + 1)
            pos += 5
        else:
            raise ValueError("another field or encoding")
    return ChunkRequest(Chunk(offset, data, crc))
