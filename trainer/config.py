"""The trainer's configuration: one dataclass, parsed from the command line."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from trainer.fp8 import DEFAULT_KEEP_HIGH_PRECISION, RECIPE_CHOICES, make_recipe
from trainer.fp8.fsdp import check_all_gather
from trainer.model.llama import ModelArgs


@dataclass(frozen=True)
class TrainConfig:
    run_id: str
    ckptd: str | None = None
    telemetry: str | None = None
    steps: int = 300
    ckpt_every: int = 100
    # What a save requested while the previous one still streams does: "wait" or "skip".
    ckpt_policy: str = "wait"
    resume: bool = False
    seed: int = 1234
    seq_len: int = 128
    global_batch: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    dp_replicate: int = 1
    dp_shard: int = -1
    corpus_bytes: int = 4 << 20
    log_every: int = 10
    # FP8 linears: a recipe of trainer.fp8 or "none", the linears kept in high precision by
    # name, and KEY=VALUE changes to the recipe (formats, amax history, margin).
    fp8: str = "none"
    fp8_keep_high_precision: tuple[str, ...] = DEFAULT_KEEP_HIGH_PRECISION
    fp8_options: tuple[str, ...] = ()
    fp8_all_gather: bool = False  # FSDP2 all-gathers the FP8 linears' weights in FP8
    model: ModelArgs = field(default_factory=ModelArgs)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
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
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--global-batch", type=int, default=TrainConfig.global_batch)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--dp-replicate", type=int, default=TrainConfig.dp_replicate)
    p.add_argument("--dp-shard", type=int, default=TrainConfig.dp_shard)
    p.add_argument("--dim", type=int, default=ModelArgs.dim)
    p.add_argument("--n-layers", type=int, default=ModelArgs.n_layers)
    p.add_argument("--n-heads", type=int, default=ModelArgs.n_heads)
    p.add_argument("--n-kv-heads", type=int, default=ModelArgs.n_kv_heads)
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
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
    return p


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Build the config; raises ValueError with a message naming the bad option."""
    model = ModelArgs(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads
    )
    return TrainConfig(
        run_id=args.run_id,
        ckptd=args.ckptd,
        telemetry=args.telemetry,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        ckpt_policy=args.ckpt_policy,
        resume=args.resume,
        seed=args.seed,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        lr=args.lr,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        log_every=args.log_every,
        fp8=args.fp8,
        fp8_keep_high_precision=args.fp8_keep_high_precision,
        fp8_options=tuple(args.fp8_options),
        fp8_all_gather=args.fp8_all_gather,
        model=model,
    )
