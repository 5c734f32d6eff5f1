"""Names of runs, steps and files, validated before they touch a path or an object key.

A run name becomes one directory on SSD and one S3 key segment, a file path a path inside the
checkpoint's directory: whatever a client sends must not escape the checkpoint, collide with
ckptd's commit marker (`ckptd.manifest`) or exceed what a filesystem or S3 accepts. Every entry
point of the store checks its names here first.
"""

from __future__ import annotations

import re

from ckptd.manifest import MARKER
from ckptd.tiers import CheckpointKey
from scaletrain.errors import InvalidArgument
from scaletrain.v1 import checkpoint_pb2

MAX_WORLD_SIZE = 1 << 20
_MAX_PATH_BYTES = 1024
_MAX_NAME_BYTES = 255
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,127}")


def check_run(run: str) -> str:
    """A run name is one path component and one S3 key segment: a safe, short token."""
    if not run:
        raise InvalidArgument("run name is empty")
    if not _RUN_RE.fullmatch(run):
        raise InvalidArgument(
            f"run name {run!r} is invalid: use 1-128 letters, digits and . _ : + = @ -, "
            "starting with a letter or digit"
        )
    return run


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
