"""FP8 matrix products of `Quantized` operands, on the fastest path the device has.

Three paths compute the same product, `a.dequantize() @ b.dequantize()` accumulated in fp32:

- `scaled_mm`: one `torch.nn.functional.scaled_mm` call with the operands' own scaling (per
  tensor everywhere, 1x128/128x128 blockwise on Hopper, MX 1x32 on Blackwell);
- `rowwise_per_block`: one row-wise `scaled_mm` per block of the contraction dimension, the
  partial products added in fp32 (DeepSeek-V3's promotion of the accumulator every 128 values):
  real FP8 products wherever row-wise scaling runs but block scaling does not (the CPU), for
  blocks of 128 and more;
- `emulated`: dequantize both operands exactly to fp32 and multiply; the fallback anywhere.

Which path serves a kind of product is decided once per process by a probe: each candidate runs
on a small product of that kind and must match the emulated result; the first that does is used.
A refused configuration ("Invalid scaling configuration"), a wrong answer, or a path far slower
than emulation moves on to the next. (oneDNN 3.12 multiplies E4M3 by E4M3 per tensor with its
reference kernel on CPUs with AVX10.1 and AMX: ~500x slower than dequantizing and multiplying in
fp32, while the row-wise product of the same operands is fast.) The decisions are kept with the
reason each faster path was passed over, for the run's log.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.fp8.formats import Fp8Format
from trainer.fp8.quantize import Quantized, oriented, quantize

ScalingType = F.ScalingType
SwizzleType = F.SwizzleType


class GemmPath(enum.StrEnum):
    SCALED_MM = "scaled_mm"
    ROWWISE_PER_BLOCK = "rowwise_per_block"
    EMULATED = "emulated"


@dataclass(frozen=True)
class GemmKind:
    """What decides the path of a product: its device, operand formats and scaling, output."""

    device: str
    a_format: Fp8Format
    b_format: Fp8Format
    a_scaling: str  # "tensor", "1x128", "128x128", "1x32": scales across x along contraction
    b_scaling: str
    out_dtype: torch.dtype
    fast_accum: bool = False


@dataclass(frozen=True)
class PathChoice:
    path: GemmPath
    passed_over: dict[str, str]  # faster path -> why it was not used


_CHOICES: dict[GemmKind, PathChoice] = {}
# A path this many times slower than emulation, timed on a SPEED_PROBE_SIZE cube, is passed over.
MAX_SLOWDOWN = 10.0
SPEED_PROBE_SIZE = 64
# Row-wise products per block pay one GEMM launch per block of K: worth it from 128 values on
# (DeepSeek-V3's accumulation interval), not for MX's 32.
MIN_BLOCK_PER_CALL = 128


def scaling_of(q: Quantized, contract_dim: int) -> str:
    """The scaling of `q` as named above: values per scale across x along the contraction."""
    if q.block == tuple(q.data.shape):
        return "tensor"
    return f"{q.block[1 - contract_dim]}x{q.block[contract_dim]}"


def run_path(
    path: GemmPath, a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False
) -> torch.Tensor:
    """a (M, K) @ b (K, N) on `path`, out in `out_dtype`."""
    if path is GemmPath.SCALED_MM:
        return _scaled_mm(a, b, out_dtype, fast_accum)
    if path is GemmPath.ROWWISE_PER_BLOCK:
        return _rowwise_per_block(a, b).to(out_dtype)
    return (a.dequantize() @ b.dequantize()).to(out_dtype)


@torch.compiler.disable
def choose_path(kind: GemmKind) -> PathChoice:
    """The fastest path that computes `kind` right, probed once per process."""
    if kind in _CHOICES:
        return _CHOICES[kind]
    a, b = _probe_operands(kind)
    expected = run_path(GemmPath.EMULATED, a, b, torch.float32)
    passed_over: dict[str, str] = {}
    for path in (GemmPath.SCALED_MM, GemmPath.ROWWISE_PER_BLOCK):
        if path is GemmPath.ROWWISE_PER_BLOCK and _contraction_block(kind) < MIN_BLOCK_PER_CALL:
            passed_over[path] = (
                f"one GEMM per {_contraction_block(kind)} values of K is slower than emulation"
            )
            continue
        try:
            slowdown = _slowdown(path, kind)
            if slowdown > MAX_SLOWDOWN:
                passed_over[path] = f"runs, but {slowdown:.0f}x slower than emulation here"
                continue
            got = run_path(path, a, b, kind.out_dtype, kind.fast_accum).float()
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            passed_over[path] = str(exc).strip().splitlines()[0][:160]
            continue
        if _agrees(got, expected, kind.out_dtype):
            _CHOICES[kind] = PathChoice(path, passed_over)
            return _CHOICES[kind]
        passed_over[path] = "ran, but its result differs from the fp32 reference"
    _CHOICES[kind] = PathChoice(GemmPath.EMULATED, passed_over)
    return _CHOICES[kind]


def _slowdown(path: GemmPath, kind: GemmKind) -> float:
    """How many times longer `path` takes than emulation on a small product of `kind` (best of
    three after a warm-up each); 0 where the small product is refused (the full probe decides)."""
    try:
        a, b = _probe_operands(kind, SPEED_PROBE_SIZE)
        seconds = _seconds(lambda: run_path(path, a, b, kind.out_dtype, kind.fast_accum), a)
    except (RuntimeError, ValueError, NotImplementedError):
        return 0.0
    return seconds / _seconds(lambda: run_path(GemmPath.EMULATED, a, b, kind.out_dtype), a)


def _seconds(product: Callable[[], torch.Tensor], a: Quantized) -> float:
    def sync() -> None:
        if a.data.device.type == "cuda":
            torch.cuda.synchronize()

    product()
    best = math.inf
    for _ in range(3):
        sync()
        start = time.perf_counter()
        product()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _contraction_block(kind: GemmKind) -> int:
    """Values of K one scale covers (0: the whole of K, per tensor)."""
    along = [int(s.split("x")[1]) for s in (kind.a_scaling, kind.b_scaling) if s != "tensor"]
    return min(along, default=0) or 1 << 30


def _agrees(got: torch.Tensor, expected: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Equal but for the accumulation order and the output's rounding (a few ulps of out_dtype,
    at least 2^-14 of the largest value: 256 fp32 partial sums may round differently)."""
    tolerance = max(4 * torch.finfo(out_dtype).eps, 2.0**-14)
    return torch.allclose(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max())


