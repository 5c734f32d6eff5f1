"""A byte-level corpus built from the Python standard library's own source files.

Every machine with Python has them, so the trainer needs no download. Files are read in sorted
order so the corpus is the same wherever the same Python version is installed; its SHA-256 is
recorded with each run so that a resume on a different corpus can be refused.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Corpus:
    tokens: torch.Tensor  # uint8, one token per byte
    sha256: str
    files: int

    def __len__(self) -> int:
        return int(self.tokens.numel())


def stdlib_corpus(max_bytes: int = 8 << 20) -> Corpus:
    """Concatenate sorted stdlib `*.py` files (outside test suites) up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = files = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(part in ("test", "tests", "idlelib", "site-packages") for part in rel):
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        files += 1
        if size >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 4096:
        raise RuntimeError(f"the standard library at {root} holds too little source for a corpus")
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return Corpus(tokens=tokens, sha256=hashlib.sha256(blob).hexdigest(), files=files)
