"""The store's half of the cluster: what a node does when peers ask, and what it asks them.

`ckptd.cluster` holds the coordinator's half of the two-phase commit and the peers; this is the
participant's: joining a save a peer's coordinator opened, voting on it (Prepare), taking the
decision (Decide, or learning it later: Outcome), and the catalog every node keeps of every
node's checkpoints (Catalog, and the sync that resolves in-doubt saves and fetches the commits a
node missed while it was down, frozen or replaced). It also answers the cluster-wide questions
of the store's API: every node's part of a checkpoint and its copies (replicas), whether a step
can be restored in full right now ("latest" only names such a step), and whether it is
node-loss safe (every part on R nodes, and at least 2).

A mixin of `CheckpointStore`: it acts on the store's saves and catalog, under the store's lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptd import cluster
from ckptd.catalog import ABORTED, COMMITTED, OPEN, Catalog, Coordination, SaveRecord
from ckptd.cluster import Peers, check_epoch
from ckptd.crash import crash_point
from ckptd.manifest import FileRecord, Manifest
from ckptd.names import MAX_WORLD_SIZE, check_run, key_of, manifest_from_peer
from ckptd.replicas import copies_for_safety
from ckptd.retention import RetentionPolicy
from ckptd.states import (
    OUTCOME_ABORTED,
    OUTCOME_COMMITTED,
    OUTCOME_IN_PROGRESS,
    OUTCOME_UNKNOWN,
    S3,
    TIER_COMMITTED,
)
from ckptd.tiers import CheckpointKey
from ckptd.tiers.ssd import SsdTier
from scaletrain.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ScaletrainError,
)
from scaletrain.v1 import checkpoint_pb2

if TYPE_CHECKING:
    from ckptd.replication import S3Replication
    from ckptd.store import _OpenSave

log = logging.getLogger("ckptd.store")


class ClusterMember:
    """The participant's half of the commit and the cluster-wide queries (see the module)."""

    # The store's, which these methods share (as are its _drop_save, _drop_aborted, _writable,
    # _freeze, _open, _commit_part and _apply_retention).
    node: str
    peers: Peers
    catalog: Catalog
    ssd: SsdTier
    _lock: threading.RLock
    _closed: threading.Event
    _saves: dict[str, _OpenSave]
    _forgotten: set[CheckpointKey]
    _replication: S3Replication | None
    replicas_of: Callable[[str], int]
    copies_wanted: Callable[[CheckpointKey], int]

    def join_save(
        self,
        save_id: str,
        ref: checkpoint_pb2.CheckpointRef,
        world_size: int,
        coordination: Coordination,
        memory_only: bool = False,
    ) -> None:
        """Take a rank's files of a save that `coordination`'s node opened (a no-op for a save
        this node already has); in memory only with `memory_only`."""
        key = key_of(ref)
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"world size must be 1..{MAX_WORLD_SIZE}, got {world_size}")
        with self._lock:
            save = self._saves.get(save_id)
            if save is not None:
                if save.record.world_size != world_size:
                    raise InvalidArgument(
                        f"save {save_id} of {key} has world size {save.record.world_size} on "
                        f"node {self.node}; a rank joined it with world size {world_size}"
                    )
                return
            existing = self.catalog.save_of(key)
            if existing is not None:
                if existing.save_id == save_id:
                    self._writable(save_id)  # committed or aborted: says which
                if existing.state == COMMITTED:
                    raise AlreadyExists(f"checkpoint {key} is already committed")
                check_epoch(
                    key, coordination.epoch, existing.coordination.epoch,
                    f"a rank joining save {save_id}",
                )  # fmt: skip
                self._drop_save(existing.save_id)
            self._open(key, save_id, world_size, {}, coordination, memory_only)

    def prepare(
        self, save_id: str, ref: checkpoint_pb2.CheckpointRef, epoch: int, coordinator: str
    ) -> tuple[int, list[FileRecord]]:
        """Vote on a save: make this node's files of it durable and record the vote; returns the
        world size this node was told and its files. From here only the outcome decides."""
        key = key_of(ref)
        with self._lock:
            check_epoch(
                key, epoch, self.catalog.epoch_of(key), f"the vote request of node {coordinator}"
            )
            record = self.catalog.save(save_id)
            if record is None or record.key != key:
                raise NotFound(
                    f"unknown save {save_id!r} of {key}: no rank wrote to node {self.node}"
                )
            if record.state == ABORTED:
                raise FailedPrecondition(f"save {save_id} of {key} was aborted on {self.node}")
            if record.state == COMMITTED or record.prepared:
                return record.world_size, self.catalog.files(key)
        save, files = self._freeze(save_id)
        if not save.record.memory_only:  # a memory-only save's files are complete in memory
            self.ssd.sync_staging(save_id)
        with self._lock:
            self.catalog.set_prepared(save_id)
            save.record = dataclasses.replace(save.record, prepared=True)
        crash_point("cluster-prepared")
        return save.record.world_size, files

    def decide(self, request: checkpoint_pb2.DecideRequest) -> None:
        """The coordinator's decision on a save this node voted on (or holds nothing of)."""
        key = key_of(request.ref)
        with self._lock:
            check_epoch(
                key, request.epoch, self.catalog.epoch_of(key),
                f"the decision of node {request.coordinator}",
            )  # fmt: skip
            if not request.commit:
                save = self._saves.get(request.save_id)
                if save is not None:
                    self._drop_aborted(save.record, request.reason)
                return
        manifest = manifest_from_peer(request.manifest, f"node {request.coordinator}")
        if manifest.key != key:
            raise InvalidArgument(f"a decision on {key} carries the manifest of {manifest.key}")
        if request.HasField("retention"):
            self._take_policy(key.run, request.retention, f"node {request.coordinator}")
        self.adopt(manifest, request.save_id)

    def _take_policy(self, run: str, wire: checkpoint_pb2.RetentionPolicy, source: str) -> None:
        """Keep `run`'s checkpoints as its coordinator does: its OpenSave set the run's
        retention and R on that node only."""
        try:
            policy = RetentionPolicy.from_proto(wire)
        except InvalidArgument as exc:
            log.warning("ignoring the retention of run %r from %s: %s", run, source, exc)
            return
        with self._lock:
            if self.catalog.policy(run) != policy:
                self.catalog.set_policy(run, policy)
                self._apply_retention(run)

    def adopt(self, manifest: Manifest, save_id: str | None) -> None:
        """Learn that `manifest` is committed. This node's part of it, if the save `save_id` (or
        an attempt of the same epoch) holds it here, commits too; a node that lost its part
        (a replaced machine) only records the checkpoint, which others hold."""
        key = manifest.key
        mine = manifest.files_on(self.node)
        with self._lock:
            record = self.catalog.save_of(key)
            if record is not None and record.state == COMMITTED:
                return
            save = None
            if record is not None and (
                record.save_id == save_id or record.coordination.epoch == manifest.epoch
            ):
                save = self._saves.get(record.save_id)
            if save is None or not mine:
                if save_id is not None and mine:
                    raise FailedPrecondition(
                        f"the commit of {key} names {len(mine)} file(s) on node {self.node}, "
                        f"which holds no save {save_id!r} of it"
                    )
                if record is not None and record.state == OPEN:
                    self._drop_save(record.save_id)
                self.catalog.record_commit(manifest, None)
                self._apply_retention(key.run)
                return
            held = {(f.path, f.size, f.block_crcs) for f in self.catalog.files(key)}
            if held != {(f.path, f.size, f.block_crcs) for f in mine}:
                raise FailedPrecondition(
                    f"the commit of {key} does not name the files node {self.node} holds"
                )
        self._commit_part(save, manifest)

    def outcome(
        self, save_id: str, ref: checkpoint_pb2.CheckpointRef, epoch: int
    ) -> tuple[int, Manifest | None]:
        """What this node knows became of a save attempt (ckptd.cluster.Outcome)."""
        key = key_of(ref)
        record = self.catalog.save_of(key)
        if record is None:
            return OUTCOME_UNKNOWN, None
        if record.state == COMMITTED:
            if record.coordination.epoch == epoch:
                return OUTCOME_COMMITTED, self.catalog.manifest(key)
            return OUTCOME_ABORTED, None  # another attempt of the step committed
        if record.save_id != save_id or record.state == ABORTED:
            return (OUTCOME_ABORTED if record.coordination.epoch > epoch else OUTCOME_UNKNOWN), None
        if record.coordination.coordinator == self.node:
            return OUTCOME_IN_PROGRESS, None
        return OUTCOME_UNKNOWN, None

    def in_doubt(self) -> list[SaveRecord]:
        """Saves this node voted on whose outcome it has not heard."""
        with self._lock:
            return [s.record for s in self._saves.values() if s.record.prepared]

    def _copies(
        self, key: CheckpointKey, views: dict[str, checkpoint_pb2.CatalogResponse | str]
    ) -> dict[str, dict[str, list[checkpoint_pb2.TierStatus]]]:
        """part owner -> node -> that node's copies of the part, as this node and every peer
        that answered say (a node's own part, and the replicas it holds)."""
        ref = checkpoint_pb2.CheckpointRef(run=key.run, step=key.step)
        owners = {f.node or self.node for f in self.catalog.files(key)}
        copies: dict[str, dict[str, list[checkpoint_pb2.TierStatus]]] = {o: {} for o in owners}
        info = self.catalog.info(key)
        own = [s for s in info.tiers if s.tier != S3] if owners and info is not None else []
        if self.node in owners:
            copies[self.node][self.node] = own
        for owner, statuses in self.catalog.replica_statuses(key).items():
            copies.setdefault(owner, {})[self.node] = statuses
        for node, view in views.items():
            if not isinstance(view, checkpoint_pb2.CatalogResponse):
                continue
            entry = entry_in(view, ref)
            if entry is None:
                continue
            if node in owners:
                copies[node][node] = [s for s in entry.tiers if s.tier != S3]
            for held in entry.replicas:
                copies.setdefault(held.owner, {})[node] = list(held.tiers)
        return copies

    @staticmethod
    def _holders(copies: dict[str, list[checkpoint_pb2.TierStatus]]) -> set[str]:
        """The nodes of `copies` (node -> its copies of one part) with a committed one."""
        return {n for n, tiers in copies.items() if any(t.state == TIER_COMMITTED for t in tiers)}

    def node_loss_safe(
        self, key: CheckpointKey, views: dict[str, checkpoint_pb2.CatalogResponse | str]
    ) -> bool:
        """Whether every part of `key` has a committed copy on as many nodes as its run's R
        asks, and on at least 2 (`copies_for_safety`). Copies are made after the commit, so a
        step is not safe until they land: a node lost before leaves it unsafe for good.

        A memory-only step needs its 2 copies (`copies_wanted`), in the memory of 2 distinct
        nodes: losing one node leaves a copy. It is safe against the loss of a node, not of
        both holders nor of a restart of both, and is never the run's newest safe step that
        retention keeps on SSD (`latest(durable=True)`)."""
        need = copies_for_safety(self.copies_wanted(key))
        copies = self._copies(key, views)
        return bool(copies) and all(len(self._holders(c)) >= need for c in copies.values())

    def _parts(
        self,
        info: checkpoint_pb2.CheckpointInfo,
        views: dict[str, checkpoint_pb2.CatalogResponse | str],
    ) -> list[checkpoint_pb2.NodePart]:
        holders: dict[str, list[checkpoint_pb2.FileInfo]] = {}
        for f in info.files:
            holders.setdefault(f.node or self.node, []).append(f)
        copies = self._copies(CheckpointKey(info.ref.run, info.ref.step), views)
        parts = []
        addresses = {p.node: p.address for p in self.peers.all() if p.node}
        addresses[self.node] = self.peers.address
        for node in sorted(set(holders) | {self.node} | set(views)):
            files = holders.get(node, [])
            part = checkpoint_pb2.NodePart(
                node=node,
                address=addresses.get(node, ""),
                files=len(files),
                bytes=sum(f.size for f in files),
                copies=len(self._holders(copies.get(node, {}))),
                replicas=[
                    checkpoint_pb2.PartCopy(node=holder, tiers=tiers)
                    for holder, tiers in sorted(copies.get(node, {}).items())
                    if holder != node
                ],
            )
            view = self.node if node == self.node else views.get(node, "not a peer of this node")
            if isinstance(view, str) and node != self.node:
                part.reachable, part.error = False, view
            else:
                part.reachable = True
                part.latest_safe_step = (
                    self.catalog.latest_safe(info.ref.run).get(info.ref.run, 0)
                    if node == self.node
                    else view.latest_safe.get(info.ref.run, 0)  # type: ignore[union-attr]
                )
                part.tiers.extend(
                    info.tiers if node == self.node else tiers_in(view, info.ref)  # type: ignore[arg-type]
                )
            parts.append(part)
        return parts

    def _whole(
        self, key: CheckpointKey, views: dict[str, checkpoint_pb2.CatalogResponse | str]
    ) -> bool:
        """Whether every part of `key` has a committed copy somewhere reachable now: on its
        own node, as a replica on another, or on S3 (the whole checkpoint)."""
        if self.catalog.tier_state(key, S3) == TIER_COMMITTED:
            return True
        copies = self._copies(key, views)
        return bool(copies) and all(self._holders(c) for c in copies.values())

    def catalog_entries(self, run: str = "") -> list[checkpoint_pb2.CatalogEntry]:
        """Every committed checkpoint this node knows (of `run`), with its own copies and the
        replicas it holds."""
        entries = []
        for info in self.catalog.checkpoints(check_run(run) if run else ""):
            key = CheckpointKey(info.ref.run, info.ref.step)
            manifest = self.catalog.manifest(key)
            if manifest is not None:
                held = [
                    checkpoint_pb2.ReplicaHeld(owner=owner, tiers=tiers)
                    for owner, tiers in self.catalog.replica_statuses(key).items()
                ]
                entries.append(
                    checkpoint_pb2.CatalogEntry(
                        manifest=manifest.to_wire(), tiers=info.tiers, replicas=held
                    )
                )
        return entries

    def latest(
        self,
        run: str,
        views: dict[str, checkpoint_pb2.CatalogResponse | str],
        safe: bool,
        durable: bool = False,
    ) -> CheckpointKey | None:
        """The newest committed step of `run` that can be restored in full now (with `safe`:
        that is node-loss safe; with `durable`: not a memory-only one), or None."""
        skipped = self.catalog.memory_only_steps(run) if durable else set()
        for step in sorted(set(self.catalog.run_states(run)) - skipped, reverse=True):
            key = CheckpointKey(run, step)
            if self.node_loss_safe(key, views) if safe else self._whole(key, views):
                return key
        return None

    def _learn_latest_safe(self, run: str, step: int) -> None:
        """Take `step` as the run's newest node-loss-safe step, in the catalog: a restart must
        not forget it while no newer step is safe (its part lost with a node before its
        copies were made), or retention would drop the step a restore needs. Retention runs
        again when it changes: the SSD copy it kept of the step safe before may go now, where
        it would otherwise wait for the run's next commit (never, once the run has ended)."""
        with self._lock:
            if self.catalog.latest_safe(run).get(run) != step:
                self.catalog.set_latest_safe(run, step)
                self._apply_retention(run)

    def policies(self, run: str = "") -> dict[str, checkpoint_pb2.RetentionPolicy]:
        """run -> its retention and R as this node holds them (of `run`)."""
        runs = [run] if run else self.catalog.runs()
        held = {r: self.catalog.policy(r) for r in runs}
        return {r: p.to_proto() for r, p in held.items() if p is not None}

    def latest_safe_steps(self, run: str = "") -> dict[str, int]:
        """run -> its newest node-loss-safe step as this node last learned it (of `run`)."""
        return self.catalog.latest_safe(run)

    def sync_with_peers(self) -> None:
        """Resolve the saves this node voted on, and learn the commits it missed (down, frozen,
        or a replaced machine with an empty data dir). Run at start and every few seconds."""
        if not self.peers.enabled or self._closed.is_set():
            return
        for record in self.in_doubt():
            outcome, manifest = cluster.outcome(self.peers, record)
            try:
                if outcome == OUTCOME_COMMITTED and manifest is not None:
                    self.adopt(manifest, record.save_id)
                elif outcome == OUTCOME_ABORTED:
                    with self._lock:
                        if record.save_id in self._saves:
                            self._drop_aborted(record, "aborted by its coordinator")
            except ScaletrainError as exc:
                log.warning("cannot resolve save %s of %s: %s", record.save_id, record.key, exc)
        views = cluster.catalogs(self.peers)
        for view in views.values():
            if not isinstance(view, checkpoint_pb2.CatalogResponse):
                continue
            for entry in view.entries:
                try:
                    manifest = manifest_from_peer(entry.manifest, f"node {view.node}")
                except InvalidArgument as exc:
                    log.warning("%s", exc)
                    continue
                if manifest.key in self._forgotten:
                    continue
                try:
                    self.adopt(manifest, None)
                except ScaletrainError as exc:
                    log.warning("cannot take %s from node %s: %s", manifest.key, view.node, exc)
                on_s3 = any(t.tier == S3 and t.state == TIER_COMMITTED for t in entry.tiers)
                if on_s3 and self._replication is not None:
                    self._replication.queue_check(manifest.key)
        for run in self.catalog.runs():
            newest = max(self.catalog.run_states(run), default=None)
            manifest = self.catalog.manifest(CheckpointKey(run, newest)) if newest else None
            view = views.get(manifest.coordinator) if manifest is not None else None
            if isinstance(view, checkpoint_pb2.CatalogResponse) and run in view.policies:
                self._take_policy(run, view.policies[run], f"node {view.node}")
            # Durable steps only: the newest safe step is the one SSD keeps whatever its age.
            safe = self.latest(run, views, safe=True, durable=True)
            if safe is not None:
                self._learn_latest_safe(run, safe.step)
        self.queue_duties()
        self.drop_surplus(lambda key, owner: self._holders(self._copies(key, views).get(owner, {})))


def entry_in(
    view: checkpoint_pb2.CatalogResponse, ref: checkpoint_pb2.CheckpointRef
) -> checkpoint_pb2.CatalogEntry | None:
    """A peer's catalog entry of checkpoint `ref` (None if it does not list it)."""
    for entry in view.entries:
        if entry.manifest.ref.run == ref.run and entry.manifest.ref.step == ref.step:
            return entry
    return None


def tiers_in(
    view: checkpoint_pb2.CatalogResponse, ref: checkpoint_pb2.CheckpointRef
) -> list[checkpoint_pb2.TierStatus]:
    """A peer's copies of checkpoint `ref`, from its catalog (none if it does not list it)."""
    entry = entry_in(view, ref)
    return list(entry.tiers) if entry is not None else []
