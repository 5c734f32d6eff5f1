"""`scaletrain plan`: what a job costs per rank before it runs, on a laptop, in seconds.

Checks the layout as `scaletrain run` does, then reports
- exact parameter counts, from the model built on the meta device (an MoE's also as the
  parameters one token activates);
- per-rank memory: parameters, gradients, optimizer state, FSDP's all-gather buffers, and
  activations. Memory is measured, not derived from formulas: the model's first blocks are trained
  for one step under FakeTensorMode (tensors without storage) with torch's MemTracker, which
  attributes every allocation to parameters, gradients, optimizer state or activations. Runs of
  one and two blocks give what a block adds and what the rest (embedding, output head, loss) costs;
  the rank's share follows from its layout: its pipeline stage's blocks, sharded as the trainer
  shards them, with as many micro-batches' activations live as the pipeline schedule keeps in
  flight. Dense blocks are split by tensor parallelism and by FSDP over dp_shard x cp; an MoE
  block is whole on every tp rank (trainer/parallel/tensor.py), its routed experts split over ep
  and sharded by FSDP over the rest of dp_shard x cp (trainer/parallel/dims.py);
- an MoE measured with static, uniform routing: its real routing is data-dependent (bincount,
  per-expert splits), which fake tensors cannot run, so `UniformMoE` stands in for each MoE block
  with tensors of the sizes uniform routing gives (every expert tokens * top_k / E rows, at most
  its capacity), on an EP rank's E / ep experts, with the all-to-all's buffers;
- expert parallelism's all-to-all bytes per MoE layer and per step, within a node and across
  nodes, and how far node-limited routing bounds a token's reach (a formula);
- FLOPs per token and per step: 6N (N: the parameters a token activates, embedding excluded; an
  MoE's routed experts count top_k of E) and with attention's 12 * layers * dim * seq_len (as
  TorchTitan and the PaLM paper);
- the pipeline bubble (p - 1) / (v * m + p - 1) of p stages, v per rank, m micro-batches (the
  zero-bubble schedules fill most of it);
- whether the busiest rank fits one device once the headroom the allocator and NCCL need is kept,
  and the MFU a target tokens/s would mean on a named GPU (dense peak from telemetry.mfu's table),
  flagged when the pipeline would have to run above BUSY_MFU_LIMIT while busy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from scaletrain.errors import UserError
from telemetry import mfu
from trainer import options
from trainer.config import TrainConfig, from_values
from trainer.model.llama import Transformer, next_token_loss
from trainer.model.moe import GroupedExperts, MoE, MoEArgs
from trainer.optim import build_optimizer
from trainer.parallel.dims import ParallelDims, elastic_accumulation, validate_layout
from trainer.parallel.pipeline import (
    ZERO_BUBBLE,
    job_stage_sizes,
    resolve_microbatches,
    resolve_stages_per_rank,
    stage_indices,
)
from trainer.parallel.recompute import apply_activation_checkpointing

# MemTracker's categories, as the plan names them.
_STATES = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer state"}
# Activations, temporaries (the optimizer's too) and buffers (rotary tables) in one part.
_ACTIVATIONS = ("Activation", "Temp", "Buffer")

# What a device's memory must keep beside the plan's tensors, which MemTracker does not see.
# PyTorch's caching allocator rounds blocks up and cannot always reuse a freed block for a larger
# request, so part of a device is reserved but unallocated at the peak: a share of the device.
ALLOCATOR_SHARE = 0.08
# NCCL's communicators keep buffers per peer and channel (NCCL_BUFFSIZE, 4 MiB each) for every
# group a rank talks in (FSDP's, tp's, pp's, ep's all-to-all), beside the CUDA context: a flat
# allowance in bytes, since they do not grow with the model.
NCCL_BYTES = 1 << 30
# MFU while the pipeline is busy above which a target is flagged as rarely reached: kernels run
# below peak and wait on communication and recomputation even when no stage idles.
BUSY_MFU_LIMIT = 0.6
_GIB = 1 << 30

# Which figures (`--json`'s keys) the plan measures, which it computes by formula, which it counts
# on a meta-device build; the memory parts a plan has and an MoE's figures are added to them.
_SOURCES = {
    "measured": [],
    "formula": ["headroom", "flops_per_token_6n", "flops_per_token", "bubble", "mfu",
                "busy_mfu"],
    "counted": ["params", "embedding_params"],
}  # fmt: skip
_SOURCES_MOE = {
    "measured": ["moe.memory_held"],
    "formula": ["moe.rows_per_expert", "moe.all_to_all"],
    "counted": ["active_params", "moe.params_per_ep_rank", "moe.params_held",
                "moe.dense_params"],
}  # fmt: skip
# The memory parts MemTracker measures; the others derive from them.
_MEASURED_PARTS = (*_STATES.values(), "activations")


class _TransientPeak(MemTracker):
    """MemTracker that also keeps the peak over time of the transient part (_ACTIVATIONS) alone.

    Its own "peak" snapshot holds the categories at the moment the *total* peaks. At a wide
    model (Llama 3 405B's 16,384) that is the end of the backward, where the dense embedding
    gradient dominates and the blocks' activations are freed: the plan read 8.33 GiB of
    activations there, against 11.5 GiB a block at the end of the forward (issue 39)."""

    def __init__(self) -> None:
        super().__init__()
        self.transient = 0

    def _update_peak_stats(self, peak_state: object) -> None:
        super()._update_peak_stats(peak_state)  # type: ignore[arg-type]
        for snapshot in self._curr_mem_snap.values():
            named = _by_name(snapshot)
            self.transient = max(self.transient, sum(named.get(k, 0) for k in _ACTIVATIONS))


@dataclass(frozen=True)
class AllToAll:
    """Bytes one rank sends in expert parallelism's all-to-alls, by formula; under uniform
    routing it receives as many. Each all-to-all moves the rank's token copies (top_k a token,
    less those over capacity) of dim elements in the compute dtype, of which (ep - 1) / ep leave
    the rank; a layer runs four a micro-batch (dispatch and combine, forward and backward) and
    two more when activation checkpointing recomputes the forward."""

    per_layer: float  # one MoE layer, one micro-batch
    per_step: float  # every MoE layer of the busiest rank, every micro-batch of a step
    intra_node: float  # of per_step, to the ep ranks of its own node
    inter_node: float  # of per_step, to other nodes (expected under uniform routing)
    ep_per_node: int  # ep ranks a node (ep ranks are tp apart: the mesh's tp is innermost)
    nodes: int  # nodes the ep group spans
    # The most nodes one token's copies reach: top_k at most, or with node-limited routing the
    # nodes of its topk_groups groups (a group: consecutive ep ranks).
    nodes_per_token: int
    # Of per_step, the most that could cross nodes were each token sent once to every node it
    # reaches (DeepSeek-V3's dispatch, which node-limited routing bounds): this trainer's
    # dispatcher sends every copy, so node-limited routing bounds its fan-out, not its bytes.
    inter_node_once_a_node: float
    formula: str


@dataclass(frozen=True)
class ExpertPlan:
    """An MoE's experts on the busiest rank, and what expert parallelism moves for them."""

    routed: int  # routed experts a layer
    shared: int  # shared experts a layer
    top_k: int
    layers: int  # MoE layers on the busiest rank
    per_ep_rank: int  # routed experts an EP rank holds a layer (routed / ep)
    # Parameters of the routed experts an EP rank holds over its MoE layers, gathered as they
    # compute; between uses FSDP keeps 1 / (dp_shard x cp / ep) of them (params_held).
    params_per_ep_rank: int
    params_held: float
    fsdp: int  # the ranks FSDP shards the routed experts over: dp_shard x cp / ep
    # Bytes of the routed experts' parameters, gradients and optimizer state the rank holds: the
    # experts' share of the measured blocks.
    memory_held: dict[str, float]
    # Router and shared experts of the rank's MoE layers: dense, whole on every tp rank.
    dense_params: int
    tokens: int  # tokens one rank routes a micro-batch (every tp rank routes them all)
    rows_per_expert: int  # the most rows an expert gets of them under uniform routing
    all_to_all: AllToAll | None  # None at ep 1: every expert on every rank


