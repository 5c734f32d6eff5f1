"""Activation checkpointing: keep each block's input, recompute its insides during backward.

Each block is wrapped with PyTorch's checkpoint wrapper (non-reentrant checkpointing). Its extra
name level (`_checkpoint_wrapped_module`) is removed from state dicts by the wrapper's hooks and by
torch's state-dict helpers, so checkpoint keys stay the unparallelised names. The composable
`checkpoint` API would keep names untouched but fails when a backward runs in two passes, as the
zero-bubble schedules' input- and weight-gradient passes do (torch 2.13).
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from trainer.model.llama import Transformer


def apply_activation_checkpointing(model: Transformer) -> None:
    for key, block in model.layers.items():
        model.layers[key] = checkpoint_wrapper(block)
