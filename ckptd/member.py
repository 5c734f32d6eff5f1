"""The store's half of the cluster: what a node does when peers ask, and what it asks them.

`ckptd.cluster` holds the coordinator's half of the two-phase commit and the peers; this is the
participant's: joining a save a peer's coordinator opened, voting on it (Prepare), taking the
decision (Decide, or learning it later: Outcome), and the catalog every node keeps of every
node's checkpoints (Catalog, and the sync that resolves in-doubt saves and fetches the commits a
node missed while it was down, frozen or replaced). It also answers the cluster-wide questions
(`store.member.checkpoints`, `store.member.checkpoint`): every node's part of a checkpoint and
its copies (replicas), whether a step can be restored in full right now ("latest" only names
such a step), and whether it is node-loss safe (every part on R nodes, and at least 2).

A component of `CheckpointStore`: it acts on the open saves through `ckptd.saves.Saves`, on the
replicas through `ckptd.holding.ReplicaHolding`, under the store's lock.
"""

from __future__ import annotations

import logging
import threading

from ckptd import cluster
from ckptd.catalog import ABORTED, COMMITTED, OPEN, Catalog, Coordination
from ckptd.cluster import Peers, check_epoch
from ckptd.crash import crash_point
from ckptd.holding import ReplicaHolding
from ckptd.manifest import FileRecord, Manifest
from ckptd.names import MAX_WORLD_SIZE, check_run, key_of, manifest_from_peer
from ckptd.replicas import copies_for_safety
from ckptd.replication import S3Replication
from ckptd.retainer import Retainer
from ckptd.retention import RetentionPolicy
from ckptd.saves import Saves
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
    Unavailable,
)
from scaletrain.v1 import checkpoint_pb2

log = logging.getLogger("ckptd.store")


