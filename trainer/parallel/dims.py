"""The parallel degrees of a job, validated before any process group exists, and its mesh.

Mesh order, outermost first: dp_replicate, dp_shard. The outermost dimension spans the slowest
links (across nodes); later parallelisms (cp, tp) will be added innermost, on the fastest links.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    # -1 takes every rank the other degrees leave.
    dp_shard: int = -1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        if self.dp_replicate < 1:
            raise ValueError(f"dp_replicate must be at least 1, got {self.dp_replicate}")
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ValueError(
                    f"dp_replicate {self.dp_replicate} does not divide world size "
                    f"{self.world_size}; valid values: {_divisors(self.world_size)}"
                )
            object.__setattr__(self, "dp_shard", self.world_size // self.dp_replicate)
        if self.dp_shard < 1 or self.dp_replicate * self.dp_shard != self.world_size:
            valid = [(r, self.world_size // r) for r in _divisors(self.world_size)]
            raise ValueError(
                f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} must equal the "
                f"world size {self.world_size}; valid (dp_replicate, dp_shard): {valid}"
            )

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas of a batch: every rank reads its own slice."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 2-D mesh (dp_replicate, dp_shard): FSDP2 shards over one, replicates over the other."""
        return init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )

    def layout(self) -> dict[str, int]:
        """Every degree by name, as telemetry's ParallelLayout records it."""
        degrees = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        return degrees | {"tp": 1, "pp": 1, "cp": 1, "ep": 1}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
