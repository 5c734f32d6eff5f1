"""The manifest: a checkpoint described completely by one small JSON document.

The same document is written as the commit marker on every durable tier: `_COMMITTED` inside the
SSD directory (written and fsynced before the directory is renamed into place) and the
`<run>/<step>/_COMMITTED` object on S3 (written after every file is uploaded and verified). A
tier holds a committed copy exactly when its marker exists, so a lost or stale catalog can be
rebuilt from the tiers themselves, and a marker always carries the checksums that every read of
the copy is verified against.

A file's checksum is the CRC-32C of its blocks' CRC-32Cs (`file_crc32c`), as S3's composite
checksums are: the per-block CRCs are what every read checks, and a file-level value derived from
them costs nothing more to compute on either side of the wire. Format 1 also kept each file's
SHA-256; it is read (and the SHA-256 ignored) so that older checkpoints stay readable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ckptd.tiers import BLOCK_BYTES, BlockCrcs, CheckpointKey
from ckptd.wire import crc32c
from scaletrain.v1 import checkpoint_pb2

MARKER = "_COMMITTED"
FORMAT = 2


def file_crc32c(block_crcs: bytes) -> int:
    """A file's checksum from its packed per-block CRC-32Cs (see the module doc)."""
    return crc32c(block_crcs)


def data_crc32c(data: bytes | memoryview) -> int:
    """The checksum (`file_crc32c`) of a whole file held in memory."""
    blocks = BlockCrcs()
    blocks.update(data)
    return file_crc32c(blocks.packed())


@dataclass(frozen=True)
class FileRecord:
    """A received, verified file of a checkpoint; block_crcs are the per-block CRC-32Cs."""

    path: str
    rank: int
    kind: int
    size: int
    block_crcs: bytes
    # The node whose ckptd received it and keeps its memory and SSD copies; "" in checkpoints
    # saved before ckptd had nodes (they live wholly on the node that lists them).
    node: str = ""

    @property
    def crc32c(self) -> int:
        """The file's checksum (`file_crc32c`)."""
        return file_crc32c(self.block_crcs)

    def to_proto(self) -> checkpoint_pb2.FileInfo:
        return checkpoint_pb2.FileInfo(
            path=self.path,
            rank=self.rank,
            kind=self.kind,
            size=self.size,
            crc32c=self.crc32c,
            node=self.node,
        )

    def to_wire(self) -> checkpoint_pb2.PartFile:
        return checkpoint_pb2.PartFile(
            path=self.path,
            rank=self.rank,
            kind=self.kind,
            size=self.size,
            block_crcs=self.block_crcs,
            node=self.node,
        )

    @classmethod
    def from_wire(cls, f: checkpoint_pb2.PartFile) -> FileRecord:
        return cls(f.path, f.rank, f.kind, f.size, bytes(f.block_crcs), f.node)


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint is: its identity, its files and their checksums."""

    key: CheckpointKey
    world_size: int
    files: tuple[FileRecord, ...]
    labels: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    committed_at: float = 0.0
    # The save attempt's epoch and the node that coordinated its commit (0 and "" before nodes).
    epoch: int = 0
    coordinator: str = ""
    # Kept in memory only (OpenSaveRequest.memory_only): never written as a marker on a
    # durable tier, so `to_json` leaves it out.
    memory_only: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def files_on(self, node: str) -> tuple[FileRecord, ...]:
        """The files `node` holds ("" files belong to whichever node lists them)."""
        return tuple(f for f in self.files if f.node in ("", node))

    def to_wire(self) -> checkpoint_pb2.Manifest:
        return checkpoint_pb2.Manifest(
            ref=checkpoint_pb2.CheckpointRef(run=self.key.run, step=self.key.step),
            world_size=self.world_size,
            files=[f.to_wire() for f in self.files],
            labels=self.labels,
            created_at=self.created_at,
            committed_at=self.committed_at,
            epoch=self.epoch,
            coordinator=self.coordinator,
            memory_only=self.memory_only,
        )

    @classmethod
    def from_wire(cls, m: checkpoint_pb2.Manifest) -> Manifest:
        return cls(
            key=CheckpointKey(m.ref.run, m.ref.step),
            world_size=m.world_size,
            files=tuple(FileRecord.from_wire(f) for f in m.files),
            labels=dict(m.labels),
            created_at=m.created_at,
            committed_at=m.committed_at,
            epoch=m.epoch,
            coordinator=m.coordinator,
            memory_only=m.memory_only,
        )

    def same_files(self, other: Manifest) -> bool:
        """Whether `other` describes the same bytes (same files, sizes and checksums)."""
        return [(f.path, f.size, f.block_crcs) for f in self.files] == [
            (f.path, f.size, f.block_crcs) for f in other.files
        ]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "run": self.key.run,
                "step": self.key.step,
                "world_size": self.world_size,
                "labels": self.labels,
                "created_at": self.created_at,
                "committed_at": self.committed_at,
                "epoch": self.epoch,
                "coordinator": self.coordinator,
                "block_bytes": BLOCK_BYTES,
                "files": [
                    {
                        "path": f.path,
                        "rank": f.rank,
                        "kind": checkpoint_pb2.FileKind.Name(f.kind),
                        "size": f.size,
                        "crc32c": f"{f.crc32c:08x}",
                        "block_crc32c": f.block_crcs.hex(),
                        "node": f.node,
                    }
                    for f in self.files
                ],
            },
            indent=1,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        """Parse a marker; ValueError naming `where` when it is not a manifest of this format."""
        try:
            doc = _object(json.loads(raw), "the document")
            if doc.get("format") != FORMAT or doc.get("block_bytes") != BLOCK_BYTES:
                raise ValueError(f"format {doc.get('format')}, block size {doc.get('block_bytes')}")
            files = tuple(
                FileRecord(
                    path=f["path"],
                    rank=int(f["rank"]),
                    kind=checkpoint_pb2.FileKind.Value(f["kind"]),
                    size=int(f["size"]),
                    block_crcs=bytes.fromhex(f["block_crc32c"]),
                    node=str(f.get("node", "")),
                )
                for f in (_object(f, "a file") for f in doc["files"])
            )
            for record, f in zip(files, doc["files"], strict=True):
                if int(f["crc32c"], 16) != record.crc32c:
                    raise ValueError(f"{record.path}: its crc32c does not match its block CRCs")
            return cls(
                key=CheckpointKey(doc["run"], int(doc["step"])),
                world_size=int(doc["world_size"]),
                files=files,
                labels=dict(doc.get("labels", {})),
                created_at=float(doc.get("created_at", 0.0)),
                committed_at=float(doc.get("committed_at", 0.0)),
                epoch=int(doc.get("epoch", 0)),
                coordinator=str(doc.get("coordinator", "")),
            )
        # OverflowError: an infinite number; RecursionError: nesting deeper than the parser goes.
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise ValueError(f"{where} is not a ckptd manifest: {exc}") from None


def _object(value: object, what: str) -> dict:
    """`value` if it is a JSON object, else a TypeError naming `what` (a marker is read from
    disk or S3, where anything may have been written)."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is not a JSON object")
    return value
