"""Helpers shared by the FP8 tests: test tensors, error bounds, and the tiny training run."""

from __future__ import annotations

import torch

from trainer.fp8.formats import Fp8Format
from trainer.fp8.quantize import Quantized


def varied(rows: int = 256, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Normal values whose magnitude changes by up to 2^±6 from one 8x8 tile to the next."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-6, 7, (rows // 8, cols // 8), generator=gen).float()
    magnitude = torch.exp2(exponents).repeat_interleave(8, 0).repeat_interleave(8, 1)
    return torch.randn(rows, cols, generator=gen) * magnitude


def error_bound(x: torch.Tensor, q: Quantized, fmt: Fp8Format) -> torch.Tensor:
    """Worst round-to-nearest error per element of `x` cast as `q`: half a step relative in the
    normal range, half the smallest subnormal (in the block's units) below it."""
    br, bc = q.block
    inverse = q.scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return torch.maximum(x.abs() * fmt.relative_step / 2, inverse * fmt.min_subnormal / 2)
