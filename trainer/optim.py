"""AdamW with the usual parameter groups, and the learning-rate schedule.

Weight decay pulls weights towards zero; on a norm's gain, a bias or an embedding row that only
distorts them (GPT-2, Llama and TorchTitan leave them undecayed), so by default a parameter
whose name contains one of `no_decay` ("norm", "bias", "embeddings") gets none; an empty
`no_decay` decays every parameter, as the trainer did before it had the option.

The schedule is a multiplier of the peak LR by step (torch's LambdaLR, whose state a checkpoint
keeps, so a resumed run continues the same curve): linear warm-up over `warmup_steps` (the first
step runs at lr / warmup_steps), then until `decay_steps` (default: the run's steps)
- constant: the peak;
- linear: straight down to min_lr_ratio;
- cosine: half a cosine down to min_lr_ratio;
- wsd (warmup-stable-decay, MiniCPM): the peak, then straight down to min_lr_ratio over the last
  `decay_fraction` of the steps.
After `decay_steps` every curve stays where it ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from trainer.config import TrainConfig


def param_groups(model: nn.Module, no_decay: tuple[str, ...], weight_decay: float) -> list[dict]:
    """Two groups: parameters with `weight_decay`, and those without (see the module docstring).
    Names are the model's own (unparallelised), so every layout makes the same split."""
    decay, plain = [], []
    for name, param in model.named_parameters():
        (plain if any(part in name for part in no_decay) else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, cfg.no_decay, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )


def lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    """The schedule: step (0-based) -> multiplier of the peak LR."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio
    end = cfg.decay_steps or cfg.steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.decay == "constant":
            return 1.0
        if cfg.decay == "wsd":
            start = end - cfg.decay_fraction * (end - warmup)
            progress = min(1.0, max(0.0, (step - start) / max(1.0, end - start)))
            return 1.0 - (1.0 - floor) * progress
        progress = min(1.0, (step - warmup) / max(1, end - warmup))
        if cfg.decay == "linear":
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
