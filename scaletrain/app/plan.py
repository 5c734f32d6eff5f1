"""`scaletrain plan`: what a job costs per rank before it runs, on a laptop, in seconds.

Checks the layout as `scaletrain run` does, then reports
- exact parameter counts, from the model built on the meta device;
- per-rank memory (dense models; an MoE's data-dependent routing cannot run on fake tensors):
  parameters, gradients, optimizer state, FSDP's all-gather buffers, and
  activations. Memory is measured, not derived from formulas: the model's first blocks are trained
  for one step under FakeTensorMode (tensors without storage) with torch's MemTracker, which
  attributes every allocation to parameters, gradients, optimizer state or activations. Runs of
  one and two blocks give what a block adds and what the rest (embedding, output head, loss) costs;
  the rank's share follows from its layout: its pipeline stage's blocks, sharded by tensor
  parallelism and by FSDP over dp_shard x cp, with as many micro-batches' activations live as the
  pipeline schedule keeps in flight;
- FLOPs per token and per step: 6N (N: the parameters, embedding excluded) and with
  attention's 12 * layers * dim * seq_len (as TorchTitan and the PaLM paper);
- the pipeline bubble (p - 1) / (v * m + p - 1) of p stages, v per rank, m micro-batches (the
  zero-bubble schedules fill most of it);
- the MFU a target tokens/s would mean on a named GPU (dense peak from telemetry.mfu's table).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from scaletrain.errors import UserError
from telemetry import mfu
from trainer import options
from trainer.config import TrainConfig, from_values
from trainer.model.llama import Transformer, next_token_loss
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

    @property
    def mfu(self) -> float | None:
        if self.peak_flops is None or self.target_tokens_s is None:
            return None
        return self.flops_per_token * self.target_tokens_s / (self.world * self.peak_flops)


def plan(
    job: dict[str, options.Value], world: int, gpu: str = "h200", tokens_s: float | None = None
) -> Plan:
    """The plan of `job` (resolved options) on `world` ranks; UserError for a layout that cannot
    run, in the words `scaletrain run` uses."""
    if world < 1:
        raise UserError(f"--ranks must be at least 1, got {world}")
    cfg = from_values(job)
    try:
        dims = validate_layout(cfg, world)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if cfg.model.moe is not None:
        # Routing is data-dependent (bincount, per-expert splits): FakeTensorMode cannot run it.
        raise UserError(
            "plan measures dense models only: an MoE's routing cannot run on fake tensors yet; "
            f"its layout on {world} ranks ({_layout(dims.layout())}) is valid"
        )
    with torch.device("meta"):
        whole = Transformer(cfg.model)
    params = whole.num_params(exclude_embedding=False)
    embedding = whole.tok_embeddings.weight.numel()
    seq, layers, dim = cfg.seq_len, cfg.model.n_layers, cfg.model.dim
    attention = 12 * layers * dim * seq
    bubble, formula = _bubble(cfg, dims)
    precision = "bf16" if cfg.parallel.mixed_precision else "tf32"
    return Plan(
        world=world,
        layout=dims.layout(),
        params=params,
        embedding_params=embedding,
        memory=rank_memory(cfg, dims),
        flops_per_token_6n=6 * (params - embedding),
        flops_per_token=6 * (params - embedding) + attention,
        tokens_per_step=cfg.global_batch * seq,
        bubble=bubble,
        bubble_formula=formula,
        gpu=gpu,
        peak_flops=mfu.dense_peak(gpu, precision),
        target_tokens_s=tokens_s,
        device_memory=mfu.device_memory(gpu),
        assumed=_assumed(cfg, dims),
        warning=_debug_defaults(cfg, params),
    )


def _assumed(cfg: TrainConfig, dims: ParallelDims) -> str:
    """The sequence, batch, micro-batches, precision and recomputation the plan measured."""
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
    return (
        f"seq_len {cfg.seq_len}, global batch {cfg.global_batch} ({cfg.global_batch // dp} a "
        f"data-parallel rank, {micro} a step), {precision}, activation checkpointing {recompute}"
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
            sized = plan(job | {"grad_accum_steps": accum}, ranks, gpu)
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


def rank_memory(cfg: TrainConfig, dims: ParallelDims) -> dict[str, float]:
    """Bytes on the busiest rank by part (see the module docstring)."""
    par = cfg.parallel
    local_batch = cfg.global_batch // dims.dp_size
    if dims.pp > 1:
        microbatches = resolve_microbatches(par.pp_microbatches, local_batch)
        micro = local_batch // microbatches
        # 1F1B keeps up to p micro-batches in flight on the first stage; GPipe all of them.
        in_flight = microbatches if par.pp_schedule == "GPipe" else min(dims.pp, microbatches)
    else:
        micro, in_flight = local_batch // cfg.grad_accum_steps, 1
    seq = cfg.seq_len // dims.cp
    dtype = torch.bfloat16 if par.mixed_precision else torch.float32
    one, two = (measure(cfg, n, micro, seq, dtype) for n in (1, 2))
    per_block = {k: two[k] - one[k] for k in one}
    rest = {k: one[k] - per_block[k] for k in one}
    blocks, rest_share = _busiest_rank(cfg, dims, sum(per_block.values()), sum(rest.values()))
    shard = dims.tp * dims.dp_shard * dims.cp
    memory = {
        name: (per_block[key] * blocks + rest[key] * rest_share) / shard
        for key, name in _STATES.items()
    }
    if dims.dp_shard * dims.cp > 1:
        scale = torch.finfo(dtype).bits / 32
        block_params = per_block["Parameter"] / dims.tp
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
    activations = per_block["transient"] * blocks + rest["transient"] * rest_share
    memory["activations"] = activations * in_flight / dims.tp
    memory["total"] = sum(memory.values())
    return memory


def _busiest_rank(
    cfg: TrainConfig, dims: ParallelDims, block_bytes: float, rest_bytes: float
) -> tuple[int, float]:
    """(blocks, share of what is not in the blocks) of the rank holding the most: its stages'
    blocks (uneven with --pp-first/last-stage-less-layers or --pp-layers-per-stage), and half of
    the rest where it holds the first stage (the embedding) or the last (the output head)."""
    if dims.pp == 1:
        return cfg.model.n_layers, 1.0
    par = cfg.parallel
    v = resolve_stages_per_rank(par.pp_schedule, par.pp_stages_per_rank)
    sizes = job_stage_sizes(cfg, dims.pp)
    ranks = []
    for rank in range(dims.pp):
        stages = stage_indices(par.pp_schedule, rank, dims.pp, v)
        share = 0.5 * (0 in stages) + 0.5 * (len(sizes) - 1 in stages)
        ranks.append((sum(sizes[s] for s in stages), share))
    return max(ranks, key=lambda r: r[0] * block_bytes + r[1] * rest_bytes)


def measure(
    cfg: TrainConfig, n_layers: int, micro: int, seq: int, dtype: torch.dtype
) -> dict[str, float]:
    """MemTracker's bytes by category for training an `n_layers`-block model of `cfg`'s shape on
    (micro, seq) tokens, under FakeTensorMode: nothing is allocated. Two steps: parameters,
    gradients and optimizer state as they stand at the end of the second backward (all live);
    activations, temporaries and buffers ("transient") at their own peak over the first
    forward and backward, wherever the total peaks. Run in fp32, how FSDP keeps the states under
    mixed precision too; activations in a `dtype` of fewer bits take that much less."""
    with FakeTensorMode():
        model = Transformer(dataclasses.replace(cfg.model, n_layers=n_layers))
        if cfg.parallel.activation_checkpointing:
            apply_activation_checkpointing(model)
        optimizer = build_optimizer(model, cfg)
        tokens = torch.randint(0, cfg.model.vocab_size, (micro, seq + 1))
        tracker = _TransientPeak()
        tracker.track_external(model, optimizer)
        with tracker:
            next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            transient = tracker.transient
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()  # one step's module stats at a time
            next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            (states,) = tracker.get_tracker_snapshot("current").values()
    scale = torch.finfo(dtype).bits / 32
    return {k: float(_by_name(states).get(k, 0)) for k in _STATES} | {
        "transient": transient * scale
    }


def _by_name(snapshot: dict) -> dict[str, int]:
    return {str(getattr(k, "value", k)): v for k, v in snapshot.items()}


def render(p: Plan) -> str:
    """The plan as `scaletrain plan` prints it."""
    gib = 1 << 30
    lines = [
        f"layout        {p.world:,} ranks: {_layout(p.layout)}",
        f"assumed       {p.assumed}",
        f"parameters    {p.params:,} ({p.params / 1e9:.2f}B; embedding {p.embedding_params:,})",
        "memory/rank   (FakeTensorMode + MemTracker, busiest rank)",
        *(f"  {name:<24}{b / gib:10.2f} GiB" for name, b in p.memory.items()),
        _fits(p),
        f"flops/token   6N {p.flops_per_token_6n:.3e}; with attention {p.flops_per_token:.3e}",
        f"flops/step    {p.flops_per_token * p.tokens_per_step:.3e} ({p.tokens_per_step:,} tokens)",
        f"bubble        {p.bubble:.1%}  {p.bubble_formula}",
    ]
    if p.target_tokens_s is not None:
        if p.peak_flops is None:
            lines.append(f"mfu           unknown: no dense peak for {p.gpu!r} in telemetry.mfu")
        else:
            step_s = p.tokens_per_step / p.target_tokens_s
            lines.append(
                f"mfu           {p.mfu:.1%} at {p.target_tokens_s:,.0f} tokens/s on {p.world:,} "
                f"x {p.gpu} ({p.peak_flops / 1e12:,.0f} TFLOP/s dense each); "
                f"{step_s:.2f} s a step"
            )
            busy = p.mfu / (1 - p.bubble) if p.bubble < 1 else math.inf
            if busy > BUSY_MFU_LIMIT:
                lines.append(
                    f"warning       that is {busy:.0%} MFU while the pipeline is busy (its "
                    f"bubble idles {p.bubble:.0%} of the step): above {BUSY_MFU_LIMIT:.0%}, a "
                    "target rarely reached"
                )
    if p.warning:
        lines.append(f"warning       {p.warning}")
    return "\n".join(lines)


# What a device's memory must keep beside the plan's tensors: the caching allocator's
# fragmentation (a share) and NCCL's communicator buffers (bytes).
ALLOCATOR_SHARE = 0.08
NCCL_BYTES = 1 << 30
# MFU while the pipeline is busy above which a target is flagged as rarely reached.
BUSY_MFU_LIMIT = 0.6


def _fits(p: Plan) -> str:
    """Whether the busiest rank's memory fits one device, less the headroom the allocator and
    NCCL need."""
    if p.device_memory is None:
        return f"fits          unknown: no memory size for {p.gpu!r} in telemetry.mfu"
    need, have = p.memory["total"], p.device_memory
    usable = have * (1 - ALLOCATOR_SHARE) - NCCL_BYTES
    verdict = "yes" if need <= usable else "no"
    gib = 1 << 30
    return (
        f"fits          {verdict}: {need / gib:,.2f} GiB of the {usable / gib:,.1f} GiB usable of "
        f"one {p.gpu}'s {have / gib:,.1f} GiB ({have / 1e9:,.0f} GB), less "
        f"{ALLOCATOR_SHARE:.0%} for the caching allocator's fragmentation and "
        f"{NCCL_BYTES / gib:g} GiB for NCCL's buffers"
    )