def _probe_operands(kind: GemmKind, size: int = 512) -> tuple[Quantized, Quantized]:
    """Random operands of `kind`, by default 512 a side: whole blocks and swizzle tiles for any
    recipe, and the four 128-blocks of K that cuBLAS's 128x128 scaling needs at least.

    Magnitudes vary by 2^-8..2^8 from one 16x16 tile to the next, so every block gets its own
    scale and a scale read from the wrong place shows in the product.
    """
    tile = 16
    gen = torch.Generator().manual_seed(0)
    operands = []
    for fmt, scaling, contract_dim in (
        (kind.a_format, kind.a_scaling, 1),
        (kind.b_format, kind.b_scaling, 0),
    ):
        exponents = torch.randint(-8, 9, (size // tile, size // tile), generator=gen)
        magnitude = torch.exp2(exponents.float()).repeat_interleave(tile, 0)
        values = torch.randn(size, size, generator=gen) * magnitude.repeat_interleave(tile, 1)
        block = _block_of(scaling, contract_dim, size)
        pow2 = scaling == "1x32"  # E8M0 holds only powers of two
        operands.append(quantize(values.to(kind.device), fmt, block, power_of_two=pow2))
    return operands[0], operands[1]


def _block_of(scaling: str, contract_dim: int, size: int) -> tuple[int, int]:
    if scaling == "tensor":
        return (size, size)
    across, along = (int(n) for n in scaling.split("x"))
    return oriented((across, along), contract_dim)


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous()


def _column_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


_BLOCK_SCALING = {
    "tensor": ScalingType.TensorWise,
    "1x128": ScalingType.BlockWise1x128,
    "128x128": ScalingType.BlockWise128x128,
    "1x32": ScalingType.BlockWise1x32,
}


def _scaled_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool
) -> torch.Tensor:
    """One scaled_mm call: a row-major, b column-major, scales in the layouts cuBLAS reads.

    Per-tensor products go through `torch._scaled_mm`, which torch.compile traces into its graph;
    block scalings need `F.scaled_mm`, called through the `block_scaled_mm` operator.
    """
    a_scaling, b_scaling = scaling_of(a, 1), scaling_of(b, 0)
    if a_scaling not in _BLOCK_SCALING or b_scaling not in _BLOCK_SCALING:
        raise ValueError(f"no scaled_mm scaling for {a_scaling} x {b_scaling}")
    if a_scaling == b_scaling == "tensor":
        return torch._scaled_mm(
            _row_major(a.data),
            _column_major(b.data),
            a.scale.reshape(()).float(),
            b.scale.reshape(()).float(),
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    scale_a, scale_b = a.scale, b.scale
    if a_scaling == "tensor":
        scale_a = scale_a.reshape(())
    elif a_scaling == "1x32":
        scale_a = _swizzled_e8m0(scale_a)
    else:  # 1x128 and 128x128 scales of a are read outer-dimension-major
        scale_a = _column_major(scale_a)
    if b_scaling == "tensor":
        scale_b = scale_b.reshape(())
    elif b_scaling == "1x32":
        scale_b = _swizzled_e8m0(scale_b.t())
    elif b_scaling == "128x128":
        scale_b = _column_major(scale_b)
    else:
        scale_b = _row_major(scale_b)
    return block_scaled_mm(
        _row_major(a.data),
        _column_major(b.data),
        scale_a,
        a_scaling,
        scale_b,
        b_scaling,
        out_dtype,
        fast_accum,
    )


@torch.library.custom_op("scaletrain::block_scaled_mm", mutates_args=())
def block_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    a_scaling: str,
    scale_b: torch.Tensor,
    b_scaling: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """`F.scaled_mm` of a (M, K) by b (K, N) with scalings named as `scaling_of` names them, MX
    scales swizzled: one opaque operator to torch.compile.

    An operator with a shape function stays in the compiled graph without the compiler tracing
    into `F.scaled_mm`, a Python function whose tracing depends on the scaling and the torch
    release; a graph break there would split every layer's graph three times under block scaling
    and keep the casts around each product out of the fused kernels.
    """
    swizzle = SwizzleType.SWIZZLE_32_4_4 if "1x32" in (a_scaling, b_scaling) else None
    return F.scaled_mm(
        a,
        b,
        scale_a,
        _BLOCK_SCALING[a_scaling],
        scale_b,
        _BLOCK_SCALING[b_scaling],
        swizzle_a=swizzle,
        swizzle_b=swizzle,
        output_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


@block_scaled_mm.register_fake
def _block_scaled_mm_shape(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    a_scaling: str,
    scale_b: torch.Tensor,
    b_scaling: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _swizzled_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """MX scales (rows, K/32) as E8M0 in cuBLAS's 128x4-tile layout ("32_4_4"), zero-padded.

    Inside a tile, row r = 32 i + j and column c go to offset 16 j + 4 i + c.
    """
    rows, cols = scale.shape
    padded_rows, padded_cols = 128 * math.ceil(rows / 128), 4 * math.ceil(cols / 4)
    e8m0 = torch.zeros(padded_rows, padded_cols, dtype=torch.float32, device=scale.device)
    e8m0[:rows, :cols] = scale
    tiles = e8m0.to(torch.float8_e8m0fnu).view(padded_rows // 128, 128, padded_cols // 4, 4)
    tiles = tiles.permute(0, 2, 1, 3).reshape(-1, 4, 32, 4).transpose(1, 2)
    return tiles.contiguous().flatten()


def _rowwise_per_block(a: Quantized, b: Quantized) -> torch.Tensor:
    """Sum over contraction blocks of row-wise scaled products, in fp32.

    Within one block of the contraction dimension every row of `a` has one scale and every
    column of `b` has one: exactly a row-wise scaled_mm.
    """
    rows, depth = a.data.shape
    step = a.block[1]
    if b.block[0] != step:
        raise ValueError(f"contraction blocks differ: {step} for a, {b.block[0]} for b")
    scale_a = a.scale.repeat_interleave(a.block[0], dim=0)  # (M, K / step)
    scale_b = b.scale.repeat_interleave(b.block[1], dim=1)  # (K / step, N)
    data_a, data_b = _row_major(a.data), _column_major(b.data)
    out = torch.zeros(rows, b.data.shape[1], dtype=torch.float32, device=a.data.device)
    for k in range(depth // step):
        part = slice(k * step, (k + 1) * step)
        out += torch._scaled_mm(
            data_a[:, part],
            data_b[part, :],
            scale_a[:, k : k + 1].contiguous(),
            scale_b[k : k + 1, :].contiguous(),
            out_dtype=torch.float32,
        )
    return out
