"""Peer replicas: copies of each node's part of a committed checkpoint on R distinct nodes.

Once checkpoints are node-local, a lost node takes its part of every checkpoint with it, and
only S3 (the slowest tier, shared by every node, paid per request) could bring it back. So each
part is copied, after the commit and in the background, to R-1 other nodes' memory tier and SSD,
where it counts against their memory budget and leaves by the run's retention like any copy.

Who holds what is a pure function of the live nodes (`placement`): the part's own node first,
then the next nodes on a ring of the sorted node names, preferring failure domains (zones)
not yet used. Every node computes it for itself and pulls what it should hold and lacks
(`Replicator`): after an offer from the commit's coordinator (OfferReplica), and on every
catalog sync, which is also how R is re-established after a node is lost. A fresh node in the
lost node's place pulls its own part back the same way. There are no divisibility rules: any
number of nodes >= R works, and the layout of the job does not matter (parts are files).

The bytes come from the part's own node if it is up, else from any other copy, over the peers'
read path (`Reader.stream_from_peers`), never from S3; every piece is checked against the block
CRC-32Cs of the checkpoint's manifest on arrival, and again on every later read, like any copy.
A copy counts (`ReplicaHolding.copy_job`) in memory as soon as every block of it is here and
checked: the part is then on two live nodes, so the loss of either leaves a verified copy
(node-loss safe); it counts on SSD once its files and marker are durable, which a restart of
this node survives too (a restart forgets the memory copy, and the catalog says so at start).
A failed copy is retried with a growing pause; until it lands the step is not node-loss safe.

Data-parallel replicas (HSDP) that already hold identical bytes are not counted toward R: DCP
deduplicates replicated tensors at save time, so each rank's file holds distinct bytes.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ckptd.ingest import FileUpload
from ckptd.manifest import FileRecord, Manifest
from ckptd.metrics import Metrics
from ckptd.tiers import BLOCK_BYTES, CheckpointKey
from ckptd.tiers.memory import MemoryBudget, MemoryFile, MemoryTier, release
from ckptd.tiers.ssd import SsdTier
from ckptd.wire import BlockChunk
from scaletrain.errors import InvalidArgument, ScaletrainError, Unavailable
from scaletrain.v1 import checkpoint_pb2

log = logging.getLogger(__name__)

REPLICA_DIR = "replicas"
# Pauses before a failed copy is tried again: doubling from the first to the last.
RETRY_FIRST_S, RETRY_LAST_S = 1.0, 10.0


def effective_replicas(asked: int, default: int, nodes: int) -> int:
    """R for a run: what it asked for (checked against the nodes there are), else ckptd's
    default capped at the nodes there are."""
    if asked:
        if asked > nodes:
            raise InvalidArgument(
                f"replicas {asked} is more than the {nodes} node(s) of this cluster: "
                f"each copy of a part needs a node of its own (ask for 1 to {nodes})"
            )
        return asked
    return max(1, min(default, nodes))


def copies_for_safety(r: int) -> int:
    """The nodes each part of a step must be on for the step to count as node-loss safe under
    R = `r`: all R copies the run asks for, and at least 2 (with R = 1, a part has no copy that
    outlives its node: such a run's steps are never node-loss safe)."""
    return max(2, r)


def placement(owner: str, zones: Mapping[str, str], r: int) -> list[str]:
    """The nodes that should hold `owner`'s part: up to `r` of the live nodes `zones` (node ->
    its zone, "" when it has none), the owner first when it is live.

    The others follow the owner on a ring of the sorted names (so the copies of many owners
    spread over the nodes), taking first the nodes of a zone no holder has yet.
    """
    ring = sorted(set(zones) | {owner})
    start = ring.index(owner)
    after = [n for n in ring[start + 1 :] + ring[:start] if n in zones]
    holders = [owner] if owner in zones else []
    used = {zones.get(owner, "")} if owner in zones else set()
    for fresh_zone_only in (True, False):
        for node in after:
            if len(holders) >= r:
                return holders
            zone = zones[node]
            if node in holders or (fresh_zone_only and zone and zone in used):
                continue
            if fresh_zone_only and not zone and "" in used:
                continue
            holders.append(node)
            used.add(zone)
    return holders[:r]


class ReplicaTiers:
    """The memory and SSD copies this node holds of other nodes' parts, one pair per owner:
    `data_dir/replicas/<owner>/<run>/<step>/` on disk (with the checkpoint's marker, as the own
    SSD tier), and a memory tier in the node's one memory budget."""

    def __init__(self, data_dir: Path, budget: MemoryBudget) -> None:
        self.root = data_dir / REPLICA_DIR
        self._budget = budget
        self._lock = threading.Lock()
        self._memory: dict[str, MemoryTier] = {}
        self._ssd: dict[str, SsdTier] = {}

    def memory(self, owner: str) -> MemoryTier:
        with self._lock:
            if owner not in self._memory:
                self._memory[owner] = MemoryTier(self._budget)
            return self._memory[owner]

    def ssd(self, owner: str) -> SsdTier:
        with self._lock:
            if owner not in self._ssd:
                self._ssd[owner] = SsdTier(self.root / owner)
            return self._ssd[owner]

    def owners_on_disk(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def memory_tiers(self) -> dict[str, MemoryTier]:
        with self._lock:
            return dict(self._memory)

    def delete(self, key: CheckpointKey, owner: str | None = None) -> None:
        """Drop the copies of `key` (of `owner`'s part, or of every owner's)."""
        owners = [owner] if owner else self.owners_on_disk()
        for name in owners:
            self.memory(name).delete(key)
            self.ssd(name).delete(key)


@dataclass(frozen=True)
class CopyJob:
    """Copy `owner`'s part of `key` into this node's tiers."""

    key: CheckpointKey
    owner: str


class Throttle:
    """A token bucket of `rate` bytes a second (0: no limit), so that copies between nodes use
    the network and CPU a training job leaves idle rather than what it needs."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._allowance = rate
        self._at = time.monotonic()

    def take(self, nbytes: int, stop: threading.Event) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self._allowance = min(self.rate, self._allowance + (now - self._at) * self.rate)
        self._at = now
        self._allowance -= nbytes
        if self._allowance < 0:
            stop.wait(-self._allowance / self.rate)

    def set_rate(self, rate: float) -> float:
        """Take `rate` from the next piece on (a piece already waiting finishes its wait);
        returns the rate before."""
        before, self.rate = self.rate, rate
        self._allowance = min(self._allowance, rate) if rate > 0 else 0.0
        self._at = time.monotonic()
        return before


class Replicator:
    """A background thread that copies the parts this node should hold (`CopyJob`s), one at a
    time, each piece throttled and verified; a failed job comes back after a pause."""

    def __init__(
        self,
        copy: Callable[[CopyJob, Throttle], bool],
        rate_bytes_s: float,
        closed: threading.Event,
    ) -> None:
        self._copy = copy
        self._throttle = Throttle(rate_bytes_s)
        self._closed = closed
        self._cond = threading.Condition()
        self._queue: list[CopyJob] = []
        self._queued: set[CopyJob] = set()
        self._busy: CopyJob | None = None
        # job -> (failures so far, the time it may be tried again)
        self._retry: dict[CopyJob, tuple[int, float]] = {}
        self._thread = threading.Thread(target=self._loop, name="ckptd-replicas", daemon=True)
        self._thread.start()

    def queue(self, job: CopyJob) -> bool:
        """Queue `job` unless it is queued, running, or waiting for its retry; whether it was."""
        with self._cond:
            if job in self._queued or job == self._busy:
                return False
            waiting = self._retry.get(job)
            if waiting is not None and time.monotonic() < waiting[1]:
                return False
            self._queue.append(job)
            self._queued.add(job)
            self._cond.notify()
            return True

    def set_rate(self, rate_bytes_s: float) -> float:
        """Copy at `rate_bytes_s` from now on (0: no limit); returns the rate before."""
        with self._cond:
            return self._throttle.set_rate(rate_bytes_s)

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (self._busy is not None)

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._closed.is_set():
            with self._cond:
                while not self._queue and not self._closed.is_set():
                    self._cond.wait(1.0)
                if self._closed.is_set():
                    return
                job = self._queue.pop(0)
                self._queued.discard(job)
                self._busy = job
            try:
                done = self._copy(job, self._throttle)
                problem = "" if done else "no live node holds a good copy yet"
            except ScaletrainError as exc:
                done, problem = False, str(exc)
            except Exception as exc:  # a bug or a disk error: keep the thread, say why
                log.exception("copy of %s's part of %s failed", job.owner, job.key)
                done, problem = False, f"{type(exc).__name__}: {exc}"
            if self._closed.is_set():  # a copy cut short by the shutdown: nothing to say
                return
            with self._cond:
                self._busy = None
                if done:
                    self._retry.pop(job, None)
                else:
                    failures = self._retry.get(job, (0, 0.0))[0] + 1
                    pause = min(RETRY_LAST_S, RETRY_FIRST_S * 2 ** (failures - 1))
                    self._retry[job] = (failures, time.monotonic() + pause)
                    log.warning(
                        "copy of node %s's part of %s failed (%s); trying again in %gs",
                        job.owner,
                        job.key,
                        problem,
                        pause,
                    )
                self._cond.notify_all()


def copy_part(
    manifest: Manifest,
    files: list[FileRecord],
    ssd: SsdTier,
    budget: MemoryBudget,
    retain: bool,
    stream: Callable[[FileRecord, Callable[[int, memoryview | bytes], None]], None],
    throttle: Throttle,
    stop: threading.Event,
    metrics: Metrics,
    held: Callable[[dict[str, MemoryFile], int], bool],
) -> int:
    """Copy `files` of `manifest` into memory (with `retain`, while the budget has room) and onto
    `ssd` (committed there, with the checkpoint's marker); returns the bytes copied.

    `stream(record, sink)` hands every byte of a file to `sink(offset, data)` in order (from a
    peer). Each file goes through the pipeline a save's files take (`ckptd.ingest.FileUpload`):
    every block is checked against the manifest's block CRC-32Cs as it arrives, written around
    the page cache from the budget's aligned buffers, fsynced.

    Once every byte is checked, and before the disk is done: `held(memory copy, bytes)` takes
    the whole memory copy (it then belongs to the caller, who counts it as a copy held in this
    node's memory) and says whether it did; when it did not (or raised), or some file spilled,
    the memory is given back here. The SSD copy is committed after that, once durable. A
    failure raises (after `held` too: the caller then drops the memory copy it took), and
    nothing partial stays on disk.
    """
    save_id = f"replica-{uuid.uuid4().hex}"
    ssd.staging_dir(save_id).mkdir(parents=True, exist_ok=True)
    memory: dict[str, MemoryFile] = {}
    uploads: list[FileUpload] = []
    try:
        for record in files:
            header = checkpoint_pb2.FileHeader(
                save_id=save_id, path=record.path, rank=record.rank, kind=record.kind
            )
            upload = FileUpload(header, ssd.incoming_file(), budget, retain, _nothing, metrics)
            uploads.append(upload)
            stream(record, _checked_sink(upload, record, throttle, stop))
            upload.finish(checkpoint_pb2.FileTrailer(size=record.size, crc32c=record.crc32c))
            upload.end_input()
            kept = upload.take_memory()  # complete: the verifier is done with the file
            if kept is not None:
                memory[record.path] = kept
        total = sum(record.size for record in files)
        whole = len(memory) == len(files) and all(
            memory[record.path].size == record.size for record in files
        )
        if whole and held(memory, total):
            memory = {}  # the caller's now
        for upload, record in zip(uploads, files, strict=True):
            upload.wait_written()
            ssd.stage(upload.incoming, save_id, record.path)
        # Spilled under memory pressure, or refused: the copy is on SSD only. Given back only
        # now, as the writers read these buffers until the files are written.
        release(memory, budget)
        memory = {}
        ssd.sync_staging(save_id)
        ssd.put(manifest, save_id)
    except BaseException:
        for upload in uploads:
            upload.cancel()
        ssd.discard_staging(save_id)
        release(memory, budget)
        raise
    return total


def copy_to_memory(
    files: Iterable[FileRecord],
    budget: MemoryBudget,
    stream: Callable[[FileRecord, Callable[[int, memoryview | bytes], None]], None],
    throttle: Throttle,
    stop: threading.Event,
    metrics: Metrics,
) -> dict[str, MemoryFile]:
    """`copy_part` for a memory-only checkpoint: `files` into memory only, each block checked
    against the manifest's CRC-32Cs as it arrives; returns the memory copy (the caller's). A
    file the budget cannot keep fails the copy (Unavailable): there is no SSD copy to fall
    back to."""
    memory: dict[str, MemoryFile] = {}
    try:
        for record in files:
            header = checkpoint_pb2.FileHeader(path=record.path, rank=record.rank, kind=record.kind)
            upload = FileUpload(header, None, budget, True, _nothing, metrics)
            try:
                stream(record, _checked_sink(upload, record, throttle, stop))
                upload.finish(checkpoint_pb2.FileTrailer(size=record.size, crc32c=record.crc32c))
            except BaseException:
                upload.cancel()
                raise
            upload.end_input()
            upload.wait_written()
            kept = upload.take_memory()
            if kept is None or kept.size != record.size:
                if kept is not None:
                    memory[record.path] = kept
                raise Unavailable(
                    f"{record.path}: no room in the memory budget for a copy of a memory-only "
                    "checkpoint"
                )
            memory[record.path] = kept
    except BaseException:
        release(memory, budget)
        raise
    return memory


def _checked_sink(
    upload: FileUpload, record: FileRecord, throttle: Throttle, stop: threading.Event
) -> Callable[[int, memoryview | bytes], None]:
    """Where a copy's bytes of `record` go: into `upload`, throttled, each block with the
    manifest's CRC-32C to be checked against."""
    crcs = struct.unpack(f"<{len(record.block_crcs) // 4}I", record.block_crcs)

    def sink(offset: int, data: memoryview | bytes) -> None:
        if stop.is_set():
            raise Unavailable("ckptd is shutting down")
        throttle.take(len(data), stop)
        first = offset // BLOCK_BYTES
        blocks = crcs[first : first + -(-len(data) // BLOCK_BYTES)]
        upload.write(BlockChunk(offset, memoryview(data), blocks))

    return sink


def _nothing(_upload: FileUpload) -> None:
    """A replica's file joins its staging dir once all of it is checked (`copy_part`)."""
