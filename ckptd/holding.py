"""This node's replicas: which parts of committed checkpoints it should hold, making those
copies, and letting them go under memory pressure.

`ckptd.replicas` has the parts that need no store (placement, the replica tiers, the copying
thread); `ReplicaHolding` acts on the catalog and the tiers it is given, under the store's lock,
and `ckptd.retainer` drops the copies a run's retention no longer wants. A copy of this node's
own part (a replaced machine getting its part back from its peers) lands in its own tiers; a
copy of another node's part in the replica tiers of that owner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptd.catalog import COMMITTED, Catalog
from ckptd.cluster import Peer, Peers
from ckptd.config import CkptdConfig
from ckptd.manifest import FileRecord, Manifest
from ckptd.metrics import Metrics
from ckptd.names import key_of
from ckptd.reads import Reader
from ckptd.replicas import (
    CopyJob,
    ReplicaTiers,
    Replicator,
    Throttle,
    copy_part,
    copy_to_memory,
    effective_replicas,
    placement,
)
from ckptd.retainer import Retainer
from ckptd.retention import MEMORY_ONLY_LAST
from ckptd.states import ABSENT, MEMORY, SSD, TIER_COMMITTED
from ckptd.tiers import CheckpointKey
from ckptd.tiers.memory import MemoryBudget, MemoryFile, MemoryTier, release
from ckptd.tiers.ssd import SsdTier
from scaletrain.errors import FailedPrecondition, InvalidArgument
from scaletrain.v1 import checkpoint_pb2

log = logging.getLogger("ckptd.store")


class ReplicaHolding:
    """This node's copies of parts (see the module)."""

    def __init__(
        self,
        config: CkptdConfig,
        node: str,
        peers: Peers,
        catalog: Catalog,
        memory: MemoryTier,
        ssd: SsdTier,
        budget: MemoryBudget,
        replicas: ReplicaTiers,
        metrics: Metrics,
        lock: threading.RLock,
        closed: threading.Event,
        reader: Reader,
        retainer: Retainer,
        notify: Callable[..., None],
    ) -> None:
        self._config, self._node, self._peers = config, node, peers
        self._catalog, self._memory, self._ssd, self._budget = catalog, memory, ssd, budget
        self._replicas, self._metrics, self._notify = replicas, metrics, notify
        self._lock, self._closed = lock, closed
        self._reader, self._retainer = reader, retainer
        # The copying thread, on a node that runs upkeep (`start_copying`); None: no copies.
        self._replicator: Replicator | None = None

    def start_copying(self) -> None:
        """Start the thread that makes the copies queued here (a node that runs upkeep)."""
        self._replicator = Replicator(
            self.copy_job, self._config.cluster.replica_bytes_s, self._closed
        )

    def stop_copying(self) -> None:
        """Stop the copying thread (the store is closing: its `closed` event is set)."""
        if self._replicator is not None:
            self._replicator.close()

    def set_replica_rate(self, bytes_s: float) -> float:
        """Copy parts to peers at `bytes_s` from now on (0: no limit); returns the rate before.
        A node that keeps no replicas (no maintenance thread) has nothing to throttle."""
        if bytes_s < 0 or bytes_s != bytes_s:
            raise InvalidArgument(f"replica rate must be >= 0 bytes/s (0: no limit), got {bytes_s}")
        if self._replicator is None:
            raise FailedPrecondition(f"node {self._node} copies no replicas (it runs no upkeep)")
        return self._replicator.set_rate(bytes_s)

    # -- who holds what --------------------------------------------------------------------------

    def live_zones(self) -> dict[str, str]:
        """The nodes up now (this one and every reachable named peer) -> their zone."""
        zones = {self._node: self._peers.config.zone}
        for peer in self._peers.all():
            if peer.node and peer.reachable:
                zones[peer.node] = peer.zone
        return zones

    def node_count(self) -> int:
        """The nodes of the cluster: this one and every peer it knows of, by name (a node
        replaced at another address, under the lost one's name, is still one node). Live or
        not: R is what the run asks of the cluster; placement makes what the live nodes can
        hold, and a step is node-loss safe only once its R copies exist."""
        return len({self._node} | {peer.name for peer in self._peers.all()})

    def replicas_of(self, run: str) -> int:
        """R for `run`: what it asked for, else ckptd's default, capped at the nodes there are."""
        asked = self._retainer.policy(run).replicas
        return (
            min(asked, self.node_count())
            if asked
            else effective_replicas(0, self._peers.config.replicas, self.node_count())
        )

    def copies_wanted(self, key: CheckpointKey) -> int:
        """The nodes that should hold each part of `key`: its run's R, or for a memory-only
        checkpoint 2 (its node's memory and one peer's, whatever R), at most the nodes there
        are."""
        record = self._catalog.save_of(key)
        if record is not None and record.memory_only:
            return min(2, self.node_count())
        return self.replicas_of(key.run)

    def check_replicas(self, asked: int) -> None:
        """Refuse, at OpenSave, an R that the cluster cannot hold."""
        effective_replicas(asked, self._peers.config.replicas, self.node_count())

    def holds(self, key: CheckpointKey, owner: str) -> bool:
        """Whether this node has a committed copy (memory or SSD) of `owner`'s part of `key`."""
        return bool(self._reader.copies_here(key, owner))

    def queue_duties(self, zones: dict[str, str] | None = None) -> int:
        """Queue a copy of every part this node should hold and lacks: of the newest
        checkpoints of each run (those its SSD keeps), by `placement` over the live nodes.
        Returns how many were queued."""
        if self._replicator is None:
            return 0
        zones = zones if zones is not None else self.live_zones()
        queued, oldest = 0, None
        for run in self._catalog.runs():
            steps = sorted(self._catalog.run_states(run), reverse=True)
            keep = self._catalog.latest_safe(run).get(run)
            in_memory = self._catalog.memory_only_steps(run)
            recent = (
                [s for s in steps if s in in_memory][:MEMORY_ONLY_LAST]
                + [s for s in steps if s not in in_memory][: self._retainer.policy(run).ssd_last]
                + ([keep] if keep in steps else [])
            )
            for step in dict.fromkeys(recent):
                key = CheckpointKey(run, step)
                r = self.copies_wanted(key)
                manifest = self._catalog.manifest(key)
                if manifest is None:
                    continue
                for owner in sorted({f.node for f in manifest.files if f.node}):
                    wants_own = owner == self._node  # a replaced machine: its part comes back
                    if (wants_own or (r > 1 and self._node in placement(owner, zones, r))) and (
                        not self.holds(key, owner)
                    ):
                        queued += self._replicator.queue(CopyJob(key, owner))
                        oldest = min(oldest or manifest.committed_at, manifest.committed_at)
        self._metrics.replication_lag.set(time.time() - oldest if oldest else 0.0)
        return queued

    def drop_surplus(self, holders_of: Callable[[CheckpointKey, str], set[str]]) -> int:
        """Drop the replicas this node holds beyond R: a part's copy here that placement now
        gives to other nodes, once each of those holds a committed copy (`holders_of(key,
        owner)`, as the last sync saw them). A copy made while a peer seemed down is the usual
        case. The R chosen copies stay, so no drop makes a step less safe; returns how many
        were dropped."""
        zones = self.live_zones()
        dropped = 0
        for key, owners in self._catalog.replicas().items():
            r = self.copies_wanted(key)
            for owner in owners:
                chosen = placement(owner, zones, r)
                if (
                    self._node in chosen
                    or len(chosen) < r
                    or not set(chosen) <= holders_of(key, owner)
                ):
                    continue
                with self._lock:
                    self._replicas.memory(owner).delete(key)
                    self._replicas.ssd(owner).delete(key)
                    self._catalog.drop_replicas(key, owner)
                log.info(
                    "dropped the replica of %s's part of %s: %s hold the %d copies",
                    owner,
                    key,
                    ", ".join(chosen),
                    r,
                    extra={"run": key.run, "step": key.step},
                )
                dropped += 1
        return dropped

    def offer_replica(self, ref: checkpoint_pb2.CheckpointRef, owner: str, sender: str) -> bool:
        """A peer asks this node to copy `owner`'s part of a committed checkpoint; whether a
        copy was queued (False: it holds one already)."""
        key = key_of(ref)
        manifest = self._catalog.manifest(key)
        if manifest is None:
            raise FailedPrecondition(
                f"replica of node {owner}'s part of {key} offered by node {sender or '?'}: node "
                f"{self._node} does not know {key} as committed; refused"
            )
        if not manifest.files_on(owner):
            raise InvalidArgument(f"checkpoint {key} has no part on node {owner!r}")
        if self.holds(key, owner) or self._replicator is None:
            return False
        return self._replicator.queue(CopyJob(key, owner))

    def offer_replicas(self, manifest: Manifest) -> None:
        """After a commit (on its coordinator): ask each part's holders to copy it, in the
        background; a holder that misses the offer picks the copy up at its next sync."""
        zones = self.live_zones()
        r = self.copies_wanted(manifest.key)
        if r <= 1:
            return
        ref = checkpoint_pb2.CheckpointRef(run=manifest.key.run, step=manifest.key.step)
        offers: dict[str, list[str]] = {}  # holder -> owners
        for owner in sorted({f.node for f in manifest.files if f.node}):
            for holder in placement(owner, zones, r):
                if holder != owner:
                    offers.setdefault(holder, []).append(owner)
        if len(zones) < r:
            self._warn_below_r(manifest.key, r, zones)
        for owner in offers.pop(self._node, []):
            self.offer_replica(ref, owner, self._node)
        targets = [p for p in self._peers.all() if p.node in offers]

        def offer(peer: Peer) -> None:
            for owner in offers[peer.node]:
                request = checkpoint_pb2.OfferReplicaRequest(
                    ref=ref, owner=owner, sender=self._node
                )
                peer.cluster().OfferReplica(request, timeout=10.0)

        def send() -> None:
            for address, answer in self._peers.call(targets, offer).items():
                if isinstance(answer, BaseException):
                    log.warning("replica offer for %s to %s failed: %s", manifest.key, address,
                                answer)  # fmt: skip

        if targets:
            threading.Thread(target=send, name="ckptd-offers", daemon=True).start()

    def _warn_below_r(self, key: CheckpointKey, r: int, zones: dict[str, str]) -> None:
        """Say that a commit has fewer live nodes than its R copies need: it is saved all the
        same, and is not node-loss safe until a node comes back or a replacement joins (each
        node's sync then makes the missing copies)."""
        down = sorted(p.name for p in self._peers.all() if p.name not in zones)
        log.warning(
            "%s is below R: its run asks for %d copies of each part, and %d node(s) are live "
            "(down: %s); it becomes node-loss safe once a node comes back or a replacement joins",
            key,
            r,
            len(zones),
            ", ".join(down) or "none",
            extra={"run": key.run, "step": key.step},
        )

    # -- making a copy ---------------------------------------------------------------------------

    def copy_job(self, job: CopyJob, throttle: Throttle) -> bool:
        """Copy `job`'s part from the peers into this node's tiers (the Replicator's work).

        The copy counts in two steps, each in the catalog and to telemetry as soon as it is
        true: in memory once every byte of the part is here and checked against the manifest's
        block CRCs (a second node holds the part: losing either node leaves a good copy, so the
        step may be node-loss safe; a restart of this node loses this copy, and says so at
        start, `recover_replicas`), then on SSD once the files and the checkpoint's marker are
        durable (the copy survives a restart of this node too). A part that does not fit in the
        memory budget counts only at the second step."""
        key, owner = job.key, job.owner
        with self._lock:
            manifest = self._catalog.manifest(key)
            if manifest is None or self.holds(key, owner):
                return True  # deleted meanwhile, or already here
        files = manifest.files_on(owner)
        if not files:
            return True
        own = owner == self._node
        ssd = self._ssd if own else self._replicas.ssd(owner)
        memory = self._memory if own else self._replicas.memory(owner)
        replica_of = "" if own else owner
        started = time.monotonic()
        # Ends the pin on the memory copy's buffers, which its SSD writer reads until done.
        unpin: list[Callable[[], None]] = []

        def held(kept: dict[str, MemoryFile], total: int) -> bool:
            with self._lock:
                if self._catalog.manifest(key) is None:  # deleted while it was copied
                    return False
                self._set_copy(key, owner, MEMORY, total)
                memory.put(key, kept)  # the last step that could fail: the copy is ours now
                unpin.append(memory.pin(key))  # evicted before it is on disk: not recycled yet
                self._notify(key, MEMORY, total, replica_of=replica_of)
            log.info(
                "node %s's part of %s is held in memory here (%d bytes, %.2fs); writing it to SSD",
                owner,
                key,
                total,
                time.monotonic() - started,
                extra={"run": key.run, "step": key.step, "bytes": total},
            )
            return True

        if manifest.memory_only:
            return self._copy_to_memory(job, manifest, files, memory, throttle)
        try:
            total = copy_part(
                manifest,
                files,
                ssd,
                self._budget,
                self._retainer.retains(key.run),
                lambda record, sink: self._reader.stream_from_peers(
                    key, record, sink, self._budget.buffer
                ),
                throttle,
                self._closed,
                self._metrics,
                held,
            )
        except BaseException:
            with self._lock:
                if memory.delete(key):  # counted in memory, then its SSD copy failed
                    self._set_copy(key, owner, MEMORY, 0, ABSENT)
            raise
        finally:
            for give_back in unpin:
                give_back()
        with self._lock:
            if self._catalog.manifest(key) is None:  # deleted while it was copied
                ssd.delete(key)
                memory.delete(key)
                return True
            self._set_copy(key, owner, SSD, total)
            self._metrics.bytes.labels("replica", "write").inc(total)
            self._notify(key, SSD, total, replica_of=replica_of)
            self._retainer.apply(key.run)
        log.info(
            "copied node %s's part of %s (%d bytes, %.2fs) from its peers",
            owner,
            key,
            total,
            time.monotonic() - started,
            extra={"run": key.run, "step": key.step, "bytes": total},
        )
        return True

    def _copy_to_memory(
        self,
        job: CopyJob,
        manifest: Manifest,
        files: tuple[FileRecord, ...],
        memory: MemoryTier,
        throttle: Throttle,
    ) -> bool:
        """`copy_job` for a memory-only checkpoint: the part into this node's memory, nothing on
        SSD; it counts once every byte is here and checked."""
        key, owner = job.key, job.owner
        started = time.monotonic()
        kept = copy_to_memory(
            files,
            self._budget,
            lambda record, sink: self._reader.stream_from_peers(
                key, record, sink, self._budget.buffer
            ),
            throttle,
            self._closed,
            self._metrics,
        )
        total = sum(f.size for f in files)
        with self._lock:
            if self._catalog.manifest(key) is None:  # deleted while it was copied
                release(kept, self._budget)
                return True
            memory.put(key, kept)
            self._set_copy(key, owner, MEMORY, total)
            self._notify(key, MEMORY, total, replica_of="" if owner == self._node else owner)
            self._retainer.apply(key.run)
        log.info(
            "node %s's part of memory-only %s is held in memory here (%d bytes, %.2fs)",
            owner,
            key,
            total,
            time.monotonic() - started,
            extra={"run": key.run, "step": key.step, "bytes": total},
        )
        return True

    def _set_copy(
        self, key: CheckpointKey, owner: str, tier: int, nbytes: int, state: int = TIER_COMMITTED
    ) -> None:
        if owner == self._node:
            self._catalog.set_tier(key, tier, state, nbytes)
        else:
            self._catalog.set_replica(key, owner, tier, state, nbytes)

    # -- memory pressure ---------------------------------------------------------------------------

    def relieve_replicas(self) -> bool:
        """Evict the oldest replica held in memory (its SSD copy stays); whether one was."""
        for owner, tier in self._replicas.memory_tiers().items():
            for key in tier.list():
                tier.delete(key)
                self._catalog.set_replica(key, owner, MEMORY, ABSENT)
                log.info("evicted the replica of %s's part of %s from memory", owner, key)
                return True
        return False


def recover_replicas(catalog: Catalog, replicas: ReplicaTiers) -> None:
    """Bring the catalog in line with the replica directories after a restart: a directory
    with its marker is a committed copy; memory copies did not survive."""
    for key, owners in catalog.replicas().items():
        for owner in owners:
            catalog.set_replica(key, owner, MEMORY, ABSENT)
    for owner in replicas.owners_on_disk():
        tier = replicas.ssd(owner)
        tier.clean_leftovers()
        for save_id in tier.staged_saves():
            tier.discard_staging(save_id)
        on_disk = set()
        for key in tier.list():
            try:
                manifest = tier.manifest(key)
            except (OSError, ValueError) as exc:
                log.error("replica of %s of %s: unreadable marker (%s)", owner, key, exc)
                continue
            on_disk.add(key)
            record = catalog.save_of(key)
            if record is None or record.state != COMMITTED:
                catalog.record_commit(manifest, None)
            nbytes = sum(f.size for f in manifest.files_on(owner))
            catalog.set_replica(key, owner, SSD, TIER_COMMITTED, nbytes)
        for key, owners in catalog.replicas().items():
            if owner in owners and key not in on_disk:
                catalog.drop_replicas(key, owner)