class ClusterMember:
    """The participant's half of the commit and the cluster-wide queries (see the module)."""

    def __init__(
        self,
        node: str,
        peers: Peers,
        catalog: Catalog,
        ssd: SsdTier,
        lock: threading.RLock,
        closed: threading.Event,
        saves: Saves,
        holding: ReplicaHolding,
        retainer: Retainer,
        replication: S3Replication | None,
    ) -> None:
        self._node, self._peers, self._catalog, self._ssd = node, peers, catalog, ssd
        self._lock, self._closed = lock, closed
        self._saves, self._holding, self._retainer = saves, holding, retainer
        self._replication = replication
        # Checkpoints deleted here, which a peer's catalog may still list for a while: the
        # sync must not take them back.
        self._forgotten: set[CheckpointKey] = set()

    def forget(self, key: CheckpointKey) -> None:
        """`key` was deleted here: never adopt it again from a peer's catalog."""
        self._forgotten.add(key)

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
                        f"node {self._node}; a rank joined it with world size {world_size}"
                    )
                return
            existing = self._catalog.save_of(key)
            if existing is not None:
                if existing.save_id == save_id:
                    self._saves.writable(save_id)  # committed or aborted: says which
                if existing.state == COMMITTED:
                    raise AlreadyExists(f"checkpoint {key} is already committed")
                check_epoch(
                    key,
                    coordination.epoch,
                    existing.coordination.epoch,
                    f"a rank joining save {save_id}",
                )
                self._saves.drop(existing.save_id)
            self._saves.open_attempt(key, save_id, world_size, {}, coordination, memory_only)

    def prepare(
        self, save_id: str, ref: checkpoint_pb2.CheckpointRef, epoch: int, coordinator: str
    ) -> tuple[int, list[FileRecord]]:
        """Vote on a save: make this node's files of it durable and record the vote; returns the
        world size this node was told and its files. From here only the outcome decides."""
        key = key_of(ref)
        with self._lock:
            check_epoch(
                key, epoch, self._catalog.epoch_of(key), f"the vote request of node {coordinator}"
            )
            record = self._catalog.save(save_id)
            if record is None or record.key != key:
                raise NotFound(
                    f"unknown save {save_id!r} of {key}: no rank wrote to node {self._node}"
                )
            if record.state == ABORTED:
                raise FailedPrecondition(f"save {save_id} of {key} was aborted on {self._node}")
            if record.state == COMMITTED or record.prepared:
                return record.world_size, self._catalog.files(key)
        save, files = self._saves.freeze(save_id)
        if not save.record.memory_only:  # a memory-only save's files are complete in memory
            self._ssd.sync_staging(save_id)
        self._saves.set_prepared(save)
        crash_point("cluster-prepared")
        return save.record.world_size, files

    def decide(self, request: checkpoint_pb2.DecideRequest) -> None:
        """The coordinator's decision on a save this node voted on (or holds nothing of)."""
        key = key_of(request.ref)
        with self._lock:
            check_epoch(
                key,
                request.epoch,
                self._catalog.epoch_of(key),
                f"the decision of node {request.coordinator}",
            )
            if not request.commit:
                save = self._saves.get(request.save_id)
                if save is not None:
                    self._saves.drop_aborted(save.record, request.reason)
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
            if self._catalog.policy(run) != policy:
                self._catalog.set_policy(run, policy)
                self._retainer.apply(run)

    def adopt(self, manifest: Manifest, save_id: str | None) -> None:
        """Learn that `manifest` is committed. This node's part of it, if the save `save_id` (or
        an attempt of the same epoch) holds it here, commits too; a node that lost its part
        (a replaced machine) only records the checkpoint, which others hold."""
        key = manifest.key
        mine = manifest.files_on(self._node)
        with self._lock:
            record = self._catalog.save_of(key)
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
                        f"the commit of {key} names {len(mine)} file(s) on node {self._node}, "
                        f"which holds no save {save_id!r} of it"
                    )
                if record is not None and record.state == OPEN:
                    self._saves.drop(record.save_id)
                self._catalog.record_commit(manifest, None)
                self._retainer.apply(key.run)
                return
            held = {(f.path, f.size, f.block_crcs) for f in self._catalog.files(key)}
            if held != {(f.path, f.size, f.block_crcs) for f in mine}:
                raise FailedPrecondition(
                    f"the commit of {key} does not name the files node {self._node} holds"
                )
        self._saves.commit_part(save, manifest)

    def outcome(
        self, save_id: str, ref: checkpoint_pb2.CheckpointRef, epoch: int
    ) -> tuple[int, Manifest | None]:
        """What this node knows became of a save attempt (ckptd.cluster.Outcome)."""
        key = key_of(ref)
        record = self._catalog.save_of(key)
        if record is None:
            return OUTCOME_UNKNOWN, None
        if record.state == COMMITTED:
            if record.coordination.epoch == epoch:
                return OUTCOME_COMMITTED, self._catalog.manifest(key)
            return OUTCOME_ABORTED, None  # another attempt of the step committed
        if record.save_id != save_id or record.state == ABORTED:
            return (OUTCOME_ABORTED if record.coordination.epoch > epoch else OUTCOME_UNKNOWN), None
        if record.coordination.coordinator == self._node:
            return OUTCOME_IN_PROGRESS, None
        return OUTCOME_UNKNOWN, None

    def _copies(
        self, key: CheckpointKey, views: dict[str, checkpoint_pb2.CatalogResponse | str]
    ) -> dict[str, dict[str, list[checkpoint_pb2.TierStatus]]]:
        """part owner -> node -> that node's copies of the part, as this node and every peer
        that answered say (a node's own part, and the replicas it holds)."""
        ref = checkpoint_pb2.CheckpointRef(run=key.run, step=key.step)
        owners = {f.node or self._node for f in self._catalog.files(key)}
        copies: dict[str, dict[str, list[checkpoint_pb2.TierStatus]]] = {o: {} for o in owners}
        info = self._catalog.info(key)
        own = [s for s in info.tiers if s.tier != S3] if owners and info is not None else []
        if self._node in owners:
            copies[self._node][self._node] = own
        for owner, statuses in self._catalog.replica_statuses(key).items():
            copies.setdefault(owner, {})[self._node] = statuses
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
        need = copies_for_safety(self._holding.copies_wanted(key))
        copies = self._copies(key, views)
        return bool(copies) and all(len(self._holders(c)) >= need for c in copies.values())

    def _parts(
        self,
        info: checkpoint_pb2.CheckpointInfo,
        views: dict[str, checkpoint_pb2.CatalogResponse | str],
    ) -> list[checkpoint_pb2.NodePart]:
        holders: dict[str, list[checkpoint_pb2.FileInfo]] = {}
        for f in info.files:
            holders.setdefault(f.node or self._node, []).append(f)
        copies = self._copies(CheckpointKey(info.ref.run, info.ref.step), views)
        parts = []
        addresses = {p.node: p.address for p in self._peers.all() if p.node}
        addresses[self._node] = self._peers.address
        for node in sorted(set(holders) | {self._node} | set(views)):
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
            view = self._node if node == self._node else views.get(node, "not a peer of this node")
            if isinstance(view, str) and node != self._node:
                part.reachable, part.error = False, view
            else:
                part.reachable = True
                part.latest_safe_step = (
                    self._catalog.latest_safe(info.ref.run).get(info.ref.run, 0)
                    if node == self._node
                    else view.latest_safe.get(info.ref.run, 0)  # type: ignore[union-attr]
                )
                part.tiers.extend(
                    info.tiers if node == self._node else tiers_in(view, info.ref)  # type: ignore[arg-type]
                )
            parts.append(part)
        return parts

    def _whole(
        self, key: CheckpointKey, views: dict[str, checkpoint_pb2.CatalogResponse | str]
    ) -> bool:
        """Whether every part of `key` has a committed copy somewhere reachable now: on its
        own node, as a replica on another, or on S3 (the whole checkpoint)."""
        if self._catalog.tier_state(key, S3) == TIER_COMMITTED:
            return True
        copies = self._copies(key, views)
        return bool(copies) and all(self._holders(c) for c in copies.values())

    def catalog_entries(self, run: str = "") -> list[checkpoint_pb2.CatalogEntry]:
        """Every committed checkpoint this node knows (of `run`), with its own copies and the
        replicas it holds."""
        entries = []
        for info in self._catalog.checkpoints(check_run(run) if run else ""):
            key = CheckpointKey(info.ref.run, info.ref.step)
            manifest = self._catalog.manifest(key)
            if manifest is not None:
                held = [
                    checkpoint_pb2.ReplicaHeld(owner=owner, tiers=tiers)
                    for owner, tiers in self._catalog.replica_statuses(key).items()
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
        skipped = self._catalog.memory_only_steps(run) if durable else set()
        for step in sorted(set(self._catalog.run_states(run)) - skipped, reverse=True):
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
            if self._catalog.latest_safe(run).get(run) != step:
                self._catalog.set_latest_safe(run, step)
                self._retainer.apply(run)

    def policies(self, run: str = "") -> dict[str, checkpoint_pb2.RetentionPolicy]:
        """run -> its retention and R as this node holds them (of `run`)."""
        runs = [run] if run else self._catalog.runs()
        held = {r: self._catalog.policy(r) for r in runs}
        return {r: p.to_proto() for r, p in held.items() if p is not None}

    def latest_safe_steps(self, run: str = "") -> dict[str, int]:
        """run -> its newest node-loss-safe step as this node last learned it (of `run`)."""
        return self._catalog.latest_safe(run)

    def sync_with_peers(self) -> None:
        """Resolve the saves this node voted on, and learn the commits it missed (down, frozen,
        or a replaced machine with an empty data dir). Run at start and every few seconds."""
        if not self._peers.enabled or self._closed.is_set():
            return
        for record in self._saves.in_doubt():
            outcome, manifest = cluster.outcome(self._peers, record)
            try:
                if outcome == OUTCOME_COMMITTED and manifest is not None:
                    self.adopt(manifest, record.save_id)
                elif outcome == OUTCOME_ABORTED:
                    with self._lock:
                        if self._saves.get(record.save_id) is not None:
                            self._saves.drop_aborted(record, "aborted by its coordinator")
            except ScaletrainError as exc:
                log.warning("cannot resolve save %s of %s: %s", record.save_id, record.key, exc)
        views = cluster.catalogs(self._peers)
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
        for run in self._catalog.runs():
            newest = max(self._catalog.run_states(run), default=None)
            manifest = self._catalog.manifest(CheckpointKey(run, newest)) if newest else None
            view = views.get(manifest.coordinator) if manifest is not None else None
            if isinstance(view, checkpoint_pb2.CatalogResponse) and run in view.policies:
                self._take_policy(run, view.policies[run], f"node {view.node}")
            # Durable steps only: the newest safe step is the one SSD keeps whatever its age.
            safe = self.latest(run, views, safe=True, durable=True)
            if safe is not None:
                self._learn_latest_safe(run, safe.step)
        self._holding.queue_duties()
        self._holding.drop_surplus(
            lambda key, owner: self._holders(self._copies(key, views).get(owner, {}))
        )

    def checkpoints(
        self, run: str = "", include_uncommitted: bool = False, nodes: bool = False
    ) -> list[checkpoint_pb2.CheckpointInfo]:
        """Checkpoints (of `run`); with `nodes`, each with every node's part as that node says
        (CheckpointInfo.parts)."""
        infos = self._catalog.checkpoints(check_run(run) if run else "", include_uncommitted)
        if nodes:
            views = cluster.catalogs(self._peers, run)
            for info in infos:
                if info.committed:
                    info.parts.extend(self._parts(info, views))
                    key = CheckpointKey(info.ref.run, info.ref.step)
                    info.node_loss_safe = self.node_loss_safe(key, views)
        return infos

    def checkpoint(
        self, ref: checkpoint_pb2.CheckpointRef, latest: bool = False, node_loss_safe: bool = False
    ) -> checkpoint_pb2.CheckpointInfo:
        """A committed checkpoint, or with `latest` the newest committed one of `ref.run` that
        can be restored in full right now (each part on a live node, or S3 whole); with
        `node_loss_safe` too, the newest whose every part has its run's R copies (at least 2).
        A latest one comes with every node's part and its copies (CheckpointInfo.parts)."""
        views: dict[str, checkpoint_pb2.CatalogResponse | str] = {}
        if latest:
            run = check_run(ref.run)
            steps = self._catalog.run_states(run)
            if not steps:
                raise NotFound(f"run {ref.run!r} has no committed checkpoint")
            views = cluster.catalogs(self._peers, run) if self._peers.enabled else {}
            key = self.latest(run, views, safe=node_loss_safe)
            if key is None:
                # Not NotFound: the run has commits, so a trainer must never take this for
                # "start from scratch"; it is a state that passes (a node comes back).
                newest = CheckpointKey(run, max(steps))
                what = "is node-loss safe now" if node_loss_safe else "can be restored in full now"
                raise Unavailable(
                    f"run {ref.run!r} has {len(steps)} committed checkpoint(s), none of which "
                    f"{what}; the newest, step {newest.step}, lacks "
                    f"{self._lacking(newest, views, node_loss_safe)}"
                )
        else:
            key = key_of(ref)
        info = self._catalog.info(key)
        if info is None or not info.committed:
            raise NotFound(f"no committed checkpoint {key}")
        if latest:
            info.parts.extend(self._parts(info, views))
            info.node_loss_safe = self.node_loss_safe(key, views)
        return info

    def _lacking(
        self,
        key: CheckpointKey,
        views: dict[str, checkpoint_pb2.CatalogResponse | str],
        node_loss_safe: bool,
    ) -> str:
        """What keeps `key` from being restorable (or node-loss safe) now, naming each part
        short of copies and the nodes that did not answer."""
        copies = self._copies(key, views)
        need = copies_for_safety(self._holding.copies_wanted(key)) if node_loss_safe else 1
        short = [
            f"{owner}'s part ({len(self._holders(held))} of {need} copies on a live node)"
            for owner, held in sorted(copies.items())
            if len(self._holders(held)) < need
        ]
        down = sorted(node for node, view in views.items() if isinstance(view, str))
        missing = ", ".join(short) or "its parts' copies"
        where = " and S3 lacks it" if not node_loss_safe else ""
        return missing + where + (f" (down or unreachable: {', '.join(down)})" if down else "")


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
