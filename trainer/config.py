"""The trainer's configuration: one dataclass, parsed from the command line."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from trainer import health
from trainer.fp8 import DEFAULT_KEEP_HIGH_PRECISION, RECIPE_CHOICES, make_recipe
from trainer.fp8.fsdp import check_all_gather
from trainer.health.faults import FaultPlan
from trainer.health.watchdog import WatchdogPolicy
from trainer.model.llama import ModelArgs
from trainer.model.moe import BALANCE_MODES, MoEArgs
from trainer.parallel.pipeline import SCHEDULES


@dataclass(frozen=True)
class ParallelConfig:
    """How the job is laid out over its ranks (trainer/parallel/dims.py checks it fits)."""

    dp_replicate: int = 1
    # -1 takes every rank the other degrees leave.
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # Borrowed from dp_shard x cp: must divide it.
    ep: int = 1
    pp_schedule: str = "1F1B"
    # 0: one micro-batch per sequence of the local batch.
    pp_microbatches: int = 0
    # 0: the schedule's own (1 for GPipe and 1F1B, 2 for the others).
    pp_stages_per_rank: int = 0
    # bf16 parameters and compute, fp32 gradient reductions and optimizer state.
    mixed_precision: bool = False
    activation_checkpointing: bool = False
    # torch.compile each transformer block (trainer/parallel/compile.py).
    compile: bool = False


@dataclass(frozen=True)
class TrainConfig:
    run_id: str
    ckptd: str | None = None
    telemetry: str | None = None
    steps: int = 300
    ckpt_every: int = 100
    # What a save requested while the previous one still streams does: "wait" or "skip".
    ckpt_policy: str = "wait"
    # Copies of each node's part of a checkpoint on distinct nodes (R); 0: ckptd's default.
    replicas: int = 0
    resume: bool = False
    seed: int = 1234
    seq_len: int = 128
    global_batch: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    corpus_bytes: int = 4 << 20
    log_every: int = 10
    # FP8 linears: a recipe of trainer.fp8 or "none", the linears kept in high precision by
    # name, and KEY=VALUE changes to the recipe (formats, amax history, margin).
    fp8: str = "none"
    fp8_keep_high_precision: tuple[str, ...] = DEFAULT_KEEP_HIGH_PRECISION
    fp8_options: tuple[str, ...] = ()
    fp8_all_gather: bool = False  # FSDP2 all-gathers the FP8 linears' weights in FP8
    fp8_count_every: int = 10  # steps between those that count FP8 saturation and underflow
    model: ModelArgs = field(default_factory=ModelArgs)
    # What the step guard does with a suspicious step (see trainer.health.guard).
    health_policy: str = "rollback"
    # Dense peak FLOP/s of one device for MFU; None: the datasheet table, or calibration on CPU.
    peak_flops: float | None = None
    faults: FaultPlan = field(default_factory=FaultPlan)
    # Every collective fails after this long instead of waiting forever (set explicitly: torch's
    # default differs between backends and versions).
    collective_timeout_s: float = 600.0
    watchdog: WatchdogPolicy = field(default_factory=WatchdogPolicy)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.replicas < 0:
            raise ValueError(
                f"--replicas must be 1 or more (0: ckptd's default), got {self.replicas}"
            )
        if self.ckpt_policy not in ("wait", "skip"):
            raise ValueError(f"--ckpt-policy must be wait or skip, got {self.ckpt_policy!r}")
        if self.ckpt_every < 0:
            raise ValueError(f"--ckpt-every must be 0 (never) or more, got {self.ckpt_every}")
        if not 1 <= self.seq_len <= self.model.max_seq_len:
            raise ValueError(
                f"--seq-len must be between 1 and {self.model.max_seq_len}, got {self.seq_len}"
            )
        if not self.run_id or "/" in self.run_id or self.run_id.startswith("."):
            raise ValueError(f"--run-id {self.run_id!r} must be a non-empty name without '/'")
        if self.health_policy not in health.POLICIES:
            raise ValueError(
                f"--health-policy {self.health_policy!r}: use one of {', '.join(health.POLICIES)}"
            )
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(
                f"--peak-flops must be a positive FLOP/s figure, got {self.peak_flops}"
            )
        if not self.collective_timeout_s > 0:
            raise ValueError(
                f"--collective-timeout-s must be positive, got {self.collective_timeout_s}"
            )
        if self.fp8_count_every < 1:
            raise ValueError(f"--fp8-count-every must be at least 1, got {self.fp8_count_every}")
        if self.fp8 != "none":
            recipe = make_recipe(self.fp8, self.fp8_options)
            if self.fp8_all_gather:
                check_all_gather(recipe)
        elif self.fp8_options or self.fp8_all_gather:
            raise ValueError("--fp8-option and --fp8-all-gather need --fp8 with a recipe")

    def to_json_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train a Llama-style model with FSDP2; run it under torchrun.",
    )
    p.add_argument("--run-id", required=True, help="name of the run (checkpoints and telemetry)")
    p.add_argument("--ckptd", help="HOST:PORT of ckptd; without it no checkpoint is saved")
    p.add_argument("--telemetry", help="HOST:PORT of the telemetry service")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--ckpt-every", type=int, default=TrainConfig.ckpt_every)
    p.add_argument(
        "--ckpt-policy",
        default=TrainConfig.ckpt_policy,
        choices=("wait", "skip"),
        help="a save requested while the previous one streams: wait for it, or skip this one",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=TrainConfig.replicas,
        help="copies of each node's part of a checkpoint, on distinct nodes (R; 1: none; "
        "default: ckptd's, 2 where there are 2 nodes or more)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--global-batch", type=int, default=TrainConfig.global_batch)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=ModelArgs.dim)
    model.add_argument("--n-layers", type=int, default=ModelArgs.n_layers)
    model.add_argument("--n-heads", type=int, default=ModelArgs.n_heads)
    model.add_argument("--n-kv-heads", type=int, default=ModelArgs.n_kv_heads)
    moe = p.add_argument_group("mixture of experts (every block, when --n-experts > 0)")
    moe.add_argument("--n-experts", type=int, default=0)
    moe.add_argument("--top-k", type=int, default=MoEArgs.top_k)
    moe.add_argument("--shared-experts", type=int, default=MoEArgs.n_shared)
    moe.add_argument("--capacity-factor", type=float, default=MoEArgs.capacity_factor,
                     help="0: never drop tokens")  # fmt: skip
    moe.add_argument("--moe-balance", default=MoEArgs.balance, choices=BALANCE_MODES)
    moe.add_argument("--expert-groups", type=int, default=MoEArgs.n_groups,
                     help="groups of consecutive experts (e.g. one per node)")  # fmt: skip
    moe.add_argument("--topk-groups", type=int, default=MoEArgs.topk_groups,
                     help="each token's experts come from at most this many groups")  # fmt: skip
    par = p.add_argument_group("parallelism (world = dp_replicate*dp_shard*cp*tp*pp)")
    defaults = ParallelConfig()
    for flag in ("dp-replicate", "dp-shard", "tp", "pp", "cp", "ep"):
        par.add_argument(f"--{flag}", type=int, default=getattr(defaults, flag.replace("-", "_")))
    par.add_argument("--pp-schedule", default=defaults.pp_schedule, choices=list(SCHEDULES))
    par.add_argument("--pp-microbatches", type=int, default=defaults.pp_microbatches)
    par.add_argument("--pp-stages-per-rank", type=int, default=defaults.pp_stages_per_rank)
    par.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 reduce")
    par.add_argument("--activation-checkpointing", action="store_true")
    par.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer block (FP8 needs it for its speed: its casts fuse); "
        "the first steps compile",
    )
    health.add_arguments(p)
    p.add_argument(
        "--fp8", default=TrainConfig.fp8, choices=RECIPE_CHOICES, help="FP8 recipe of the linears"
    )
    p.add_argument(
        "--fp8-keep-high-precision",
        type=lambda names: tuple(n for n in names.split(",") if n),
        default=TrainConfig.fp8_keep_high_precision,
        metavar="NAME,...",
        help="linears kept out of FP8, matched by dotted name parts "
        f"(default: {','.join(DEFAULT_KEEP_HIGH_PRECISION)})",
    )
    p.add_argument(
        "--fp8-option",
        dest="fp8_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change the recipe: forward_format, backward_format (e4m3|e5m2), amax_history_len, "
        "amax_compute (max|most_recent), margin, power_of_two_scales",
    )
    p.add_argument(
        "--fp8-all-gather",
        action="store_true",
        help="FSDP all-gathers the FP8 linears' weights in FP8 (not with mxfp8)",
    )
    p.add_argument(
        "--fp8-count-every",
        type=int,
        default=TrainConfig.fp8_count_every,
        metavar="N",
        help="count saturated and underflowed FP8 values on steps 1, 1+N, 1+2N, ... only (1: "
        "every step; counting costs a pass over each cast; default "
        f"{TrainConfig.fp8_count_every})",
    )
    return p


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Build the config; raises ValueError with a message naming the bad option."""
    moe = None
    if args.n_experts:
        moe = MoEArgs(
            n_experts=args.n_experts,
            top_k=args.top_k,
            n_shared=args.shared_experts,
            capacity_factor=args.capacity_factor,
            balance=args.moe_balance,
            n_groups=args.expert_groups,
            topk_groups=args.topk_groups,
        )
    model = ModelArgs(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        moe=moe,
    )
    # Every ParallelConfig field has the flag of the same name.
    fields = dataclasses.fields(ParallelConfig)
    parallel = ParallelConfig(**{f.name: getattr(args, f.name) for f in fields})
    return TrainConfig(
        run_id=args.run_id,
        ckptd=args.ckptd,
        telemetry=args.telemetry,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        ckpt_policy=args.ckpt_policy,
        replicas=args.replicas,
        resume=args.resume,
        seed=args.seed,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        lr=args.lr,
        parallel=parallel,
        log_every=args.log_every,
        fp8=args.fp8,
        fp8_keep_high_precision=args.fp8_keep_high_precision,
        fp8_options=tuple(args.fp8_options),
        fp8_all_gather=args.fp8_all_gather,
        fp8_count_every=args.fp8_count_every,
        model=model,
        health_policy=args.health_policy or TrainConfig.health_policy,
        peak_flops=args.peak_flops,
        faults=FaultPlan.parse(
            args.inject_sdc, args.inject_straggler, args.inject_loss_spike, args.inject_bad_device
        ),
        collective_timeout_s=TrainConfig.collective_timeout_s
        if args.collective_timeout_s is None
        else args.collective_timeout_s,
        watchdog=WatchdogPolicy(
            **{
                name: getattr(args, arg)
                for name, arg in (
                    ("min_s", "watchdog_min_s"),
                    ("factor", "watchdog_factor"),
                    ("heartbeat_s", "heartbeat_s"),
                )
                if getattr(args, arg) is not None
            }
        ),
    )
