"""The rank's own copy of its last staged step, in shared memory that outlives the rank's process.

Every save stages the rank's state into host buffers before streaming it to ckptd
(`HostStager`). Here those buffers are files in /dev/shm: when the rank's process dies, a killed
rank or one its keeper stopped (`trainer.keeper`), or every rank of a node restarted cold by
torchrun, the buffers stay in the node's memory, and the rank that takes its place on the same
node restores from them without reading ckptd at all. A lost node takes its copies with it; its
ranks read from ckptd and its peers.

A copy is trusted only when sealed: after a staging completes, a manifest records its step, the
non-tensor parts, and a CRC-32C of every buffer; it is removed before the next staging starts
overwriting them. A restore checks the step, that the layout is the live state's, and every CRC.
A copy that fails any of them is never loaded: the restore reads ckptd instead, and says why.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptd.wire import crc32c

# Where the copies live: memory that outlives processes (a tmpfs).
SHM_ROOT = Path("/dev/shm")
MANIFEST = "manifest.pkl"
# What a restore from it read, in `Checkpointer.restored_from` ("own memory@node0").
OWN_MEMORY = "own memory"
# The file every buffer is a view into, as far as it has room (`OwnCopy.reserve`), and the
# alignment of each buffer in it.
_ARENA = "arena.bin"
_ALIGN = 64


class Unusable(Exception):
    """The copy cannot be restored (missing, another step, another layout, a failed CRC)."""


class Damaged(Unusable):
    """The copy holds the step but not the live layout, or fails a CRC: worth saying so."""


@dataclass(frozen=True)
class SealedBuffer:
    """A tensor of the sealed state: where its bytes are (a file, at an offset) and their
    CRC-32C."""

    name: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def read(self, directory: Path) -> torch.Tensor:
        """Its bytes in `directory`, mapped privately (nothing written reaches the file)."""
        end = self.offset + self.nbytes
        mapped = torch.from_file(str(directory / self.name), shared=False, size=end,
                                 dtype=torch.uint8)  # fmt: skip
        return mapped[self.offset : end].view(self.dtype).view(self.shape)


def copy_dir(run_id: str, host: str, rank: int, world: int) -> Path | None:
    """The directory of rank `rank`'s copies on `host` in a job of `world` ranks (None where no
    /dev/shm exists). Under the world size: a job re-formed at another size (elastic) shards
    its state otherwise, and never takes a copy of another size for its own."""
    if not SHM_ROOT.is_dir():
        return None
    return world_dir(run_id, host, world) / f"rank{rank}"


def world_dir(run_id: str, host: str, world: int) -> Path:
    """The copies `host` holds of the ranks of a job of `world` ranks."""
    return host_dir(run_id, host) / f"world{world}"


def host_dir(run_id: str, host: str) -> Path:
    """Every rank's copy on `host`: what a lost machine takes with it."""
    return SHM_ROOT / "scaletrain" / run_id / host


