"""The parallel degrees of a job, validated before any process group exists, and its device mesh.

One mesh, outermost (slowest links) first:

    pp, dp_replicate, dp_shard, cp, tp

TP exchanges activations inside every layer, so it sits innermost, on the fastest links (NVLink
within a node); CP passes key/value blocks around a ring in every attention layer, next to it; EP's
all-to-alls use the innermost ranks of dp_shard·cp; FSDP gathers parameters per block and reduces
gradients once a step; HSDP's replica groups only all-reduce gradients, so dp_replicate is the
outermost data-parallel dimension. PP sits outside DP, as in TorchTitan and Megatron-Core: it
sends one activation per micro-batch point to point, the lightest and most latency-tolerant
traffic, so it is the dimension to stretch across the slowest links.

Derived views (flattened or unflattened from the same mesh, so they share its process groups):
- dp = dp_replicate·dp_shard: which slice of the global batch a rank reads;
- dp_shard_cp: FSDP's shard dimension. CP ranks hold different tokens of the same sequences, so
  their gradients are averaged like data-parallel ones;
- dp_cp = dp_replicate·dp_shard·cp: every rank with different tokens (expert load statistics);
- expert parallelism borrows dp_shard·cp: its innermost `ep` ranks form the ep dimension (experts
  split across them), the remaining efsdp = dp_shard·cp/ep shard the experts with FSDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.parallel.pipeline import (
    SCHEDULES,
    V_SHAPED,
    evaluates,
    job_stage_sizes,
    resolve_microbatches,
    resolve_stages_per_rank,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.config import TrainConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Every degree, in the order telemetry's ParallelLayout lists them.
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")


class LayoutError(ValueError):
    """A parallel layout that cannot run, with the offending value and the nearest valid ones."""


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism; constructing one checks they fill the world exactly."""

    world_size: int
    # -1 (one of the two at most) takes every rank the other degrees leave: dp_shard in a plain
    # job, dp_replicate in an HSDP job whose shard groups stay within a node, so that an elastic
    # job losing a node loses a replica and keeps its sharding.
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    # Borrowed from dp_shard·cp, so not a factor of the world size.
    ep: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LayoutError(f"world size must be at least 1, got {self.world_size}")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise LayoutError(
                "dp_replicate and dp_shard are both -1: one at most takes the ranks the others "
                "leave (HSDP across nodes: --dp-replicate -1 --dp-shard RANKS_PER_NODE)"
            )
        absorbs = self._absorbs()
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            if name != absorbs and getattr(self, name) < 1:
                raise LayoutError(f"{name} must be at least 1, got {getattr(self, name)}")
        world, others = self.world_size, self._others(absorbs)
        fits = world % others == 0
        given = getattr(self, absorbs)
        degree = world // others if given == -1 and fits else given
        if degree < 1 or others * degree != world:
            # The choices that fit first, the arithmetic after (what a user acts on leads).
            valid = f"{absorbs} {world // others} (or -1)" if fits else self._alternatives()
            raise LayoutError(
                f"the layout does not fit {world} ranks; valid with the others unchanged: "
                f"{valid} (dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp "
                f"{self.cp} x tp {self.tp} x pp {self.pp} must equal the world size {world})"
            )
        object.__setattr__(self, absorbs, degree)
        if (self.dp_shard * self.cp) % self.ep:
            raise LayoutError(
                f"ep {self.ep} does not divide dp_shard x cp = {self.dp_shard * self.cp}: expert "
                f"parallelism borrows its ranks from them; valid ep: "
                f"{_divisors(self.dp_shard * self.cp)}"
            )

    def _absorbs(self) -> str:
        """The degree given as -1, which takes the ranks the others leave."""
        return "dp_replicate" if self.dp_replicate == -1 else "dp_shard"

    def _others(self, but: str) -> int:
        """The product of the world's degrees other than `but` (ep is borrowed, not one)."""
        return math.prod(getattr(self, n) for n in MESH_DIMS if n != but)

    def _alternatives(self) -> str:
        """For each degree above 1, the values that would fit with the others unchanged
        ("none" when no single degree can)."""
        absorbs = self._absorbs()
        parts = []
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp"):
            if name == absorbs or getattr(self, name) == 1:
                continue
            rest = math.prod(getattr(self, n) for n in MESH_DIMS if n not in (name, absorbs))
            if self.world_size % rest == 0:
                parts.append(f"{name} in {_divisors(self.world_size // rest)}")
        return ", ".join(parts) or "none"

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas of a batch: each reads its own slice."""
        return self.dp_replicate * self.dp_shard

    def layout(self) -> dict[str, int]:
        """Every degree by name, as telemetry's ParallelLayout records it."""
        return {name: getattr(self, name) for name in DEGREES}

    def check(self, cfg: TrainConfig) -> None:
        """Refuse a model, sequence or batch this layout cannot split evenly.

        An uneven split would otherwise abort inside gloo (SIGABRT) or silently change the math.
        """
        model = cfg.model
        if self.tp > 1:
            sizes = {"n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads}
            sizes["vocab_size"] = model.vocab_size
            if model.moe is None:
                sizes["ffn hidden size"] = model.ffn_dim
            for what, size in sizes.items():
                if size % self.tp:
                    valid_tp = _divisors(math.gcd(*sizes.values()))
                    raise LayoutError(
                        f"{what} {size} is not divisible by tp {self.tp}: tensor parallelism "
                        f"splits it evenly; nearest valid {what}: "
                        f"{_nearest_multiples(size, self.tp)}; valid tp for this model: {valid_tp}"
                    )
        step = self.seq_multiple
        if cfg.seq_len % step:
            reasons = [f"cp {self.cp} x 2 load-balanced causal chunks"] if self.cp > 1 else []
            reasons += [f"tp {self.tp} sequence shards"] if self.tp > 1 else []
            why = " and ".join(reasons)
            raise LayoutError(
                f"seq_len {cfg.seq_len} is not a multiple of {step} ({why}); nearest valid "
                f"seq_len: {_nearest_multiples(cfg.seq_len, step)}"
            )
        if cfg.global_batch % self.dp_size:
            raise LayoutError(
                f"global_batch {cfg.global_batch} is not divisible by the data-parallel degree "
                f"dp_replicate x dp_shard = {self.dp_size}; nearest valid global_batch: "
                f"{_nearest_multiples(cfg.global_batch, self.dp_size)}"
            )
        local_batch, accum = cfg.global_batch // self.dp_size, cfg.grad_accum_steps
        if local_batch % accum:
            raise LayoutError(
                f"grad_accum_steps {accum} does not divide the local batch {local_batch} "
                f"(global_batch {cfg.global_batch} / dp {self.dp_size}): global batch = "
                f"micro-batch x accumulation x dp; valid grad_accum_steps: "
                f"{_divisors(local_batch)}; nearest valid global_batch: "
                f"{_nearest_multiples(cfg.global_batch, accum * self.dp_size)}"
            )
        if accum > 1 and self.pp > 1:
            raise LayoutError(
                f"grad_accum_steps {accum} with pp {self.pp}: the pipeline schedule already runs "
                "micro-batches; raise --pp-microbatches instead"
            )
        if self.ep > 1 and model.moe is None:
            raise LayoutError(f"ep {self.ep} needs a mixture-of-experts model (--n-experts > 0)")
        if model.moe is not None and model.moe.n_experts % self.ep:
            raise LayoutError(
                f"n_experts {model.moe.n_experts} is not divisible by ep {self.ep}: every expert "
                f"rank holds the same number of experts; nearest valid n_experts: "
                f"{_nearest_multiples(model.moe.n_experts, self.ep)}"
            )
        if cfg.document_masking and (self.pp > 1 or self.cp > 1):
            raise LayoutError(
                f"--document-masking with {'pp' if self.pp > 1 else 'cp'} "
                f"{self.pp if self.pp > 1 else self.cp}: this layout cannot mask documents yet "
                "(pipeline stages and ring attention take no mask); use dp, FSDP and tp, or "
                "leave --document-masking out"
            )
        if self.pp > 1:
            self._check_pipeline(cfg)

    def _check_pipeline(self, cfg: TrainConfig) -> None:
        """Refuse a stage split or micro-batch count the schedule cannot run."""
        par, pp = cfg.parallel, self.pp
        schedule = par.pp_schedule
        if schedule not in SCHEDULES:
            raise LayoutError(f"pp_schedule {schedule!r} is not one of {list(SCHEDULES)}")
        v = resolve_stages_per_rank(schedule, par.pp_stages_per_rank)
        if SCHEDULES[schedule] == 1 and v != 1:
            raise LayoutError(f"pp_schedule {schedule} runs one stage per rank, not {v}")
        if schedule in V_SHAPED and v != 2:
            raise LayoutError(f"pp_schedule {schedule} runs exactly 2 stages per rank, not {v}")
        if cfg.eval_every and not evaluates(schedule):
            raise LayoutError(
                f"--eval-every with pp_schedule {schedule}: torch's pipeline eval still runs "
                "this schedule's backward actions; evaluate with another schedule "
                "(GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble) or leave --eval-every out"
            )
        stages = pp * v
        try:
            job_stage_sizes(cfg, pp)
        except ValueError as exc:
            raise LayoutError(f"{exc} (pp {pp} x {v} stages per rank)") from None
        local_batch = cfg.global_batch // self.dp_size
        m = resolve_microbatches(par.pp_microbatches, local_batch)
        if local_batch % m:
            raise LayoutError(
                f"pp_microbatches {m} does not divide the local batch {local_batch} "
                f"(global_batch / dp); valid: {_divisors(local_batch)}"
            )
        if schedule == "1F1B" and m < pp:
            raise LayoutError(f"1F1B needs at least pp = {pp} micro-batches, got {m}")
        if schedule == "DualPipeV" and m < stages:
            raise LayoutError(f"DualPipeV needs at least 2 x pp = {stages} micro-batches, got {m}")
        rounds = max(1, m // pp)
        if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
            raise LayoutError(
                f"{schedule} needs the micro-batches ({m}) to be a multiple of "
                f"max(1, micro-batches // pp) = {rounds}"
            )

    @property
    def seq_multiple(self) -> int:
        """The sequence length must be a multiple of this: 2·cp chunks, each rank's tp shards."""
        return math.lcm(2 * self.cp, self.cp * self.tp) if self.cp > 1 else self.tp

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """The job's mesh and its derived views; needs the default process group to exist."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(
            device_type,
            tuple(getattr(self, name) for name in MESH_DIMS),
            mesh_dim_names=MESH_DIMS,
        )
        dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        shard_cp = self.dp_shard * self.cp
        fsdp = (
            dp_cp._unflatten(0, (self.dp_replicate, shard_cp), ("dp_replicate", "dp_shard_cp"))
            if self.dp_replicate > 1
            else world["dp_shard", "cp"]._flatten("dp_shard_cp")
        )
        ep = expert_fsdp = None
        if self.ep > 1:
            experts = dp_cp._unflatten(
                0,
                (self.dp_replicate, shard_cp // self.ep, self.ep),
                ("dp_replicate", "efsdp", "ep"),
            )
            ep = experts["ep"]
            expert_fsdp = (
                experts["dp_replicate", "efsdp"] if self.dp_replicate > 1 else experts["efsdp"]
            )
        return ParallelMesh(
            dims=self,
            world=world,
            dp=world["dp_replicate", "dp_shard"]._flatten("dp"),
            dp_cp=dp_cp,
            fsdp=fsdp,
            ep=ep,
            expert_fsdp=expert_fsdp,
        )


def elastic_accumulation(cfg: TrainConfig, world_size: int, full_world: int) -> int:
    """The micro-batches each rank runs per step when an elastic job of `full_world` ranks runs
    on `world_size`: the configured accumulation times the full data-parallel degree over the
    live one, so that the per-rank micro-batch (and so each rank's activation memory) stays the
    full job's while the global batch does not change. The configured accumulation where that
    is not a whole number, or the pipeline runs the micro-batches (then each rank's batch grows
    instead)."""
    accum = cfg.grad_accum_steps
    if not full_world or full_world <= world_size or full_world % world_size:
        return accum
    live = dims_of(cfg, world_size)
    others = world_size // live.dp_size
    if full_world % others or live.pp > 1:
        return accum
    full_dp = full_world // others
    if (accum * full_dp) % live.dp_size:
        return accum
    scaled = accum * full_dp // live.dp_size
    local = cfg.global_batch // live.dp_size
    return scaled if cfg.global_batch % live.dp_size == 0 and local % scaled == 0 else accum


def dims_of(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """The job's degrees for `world_size` ranks (the data-parallel shard degree absorbing what
    the others leave), unchecked."""
    return ParallelDims(world_size, **{name: getattr(cfg.parallel, name) for name in DEGREES})


def validate_layout(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """The job's degrees for `world_size` ranks, checked against the model and data."""
    dims = dims_of(cfg, world_size)
    dims.check(cfg)
    return dims


@dataclass(frozen=True)
class ParallelMesh:
    """The mesh and the views each parallelism works on (see the module docstring)."""

    dims: ParallelDims
    world: DeviceMesh
    dp: DeviceMesh
    # Every rank that sees different tokens (tp ranks see the same, pp ranks other layers).
    dp_cp: DeviceMesh
    # FSDP's mesh: 1-D shard, or 2-D (dp_replicate, dp_shard_cp) for HSDP.
    fsdp: DeviceMesh
    # Expert parallelism only: the ranks experts are split over, and FSDP's mesh for experts.
    ep: DeviceMesh | None
    expert_fsdp: DeviceMesh | None

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.world["cp"]

    @property
    def pp(self) -> DeviceMesh:
        return self.world["pp"]

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank reads."""
        return self.dp.get_local_rank()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest_multiples(value: int, step: int) -> str:
    """The multiples of `step` just below and above `value` (below omitted when 0)."""
    below, above = value // step * step, (value // step + 1) * step
    return f"{below} or {above}" if below else f"{above}"
