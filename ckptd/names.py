"""Names of runs, steps and files, validated before they touch a path or an object key.

A run name becomes one directory on SSD and one S3 key segment, a file path a path inside the
checkpoint's directory: whatever a client sends must not escape the checkpoint, collide with
ckptd's commit marker (`ckptd.manifest`) or exceed what a filesystem or S3 accepts. Every entry
point of the store checks its names here first.
"""

from __future__ import annotations

from ckptd.manifest import MARKER, Manifest
from ckptd.tiers import BLOCK_BYTES, CheckpointKey
from scaletrain.errors import InvalidArgument
from scaletrain.names import check_run_id
from scaletrain.v1 import checkpoint_pb2

MAX_WORLD_SIZE = 1 << 20
_MAX_PATH_BYTES = 1024
_MAX_NAME_BYTES = 255


def check_run(run: str) -> str:
    """A run name is one path component and one S3 key segment: the run-id rule every service
    applies (`scaletrain.names`), in ckptd's words for the field."""
    return check_run_id(run, "run name")


def check_step(step: int) -> int:
    if step < 0:
        raise InvalidArgument(f"step must be >= 0, got {step}")
    return step


def check_path(path: str) -> str:
    """A file path must name a file inside the checkpoint directory, as DCP names them."""
    if not path:
        raise InvalidArgument("file path is empty")
    if "\x00" in path or "\\" in path:
        raise InvalidArgument(f"file path {path!r} contains a NUL byte or a backslash")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidArgument(
            f"file path {path!r} must stay inside the checkpoint directory "
            "(relative, no '..', '.' or empty parts)"
        )
    if len(path.encode()) > _MAX_PATH_BYTES or any(
        len(part.encode()) > _MAX_NAME_BYTES for part in parts
    ):
        raise InvalidArgument(f"file path {path[:80]!r}... is too long")
    if parts[0] in (MARKER, f"{MARKER}.tmp"):
        raise InvalidArgument(f"file path {path!r} is reserved for ckptd's commit marker")
    return path


def key_of(ref: checkpoint_pb2.CheckpointRef) -> CheckpointKey:
    return CheckpointKey(check_run(ref.run), check_step(ref.step))


def manifest_from_peer(wire: checkpoint_pb2.Manifest, source: str) -> Manifest:
    """A manifest a peer sent (a decision, an outcome, an entry of its catalog), once it names
    only what a client could have saved here: a valid run, step and world size, distinct valid
    file paths, and one block CRC per BLOCK_BYTES of each file's size. A node adopts what its
    peers list into its own catalog and directories, so a broken or hostile peer must not make
    it write outside a checkpoint or record sizes its reads would trust."""
    manifest = Manifest.from_wire(wire)
    try:
        key_of(wire.ref)
        if not 1 <= manifest.world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"world size {manifest.world_size} is not 1..{MAX_WORLD_SIZE}")
        seen: set[str] = set()
        for record in manifest.files:
            check_path(record.path)
            if record.path in seen:
                raise InvalidArgument(f"file {record.path!r} is listed twice")
            seen.add(record.path)
            blocks = -(-record.size // BLOCK_BYTES) if record.size >= 0 else -1
            if len(record.block_crcs) != 4 * blocks:
                raise InvalidArgument(
                    f"file {record.path!r} of {record.size} bytes comes with "
                    f"{len(record.block_crcs)} bytes of block CRCs"
                )
    except InvalidArgument as exc:
        raise InvalidArgument(f"a manifest from {source} is refused: {exc}") from None
    return manifest
