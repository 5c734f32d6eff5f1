"""The fuzz targets: ckptd's parsers of bytes that arrive from outside, one function each.

- `frames`: the data socket's frame parser (`ckptd.datapath.read_frames`), the very code that
  reads every upload's bytes off the network, over an announced size and a byte stream; each frame
  it yields is checked against its block CRCs as ckptd's pipeline checks them.
- `manifest`: a commit marker (`Manifest.from_json`), as read back from SSD or S3.
- `catalog`: a peer's catalog (`CatalogResponse`), each entry's manifest as a node adopts it
  (`ckptd.names.manifest_from_peer`).

Each target accepts its input or refuses it with the one error its caller expects (a one-line
InvalidArgument or ValueError, a cut connection, a message that does not parse); anything else
(another exception, a hang, a frame past the announced size) is a finding. `run.py` drives them
with atheris (coverage-guided); `test_fuzz_targets.py` replays the checked-in corpus and runs
them all (`every`) for a few seconds.
"""

from __future__ import annotations

import struct

from google.protobuf.message import DecodeError

from ckptd.datapath import UNKNOWN_SIZE, Buffer, _Short, read_frames
from ckptd.manifest import Manifest
from ckptd.names import check_path, check_run, manifest_from_peer
from ckptd.tiers import BLOCK_BYTES
from scaletrain.errors import InvalidArgument
from scaletrain.transport import MAX_CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2

# One receive buffer for every frame: a frame may announce up to MAX_CHUNK_BYTES, and a fresh
# allocation of that per input would be most of the fuzzer's time.
_SCRATCH = bytearray(MAX_CHUNK_BYTES)
_SIZE = struct.Struct("<i")


def frames(data: bytes) -> None:
    """The first 4 bytes are the size announced (little-endian; negative: not known), the rest
    is what the connection brings after its ticket."""
    if len(data) < _SIZE.size:
        return
    (size,) = _SIZE.unpack_from(data)
    size = UNKNOWN_SIZE if size < 0 else size
    stream = memoryview(data)[_SIZE.size :]
    pos = 0

    def recv(buffer: Buffer) -> None:
        nonlocal pos
        view = memoryview(buffer)
        got = min(len(view), len(stream) - pos)
        view[:got] = stream[pos : pos + got]
        pos += got
        if got < len(view):
            raise _Short

    received = 0
    try:
        for chunk in read_frames(recv, "f", size, lambda n: memoryview(_SCRATCH)[:n]):
            length = len(chunk.data)
            assert 0 < length <= MAX_CHUNK_BYTES
            assert chunk.offset == received
            assert len(chunk.block_crcs) == -(-length // BLOCK_BYTES)
            received += length
            assert size == UNKNOWN_SIZE or received <= size
    except (InvalidArgument, _Short) as exc:
        assert "\n" not in str(exc)
        return
    assert size == UNKNOWN_SIZE or received == size


def manifest(data: bytes) -> None:
    """A commit marker: parsed, or refused with a ValueError naming where it came from."""
    try:
        parsed = Manifest.from_json(data, "the marker")
    except ValueError as exc:
        assert str(exc).startswith("the marker is not a ckptd manifest")
        return
    assert Manifest.from_json(parsed.to_json(), "again") == parsed


def catalog(data: bytes) -> None:
    """A peer's catalog: every manifest it lists is adopted only with valid names and sizes."""
    try:
        view = checkpoint_pb2.CatalogResponse.FromString(data)
    except DecodeError:
        return
    for entry in view.entries:
        try:
            adopted = manifest_from_peer(entry.manifest, f"node {view.node[:64]!r}")
        except InvalidArgument as exc:
            assert "\n" not in str(exc)
            continue
        check_run(adopted.key.run)
        for record in adopted.files:
            check_path(record.path)
            assert len(record.block_crcs) == 4 * -(-record.size // BLOCK_BYTES)


TARGETS = {"frames": frames, "manifest": manifest, "catalog": catalog}
ORDER = sorted(TARGETS)


def every(data: bytes) -> None:
    """All three in one process (`make test`'s short run pays one start-up): the first byte
    picks the target (its value modulo 3, in `ORDER`), the rest is that target's input."""
    if data:
        TARGETS[ORDER[data[0] % len(ORDER)]](data[1:])