@dataclass(frozen=True)
class Plan:
    world: int
    layout: dict[str, int]
    params: int
    embedding_params: int
    memory: dict[str, float]  # bytes on the busiest rank, by part
    flops_per_token_6n: float
    flops_per_token: float
    tokens_per_step: int
    bubble: float
    bubble_formula: str
    gpu: str
    peak_flops: float | None
    target_tokens_s: float | None
    # Bytes of one `gpu` (None: not in telemetry.mfu's table).
    device_memory: float | None = None
    # What the numbers depend on that the user may not have chosen (sequence, batch, precision).
    assumed: str = ""
    # A large model planned with the debug model's defaults: its memory is not a real run's.
    warning: str = ""
    # Parameters one token computes with (an MoE's routed experts: top_k of E); 0: all of them.
    active_params: int = 0
    moe: ExpertPlan | None = None
    # The figures (`as_json`'s keys) measured, computed by formula, and counted (_SOURCES).
    sources: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def mfu(self) -> float | None:
        if self.peak_flops is None or self.target_tokens_s is None:
            return None
        return self.flops_per_token * self.target_tokens_s / (self.world * self.peak_flops)

    @property
    def busy_mfu(self) -> float | None:
        """The MFU the target needs while the pipeline is busy (its bubble taken out)."""
        if self.mfu is None:
            return None
        return self.mfu / (1 - self.bubble) if self.bubble < 1 else math.inf

    @property
    def headroom(self) -> dict[str, float] | None:
        """Bytes of one device kept beside the plan's tensors, by what needs them."""
        if self.device_memory is None:
            return None
        return {
            "allocator fragmentation": self.device_memory * ALLOCATOR_SHARE,
            "nccl buffers": float(NCCL_BYTES),
        }

    @property
    def spare(self) -> float | None:
        """Bytes left on one device after the busiest rank and the headroom; negative: over."""
        if self.device_memory is None or self.headroom is None:
            return None
        return self.device_memory - sum(self.headroom.values()) - self.memory["total"]

    def as_json(self) -> dict[str, Any]:
        """Every figure, the derived ones too, as `scaletrain plan --json` prints them."""
        return dataclasses.asdict(self) | {
            "mfu": self.mfu,
            "busy_mfu": self.busy_mfu,
            "busy_mfu_limit": BUSY_MFU_LIMIT,
            "headroom": self.headroom,
            "spare": self.spare,
            "fits": None if self.spare is None else self.spare >= 0,
        }


