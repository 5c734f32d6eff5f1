"""The read path of the store: byte ranges of committed files, each piece verified.

Every read verifies the per-block CRC-32Cs of the bytes it returns (`ckptd.tiers`), and falls
through to the next copy when one is damaged or missing: this node's memory, then its SSD (of its
own part, or of the replica it holds of another node's part: `ckptd.replicas`), then the peers
(the node that served the last piece first, then the part's own node), then S3. A damaged copy
here is marked FAILED in the catalog (and dropped from memory) so that nothing reads it again,
and only when no copy verifies does a read fail, with DataLoss. Reads are served in pieces, so
one file can come partly from one copy and partly from another.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from ckptd.catalog import COMMITTED, Catalog
from ckptd.cluster import (
    Peer,
    Peers,
    PeerUnreachable,
    open_peer_range,
    open_peer_read,
    read_from_peer,
)
from ckptd.manifest import FileRecord
from ckptd.metrics import Metrics
from ckptd.names import check_path, key_of
from ckptd.readpath import Piece, spans_of
from ckptd.replicas import ReplicaTiers
from ckptd.states import FAILED, MEMORY, S3, SSD, TIER_COMMITTED
from ckptd.tiers import (
    BLOCK_BYTES,
    BlockCrcs,
    CheckpointKey,
    Tier,
    block_span,
    first_bad_block,
)
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.s3 import S3Tier
from ckptd.tiers.ssd import SsdTier
from scaletrain.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ScaletrainError,
)
from scaletrain.names import TIER_LABELS
from scaletrain.v1 import checkpoint_pb2

# The store's logger still: log queries select on it.
log = logging.getLogger("ckptd.store")

# Reads are served in pieces of this size, each from the fastest tier whose copy verifies.
READ_PIECE_BYTES = 4 << 20


def _damage(data: bytes | memoryview, lo: int, hi: int, record: FileRecord) -> str | None:
    """What is wrong with bytes [lo, hi) of `record` as read from a tier, or None if they verify."""
    if len(data) != hi - lo:
        return f"{record.path} is short ({len(data)} of {hi - lo} bytes at offset {lo})"
    bad = first_bad_block(data, lo, record.block_crcs)
    if bad is not None:
        return f"{record.path} fails its checksum in block {bad}"
    return None


def _piece(
    record: FileRecord,
    tier: int,
    start: int,
    end: int,
    lo: int,
    data: bytes | memoryview,
    node: str,
    done: Callable[[], None] | None = None,
) -> Piece:
    """Bytes [start, end) of `record` out of `data`, verified bytes read from `lo` (a block
    boundary), with their stored block CRCs when they start on a block and end on one or at the
    file's end."""
    if (start, end) != (lo, lo + len(data)):
        data = data[start - lo : end - lo]
    crcs = b""
    if start % BLOCK_BYTES == 0 and (end % BLOCK_BYTES == 0 or end == record.size):
        crcs = record.block_crcs[4 * (start // BLOCK_BYTES) : 4 * -(-end // BLOCK_BYTES)]
    return Piece(tier, start, data, node, crcs, done)


class Reader:
    """Reads committed files from the store's tiers, under the store's lock where it changes the
    catalog (a damaged copy). Callers reach it as `store.reader` (`iter_range`, `open_elsewhere`,
    `export`)."""

    def __init__(
        self,
        catalog: Catalog,
        memory: MemoryTier,
        ssd: SsdTier,
        s3: S3Tier | None,
        metrics: Metrics,
        lock: threading.RLock,
        peers: Peers,
        replicas: ReplicaTiers,
        on_damage: Callable[[CheckpointKey, int, str, str], None],
    ) -> None:
        """`on_damage(key, tier, part owner, reason)` hears of every damaged copy found here."""
        self._catalog = catalog
        self._memory = memory
        self._local: list[Tier] = [memory, ssd]
        self._s3 = s3
        self._metrics = metrics
        self._lock = lock
        self._peers = peers
        self._replicas = replicas
        self._on_damage = on_damage
        # (checkpoint, part owner) -> the peer that served its last piece: tried first next.
        self._source: dict[tuple[CheckpointKey, str], str] = {}

    def iter_range(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        path: str,
        offset: int = 0,
        length: int = 0,
        piece_bytes: int = READ_PIECE_BYTES,
        tier: int = 0,
        local_only: bool = False,
        lend: bool = False,
    ) -> Iterator[Piece]:
        """Yield the pieces of [offset, offset+length) of a committed file.

        `length` 0 reads to the end. Each piece comes from the fastest copy of it that verifies:
        this node's memory and SSD (its own part, or its replica of the file's part), else a
        peer's, then S3; only from `tier` if given, only from this node's tiers with
        `local_only`. Bad names and ranges raise here, before the first piece.

        With `lend`, for a caller that calls each piece's `done` (the data socket): pieces from
        memory are views, not copies, and a file this node holds no copy of streams from one
        peer over one connection (not one per piece) into the budget's reused buffers.
        """
        key = key_of(ref)
        check_path(path)
        save = self._catalog.save_of(key)
        if save is None or save.state != COMMITTED:
            raise NotFound(f"no committed checkpoint {key}")
        record = self._catalog.file(key, path)
        if record is None:
            raise NotFound(f"checkpoint {key} has no file {path!r}")
        if offset < 0 or length < 0:
            raise InvalidArgument(f"{path}: offset and length must be >= 0")
        end = record.size if length == 0 else offset + length
        if offset > record.size or end > record.size:
            raise InvalidArgument(
                f"{path}: range {offset}+{end - offset} is beyond its {record.size} bytes"
            )
        if tier:
            if tier not in TIER_LABELS:
                raise InvalidArgument(f"unknown tier {tier}")
            committed = (
                self._catalog.tier_state(key, S3) == TIER_COMMITTED
                if tier == S3
                else any(t.tier == tier for t in self.copies_here(key, self._owner(record)))
            )
            if not committed:
                raise NotFound(f"{key} has no committed copy on {TIER_LABELS[tier]}")
        only = (tier,) if tier else (MEMORY, SSD) if local_only else None
        if local_only and not self.copies_here(key, self._owner(record)):
            raise NotFound(f"node {self._peers.node} holds no copy of {key}/{path}")
        return self._pieces(key, record, offset, end, piece_bytes, only, lend)

    def open_elsewhere(
        self, request: checkpoint_pb2.OpenReadRequest
    ) -> checkpoint_pb2.OpenReadResponse | None:
        """A peer's ticket for the range when this node holds no copy of the file's part and a
        peer does, for a caller that reads from that peer's data socket itself (`direct`): one
        hop, where serving it here would pass every byte through this node. None when this node
        serves it: it holds a copy, the request names a tier or this node only, no peer offers
        it, or the request is one this node must refuse (the peer's checks are this node's, and
        `iter_range` then raises the one-line error)."""
        if request.local_only or request.tier:
            return None
        key = key_of(request.ref)
        save = self._catalog.save_of(key)
        record = self._catalog.file(key, request.path)
        if save is None or save.state != COMMITTED or record is None:
            return None
        if self.copies_here(key, self._owner(record)):
            return None
        for peer in self._peer_order(key, record):
            try:
                return open_peer_read(peer, request)
            except (grpc.RpcError, PeerUnreachable):
                continue  # no copy there, not up, or no data socket for us: the next one
        return None

    def _owner(self, record: FileRecord) -> str:
        return record.node or self._peers.node

    def copies_here(self, key: CheckpointKey, owner: str) -> list[Tier]:
        """This node's tiers with a committed copy of `owner`'s part of `key`: its own memory
        and SSD for its own part ("" is its own too), the replica tiers it holds of another's."""
        if owner in ("", self._peers.node):
            local = self._local
            return [t for t in local if self._catalog.tier_state(key, t.tier) == TIER_COMMITTED]
        tiers: list[Tier] = [self._replicas.memory(owner), self._replicas.ssd(owner)]
        return [
            t for t in tiers if self._catalog.replica_state(key, owner, t.tier) == TIER_COMMITTED
        ]

    def _pieces(
        self,
        key: CheckpointKey,
        record: FileRecord,
        start: int,
        end: int,
        piece_bytes: int,
        only: tuple[int, ...] | None,
        lend: bool,
    ) -> Iterator[Piece]:
        spans = deque(spans_of(start, end - start, piece_bytes))
        relayed = lend and only is None and piece_bytes == READ_PIECE_BYTES
        if relayed and not self.copies_here(key, self._owner(record)):
            yield from self._relay(key, record, spans)
        for pos, length in spans:  # all of them, or what the relay left
            yield self._piece(key, record, pos, pos + length, only, lend)

    def _piece(
        self,
        key: CheckpointKey,
        record: FileRecord,
        start: int,
        end: int,
        only: tuple[int, ...] | None,
        lend: bool = False,
    ) -> Piece:
        """Bytes [start, end) of `record` from the fastest tier (of `only`) whose copy verifies,
        with that tier and the node whose copy it was; a damaged copy is marked FAILED on the
        way. With `lend`, a memory copy's bytes are a view (see `iter_range`)."""
        lo, hi = block_span(start, end - start, record.size)
        problems = []
        for tier in self._read_order(key, record, only):
            if isinstance(tier, Peer):
                found = self._from_peer(tier, key, record, lo, hi, problems)
                if found is not None:
                    served, data = found
                    return _piece(record, served, start, end, lo, data, tier.node)
                continue
            name = TIER_LABELS[tier.tier]
            began = time.perf_counter()
            done = None
            try:
                if lend and isinstance(tier, MemoryTier):
                    data, done = tier.read_view(key, record.path, lo, hi - lo)
                else:
                    data = tier.read_range(key, record.path, lo, hi - lo)
            except FileNotFoundError:
                damage: str | None = f"{record.path} is missing"
            except Exception as exc:  # an unreachable tier: try the next one
                self._metrics.failed(tier.tier, "read")
                problems.append(f"{name}: {' '.join(str(exc).split())[:200]}")
                log.warning("reading %s/%s from %s failed: %s", key, record.path, name, exc)
                continue
            else:
                damage = _damage(data, lo, hi, record)
                if damage is None:
                    self._metrics.bytes.labels(name, "read").inc(len(data))
                    self._metrics.seconds.labels(name, "read").observe(time.perf_counter() - began)
                    node = "" if tier.tier == S3 else self._peers.node
                    return _piece(record, tier.tier, start, end, lo, data, node, done)
                if done is not None:
                    done()
            problems.append(f"{name}: {damage}")
            self._metrics.failed(tier.tier, "verify")
            log.error(
                "%s copy of %s is damaged (%s); trying the next tier",
                name,
                key,
                damage,
                extra={"run": key.run, "step": key.step, "tier": name},
            )
            self._failed(key, record, tier, damage)
        raise DataLoss(
            f"no verified copy of bytes {start}-{end} of {key}/{record.path}: "
            + ("; ".join(problems) or "no tier holds it")
        )

    def _relay(
        self, key: CheckpointKey, record: FileRecord, spans: deque[tuple[int, int]]
    ) -> Iterator[Piece]:
        """The pieces of `spans` (taken off it as they are served) streamed from the first peer
        that opens their range: one OpenRead and one connection for the whole range, where a
        piece at a time would pay both per piece. Each frame lands in a receive buffer of the
        budget (given back by its piece's `done`) and is checked against the block CRCs of this
        node's manifest. At the first problem it stops, and the piece-at-a-time path (every
        copy in order, S3 last) serves what is left."""
        lo = spans[0][0] // BLOCK_BYTES * BLOCK_BYTES
        hi = block_span(*spans[-1], record.size)[1]
        budget = self._memory.budget
        what = f"read {key}/{record.path}"
        for peer in self._peer_order(key, record):
            try:
                fast = open_peer_range(peer, key, record.path, lo, hi - lo, what)
            except (grpc.RpcError, PeerUnreachable):
                continue  # no copy there, or not up: the next peer
            if fast is None:
                return  # no data socket offered: ReadFile, a piece at a time
            with fast:
                try:
                    for offset, data in fast.frames_into(budget.buffer, verify=False):
                        end = offset + len(data)
                        if _damage(data, offset, end, record) is not None or not (
                            offset <= spans[0][0] and spans[0][0] + spans[0][1] <= end
                        ):
                            budget.recycle([data])
                            return  # a damaged frame, or not cut as this read's pieces
                        self._metrics.bytes.labels("peer", "read").inc(len(data))
                        self._source[(key, self._owner(record))] = peer.node
                        start, length = spans.popleft()
                        yield _piece(
                            record,
                            fast.tier,
                            start,
                            start + length,
                            offset,
                            data,
                            peer.node,
                            lambda data=data: budget.recycle([data]),
                        )
                        if not spans:
                            return
                except ScaletrainError as exc:
                    log.warning("relaying %s from node %s stopped: %s", what, peer.node, exc)
            return

    def read_range(
        self, ref: checkpoint_pb2.CheckpointRef, path: str, offset: int = 0, length: int = 0
    ) -> bytes:
        """The bytes of [offset, offset+length) of a committed file (length 0: to its end), each
        piece verified (`iter_range`)."""
        pieces = self.iter_range(ref, path, offset, length, READ_PIECE_BYTES, tier=0)
        return b"".join(piece.data for piece in pieces)

    def _read_order(
        self, key: CheckpointKey, record: FileRecord, only: tuple[int, ...] | None
    ) -> list[Tier | Peer]:
        order: list[Tier | Peer] = [
            t for t in self.copies_here(key, self._owner(record)) if only is None or t.tier in only
        ]
        if only is None:
            order += self._peer_order(key, record)
        if (
            self._s3 is not None
            and (only is None or S3 in only)
            and self._catalog.tier_state(key, S3) == TIER_COMMITTED
        ):
            order.append(self._s3)
        return order

    def _peer_order(self, key: CheckpointKey, record: FileRecord) -> list[Peer]:
        """The peers to ask for `record`: the one that served its part last, then the part's
        own node, then the others."""
        owner = self._owner(record)
        last = self._source.get((key, owner))
        return sorted(self._peers.all(), key=lambda p: (p.node != last, p.node != owner, p.node))

    def stream_from_peers(
        self,
        key: CheckpointKey,
        record: FileRecord,
        sink: Callable[[int, memoryview | bytes], None],
        alloc: Callable[[int], memoryview],
    ) -> None:
        """Every byte of `record`, in order, from the peers' copies only (how a replica is made:
        never from S3) into `sink(offset, data)`: over a peer's data socket into buffers of
        `alloc` where it offers one, else through ReadFile, piece by piece. A peer that fails
        midway hands over to the next at the same offset; DataLoss naming every peer's problem
        when none can finish. `sink` checks the bytes (against the block CRCs) and raises."""
        pos, problems = 0, []
        for peer in self._peer_order(key, record):
            if pos >= record.size:
                break
            name = f"node {peer.name}"
            try:
                fast = open_peer_range(
                    peer, key, record.path, pos, record.size - pos, f"copy {key}/{record.path}"
                )
            except grpc.RpcError as exc:
                problems.append(f"{name}: {exc.code().name}: {exc.details()}")
                continue
            if fast is None:  # no data socket offered: ReadFile, a piece at a time
                for lo, length in spans_of(pos, record.size - pos, READ_PIECE_BYTES):
                    found = self._from_peer(peer, key, record, lo, lo + length, problems)
                    if found is None:
                        break
                    sink(lo, found[1])
                    pos = lo + length
                continue
            with fast:
                frames = fast.frames_into(alloc, verify=False)
                while pos < record.size:
                    try:
                        offset, data = next(frames)
                    except ScaletrainError as exc:
                        problems.append(f"{name}: {' '.join(str(exc).split())[:200]}")
                        break
                    sink(offset, data)
                    pos = offset + len(data)
                self._metrics.bytes.labels("peer", "read").inc(sum(fast.served.values()))
            if pos >= record.size:
                self._source[(key, self._owner(record))] = peer.node
        if pos < record.size:
            raise DataLoss(
                f"no peer could serve bytes {pos}-{record.size} of {key}/{record.path}: "
                + ("; ".join(problems) or "no peers")
            )

    def read_verified(
        self,
        key: CheckpointKey,
        record: FileRecord,
        start: int,
        end: int,
        only: tuple[int, ...] | None = None,
    ) -> tuple[int, str, bytes]:
        """Bytes [start, end) of `record` from the fastest tier (of `only`) whose copy verifies,
        with that tier and the node whose copy it was (`_piece`)."""
        piece = self._piece(key, record, start, end, only)
        assert isinstance(piece.data, bytes)  # lent only on request
        return piece.tier, piece.node, piece.data

    def _from_peer(
        self,
        peer: Peer,
        key: CheckpointKey,
        record: FileRecord,
        lo: int,
        hi: int,
        problems: list[str],
    ) -> tuple[int, bytes] | None:
        """Bytes [lo, hi) of `record` from `peer`'s own tiers, checked against the block CRCs
        this node holds; None (and why, in `problems`) when the peer has no good copy."""
        name = f"node {peer.name}"
        try:
            served, data = read_from_peer(
                peer, key, record.path, lo, hi - lo, self._peers.config.connect_timeout_s
            )
        except ScaletrainError as exc:
            problems.append(f"{name}: {' '.join(str(exc).split())[:200]}")
            return None
        damage = _damage(data, lo, hi, record)
        if damage is not None:
            problems.append(f"{name}: {damage}")
            log.error("%s's copy of %s is damaged (%s); trying the next copy", name, key, damage)
            return None
        self._metrics.bytes.labels("peer", "read").inc(len(data))
        self._source[(key, self._owner(record))] = peer.node
        return served, data

    def _failed(self, key: CheckpointKey, record: FileRecord, tier: Tier, damage: str) -> None:
        """Mark this node's damaged copy of `record`'s part on `tier` FAILED, so that nothing
        reads it again (S3's copy is the whole checkpoint's)."""
        owner = self._owner(record)
        self._on_damage(key, tier.tier, owner, damage)
        with self._lock:
            if tier.tier == S3 or owner == self._peers.node:
                if tier is self._memory:
                    self._memory.delete(key)
                self._catalog.set_tier(key, tier.tier, FAILED, error=damage)
            else:
                if tier.tier == MEMORY:
                    tier.delete(key)
                self._catalog.set_replica(key, owner, tier.tier, FAILED, error=damage)

    def export(
        self,
        info: checkpoint_pb2.CheckpointInfo,
        dest_dir: Path,
        progress: Callable[[int], None] | None,
    ) -> list[Path]:
        """Write the committed checkpoint `info` as a plain DCP directory (stock
        FileSystemReader loads it).

        Each file is written under a temporary name and renamed once its block CRC-32Cs match
        (each read is verified too).
        `progress` gets the byte count of each piece written.
        """
        key = key_of(info.ref)
        dest = Path(dest_dir)
        if dest.exists() and any(dest.iterdir()):
            raise FailedPrecondition(f"export target {dest} is not empty")
        written = []
        for record in self._catalog.files(key):
            target = dest / record.path
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.partial")
            blocks = BlockCrcs()
            pieces = self.iter_range(info.ref, record.path, 0, 0, READ_PIECE_BYTES, tier=0)
            with open(partial, "wb") as out:
                for piece in pieces:
                    out.write(piece.data)
                    blocks.update(piece.data)
                    if progress is not None:
                        progress(len(piece.data))
            if blocks.packed() != record.block_crcs:
                partial.unlink()
                raise DataLoss(f"export of {key}/{record.path}: block CRC-32C mismatch")
            os.replace(partial, target)
            written.append(target)
        return written
