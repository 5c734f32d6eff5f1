"""Activation checkpointing: keep each block's input, recompute its insides during backward.

Uses the composable `checkpoint`, which works by hooks, so module names (and checkpoint keys) stay
the same and FSDP, TP and the pipeline split compose with it unchanged.
"""

from __future__ import annotations

from torch.distributed._composable import checkpoint

from trainer.model.llama import Transformer


def apply_activation_checkpointing(model: Transformer) -> None:
    for block in model.layers.values():
        checkpoint(block)