def plan(
    job: dict[str, options.Value],
    world: int,
    gpu: str = "h200",
    tokens_s: float | None = None,
    per_node: int = 8,
) -> Plan:
    """The plan of `job` (resolved options) on `world` ranks, `per_node` a node; UserError for a
    layout that cannot run, in the words `scaletrain run` uses."""
    if world < 1:
        raise UserError(f"--ranks must be at least 1, got {world}")
    if per_node < 1:
        raise UserError(f"--ranks-per-node must be at least 1, got {per_node}")
    cfg = from_values(job)
    try:
        dims = validate_layout(cfg, world)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    with torch.device("meta"):
        whole = Transformer(cfg.model)
    params = whole.num_params(exclude_embedding=False)
    embedding = whole.tok_embeddings.weight.numel()
    parts = _block_parts(whole.layers["0"])
    active = whole.active_params()
    seq, layers, dim = cfg.seq_len, cfg.model.n_layers, cfg.model.dim
    attention = 12 * layers * dim * seq
    bubble, formula = _bubble(cfg, dims)
    precision = "bf16" if cfg.parallel.mixed_precision else "tf32"
    memory, expert_states, blocks = rank_memory(cfg, dims, parts)
    moe = None
    if cfg.model.moe is not None:
        moe = _expert_plan(cfg, dims, parts, blocks, per_node, expert_states)
    return Plan(
        world=world,
        layout=dims.layout(),
        params=params,
        embedding_params=embedding,
        memory=memory,
        flops_per_token_6n=6 * active,
        flops_per_token=6 * active + attention,
        tokens_per_step=cfg.global_batch * seq,
        bubble=bubble,
        bubble_formula=formula,
        gpu=gpu,
        peak_flops=mfu.dense_peak(gpu, precision),
        target_tokens_s=tokens_s,
        device_memory=mfu.device_memory(gpu),
        assumed=_assumed(cfg, dims, per_node),
        warning=_debug_defaults(cfg, params),
        active_params=active,
        moe=moe,
        sources=_sources(memory, moe is not None),
    )


def _sources(memory: dict[str, float], moe: bool) -> dict[str, list[str]]:
    """The figures of a plan with these memory parts by where they come from (_SOURCES)."""
    parts = {
        "measured": [f"memory.{n}" for n in memory if n in _MEASURED_PARTS],
        "formula": [f"memory.{n}" for n in memory if n not in (*_MEASURED_PARTS, "total")],
    }
    return {
        kind: parts.get(kind, []) + figures + (_SOURCES_MOE[kind] if moe else [])
        for kind, figures in _SOURCES.items()
    }


def _assumed(cfg: TrainConfig, dims: ParallelDims, per_node: int) -> str:
    """The sequence, batch, micro-batches, precision and recomputation the plan measured, and
    for an MoE the routing and the ranks a node its all-to-all bytes split by."""
    dp = dims.dp_size
    micro = (
        f"{resolve_microbatches(cfg.parallel.pp_microbatches, cfg.global_batch // dp)} pipeline "
        "micro-batches"
        if dims.pp > 1
        else f"{cfg.grad_accum_steps} micro-batch(es)"
    )
    precision = (
        "bf16 mixed precision" if cfg.parallel.mixed_precision else "fp32 (no --mixed-precision)"
    )
    recompute = "on" if cfg.parallel.activation_checkpointing else "off"
    assumed = (
        f"seq_len {cfg.seq_len}, global batch {cfg.global_batch} ({cfg.global_batch // dp} a "
        f"data-parallel rank, {micro} a step), {precision}, activation checkpointing {recompute}"
    )
    moe = cfg.model.moe
    if moe is None:
        return assumed
    capacity = (
        f"capped at capacity factor {moe.capacity_factor:g}"
        if moe.capacity_factor
        else "no capacity factor"
    )
    return (
        f"{assumed}; uniform routing (every expert tokens x top_k / E rows, {capacity}), "
        f"{per_node} ranks a node"
    )


# Above this many parameters, the debug model's sequence and batch say nothing of a real run.
_LARGE = 10**9


def _debug_defaults(cfg: TrainConfig, params: int) -> str:
    """A warning when a large model meets the debug model's sequence, batch and precision."""
    debug = (
        cfg.seq_len == options.BY_DEST["seq_len"].default
        and cfg.global_batch == options.BY_DEST["global_batch"].default
        and not cfg.parallel.mixed_precision
    )
    if params < _LARGE or not debug:
        return ""
    return (
        f"a {params / 1e9:.2f}B model with the debug model's seq_len {cfg.seq_len}, global batch "
        f"{cfg.global_batch} and fp32: give --seq-len, --global-batch and --mixed-precision "
        "for a real run's memory"
    )


