"""The manifest: a checkpoint described completely by one small JSON document.

The same document is written as the commit marker on every durable tier: `_COMMITTED` inside the
SSD directory (written and fsynced before the directory is renamed into place) and the
`<run>/<step>/_COMMITTED` object on S3 (written after every file is uploaded and verified). A
tier holds a committed copy exactly when its marker exists, so a lost or stale catalog can be
rebuilt from the tiers themselves, and a marker always carries the checksums that every read of
the copy is verified against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ckptd.tiers import BLOCK_BYTES, CheckpointKey
from scaletrain.v1 import checkpoint_pb2

MARKER = "_COMMITTED"
FORMAT = 1


@dataclass(frozen=True)
class FileRecord:
    """A received, verified file of a checkpoint; block_crcs are the per-block CRC-32Cs."""

    path: str
    rank: int
    kind: int
    size: int
    sha256: str
    block_crcs: bytes

    def to_proto(self) -> checkpoint_pb2.FileInfo:
        return checkpoint_pb2.FileInfo(
            path=self.path, rank=self.rank, kind=self.kind, size=self.size, sha256=self.sha256
        )


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint is: its identity, its files and their checksums."""

    key: CheckpointKey
    world_size: int
    files: tuple[FileRecord, ...]
    labels: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    committed_at: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

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
                "block_bytes": BLOCK_BYTES,
                "files": [
                    {
                        "path": f.path,
                        "rank": f.rank,
                        "kind": checkpoint_pb2.FileKind.Name(f.kind),
                        "size": f.size,
                        "sha256": f.sha256,
                        "block_crc32c": f.block_crcs.hex(),
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
            doc = json.loads(raw)
            if doc.get("format") != FORMAT or doc.get("block_bytes") != BLOCK_BYTES:
                raise ValueError(f"format {doc.get('format')}, block size {doc.get('block_bytes')}")
            files = tuple(
                FileRecord(
                    path=f["path"],
                    rank=int(f["rank"]),
                    kind=checkpoint_pb2.FileKind.Value(f["kind"]),
                    size=int(f["size"]),
                    sha256=f["sha256"],
                    block_crcs=bytes.fromhex(f["block_crc32c"]),
                )
                for f in doc["files"]
            )
            return cls(
                key=CheckpointKey(doc["run"], int(doc["step"])),
                world_size=int(doc["world_size"]),
                files=files,
                labels=dict(doc.get("labels", {})),
                created_at=float(doc.get("created_at", 0.0)),
                committed_at=float(doc.get("committed_at", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where} is not a ckptd manifest: {exc}") from None
