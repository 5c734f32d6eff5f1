"""A digest of model parameters that is the same whatever the parallel layout."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from trainer.model.llama import ModelArgs, Transformer


def state_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over (name, dtype, shape, bytes) of every tensor, in sorted name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def probe_logits_sha256(state: Mapping[str, torch.Tensor], args: ModelArgs) -> str:
    """SHA-256 of the logits that a plain, single-process model with these parameters gives on a
    fixed probe sequence: what anyone who loads the checkpoint with stock PyTorch will see."""
    model = Transformer(args)
    model.load_state_dict({name: tensor.cpu() for name, tensor in state.items()})
    probe = (torch.arange(32) * 7 % args.vocab_size).view(1, 32)
    with torch.no_grad():
        logits = model(probe)
    return hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()