def _layout(layout: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items() if v != 1 or k == "dp_shard")


@dataclass(frozen=True)
class ElasticSize:
    """The job on fewer nodes (`scaletrain run --nodes MIN:MAX`), as an elastic job re-forms."""

    nodes: int
    ranks: int
    # Why it cannot run at this size ("" where it can).
    refused: str = ""
    layout: dict[str, int] = dataclasses.field(default_factory=dict)
    micro_batches: int = 0
    memory: float = 0.0  # bytes on the busiest rank
    # Tokens/s relative to the full size, data parallelism's ideal (its ranks over the full's).
    throughput: float = 0.0


def elastic_sizes(
    job: dict[str, options.Value], world: int, per_node: int, min_nodes: int, gpu: str
) -> list[ElasticSize]:
    """The job of `world` ranks on every node count from the full one down to `min_nodes`
    (`per_node` ranks each): whether its layout fits (the data-parallel degree absorbs the
    change), the micro-batches each rank then runs (`elastic_accumulation`: its micro-batch
    stays the full job's where it can) and its memory, so that a user knows MIN before the run."""
    if per_node < 1 or world % per_node:
        raise UserError(f"--ranks-per-node {per_node} must divide --ranks {world}")
    full = world // per_node
    if not 1 <= min_nodes <= full:
        raise UserError(f"--min-nodes must be 1 to {full} (the job's nodes), got {min_nodes}")
    sizes, cfg = [], from_values(job)
    for nodes in range(full, min_nodes - 1, -1):
        ranks = nodes * per_node
        accum = elastic_accumulation(cfg, ranks, world)
        try:
            sized = plan(job | {"grad_accum_steps": accum}, ranks, gpu, per_node=per_node)
        except UserError as exc:
            sizes.append(ElasticSize(nodes, ranks, refused=str(exc)))
            continue
        sizes.append(
            ElasticSize(nodes, ranks, "", sized.layout, accum, sized.memory["total"], ranks / world)
        )
    return sizes


def render_elastic(sizes: list[ElasticSize], per_node: int) -> str:
    """The sizes as `scaletrain plan --min-nodes` prints them."""
    lines = [f"elastic       on fewer nodes ({per_node} ranks a node), as --nodes MIN:MAX re-forms"]
    for size in sizes:
        head = f"  {size.nodes:>4} nodes {size.ranks:>6,} ranks  "
        if size.refused:
            lines.append(head + f"cannot run: {size.refused}")
            continue
        lines.append(
            head + f"{_layout(size.layout)}; {size.micro_batches} micro-batch(es) a step, "
            f"{size.memory / (1 << 30):,.2f} GiB a rank, throughput ~{size.throughput:.2f} of full"
        )
    return "\n".join(lines)


