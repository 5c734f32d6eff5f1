"""Retention: which tiers want which of a run's committed checkpoints, and what may be dropped.

Pure functions over steps and tier states, so the rules are tested without any storage. The
rules, for a run with policy (memory_last=N, ssd_last=M, s3_every=K):

- memory wants the newest N committed checkpoints, SSD the newest M, and SSD also the newest
  node-loss-safe one when it is older (`keep`), so a lost node can always be recovered from its
  peers' copies of it;
- S3 wants every step that is a multiple of K, the newest committed checkpoint, and, until that
  one is on S3, the newest checkpoint S3 already holds (so S3 always has a "latest");
- memory-only checkpoints (`OpenSaveRequest.memory_only`) stand apart: they count toward none of
  the rules above (so none displaces a durable checkpoint), and memory wants only the newest
  MEMORY_ONLY_LAST of them that are newer than the run's newest durable checkpoint: a newer
  durable one makes them pointless, and they leave the catalog with their memory copies;
- a tier's copy that its tier no longer wants is dropped only if the checkpoint is wanted nowhere,
  or another durable tier (SSD or S3) holds a committed copy. So a copy leaves a faster tier only
  once a slower one holds it, and the only durable copy of a wanted checkpoint is never deleted.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ckptd.states import MEMORY, S3, SSD
from scaletrain.errors import InvalidArgument
from scaletrain.v1 import checkpoint_pb2

DURABLE = (SSD, S3)
# Memory-only checkpoints of a run kept at most: the newest, and the one before it while the
# newest may still be incomplete on some node (its copy to a peer in flight).
MEMORY_ONLY_LAST = 2


@dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints of a run each tier keeps (see the module docstring).

    The default sends every checkpoint to S3 (s3_every=1); a run that saves often asks for, say,
    every 10th step plus the latest with its OpenSave, or ckptd is started with --s3-every.
    """

    memory_last: int = 2
    ssd_last: int = 5
    s3_every: int = 1
    # Copies of each node's part on distinct nodes (R); 0: ckptd's default, capped at the
    # number of nodes (so a one-node ckptd keeps no replicas without being told to fail).
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.memory_last < 0:
            raise InvalidArgument(f"retention memory_last must be >= 0, got {self.memory_last}")
        if self.ssd_last < 1:
            raise InvalidArgument(f"retention ssd_last must be >= 1, got {self.ssd_last}")
        if self.s3_every < 1:
            raise InvalidArgument(f"retention s3_every must be >= 1, got {self.s3_every}")
        if self.replicas < 0:
            raise InvalidArgument(f"replicas must be >= 1 (or 0: the default), got {self.replicas}")

    @classmethod
    def from_proto(cls, msg: checkpoint_pb2.RetentionPolicy) -> RetentionPolicy:
        return cls(msg.memory_last, msg.ssd_last, msg.s3_every, msg.replicas)

    def to_proto(self) -> checkpoint_pb2.RetentionPolicy:
        return checkpoint_pb2.RetentionPolicy(
            memory_last=self.memory_last,
            ssd_last=self.ssd_last,
            s3_every=self.s3_every,
            replicas=self.replicas,
        )


def wanted(
    policy: RetentionPolicy,
    steps: Sequence[int],
    on_s3: Sequence[int],
    has_s3: bool,
    keep: int | None = None,
    memory_only: Collection[int] = (),
) -> dict[int, set[int]]:
    """step -> the tiers that want it, for a run's committed `steps` (any order).

    `on_s3` are the steps S3 holds committed copies of; `has_s3` whether the S3 tier exists;
    `keep` the run's newest node-loss-safe step, which SSD keeps whatever its age;
    `memory_only` the steps of `steps` that are memory-only checkpoints.
    """
    result: dict[int, set[int]] = {step: set() for step in steps}
    newest_first = sorted((s for s in steps if s not in memory_only), reverse=True)
    newest_durable = newest_first[0] if newest_first else -1
    fresh = sorted((s for s in steps if s in memory_only and s > newest_durable), reverse=True)
    for step in fresh[:MEMORY_ONLY_LAST]:
        result[step].add(MEMORY)
    for step in newest_first[: policy.memory_last]:
        result[step].add(MEMORY)
    for step in newest_first[: policy.ssd_last]:
        result[step].add(SSD)
    if keep in result:
        result[keep].add(SSD)
    if has_s3 and newest_first:
        newest = newest_first[0]
        for step in newest_first:
            if step % policy.s3_every == 0 or step == newest:
                result[step].add(S3)
        held = [s for s in on_s3 if s in result]
        if held and newest not in held:
            result[max(held)].add(S3)
    return result


def droppable(wants: set[int], held: Mapping[int, bool]) -> list[int]:
    """The tiers whose copy may go now; `held` maps each tier to whether it has a good copy."""
    holders = {tier for tier, good in held.items() if good}
    if not wants:
        return sorted(holders)
    drops = []
    for tier in sorted(holders - wants):  # fastest first; each drop leaves fewer holders
        if any(other in holders for other in DURABLE if other != tier):
            drops.append(tier)
            holders.discard(tier)
    return drops
