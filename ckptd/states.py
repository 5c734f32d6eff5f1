"""The protobuf enum values ckptd compares against, each named once.

The store, the catalog, the cluster, the reads and the replication all test file kinds, tiers,
tier states and commit outcomes; they import the short names from here instead of each aliasing
the generated constants again. It is a base module: it imports the generated contracts and
nothing else, so any ckptd module may import it without a cycle.

A tier's COMMITTED is `TIER_COMMITTED` and a peer's is `OUTCOME_COMMITTED`: plain `COMMITTED`
is the catalog's state of a save (`ckptd.catalog`), a string.
"""

from __future__ import annotations

from scaletrain.v1 import checkpoint_pb2, common_pb2

# What a file of a checkpoint is (FileHeader.kind).
SHARD = checkpoint_pb2.FILE_KIND_SHARD  # a rank's data file
METADATA = checkpoint_pb2.FILE_KIND_METADATA  # the DCP `.metadata` file, one per checkpoint

# The tiers, fastest first.
MEMORY = common_pb2.TIER_MEMORY
SSD = common_pb2.TIER_SSD
S3 = common_pb2.TIER_S3

# A checkpoint's state on one tier (TierStatus.state, the catalog's tier rows).
ABSENT = checkpoint_pb2.TIER_STATE_ABSENT  # not there: never placed, evicted, tier disabled
PENDING = checkpoint_pb2.TIER_STATE_PENDING  # being copied there
TIER_COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED  # every file durably there, verified
FAILED = checkpoint_pb2.TIER_STATE_FAILED  # the copy failed

# What became of a save, as a peer answers Outcome (ckptd.cluster.outcome).
OUTCOME_IN_PROGRESS = checkpoint_pb2.OUTCOME_IN_PROGRESS  # still open on its coordinator
OUTCOME_COMMITTED = checkpoint_pb2.OUTCOME_COMMITTED
OUTCOME_ABORTED = checkpoint_pb2.OUTCOME_ABORTED  # aborted, or unknown to the coordinator
OUTCOME_UNKNOWN = checkpoint_pb2.OUTCOME_UNKNOWN  # a non-coordinator that knows nothing of it
