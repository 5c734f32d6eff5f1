"""The trainer's configuration: one dataclass, parsed from the command line."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from trainer import health
from trainer.health.faults import FaultPlan
from trainer.model.llama import ModelArgs


@dataclass(frozen=True)
class TrainConfig:
    run_id: str
    ckptd: str | None = None
    telemetry: str | None = None
    steps: int = 300
    ckpt_every: int = 100
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
    model: ModelArgs = field(default_factory=ModelArgs)
    # What the step guard does with a suspicious step (see trainer.health.guard).
    health_policy: str = "rollback"
    # Dense peak FLOP/s of one device for MFU; None: the datasheet table, or calibration on CPU.
    peak_flops: float | None = None
    faults: FaultPlan = field(default_factory=FaultPlan)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
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
    health.add_arguments(p)
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
        resume=args.resume,
        seed=args.seed,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        lr=args.lr,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        log_every=args.log_every,
        model=model,
        health_policy=args.health_policy or TrainConfig.health_policy,
        peak_flops=args.peak_flops,
        faults=FaultPlan.parse(args.inject_sdc, args.inject_straggler, args.inject_loss_spike),
    )