class OwnCopy:
    """Allocates the stager's buffers in shared-memory files, seals and restores them.

    The buffers are views into one file (the arena) reserved at the first save for the whole
    state: a copy of the directory (`peer_copy`) is then one message, not one per tensor. A
    buffer the arena has no room for (the state grew) gets a file of its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._places: dict[str, tuple[str, int]] = {}  # stager path -> (file name, offset)
        self._arena: torch.Tensor | None = None
        self._used = 0
        self._reserved = False
        self.enabled = True

    @property
    def reserved(self) -> bool:
        """Whether `reserve` was called (it made the arena, or found no room for it)."""
        return self._reserved

    def reserve(self, nbytes: int) -> None:
        """Make the arena, room for `nbytes` of buffers (aligned), once."""
        self._reserved = True
        if self._arena is None and self.enabled and nbytes > 0:
            self._arena = self._file(_ARENA, nbytes + _ALIGN * 1024, torch.uint8)

    def allocate(self, path: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer for stager path `path` backed by shared memory here; None when the tmpfs has
        no room for it (twice its size left), and from then on for every buffer: the copy is
        off."""
        nbytes = shape.numel() * dtype.itemsize
        if not self.enabled or nbytes == 0:
            return None
        arena = self._arena
        if arena is not None and self._used + nbytes <= arena.numel():
            offset, self._used = self._used, self._used + -(-nbytes // _ALIGN) * _ALIGN
            self._places[path] = (_ARENA, offset)
            return arena[offset : offset + nbytes].view(dtype).view(shape)
        name = f"{len(self._places)}.bin"
        flat = self._file(name, shape.numel(), dtype)
        if flat is None:
            return None
        self._places[path] = (name, 0)
        return flat.view(shape)

    def _file(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A new shared-memory file of `numel` elements, or None (and the copy off) when the
        tmpfs has not twice its size left."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(self.directory).free < 2 * numel * dtype.itemsize:
            self.enabled = False
            return None
        (self.directory / name).unlink(missing_ok=True)
        flat = torch.from_file(str(self.directory / name), shared=True, size=numel, dtype=dtype)
        # Touched now, so that the tmpfs counts its pages before the next buffer asks for room
        # (an untouched page it cannot back later would be a SIGBUS, not an error).
        flat.zero_()
        return flat

    def invalidate(self) -> None:
        """The buffers are about to be overwritten: the copy is no longer any step's."""
        (self.directory / MANIFEST).unlink(missing_ok=True)

    @property
    def name(self) -> str:
        """The copy's slot name, the same on every rank (`peer_copy` keeps a peer's under it)."""
        return self.directory.name

    def seal(self, step: int, staged: dict[str, Any], buffers: dict[str, torch.Tensor]) -> bool:
        """Record that `staged` (whose tensors are `buffers`, by stager path) holds `step`;
        whether it could (not when some buffer is not in shared memory)."""
        if not self.enabled or any(
            path not in self._places and buffer.numel() for path, buffer in buffers.items()
        ):
            return False
        skeleton = _skeleton(staged, "", buffers, self._places)
        temp = self.directory / f"{MANIFEST}.tmp"
        temp.write_bytes(pickle.dumps((step, skeleton)))
        temp.rename(self.directory / MANIFEST)
        return True

    def restore_into(self, step: int, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """`state` (the live state's tree, `Checkpointer._state`) filled from the copy of `step`:
        tensors copied in place, the other parts the copy's; and the bytes copied. Raises
        Unusable, naming why, when the copy is not `step`'s or fails a check."""
        try:
            sealed, skeleton = pickle.loads((self.directory / MANIFEST).read_bytes())
        except (OSError, pickle.UnpicklingError, ValueError) as exc:
            raise Unusable(f"no sealed copy ({type(exc).__name__})") from None
        if sealed != step:
            raise Unusable(f"it holds step {sealed}")
        copied = [0]
        filled = _fill(state, skeleton, "", self.directory, copied)
        return filled, copied[0]

    def remove(self) -> None:
        """Free the copy (the run ended), and the run's directories once the last one is gone."""
        with contextlib.suppress(OSError):
            shutil.rmtree(self.directory)
        with contextlib.suppress(OSError):  # not empty yet: another copy is still there
            for parent in self.directory.parents:
                if parent == SHM_ROOT / "scaletrain":
                    break
                parent.rmdir()


def _skeleton(
    value: Any, path: str, buffers: dict[str, torch.Tensor], places: dict[str, tuple[str, int]]
) -> Any:
    """`value` with each tensor replaced by its `SealedBuffer` (stager paths, as HostStager
    walks)."""
    if isinstance(value, dict):
        return {k: _skeleton(v, f"{path}.{k}", buffers, places) for k, v in value.items()}
    if isinstance(value, list):
        return [_skeleton(v, f"{path}.{i}", buffers, places) for i, v in enumerate(value)]
    if isinstance(value, DTensor | torch.Tensor):
        buffer = buffers[path]
        name, offset = places.get(path, ("", 0))
        return SealedBuffer(name, offset, buffer.dtype, tuple(buffer.shape), _crc(buffer))
    return value


def buffers_of(skeleton: Any) -> list[SealedBuffer]:
    """Every non-empty buffer of a sealed copy's skeleton."""
    if isinstance(skeleton, dict):
        return [b for v in skeleton.values() for b in buffers_of(v)]
    if isinstance(skeleton, list):
        return [b for v in skeleton for b in buffers_of(v)]
    return [skeleton] if isinstance(skeleton, SealedBuffer) and skeleton.name else []


def files_of(skeleton: Any) -> list[tuple[str, int]]:
    """(name, bytes) of every file a sealed copy's buffers are in, in name order: what a copy of
    its directory must carry (`peer_copy`)."""
    ends: dict[str, int] = {}
    for buffer in buffers_of(skeleton):
        ends[buffer.name] = max(ends.get(buffer.name, 0), buffer.offset + buffer.nbytes)
    return sorted(ends.items())


def sealed_step(directory: Path, verify: bool = False) -> int | None:
    """The step the copy in `directory` is sealed for, None if none; with `verify`, only if
    every buffer also passes its CRC-32C."""
    try:
        step, skeleton = pickle.loads((directory / MANIFEST).read_bytes())
        if verify and any(
            _crc(buffer.read(directory)) != buffer.crc for buffer in buffers_of(skeleton)
        ):
            return None
    except (OSError, RuntimeError, pickle.UnpicklingError, ValueError, EOFError):
        return None
    return int(step)


def _fill(live: Any, saved: Any, path: str, directory: Path, copied: list[int]) -> Any:
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(saved) != set(live):
            raise Damaged(f"its layout differs at {path or 'the top'}")
        return {k: _fill(live[k], saved[k], f"{path}.{k}", directory, copied) for k in live}
    if isinstance(live, list):
        if not isinstance(saved, list) or len(saved) != len(live):
            raise Damaged(f"its layout differs at {path}")
        pairs = enumerate(zip(live, saved, strict=True))
        return [_fill(v, s, f"{path}.{i}", directory, copied) for i, (v, s) in pairs]
    if isinstance(live, DTensor | torch.Tensor):
        target = live.to_local() if isinstance(live, DTensor) else live
        if not isinstance(saved, SealedBuffer) or (saved.dtype, saved.shape) != (
            target.dtype,
            tuple(target.shape),
        ):
            raise Damaged(f"its layout differs at {path}")
        numel = target.numel()
        if not numel:
            return live
        buffer = saved.read(directory)
        if _crc(buffer) != saved.crc:
            raise Damaged(f"{path} fails its CRC-32C")
        with torch.no_grad():
            target.copy_(buffer)
        copied[0] += numel * saved.dtype.itemsize
        return live
    return saved


def _crc(tensor: torch.Tensor) -> int:
    """CRC-32C of a contiguous CPU tensor's bytes: ckptd's checksum, in hardware where the CPU
    has it (4x zlib's CRC-32 here), the GIL released over the buffer."""
    if not tensor.numel():
        return 0
    return crc32c(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def remove_copies(run_id: str, host: str = "") -> None:
    """Drop every copy of `run_id` that `host` holds (a simulated machine lost: its memory goes
    with it), or with no host, every copy of the run on this machine."""
    with contextlib.suppress(OSError):
        shutil.rmtree(host_dir(run_id, host) if host else SHM_ROOT / "scaletrain" / run_id)
