"""An H200's FP8 products on a CPU: what torch's CUDA `_scaled_mm` accepts, computed exactly.

A GPU is rarely at hand, and a refusal found only there costs a whole device session (the
blockwise backward products, for one: "Invalid scaling configuration", cuBLAS block scaling takes
E4M3 operands only). These stand-ins for `torch._scaled_mm` and `torch._scaled_mm_v2` (what
`F.scaled_mm` calls) refuse what torch refuses on sm90 with cuBLAS 12.9 (ScaledBlas.cpp:
`get_joint_scaling`, `check_deepseek_recipe`, `_check_deepseek_scale_stride`, cuBLASLt's
row-major-by-column-major rule), with its error text, and otherwise return the exact product of
the dequantized operands. With them a CPU plans every product as an H200 would: tests check that
each recipe's three products are single cuBLAS calls, and bench/fp8_traffic.py compiles steps
whose products are planned as on Hopper.

    install_on_cpu()   registers both as the CPU kernels of aten::_scaled_mm(_v2), for a whole
                       process (a benchmark); a test patches `torch._scaled_mm(_v2)` instead
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.fp8.formats import E4M3 as E4M3_FORMAT
from trainer.fp8.quantize import Quantized

ScalingType = F.ScalingType
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The (a, b) block scalings cuBLAS 12.9 multiplies on sm90: DeepSeek-V3's three products.
DEEPSEEK_PAIRS = {
    (ScalingType.BlockWise1x128, ScalingType.BlockWise128x128),
    (ScalingType.BlockWise128x128, ScalingType.BlockWise1x128),
    (ScalingType.BlockWise1x128, ScalingType.BlockWise1x128),
}
INVALID = "Invalid scaling configuration"


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_result: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """`torch._scaled_mm`: the scaling is read off the scales' shapes and strides."""
    _check_operands(a, b)
    for pair in [(ScalingType.TensorWise,) * 2, (ScalingType.RowWise,) * 2, *DEEPSEEK_PAIRS]:
        if _is_scaling(a, scale_a, pair[0]) and _is_scaling(b.t(), scale_b.t(), pair[1]):
            return _checked_product(a, b, scale_a, scale_b, pair, out_dtype or a.dtype)
    raise RuntimeError(f"{INVALID}.\n(fp8_hopper: no scaling of a and b matches their scales)")


def scaled_mm_v2(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: list[torch.Tensor],
    recipe_a: list[int],
    swizzle_a: list[int],
    scale_b: list[torch.Tensor],
    recipe_b: list[int],
    swizzle_b: list[int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    contraction_dim: list[int] = (),
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """`torch._scaled_mm_v2` (`F.scaled_mm`): the scalings are named, then checked."""
    _check_operands(a, b)
    if len(scale_a) != 1 or len(scale_b) != 1:
        raise RuntimeError(f"{INVALID} (fp8_hopper: one scale per operand only)")
    pair = (ScalingType(recipe_a[0]), ScalingType(recipe_b[0]))
    if ScalingType.BlockWise1x32 in pair or ScalingType.BlockWise1x16 in pair:
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED: MX block scaling needs sm100 (Blackwell)")
    if not (_is_scaling(a, scale_a[0], pair[0]) and _is_scaling(b.t(), scale_b[0].t(), pair[1])):
        raise ValueError(
            f"{INVALID}: scales of shapes {tuple(scale_a[0].shape)}, {tuple(scale_b[0].shape)} "
            f"and strides {scale_a[0].stride()}, {scale_b[0].stride()} are not {pair[0].name} x "
            f"{pair[1].name} of ({a.shape[0]}, {a.shape[1]}) x ({b.shape[0]}, {b.shape[1]})"
        )
    return _checked_product(a, b, scale_a[0], scale_b[0], pair, out_dtype or torch.bfloat16)


def install_on_cpu() -> torch.library.Library:
    """Both stand-ins as this process's CPU kernels of aten::_scaled_mm and _scaled_mm_v2, with
    their out= overloads (what compiled graphs call). Keep the returned library alive."""
    library = torch.library.Library("aten", "IMPL")
    for name, product in (("_scaled_mm", scaled_mm), ("_scaled_mm_v2", scaled_mm_v2)):
        library.impl(name, product, "CPU")
        library.impl(f"{name}.out", _with_out(product), "CPU")
    return library


def _with_out(product):
    def into(*args: object, out: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return out.copy_(product(*args, **kwargs))

    return into


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({a.shape} and {b.shape})")
    if a.dtype not in (E4M3, E5M2) or b.dtype not in (E4M3, E5M2):
        raise RuntimeError(f"Expected both matrices to be float8, got {a.dtype}, {b.dtype}")
    if a.dtype == b.dtype == E5M2:
        raise RuntimeError("Multiplication of two Float8_e5m2 matrices is not supported")
    if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
        raise RuntimeError(f"mat2 shape ({b.shape[0]}x{b.shape[1]}) must be divisible by 16")
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise RuntimeError(
            "Only multiplication of row-major and column-major matrices is supported by cuBLASLt"
        )


def _checked_product(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    pair: tuple[ScalingType, ScalingType],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if pair in DEEPSEEK_PAIRS and not a.dtype == b.dtype == E4M3:
        raise RuntimeError(f"{INVALID}: block scaling takes Float8_e4m3fn operands only")
    return (_dequantized(a, scale_a) @ _dequantized(b, scale_b)).to(out_dtype)


def _dequantized(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`data` times its scales, the block read off the scales' shape (whole blocks only, as the
    trainer's casts make them; the format is not needed to dequantize)."""
    scale = scale.float().reshape(1, 1) if scale.numel() == 1 else scale.float()
    block = (data.shape[0] // scale.shape[0], data.shape[1] // scale.shape[1])
    return Quantized(data, scale, block, E4M3_FORMAT).dequantize()


def _is_scaling(t: torch.Tensor, scale: torch.Tensor, scaling: ScalingType) -> bool:
    """torch's `is_desired_scaling`: does `scale` have the shape and strides `scaling` needs for
    operand `t` (b is checked transposed, as (N, K))?"""
    rows, cols = t.shape
    if scale.dtype != torch.float32:
        return False
    # pybind11 enums: a member made from its value is equal to, not identical with, the named one
    if scaling == ScalingType.TensorWise:
        return scale.numel() == 1
    if scale.dim() != 2:
        return False
    if scaling == ScalingType.RowWise:
        return tuple(scale.shape) == (rows, 1) and scale.is_contiguous()
    if scaling == ScalingType.BlockWise1x128:  # outer-dimension-major
        return _size_stride(scale, 0, rows, 1) and _size_stride(scale, 1, -(-cols // 128), rows)
    if scaling == ScalingType.BlockWise128x128:  # row-major
        blocks = -(-cols // 128)
        return _size_stride(scale, 0, -(-rows // 128), blocks) and _size_stride(scale, 1, blocks, 1)
    return False


def _size_stride(t: torch.Tensor, dim: int, size: int, stride: int) -> bool:
    """torch's `check_size_stride`: the stride of a dimension of size 1 does not matter."""
    return t.shape[dim] == size and (size == 1 or t.stride(dim) == stride)
