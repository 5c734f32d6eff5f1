"""torch.distributed.checkpoint storage over ckptd: any PyTorch program can save to ckptd.

    dcp.save(state, storage_writer=CkptdStorageWriter("127.0.0.1:50051", run="r1", step=100))
    dcp.load(state, storage_reader=CkptdStorageReader("127.0.0.1:50051", run="r1", step=100))

The writer and reader subclass DCP's own filesystem writer and reader and swap their filesystem
object for one whose streams go to ckptd (`CkptdClient.open_file`, over its data socket when it
offers one), so a checkpoint keeps DCP's stock layout (`__R_I.distcp` per rank plus `.metadata`)
on every tier, and a checkpoint saved at one parallel layout loads into another.

Save protocol: the coordinator opens the save in `prepare_global_plan` (it then knows the world
size) and hands the save (id, epoch, coordinator) to every rank inside its plan; each rank joins
it on its own node's ckptd and streams its own files there in `write_data`; the coordinator
writes `.metadata` to its node's ckptd and commits in `finish`, which commits on every node.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptd.client import CkptdClient
from ckptd.states import METADATA, SHARD
from scaletrain.transport import CHUNK_BYTES
from scaletrain.v1 import checkpoint_pb2

METADATA_NAME = ".metadata"
_TMP_SUFFIX = ".tmp"


def first_cause(exc: CheckpointException) -> BaseException:
    """The lowest rank's original error inside DCP's CheckpointException (e.g. ckptd's refusal)."""
    failures = exc.failures
    if not failures:
        return exc
    error, _stack = failures[min(failures)]  # DCP keeps (exception, stack summary) pairs
    return error


def _name(path: str | os.PathLike) -> str:
    """The file name within the checkpoint: DCP passes `<root>/<name>` paths."""
    return os.fspath(path).rsplit("/", 1)[-1]


class _UploadStream(io.RawIOBase):
    """A write-only stream that sends its bytes to ckptd as one file (`CkptdClient.open_file`).

    Writes go on as they come: over the data socket each is sent before it returns (DCP may
    free a tensor it serialized right after), through WriteFile a bounded queue slows the writer
    down to ckptd's pace. An error on ckptd's side is raised by the next write or by close; a
    stream left on an exception stores nothing.
    """

    def __init__(self, client: CkptdClient, save_id: str, name: str, rank: int) -> None:
        super().__init__()
        kind = METADATA if name == METADATA_NAME else SHARD
        self._file = client.open_file(save_id, name, rank, kind)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        """Bytes written so far: DCP records each item's offset in the file from it."""
        return self._file.size

    def write(self, data: Any) -> int:
        self._file.write(data)
        return memoryview(data).nbytes

    def close(self) -> None:
        if self.closed:
            return  # DCP closes a stream inside its `with` block and again on exit.
        try:
            self._file.close()
        finally:
            super().close()

    def __exit__(self, *exc_info: Any) -> None:
        if exc_info[0] is not None and not self.closed:
            self._file.abort()
            super().close()
        else:
            self.close()


class RangeSource(Protocol):
    """Where a reader's verified byte ranges come from: `CkptdClient` (a running ckptd), or a
    work directory's store opened offline (`scaletrain.app.checkpoints`)."""

    def get(self, run: str, step: int) -> checkpoint_pb2.CheckpointInfo: ...

    def read(
        self, run: str, step: int, path: str, offset: int = 0, length: int = 0
    ) -> bytes | bytearray: ...

    def close(self) -> None: ...


class _RangeReadStream(io.RawIOBase):
    """A seekable read-only view of one checkpoint file that fetches byte ranges lazily.

    `spans` are the (start, end) byte ranges the load will read, adjacent ones merged: a fetch
    reads ahead a chunk but never past the end of its span, so the bytes of items the load
    skips (the optimizer's, when only the model is loaded) are never transferred. Without them
    a fetch reads ahead a whole chunk.
    """

    def __init__(
        self,
        client: RangeSource,
        run: str,
        step: int,
        name: str,
        size: int,
        spans: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self._client, self._run, self._step, self._name = client, run, step, name
        self._size = size
        self._spans = spans or []
        self._pos = 0
        self._block_start = 0
        self._block: bytes | bytearray = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._size - self._pos)
        if want <= 0:
            return 0
        start = self._pos - self._block_start
        if not (start >= 0 and start + want <= len(self._block)):
            # Read ahead a whole chunk: DCP reads many small items from one file in order.
            end = next((e for s, e in self._spans if s <= self._pos < e), self._size)
            length = min(max(want, min(CHUNK_BYTES, end - self._pos)), self._size - self._pos)
            self._block = self._client.read(self._run, self._step, self._name, self._pos, length)
            self._block_start = self._pos
            start = 0
        view[:want] = memoryview(self._block)[start : start + want]
        self._pos += want
        return want


class _CkptdFileSystem(FileSystemBase):
    """DCP's filesystem interface over one checkpoint in ckptd."""

    def __init__(self, client: CkptdClient | RangeSource, run: str, step: int) -> None:
        self.client, self.run, self.step = client, run, step
        self.save_id = ""
        self.rank = 0
        self._sizes: dict[str, int] | None = None
        # The byte ranges a load will read, by file (CkptdStorageReader.read_data).
        self.spans: dict[str, list[tuple[int, int]]] = {}
        self._held: dict[str, io.BytesIO] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        name = _name(path)
        if mode == "rb":
            size, spans = self._size(name), self.spans.get(name)
            with _RangeReadStream(self.client, self.run, self.step, name, size, spans) as s:
                yield s
        elif name.endswith(_TMP_SUFFIX):
            # DCP writes the metadata under a temporary name and renames it: hold the (small)
            # bytes here and send them under the final name at the rename.
            buffer = self._held[name] = _HeldBuffer()
            yield buffer
        else:
            with _UploadStream(self.client, self.save_id, name, self.rank) as stream:
                yield stream

    def _size(self, name: str) -> int:
        if self._sizes is None:
            info = self.client.get(self.run, self.step)
            self._sizes = {f.path: f.size for f in info.files}
        if name not in self._sizes:
            raise FileNotFoundError(f"checkpoint {self.run}@{self.step} has no file {name!r}")
        return self._sizes[name]

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        data = self._held.pop(_name(path)).getvalue()
        with _UploadStream(self.client, self.save_id, _name(new_path), self.rank) as stream:
            stream.write(data)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        """Nothing to create: ckptd names the checkpoint by (run, step)."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.fspath(checkpoint_id).startswith("ckptd://")

    def exists(self, path: str | os.PathLike) -> bool:
        """A save is always new: ckptd refuses to overwrite a committed checkpoint itself."""
        return False

    def rm_file(self, path: str | os.PathLike) -> None:
        """Never called, since `exists` is False; ckptd deletes whole checkpoints."""


class _HeldBuffer(io.BytesIO):
    """A BytesIO that keeps its bytes when closed, since DCP closes it before renaming."""

    def close(self) -> None:
        """Keep the buffer: `_CkptdFileSystem.rename` reads it afterwards."""


@dataclasses.dataclass(frozen=True)
class _CkptdPlanData:
    """What the coordinator hands each rank with its plan: its file prefix and rank, and the
    save as the coordinator's ckptd opened it (id, epoch, coordinator), which each rank joins
    on its own node's ckptd."""

    prefix: str
    rank: int
    world_size: int
    opened: bytes  # a serialized OpenSaveResponse (plans are pickled: keep it plain)


def _checkpoint_id(run: str, step: int) -> str:
    return f"ckptd://{run}/{step}"


class CkptdStorageWriter(FileSystemWriter):
    """A DCP storage writer that streams every rank's files to ckptd and commits the save."""

    def __init__(
        self,
        address: str,
        run: str,
        step: int,
        labels: dict[str, str] | None = None,
        thread_count: int = 1,
        replicas: int = 0,
        memory_only: bool = False,
    ) -> None:
        """`replicas`: R for the run from now on (0: keep the run's, or ckptd's default).
        `memory_only`: a checkpoint ckptd keeps in memory only (its node's and one peer's)."""
        # ckptd makes the files durable itself: no fsync (DCP would call os.sync()) on our side.
        super().__init__(_checkpoint_id(run, step), sync_files=False, thread_count=thread_count)
        self.client = CkptdClient(address)
        self.fs = _CkptdFileSystem(self.client, run, step)
        self.run, self.step = run, step
        self.labels = labels or {}
        self.replicas = replicas
        self.memory_only = memory_only
        self.committed: checkpoint_pb2.CheckpointInfo | None = None

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        opened = self.client.open_save(
            self.run,
            self.step,
            len(plans),
            self.labels,
            replicas=self.replicas,
            memory_only=self.memory_only,
        )
        self.fs.save_id = opened.save_id
        wire = opened.SerializeToString()
        return [
            dataclasses.replace(plan, storage_data=_CkptdPlanData(f"__{i}_", i, len(plans), wire))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        data: _CkptdPlanData = plan.storage_data
        opened = checkpoint_pb2.OpenSaveResponse.FromString(data.opened)
        # This rank's files go to its own node's ckptd, which must know the save first.
        self.client.join_save(opened, self.run, self.step, data.world_size, self.memory_only)
        self.fs.save_id, self.fs.rank = opened.save_id, data.rank
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.committed = self.client.commit(self.fs.save_id)

    def abort(self, reason: str) -> None:
        """Tell ckptd to drop this save's files (call on the coordinator after a failed save)."""
        if self.fs.save_id:
            self.client.abort(self.fs.save_id, reason)

    def close(self) -> None:
        self.client.close()


class CkptdStorageReader(FileSystemReader):
    """A DCP storage reader that reads byte ranges of a committed checkpoint from ckptd (or from
    another `source` of verified ranges)."""

    def __init__(
        self, address: str, run: str, step: int, source: RangeSource | None = None
    ) -> None:
        super().__init__(_checkpoint_id(run, step))
        self.client = source or CkptdClient(address)
        self.fs = _CkptdFileSystem(self.client, run, step)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's reads, told first which byte ranges of each file the plan covers (`spans`)."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault(info.relative_path, []).append(
                (info.offset, info.offset + info.length)
            )
        self.fs.spans = {name: _merged(spans) for name, spans in ranges.items()}
        return super().read_data(plan, planner)

    def close(self) -> None:
        self.client.close()


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` sorted, with overlapping or adjacent ones merged."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
