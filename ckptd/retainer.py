"""Retention applied: the copies of a run's checkpoints that `ckptd.retention`'s rules let go.

`ckptd.retention` decides from steps and tier states alone, so its rules are tested without any
storage; this is where its answer meets the tiers. After every tier commit (and at start) the
`Retainer` drops the copies no tier wants any more, own and replicas alike, removes a checkpoint
no tier wants from the catalog, and queues the S3 uploads a wanted checkpoint still lacks.
"""

from __future__ import annotations

import logging

from ckptd.catalog import Catalog
from ckptd.config import CkptdConfig
from ckptd.replicas import ReplicaTiers
from ckptd.replication import S3Replication
from ckptd.retention import RetentionPolicy, droppable, wanted
from ckptd.states import ABSENT, MEMORY, S3, SSD, TIER_COMMITTED
from ckptd.tiers import CheckpointKey
from ckptd.tiers.memory import MemoryBudget, MemoryTier
from ckptd.tiers.ssd import SsdTier
from scaletrain.names import TIER_LABELS

log = logging.getLogger("ckptd.store")

# The tiers a node holds a part on (its own or a replica); S3 holds whole checkpoints.
NODE_TIERS = (MEMORY, SSD)


class Retainer:
    """Applies each run's retention to this node's tiers (see the module).

    Called with the store's lock held. S3's jobs come in with `attach`: the S3 replication is
    built after the retainer, since its uploads apply retention in turn.
    """

    def __init__(
        self,
        config: CkptdConfig,
        catalog: Catalog,
        budget: MemoryBudget,
        memory: MemoryTier,
        ssd: SsdTier,
        replicas: ReplicaTiers,
        has_s3: bool,
    ) -> None:
        self._config, self._catalog, self._budget = config, catalog, budget
        self._memory, self._ssd, self._replicas = memory, ssd, replicas
        self._has_s3 = has_s3
        self._replication: S3Replication | None = None

    def attach(self, replication: S3Replication) -> None:
        """Take the S3 jobs (uploads, removals) that retention queues from now on."""
        self._replication = replication

    def policy(self, run: str) -> RetentionPolicy:
        """`run`'s retention and R: what its saves asked for, else ckptd's default."""
        return self._catalog.policy(run) or self._config.retention

    def retains(self, run: str) -> bool:
        """Whether `run`'s new copies (a save's files, a replica) are kept in memory too."""
        return self._budget.total > 0 and self.policy(run).memory_last > 0

    def queue_removal(self, key: CheckpointKey) -> None:
        """Remove `key`'s objects from S3 in the background (the catalog remembers it)."""
        assert self._replication is not None
        self._replication.queue_removal(key)

    def apply(self, run: str) -> None:
        """Drop the copies of `run`'s checkpoints that no tier wants; queue S3 uploads it lacks.

        Called with the lock held after every tier commit, and at startup.
        """
        if not self._config.maintain:
            return
        states = self._catalog.run_states(run)
        on_s3 = [s for s, tiers in states.items() if tiers.get(S3) == TIER_COMMITTED]
        wants = wanted(
            self.policy(run),
            list(states),
            on_s3,
            has_s3=self._has_s3,
            keep=self._catalog.latest_safe(run).get(run),
            memory_only=self._catalog.memory_only_steps(run),
        )
        if not self._has_s3:
            for step in on_s3:  # a store without S3 (offline) cannot manage S3's copies
                wants[step].add(S3)
        self._retain_replicas(run, wants, set(on_s3))
        for step, tiers in states.items():
            key = CheckpointKey(run, step)
            held = {t: tiers.get(t) == TIER_COMMITTED for t in (MEMORY, SSD, S3)}
            drops = droppable(wants[step], held)
            for tier in drops:
                self._drop_copy(key, tier)
            if not wants[step]:
                s3_objects = self._has_s3 and tiers.get(S3, ABSENT) != ABSENT
                self._replicas.delete(key)
                self._catalog.delete(key, s3_too=s3_objects)
                if s3_objects:
                    self.queue_removal(key)
                log.info("retention removed %s", key, extra={"run": run, "step": step})
            elif S3 in wants[step] and not held[S3] and self._replication is not None:
                self._replication.queue_upload(key)

    def _drop_copy(self, key: CheckpointKey, tier: int) -> None:
        if tier == MEMORY:
            self._memory.delete(key)
        elif tier == SSD:
            self._ssd.delete(key)
        else:
            self._catalog.queue_deletion(key)
            self.queue_removal(key)
        self._catalog.set_tier(key, tier, ABSENT)
        log.info("retention dropped the %s copy of %s", TIER_LABELS[tier], key)

    def _retain_replicas(self, run: str, wants: dict[int, set[int]], on_s3: set[int]) -> None:
        """Drop the replicas of `run` that no tier wants, by the rules of the own copies."""
        for key, owners in self._catalog.replicas(run).items():
            for owner, states in owners.items():
                held = {t: states.get(t) == TIER_COMMITTED for t in NODE_TIERS}
                held[S3] = key.step in on_s3
                for tier in droppable(wants.get(key.step, set()), held):
                    if tier == S3:
                        continue
                    if tier == MEMORY:
                        self._replicas.memory(owner).delete(key)
                    else:
                        self._replicas.ssd(owner).delete(key)
                    self._catalog.set_replica(key, owner, tier, ABSENT)
                    log.info("retention dropped the replica of %s's part of %s", owner, key)
