"""The trainer's configuration: one dataclass, built from the options of trainer.options (the
command line over a job config file)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from scaletrain.errors import InvalidArgument
from scaletrain.names import check_run_id
from trainer import health, options
from trainer.fp8 import make_recipe
from trainer.fp8.fsdp import check_all_gather
from trainer.health.faults import FaultPlan
from trainer.health.watchdog import WatchdogPolicy
from trainer.model.llama import ModelArgs, RopeScaling
from trainer.model.moe import MoEArgs


def _default(dest: str) -> Any:
    """The default of option `dest`: declared once, in trainer.options."""
    return options.BY_DEST[dest].default


@dataclass(frozen=True)
class ParallelConfig:
    """How the job is laid out over its ranks (trainer/parallel/dims.py checks it fits)."""

    dp_replicate: int = _default("dp_replicate")
    dp_shard: int = _default("dp_shard")  # -1 takes every rank the other degrees leave
    tp: int = _default("tp")
    pp: int = _default("pp")
    cp: int = _default("cp")
    ep: int = _default("ep")  # borrowed from dp_shard x cp: must divide it
    pp_schedule: str = _default("pp_schedule")
    pp_microbatches: int = _default("pp_microbatches")
    pp_stages_per_rank: int = _default("pp_stages_per_rank")
    pp_first_stage_less_layers: int = _default("pp_first_stage_less_layers")
    pp_last_stage_less_layers: int = _default("pp_last_stage_less_layers")
    pp_layers_per_stage: tuple[str, ...] = _default("pp_layers_per_stage")
    mixed_precision: bool = False
    activation_checkpointing: bool = False
    compile: bool = False  # trainer/parallel/compile.py


@dataclass(frozen=True)
class TrainConfig:
    """What one run does; `from_args` builds it from trainer.options, where each field's meaning
    and default are declared (fields of the same name)."""

    run_id: str
    ckptd: str | None = None
    telemetry: str | None = None
    steps: int = _default("steps")
    ckpt_every: int = _default("ckpt_every")
    # Memory-only checkpoints every K steps (trainer.checkpoint.checkpointer); 0: none.
    mem_ckpt_every: int = _default("mem_ckpt_every")
    ckpt_policy: str = _default("ckpt_policy")
    replicas: int = _default("replicas")
    resume: bool = False
    resume_wait_s: float = _default("resume_wait_s")
    # A Hugging Face Llama directory a new run takes its weights from (trainer.interop.hf_import).
    init_from_hf: str = _default("init_from_hf")
    allow_config_change: bool = False
    seed: int = _default("seed")
    seq_len: int = _default("seq_len")
    global_batch: int = _default("global_batch")
    grad_accum_steps: int = _default("grad_accum_steps")
    lr: float = _default("lr")
    beta1: float = _default("beta1")
    beta2: float = _default("beta2")
    eps: float = _default("eps")
    weight_decay: float = _default("weight_decay")
    no_decay: tuple[str, ...] = _default("no_decay")
    max_grad_norm: float = _default("max_grad_norm")
    warmup_steps: int = _default("warmup_steps")
    decay: str = _default("decay")
    min_lr_ratio: float = _default("min_lr_ratio")
    decay_steps: int = _default("decay_steps")
    decay_fraction: float = _default("decay_fraction")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: str = _default("data")
    document_masking: bool = _default("document_masking")
    eval_data: str = _default("eval_data")
    eval_every: int = _default("eval_every")
    eval_batches: int = _default("eval_batches")
    corpus_bytes: int = _default("corpus_bytes")
    log_every: int = _default("log_every")
    fp8: str = _default("fp8")
    fp8_keep_high_precision: tuple[str, ...] = _default("fp8_keep_high_precision")
    fp8_options: tuple[str, ...] = ()
    fp8_all_gather: bool = False
    fp8_count_every: int = _default("fp8_count_every")
    # Refuse a linear whose shape does not fit the recipe instead of keeping it high precision.
    fp8_strict: bool = False
    model: ModelArgs = field(default_factory=ModelArgs)
    health_policy: str = _default("health_policy")
    check_reductions: bool = _default("check_reductions")
    quarantine: str = _default("quarantine")
    quarantine_after: int = _default("quarantine_after")
    # Dense peak FLOP/s of one device for MFU; None: the datasheet table, or calibration on CPU.
    peak_flops: float | None = None
    faults: FaultPlan = field(default_factory=FaultPlan)
    # Every collective fails after this long instead of waiting forever (set explicitly: torch's
    # default differs between backends and versions).
    collective_timeout_s: float = _default("collective_timeout_s")
    in_job_restarts: int = _default("in_job_restarts")
    watchdog: WatchdogPolicy = field(default_factory=WatchdogPolicy)
    # Every option's resolved value (trainer.options), kept in telemetry and in every checkpoint;
    # empty when built directly rather than from options.
    job: dict[str, options.Value] = field(default_factory=dict, compare=False)

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
        if self.mem_ckpt_every < 0:
            raise ValueError(f"--mem-ckpt-every must be 0 (off) or more, got {self.mem_ckpt_every}")
        if self.mem_ckpt_every and not self.ckptd:
            raise ValueError("--mem-ckpt-every needs --ckptd: memory checkpoints are kept by ckptd")
        if not 1 <= self.seq_len <= self.model.max_seq_len:
            raise ValueError(
                f"--seq-len must be between 1 and {self.model.max_seq_len}, got {self.seq_len}"
            )
        try:
            # The rule ckptd and telemetry apply, so a run id is refused here, not at a first save.
            check_run_id(self.run_id, options.BY_DEST["run_id"].where)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
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
        if self.resume_wait_s >= self.collective_timeout_s:
            # The other ranks wait for rank 0's answer in a collective.
            raise ValueError(
                f"--resume-wait-s ({self.resume_wait_s:g}) must be shorter than "
                f"--collective-timeout-s ({self.collective_timeout_s:g})"
            )
        if self.fp8_count_every < 1:
            raise ValueError(f"--fp8-count-every must be at least 1, got {self.fp8_count_every}")
        if self.document_masking and not self.data:
            raise ValueError(
                "--document-masking needs --data: prepared documents end with EOS, the built-in "
                "byte corpus has no document boundaries"
            )
        if self.eval_every and not self.eval_data:
            raise ValueError("--eval-every needs --eval-data (a prepared directory)")
        if self.fp8 != "none":
            recipe = make_recipe(self.fp8, self.fp8_options)
            if self.fp8_all_gather:
                check_all_gather(recipe)
        elif self.fp8_options or self.fp8_all_gather:
            raise ValueError("--fp8-option and --fp8-all-gather need --fp8 with a recipe")

    def to_json_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def parser() -> argparse.ArgumentParser:
    """The trainer's command line: every option of trainer.options, and --config."""
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train a Llama-style model with FSDP2; run it under torchrun. Options come "
        "from a job config file (--config) and the command line, which overrides the file.",
    )
    options.add_arguments(p)
    return p


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Build the config from the command line and its --config file; raises ValueError with a
    message naming the bad option or key."""
    return from_values(options.resolve(options.given(args), getattr(args, "config", None)))


def from_values(v: dict[str, options.Value]) -> TrainConfig:
    """The TrainConfig of resolved option values (trainer.options.resolve)."""
    moe = None
    if v["n_experts"]:
        moe = MoEArgs(
            n_experts=v["n_experts"],
            top_k=v["top_k"],
            hidden=v["moe_hidden"],
            n_shared=v["shared_experts"],
            capacity_factor=v["capacity_factor"],
            balance=v["moe_balance"],
            n_groups=v["expert_groups"],
            topk_groups=v["topk_groups"],
        )
    model = ModelArgs(
        dim=v["dim"],
        n_layers=v["n_layers"],
        n_heads=v["n_heads"],
        n_kv_heads=v["n_kv_heads"],
        vocab_size=v["vocab_size"],
        ffn_multiple_of=v["multiple_of"],
        ffn_dim_multiplier=v["ffn_dim_multiplier"] or None,
        max_seq_len=v["max_seq_len"],
        rope_theta=v["rope_theta"],
        rope_scaling=RopeScaling(
            v["rope_scaling"],
            v["rope_low_freq_factor"],
            v["rope_high_freq_factor"],
            v["rope_original_max_len"],
        )
        if v["rope_scaling"]
        else None,
        norm_eps=v["norm_eps"],
        moe=moe,
    )
    # Every ParallelConfig field, and every plain TrainConfig field, is the option of its name.
    parallel = ParallelConfig(**{f.name: v[f.name] for f in dataclasses.fields(ParallelConfig)})
    plain = {f.name: v[f.name] for f in dataclasses.fields(TrainConfig) if f.name in v}
    # An empty address or a zero peak is the file's way of saying none.
    unset = {name: v[name] or None for name in ("ckptd", "telemetry", "peak_flops")}
    return TrainConfig(
        **plain | unset | {"model": model},
        parallel=parallel,
        faults=FaultPlan.parse(
            v["inject_sdc"], v["inject_straggler"], v["inject_loss_spike"], v["inject_bad_device"]
        ),
        watchdog=WatchdogPolicy(v["watchdog_min_s"], v["watchdog_factor"], v["heartbeat_s"]),
        job=v,
    )