def _bubble(cfg: TrainConfig, dims: ParallelDims) -> tuple[float, str]:
    if dims.pp == 1:
        return 0.0, "no pipeline"
    p, schedule = dims.pp, cfg.parallel.pp_schedule
    v = resolve_stages_per_rank(schedule, cfg.parallel.pp_stages_per_rank)
    m = resolve_microbatches(cfg.parallel.pp_microbatches, cfg.global_batch // dims.dp_size)
    bubble = (p - 1) / (v * m + p - 1)
    note = "; the zero-bubble schedule fills most of it" if schedule in ZERO_BUBBLE else ""
    formula = f"(p-1)/(v*m+p-1), p={p} v={v} m={m} ({schedule}){note}"
    sizes = job_stage_sizes(cfg, p)
    # The embedding and the head weigh a block each on the first and last stage.
    work = [n + (s == 0) + (s == len(sizes) - 1) for s, n in enumerate(sizes)]
    if len(set(work)) > 1:
        # Every stage waits on the slowest: the time of (v*m+p-1) slots of the slowest stage,
        # of which the mean stage's v*m are work.
        busy = (v * m) * (sum(work) / len(work)) / ((v * m + p - 1) * max(work))
        bubble = 1 - busy
        formula = (
            f"1 - v*m*mean/((v*m+p-1)*max) over stages of {min(work)}..{max(work)} blocks "
            f"(embedding and head a block each), p={p} v={v} m={m} ({schedule}){note}"
        )
    return bubble, formula


@dataclass(frozen=True)
class _Batch:
    """What one rank runs of a step: `micro` sequences of `seq` tokens (its cp share) in each of
    `count` micro-batches, `in_flight` of them holding activations at once."""

    micro: int
    seq: int
    count: int
    in_flight: int


def _rank_batch(cfg: TrainConfig, dims: ParallelDims) -> _Batch:
    par = cfg.parallel
    local_batch = cfg.global_batch // dims.dp_size
    seq = cfg.seq_len // dims.cp
    if dims.pp == 1:
        count = cfg.grad_accum_steps
        return _Batch(local_batch // count, seq, count, 1)
    count = resolve_microbatches(par.pp_microbatches, local_batch)
    # 1F1B keeps up to p micro-batches in flight on the first stage; GPipe all of them.
    in_flight = count if par.pp_schedule == "GPipe" else min(dims.pp, count)
    return _Batch(local_batch // count, seq, count, in_flight)


@dataclass(frozen=True)
class _BlockParts:
    """A block's parameters by how the trainer shards them."""

    # Attention, a dense feed-forward and the norms: split by tp, then FSDP over dp_shard x cp
    # (the norms are whole on every tp rank, too small to tell).
    tp_split: int
    # An MoE's router and shared experts: whole on every tp rank, FSDP over dp_shard x cp.
    tp_whole: int
    # An MoE's routed experts, all E of them: split over ep, FSDP over dp_shard x cp / ep.
    experts: int


def _block_parts(block: nn.Module) -> _BlockParts:
    moe = block.feed_forward
    if not isinstance(moe, MoE):
        return _BlockParts(_numel(block), 0, 0)
    experts = _numel(moe.experts)
    return _BlockParts(_numel(block) - _numel(moe), _numel(moe) - experts, experts)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_shares(parts: _BlockParts, dims: ParallelDims) -> tuple[float, float, float]:
    """Of a measured block (its routed experts an EP rank's E / ep): the share of its states the
    rank holds between uses, the share of its parameters it gathers to compute, and the share of
    its states that are the routed experts the rank holds."""
    shard = dims.dp_shard * dims.cp
    local_experts = parts.experts / dims.ep
    measured = parts.tp_split + parts.tp_whole + local_experts
    held = parts.tp_split / (dims.tp * shard) + parts.tp_whole / shard + parts.experts / shard
    gathered = parts.tp_split / dims.tp + parts.tp_whole + local_experts
    return held / measured, gathered / measured, parts.experts / shard / measured


@dataclass(frozen=True)
class _Measured:
    """MemTracker's bytes by category (`measure`): the one-block run, what each further block
    adds, and the rest (embedding, head, loss)."""

    one: dict[str, float]
    per_block: dict[str, float]
    rest: dict[str, float]


def rank_memory(
    cfg: TrainConfig, dims: ParallelDims, parts: _BlockParts
) -> tuple[dict[str, float], dict[str, float], int]:
    """Bytes on the busiest pipeline rank by part (see the module docstring), a block's
    parameters being `parts`; of its states, those of the routed experts (empty for a dense
    model); and the blocks it holds."""
    batch = _rank_batch(cfg, dims)
    dtype = _compute_dtype(cfg)
    one, two = (measure(cfg, n, batch.micro, batch.seq, dtype, dims.ep) for n in (1, 2))
    per_block = {k: two[k] - one[k] for k in one}
    measured = _Measured(one, per_block, {k: one[k] - per_block[k] for k in one})
    ranks = [
        (_stage_memory(cfg, dims, batch, measured, parts, blocks, share), blocks)
        for blocks, share in _pipeline_ranks(cfg, dims)
    ]
    memory, blocks = max(ranks, key=lambda rank: rank[0]["total"])
    expert_states = {}
    if cfg.model.moe is not None:
        _, _, experts = _block_shares(parts, dims)
        expert_states = {name: per_block[key] * blocks * experts for key, name in _STATES.items()}
    return memory, expert_states, blocks


def _compute_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype activations, gathered parameters and the all-to-all's rows are in."""
    return torch.bfloat16 if cfg.parallel.mixed_precision else torch.float32


def _stage_memory(
    cfg: TrainConfig,
    dims: ParallelDims,
    batch: _Batch,
    measured: _Measured,
    parts: _BlockParts,
    blocks: int,
    rest_share: float,
) -> dict[str, float]:
    """Bytes by part of a rank holding `blocks` blocks and `rest_share` of the rest, a block's
    parameters being `parts`."""
    per_block, rest, one = measured.per_block, measured.rest, measured.one
    held, gathered, _ = _block_shares(parts, dims)
    rest_shard = dims.tp * dims.dp_shard * dims.cp
    memory = {
        name: per_block[key] * blocks * held + rest[key] * rest_share / rest_shard
        for key, name in _STATES.items()
    }
    if dims.dp_shard * dims.cp > 1:
        scale = _compute_dtype(cfg).itemsize / 4
        block_params = per_block["Parameter"] * gathered
        if dims.pp > 1:
            # The trainer keeps a stage's blocks gathered from their first forward to their last
            # backward under pipelining (reshard_after_forward off), in the compute dtype.
            memory["fsdp all-gather buffers"] = block_params * blocks * scale
        else:
            # A block's parameters gathered in the compute dtype, and the next one prefetched.
            memory["fsdp all-gather buffers"] = 2 * block_params * scale
        if dims.pp > 1 or cfg.grad_accum_steps > 1:
            # Gradients are reduce-scattered in the last micro-batch's backward only (torch's
            # pipeline stage, or --grad-accum-steps): until then each is kept whole, in fp32.
            memory["unsharded gradients"] = block_params * blocks
    # An MoE block sees the whole sequence on every tp rank: its activations are not divided by
    # tp (its attention's are, which this does not split out: an upper bound at tp > 1).
    block_tp = 1 if cfg.model.moe is not None else dims.tp
    kept = per_block["kept"] * blocks / block_tp + rest["kept"] * rest_share / dims.tp
    # What one micro-batch needs beyond what the forward keeps, at its busiest moment (a
    # block's recomputation and gradients, the loss's): once a rank, whatever its stage and the
    # micro-batches in flight. Without a pipeline this adds up to the measured peak.
    working = (one["transient"] - one["kept"]) / block_tp
    memory["activations"] = kept * batch.in_flight + working
    memory["total"] = sum(memory.values())
    return memory


def _expert_plan(
    cfg: TrainConfig,
    dims: ParallelDims,
    parts: _BlockParts,
    layers: int,
    per_node: int,
    memory_held: dict[str, float],
) -> ExpertPlan:
    """The routed experts of the busiest rank's `layers` MoE layers and their all-to-all."""
    moe = cfg.model.moe
    assert moe is not None
    batch = _rank_batch(cfg, dims)
    tokens = batch.micro * batch.seq
    per_ep_rank = parts.experts // dims.ep
    fsdp = dims.dp_shard * dims.cp // dims.ep
    return ExpertPlan(
        routed=moe.n_experts,
        shared=moe.n_shared,
        top_k=moe.top_k,
        layers=layers,
        per_ep_rank=moe.n_experts // dims.ep,
        params_per_ep_rank=per_ep_rank * layers,
        params_held=per_ep_rank * layers / fsdp,
        fsdp=fsdp,
        memory_held=memory_held,
        dense_params=parts.tp_whole * layers,
        tokens=tokens,
        rows_per_expert=max(expert_rows(tokens, moe)),
        all_to_all=all_to_all(cfg, dims, tokens, batch.count * layers, per_node),
    )


def expert_rows(tokens: int, moe: MoEArgs) -> list[int]:
    """Rows each expert computes of `tokens` routed tokens under uniform routing: their
    tokens * top_k copies split as evenly as they go, each capped at the trainer's capacity,
    ceil(factor * tokens * top_k / E) as MoE._drop_over_capacity takes it, when there is one."""
    base, extra = divmod(tokens * moe.top_k, moe.n_experts)
    rows = [base + (e < extra) for e in range(moe.n_experts)]
    if not moe.capacity_factor:
        return rows
    capacity = math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.n_experts)
    return [min(r, capacity) for r in rows]


def all_to_all(
    cfg: TrainConfig, dims: ParallelDims, tokens: int, layer_runs: int, per_node: int
) -> AllToAll | None:
    """The all-to-all bytes of `layer_runs` MoE layer runs a step (layers x micro-batches) of
    `tokens` tokens each, on ranks `per_node` a node (see AllToAll); None at ep 1."""
    moe, ep = cfg.model.moe, dims.ep
    if moe is None or ep == 1:
        return None
    width = cfg.model.dim * _compute_dtype(cfg).itemsize
    copies = sum(expert_rows(tokens, moe))
    recompute = cfg.parallel.activation_checkpointing
    exchanges = 6 if recompute else 4
    per_layer = exchanges * copies * width * (ep - 1) / ep
    per_step = per_layer * layer_runs
    local = max(1, min(ep, per_node // dims.tp))
    nodes = -(-ep // local)
    intra = per_step * (local - 1) / (ep - 1)
    if moe.n_groups > 1:
        # A group is ep / n_groups consecutive ep ranks: on one node, or spanning several.
        reach = min(nodes, moe.topk_groups * max(1, -(-ep // (moe.n_groups * local))))
    else:
        reach = min(nodes, moe.top_k)
    once = exchanges * tokens * min(reach, nodes - 1) * width * layer_runs
    again = ", and the recomputed forward's" if recompute else ""
    return AllToAll(
        per_layer=per_layer,
        per_step=per_step,
        intra_node=intra,
        inter_node=per_step - intra,
        ep_per_node=local,
        nodes=nodes,
        nodes_per_token=reach,
        inter_node_once_a_node=once,
        formula=(
            f"{exchanges} x {copies:,} token copies x {width:,} B x (ep-1)/ep: dispatch and "
            f"combine, forward and backward{again}; of the other ep ranks {local - 1} on its "
            f"node, {ep - local} on others"
        ),
    )


def _pipeline_ranks(cfg: TrainConfig, dims: ParallelDims) -> set[tuple[int, float]]:
    """(blocks, share of what is not in the blocks) of every pipeline rank: its stages' blocks
    (uneven with --pp-first/last-stage-less-layers or --pp-layers-per-stage), and half of the
    rest where it holds the first stage (the embedding) or the last (the output head)."""
    if dims.pp == 1:
        return {(cfg.model.n_layers, 1.0)}
    par = cfg.parallel
    v = resolve_stages_per_rank(par.pp_schedule, par.pp_stages_per_rank)
    sizes = job_stage_sizes(cfg, dims.pp)
    ranks = set()
    for rank in range(dims.pp):
        stages = stage_indices(par.pp_schedule, rank, dims.pp, v)
        share = 0.5 * (0 in stages) + 0.5 * (len(sizes) - 1 in stages)
        ranks.add((sum(sizes[s] for s in stages), share))
    return ranks


class UniformMoE(nn.Module):
    """An MoE block with static, uniform routing, for planning only: the tensors MoE.forward
    allocates, of the sizes uniform routing gives them, without its data-dependent shapes.

    The router runs as it is (its fixed-shape scores, top-k and gates); the token copies then go
    to experts by `expert_rows` instead of the router's choices, so no count is read from the
    data. The block holds an EP rank's E / ep experts, and each receives from the ep ranks what
    it sends them (uniform routing: as many rows as the rank routes). The all-to-all's buffers
    are stood in for by copies of the same size (`_moved`). Left out: the load counters and the
    sequence-wise auxiliary loss's (batch, E) statistics, small beside the rows."""

    def __init__(self, moe: MoE, ep: int) -> None:
        super().__init__()
        self.args, self.ep = moe.args, ep
        self.router = moe.router
        _, dim, hidden = moe.experts.w1.shape
        self.experts = GroupedExperts(moe.args.n_experts // ep, dim, hidden)
        self.shared = moe.shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, _, _ = self.router(flat)
        rows = expert_rows(flat.shape[0], self.args)
        copies = sum(rows)
        # The copies sorted by expert: an index of their tokens, and the rows it gathers.
        token_of = torch.arange(flat.shape[0], device=x.device)
        token_of = token_of.repeat_interleave(self.args.top_k)[:copies]
        sent = flat[token_of]
        gate = weights.flatten()[:copies].unsqueeze(-1).to(sent.dtype)
        local = self.experts.w1.shape[0]
        received = [self.ep * r for r in rows[:local]]
        out = self.experts(_moved(sent, self.ep), received)
        out = _moved(out, self.ep)
        out = torch.zeros_like(flat).index_add(0, token_of, out * gate)
        if self.shared is not None:
            out = out + self.shared(flat, [flat.shape[0]])
        return out.view(bsz, seq, dim)


def _moved(x: torch.Tensor, ep: int) -> torch.Tensor:
    """`x` as an all-to-all leaves it: the exchange's output (a fresh tensor) and its
    regrouping by expert or by source (a copy through a kept index); `x` itself at ep 1."""
    if ep == 1:
        return x
    return x.clone()[torch.arange(x.shape[0], device=x.device)]


def measure(
    cfg: TrainConfig, n_layers: int, micro: int, seq: int, dtype: torch.dtype, ep: int = 1
) -> dict[str, float]:
    """MemTracker's bytes by category for training an `n_layers`-block model of `cfg`'s shape on
    (micro, seq) tokens, under FakeTensorMode: nothing is allocated. Two steps: parameters,
    gradients and optimizer state as they stand at the end of the second backward (all live);
    activations, temporaries and buffers ("transient") at their own peak over the first
    forward and backward, wherever the total peaks, and as the first forward leaves them for
    the backward ("kept"). Run in fp32, how FSDP keeps the states under mixed precision too;
    activations in a `dtype` of fewer bits take that much less. An MoE's blocks route uniformly
    (`UniformMoE`), holding the experts of one of `ep` ranks."""
    with FakeTensorMode():
        model = Transformer(dataclasses.replace(cfg.model, n_layers=n_layers))
        for block in model.layers.values():
            if isinstance(block.feed_forward, MoE):
                block.feed_forward = UniformMoE(block.feed_forward, ep)
        if cfg.parallel.activation_checkpointing:
            apply_activation_checkpointing(model)
        optimizer = build_optimizer(model, cfg)
        tokens = torch.randint(0, cfg.model.vocab_size, (micro, seq + 1))
        tracker = _TransientPeak()
        tracker.track_external(model, optimizer)
        with tracker:
            loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
            (forward,) = tracker.get_tracker_snapshot("current").values()
            kept = sum(_by_name(forward).get(k, 0) for k in _ACTIVATIONS)
            loss.backward()
            transient = tracker.transient
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()  # one step's module stats at a time
            next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            (states,) = tracker.get_tracker_snapshot("current").values()
    scale = dtype.itemsize / 4
    return {k: float(_by_name(states).get(k, 0)) for k in _STATES} | {
        "transient": transient * scale,
        "kept": kept * scale,
    }


def _by_name(snapshot: dict) -> dict[str, int]:
    return {str(getattr(k, "value", k)): v for k, v in snapshot.items()}


def render(p: Plan) -> str:
    """The plan as `scaletrain plan` prints it."""
    active = ""
    if p.moe is not None:
        active = (
            f"; a token activates {p.active_params:,} ({p.active_params / 1e9:.2f}B: top "
            f"{p.moe.top_k} of {p.moe.routed} routed experts)"
        )
    routed = ", MoE routed uniformly" if p.moe is not None else ""
    lines = [
        f"layout        {p.world:,} ranks: {_layout(p.layout)}",
        f"assumed       {p.assumed}",
        f"parameters    {p.params:,} ({p.params / 1e9:.2f}B; embedding {p.embedding_params:,})"
        + active,
        f"memory/rank   (FakeTensorMode + MemTracker{routed}; busiest rank)",
        *(f"  {name:<24}{b / _GIB:10.2f} GiB" for name, b in p.memory.items()),
        _fits(p),
        *([] if p.moe is None else _render_experts(p.moe)),
        f"flops/token   6N {p.flops_per_token_6n:.3e}; with attention {p.flops_per_token:.3e}",
        f"flops/step    {p.flops_per_token * p.tokens_per_step:.3e} ({p.tokens_per_step:,} tokens)",
        f"bubble        {p.bubble:.1%}  {p.bubble_formula}",
    ]
    if p.target_tokens_s is not None:
        if p.peak_flops is None or p.mfu is None or p.busy_mfu is None:
            lines.append(f"mfu           unknown: no dense peak for {p.gpu!r} in telemetry.mfu")
        else:
            step_s = p.tokens_per_step / p.target_tokens_s
            lines.append(
                f"mfu           {p.mfu:.1%} at {p.target_tokens_s:,.0f} tokens/s on {p.world:,} "
                f"x {p.gpu} ({p.peak_flops / 1e12:,.0f} TFLOP/s dense each); "
                f"{step_s:.2f} s a step"
            )
            if p.busy_mfu > BUSY_MFU_LIMIT:
                lines.append(
                    f"warning       that is {p.busy_mfu:.0%} MFU while the pipeline is busy (its "
                    f"bubble idles {p.bubble:.0%} of the step): above {BUSY_MFU_LIMIT:.0%}, a "
                    "target rarely reached"
                )
    if p.warning:
        lines.append(f"warning       {p.warning}")
    routing, moved = (" (MoE blocks routed uniformly)", ", all-to-all") if p.moe else ("", "")
    lines.append(
        f"measured      memory's parameters, gradients, optimizer state and activations: one "
        f"training step of one and two blocks{routing} under FakeTensorMode with MemTracker; the "
        f"rank's share of them, the other memory parts, flops, bubble, MFU{moved} by formula "
        "(--json: sources)"
    )
    return "\n".join(lines)


def _render_experts(e: ExpertPlan) -> list[str]:
    """The experts' lines of `render`: what an EP rank holds, the routing measured, the
    all-to-all."""
    held = ", ".join(f"{name} {_size(b)}" for name, b in e.memory_held.items())
    lines = [
        f"experts       {e.routed} routed (top {e.top_k}) and {e.shared} shared a layer; "
        f"{e.per_ep_rank} routed an EP rank: {e.params_per_ep_rank:,} parameters over its "
        f"{e.layers} MoE layers, {e.params_held:,.0f} held after FSDP over {e.fsdp}; router "
        "and shared "
        f"experts {e.dense_params:,} (dense, whole on every tp rank)",
        f"  held         by the routed experts (of the memory above): {held}",
        f"  routing      uniform: {e.tokens:,} tokens a micro-batch on every rank, at most "
        f"{e.rows_per_expert:,} rows an expert, as measured",
    ]
    a = e.all_to_all
    if a is None:
        return [*lines, "all-to-all    none: ep 1 keeps every expert on every rank"]
    return [
        *lines,
        f"all-to-all    (formula) {_size(a.per_layer)} sent a rank an MoE layer and micro-batch; "
        f"a step {_size(a.per_step)}: {_size(a.intra_node)} within its node, "
        f"{_size(a.inter_node)} across nodes (ep over {a.nodes} node(s), {a.ep_per_node} ep "
        "ranks a node)",
        f"  reach        a token's copies reach at most {a.nodes_per_token} of the {a.nodes} "
        f"node(s); sent once a node (DeepSeek-V3's dispatch; this trainer sends every copy), "
        f"at most {_size(a.inter_node_once_a_node)} a step would cross nodes",
        f"  bytes        {a.formula}",
    ]


def _size(n: float) -> str:
    """`n` bytes in the binary unit that keeps the figure below 1,024 (GiB at most)."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1 << 10:
            return f"{n:,.1f} {unit}"
        n /= 1 << 10
    return f"{n:,.1f} GiB"


def _fits(p: Plan) -> str:
    """Whether the busiest rank's memory fits one device once the headroom the allocator and
    NCCL need is left, and by how much it does or does not."""
    if p.device_memory is None or p.headroom is None or p.spare is None:
        return f"fits          unknown: no memory size for {p.gpu!r} in telemetry.mfu"
    need, have = p.memory["total"], p.device_memory
    left = (
        f"{sum(p.headroom.values()) / _GIB:,.1f} GiB for the caching allocator's fragmentation "
        f"({ALLOCATOR_SHARE:.0%}) and NCCL's buffers ({NCCL_BYTES / _GIB:g} GiB)"
    )
    device = f"one {p.gpu}'s {have / _GIB:,.1f} GiB ({have / 1e9:,.0f} GB)"
    if p.spare >= 0:
        return (
            f"fits          yes: {need / _GIB:,.2f} GiB of {device}, leaving {left}; "
            f"{p.spare / _GIB:,.2f} GiB to spare"
        )
    return (
        f"fits          no: {need / _GIB:,.2f} GiB of {device}: over by {-p.spare / _GIB:,.2f} GiB "
        f"once it leaves {left}"
    )
