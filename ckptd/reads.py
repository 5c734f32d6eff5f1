"""The read path of the store: byte ranges of committed files, each piece verified.

Every read verifies the per-block CRC-32Cs of the bytes it returns (`ckptd.tiers`), and falls
through to the next tier when a copy is damaged or missing: memory, then SSD, then S3. A damaged
copy is marked FAILED in the catalog (and dropped from memory) so that nothing reads it again, and
only when no tier holds a verified copy does a read fail, with DataLoss. Reads are served in
pieces, so one file can come partly from one tier and partly from another.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ckptd.catalog import COMMITTED, Catalog
from ckptd.cluster import Peer, Peers, read_from_peer
from ckptd.manifest import FileRecord
from ckptd.metrics import Metrics
from ckptd.names import check_path, key_of
from ckptd.tiers import TIER_NAMES, BlockCrcs, CheckpointKey, Tier, block_span, first_bad_block
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
from scaletrain.v1 import checkpoint_pb2, common_pb2

# The store's logger still: log queries select on it.
log = logging.getLogger("ckptd.store")

# Reads are served in pieces of this size, each from the fastest tier whose copy verifies.
READ_PIECE_BYTES = 4 << 20

TIER_COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED
FAILED = checkpoint_pb2.TIER_STATE_FAILED
MEMORY, SSD, S3 = common_pb2.TIER_MEMORY, common_pb2.TIER_SSD, common_pb2.TIER_S3


def _damage(data: bytes, lo: int, hi: int, record: FileRecord) -> str | None:
    """What is wrong with bytes [lo, hi) of `record` as read from a tier, or None if they verify."""
    if len(data) != hi - lo:
        return f"{record.path} is short ({len(data)} of {hi - lo} bytes at offset {lo})"
    bad = first_bad_block(data, lo, record.block_crcs)
    if bad is not None:
        return f"{record.path} fails its checksum in block {bad}"
    return None


class Reader:
    """Reads committed files from the store's tiers, under the store's lock where it changes the
    catalog (a damaged copy). The store's methods of the same names are the API, with the
    defaults."""

    def __init__(
        self,
        catalog: Catalog,
        memory: MemoryTier,
        ssd: SsdTier,
        s3: S3Tier | None,
        metrics: Metrics,
        lock: threading.RLock,
        peers: Peers,
    ) -> None:
        self._catalog = catalog
        self._memory = memory
        self._local: list[Tier] = [memory, ssd]
        self._s3 = s3
        self._metrics = metrics
        self._lock = lock
        self._peers = peers

    def iter_range(
        self,
        ref: checkpoint_pb2.CheckpointRef,
        path: str,
        offset: int,
        length: int,
        piece_bytes: int,
        tier: int,
        local_only: bool = False,
    ) -> Iterator[tuple[int, int, bytes]]:
        """Yield (tier, offset, bytes) pieces of [offset, offset+length) of a committed file.

        `length` 0 reads to the end. Each piece comes from the fastest copy of it that verifies:
        this node's memory and SSD if the file is in its part, else the peer that holds it (then
        any other peer), then S3; only from `tier` if given, only from this node's own tiers
        with `local_only`. Bad names and ranges raise here, before the first piece.
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
            if tier not in TIER_NAMES:
                raise InvalidArgument(f"unknown tier {tier}")
            if self._catalog.tier_state(key, tier) != TIER_COMMITTED or (
                tier != S3 and not self._here(record)
            ):
                raise NotFound(f"{key} has no committed copy on {TIER_NAMES[tier]}")
        only = (tier,) if tier else (MEMORY, SSD) if local_only else None
        if local_only and not self._here(record):
            raise NotFound(f"node {self._peers.node} holds no copy of {key}/{path}")
        return self._pieces(key, record, offset, end, piece_bytes, only)

    def _here(self, record: FileRecord) -> bool:
        """Whether this node's memory and SSD hold `record` (its part of the checkpoint)."""
        return record.node in ("", self._peers.node)

    def _pieces(
        self,
        key: CheckpointKey,
        record: FileRecord,
        start: int,
        end: int,
        piece_bytes: int,
        only: tuple[int, ...] | None,
    ) -> Iterator[tuple[int, int, bytes]]:
        pos = start
        while pos < end:
            stop = min(end, (pos // piece_bytes + 1) * piece_bytes)
            tier, data = self.read_verified(key, record, pos, stop, only)
            yield tier, pos, data
            pos = stop

    def read_range(
        self, ref: checkpoint_pb2.CheckpointRef, path: str, offset: int, length: int
    ) -> bytes:
        pieces = self.iter_range(ref, path, offset, length, READ_PIECE_BYTES, tier=0)
        return b"".join(data for _tier, _offset, data in pieces)

    def _read_order(
        self, key: CheckpointKey, record: FileRecord, only: tuple[int, ...] | None
    ) -> list[Tier | Peer]:
        local = self._local if self._here(record) else []
        if self._s3 is not None:
            local = [*local, self._s3]
        order: list[Tier | Peer] = [
            t
            for t in local
            if (only is None or t.tier in only)
            and self._catalog.tier_state(key, t.tier) == TIER_COMMITTED
        ]
        if only is None and not self._here(record):
            peers = sorted(self._peers.all(), key=lambda p: p.node != record.node)
            order[:0] = peers  # before S3
        return order

    def read_verified(
        self,
        key: CheckpointKey,
        record: FileRecord,
        start: int,
        end: int,
        only: tuple[int, ...] | None = None,
    ) -> tuple[int, bytes]:
        """Bytes [start, end) of `record` from the fastest tier (of `only`) whose copy verifies,
        and that tier; a damaged copy is marked FAILED on the way."""
        lo, hi = block_span(start, end - start, record.size)
        problems = []
        for tier in self._read_order(key, record, only):
            if isinstance(tier, Peer):
                found = self._from_peer(tier, key, record, lo, hi, problems)
                if found is not None:
                    served, data = found
                    return served, data if (start, end) == (lo, hi) else data[start - lo : end - lo]
                continue
            name = TIER_NAMES[tier.tier]
            began = time.perf_counter()
            try:
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
                    if start == lo and end == hi:
                        return tier.tier, data
                    return tier.tier, data[start - lo : end - lo]
            problems.append(f"{name}: {damage}")
            self._metrics.failed(tier.tier, "verify")
            log.error(
                "%s copy of %s is damaged (%s); trying the next tier", name, key, damage,
                extra={"run": key.run, "step": key.step, "tier": name},
            )  # fmt: skip
            with self._lock:
                if tier is self._memory:
                    self._memory.delete(key)
                self._catalog.set_tier(key, tier.tier, FAILED, error=damage)
        raise DataLoss(
            f"no verified copy of bytes {start}-{end} of {key}/{record.path}: "
            + ("; ".join(problems) or "no tier holds it")
        )

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
        name = f"node {peer.node or peer.address}"
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
        return served, data

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
                for _tier, _offset, data in pieces:
                    out.write(data)
                    blocks.update(data)
                    if progress is not None:
                        progress(len(data))
            if blocks.packed() != record.block_crcs:
                partial.unlink()
                raise DataLoss(f"export of {key}/{record.path}: block CRC-32C mismatch")
            os.replace(partial, target)
            written.append(target)
        return written
