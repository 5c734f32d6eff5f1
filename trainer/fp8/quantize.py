"""Scaling and casting to FP8, block by block: the one quantization code every recipe and GEMM uses.

A 2-D tensor is cut into blocks of `block = (rows, cols)` elements; each block gets one scale. The
recipes differ only in the block shape and where the scale comes from:

- per tensor: one block the size of the whole tensor;
- 1 x 128 tiles (activations, gradients) and 128 x 128 blocks (weights): DeepSeek-V3's blockwise;
- 1 x 32 with a power-of-two scale: OCP MX (MXFP8), the scale stored as E8M0.

Quantizing multiplies each block by its scale `s` (chosen so the block's largest magnitude lands
at or under the format's maximum), clamps and casts. What is kept is the inverse, the
*dequantization* scale, because that is what `scaled_mm` takes: value ~= fp8 * (1 / s).

Nothing is silent: values that saturate (clamped at the format's maximum by more than rounding
would have moved them) and nonzero values that underflow to zero are counted into a
`QuantStats`, on the device, without synchronising.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.fp8.formats import Fp8Format

# The largest scale: E8M0 (MX's scale format) and fp32 both represent 2^127 and its inverse.
MAX_SCALE = 2.0**127
_EXPONENT_BITS = 0x7F800000
# What a QuantStats counts, in the order of its `totals`.
COUNTS = ("values", "saturated", "underflow")


@dataclass(frozen=True)
class Quantized:
    """An FP8 matrix and its dequantization scales: `dequantize()` gives back ~the source.

    `scale` has one fp32 entry per block: shape (rows // block[0], cols // block[1]).
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    fmt: Fp8Format

    def t(self) -> Quantized:
        """The transposed matrix, as views: a block of the source is a block of the transpose."""
        return Quantized(self.data.t(), self.scale.t(), (self.block[1], self.block[0]), self.fmt)

    def dequantize(self) -> torch.Tensor:
        """fp32 values: exact products of FP8 values and their block's scale."""
        rows, cols = self.data.shape
        br, bc = self.block
        blocks = self.data.float().reshape(rows // br, br, cols // bc, bc)
        return (blocks * self.scale.reshape(rows // br, 1, cols // bc, 1)).reshape(rows, cols)


class QuantStats:
    """Running counts of quantized, saturated and underflowed values (int64 tensors on a device).

    Counting never syncs with the host (`counts()` is the only call that reads the numbers back)
    and costs little: underflow is the drop in nonzero values from the source to its FP8 bytes
    (a cast never makes a zero nonzero), saturation is only counted where it can happen.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.totals = torch.zeros(3, dtype=torch.int64, device=device)

    def record(
        self, source: torch.Tensor, data: torch.Tensor, saturated: torch.Tensor | None
    ) -> None:
        """Count the cast of `source` to FP8 `data`, `saturated` of its values clipped."""
        self.totals[0] += source.numel()
        if saturated is not None:
            self.totals[1] += saturated
        magnitude_bits = data.view(torch.uint8) & 0x7F  # FP8 zero: every bit but the sign clear
        self.totals[2] += torch.count_nonzero(source) - torch.count_nonzero(magnitude_bits)

    def counts(self) -> dict[str, int]:
        return dict(zip(COUNTS, self.totals.tolist(), strict=True))


def check_blocks(shape: torch.Size | tuple[int, ...], block: tuple[int, int], what: str) -> None:
    """ValueError naming `what` unless a 2-D `shape` splits into whole `block`s."""
    if len(shape) != 2:
        raise ValueError(f"{what}: expected a 2-D matrix, got shape {tuple(shape)}")
    rows, cols = shape
    if rows % block[0] or cols % block[1]:
        raise ValueError(
            f"{what}: a {rows}x{cols} matrix does not split into {block[0]}x{block[1]} blocks "
            f"(each dimension must be divisible by the block size)"
        )


def oriented(extent: tuple[int, int], contract_dim: int) -> tuple[int, int]:
    """The (rows, cols) block of `extent` = (across, along) the contraction dimension."""
    across, along = extent
    return (across, along) if contract_dim == 1 else (along, across)


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = x.shape
    return x.reshape(rows // block[0], block[0], cols // block[1], block[1])


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest magnitude in each block, fp32, shape (rows // block[0], cols // block[1])."""
    return _blocks(x, block).abs().amax(dim=(1, 3)).float()


def floor_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= x, for positive normal fp32 x: exact (clears the mantissa)."""
    return (x.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)


def scale_for_amax(
    amax: torch.Tensor, fmt: Fp8Format, *, margin: int = 0, power_of_two: bool = False
) -> torch.Tensor:
    """The quantization scale that maps `amax` to `fmt.max / 2^margin` (never above 2^127).

    With `power_of_two` the scale is rounded down to a power of two, so dequantizing is exact and
    the largest value still does not saturate; for MX this is the E8M0 scale.
    """
    scale = (fmt.max * 2.0**-margin) / amax.float().clamp(min=fmt.max / MAX_SCALE)
    scale = scale.clamp(max=MAX_SCALE)
    return floor_power_of_two(scale) if power_of_two else scale


def quantize_with_scale(
    x: torch.Tensor,
    fmt: Fp8Format,
    block: tuple[int, int],
    scale: torch.Tensor,
    stats: QuantStats | None = None,
    *,
    may_saturate: bool = True,
) -> Quantized:
    """Cast 2-D `x` to `fmt` with the given per-block quantization `scale`, saturating at max.

    Values beyond the format's range are clipped and, with `stats`, counted; a caller whose
    scale comes from `x`'s own amax passes `may_saturate=False`, as nothing can clip then.
    """
    rows, cols = x.shape
    grid = (rows // block[0], 1, cols // block[1], 1)
    # The cast comes last, so `data` is a tensor of its own, never a view (torch.compile keeps
    # views of an autograd.Function's intermediates out of what it may save for backward).
    scaled = (_blocks(x, block).float() * scale.reshape(grid)).reshape(rows, cols)
    data = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    if stats is not None:
        clipped = scaled.abs() > fmt.saturation_threshold if may_saturate else None
        stats.record(x, data, None if clipped is None else torch.count_nonzero(clipped))
    return Quantized(data, scale.reshape(grid[0], grid[2]).reciprocal(), block, fmt)


def quantize(
    x: torch.Tensor,
    fmt: Fp8Format,
    block: tuple[int, int],
    *,
    power_of_two: bool = False,
    stats: QuantStats | None = None,
) -> Quantized:
    """Dynamic scaling: each block's scale comes from its own current amax, so nothing clips."""
    scale = scale_for_amax(block_amax(x, block), fmt, power_of_two=power_of_two)
    return quantize_with_scale(x, fmt, block, scale, stats, may_saturate=False)
