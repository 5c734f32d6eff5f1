"""A digest of model parameters that is the same whatever the parallel layout."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def state_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over (name, dtype, shape, bytes) of every tensor, in sorted name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def probe_logits_sha256(model: torch.nn.Module, vocab_size: int) -> str:
    """SHA-256 of the model's logits on a fixed probe sequence: the same bytes wherever the same
    parameters run the same arithmetic (every rank of a sharded model, or one plain process)."""
    device = next(iter(model.parameters())).device
    probe = (torch.arange(32, device=device) * 7 % vocab_size).view(1, 32)
    with torch.no_grad():
        logits = model(probe)
    return hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest()
