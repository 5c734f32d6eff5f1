"""Counter-based initialisation: a parameter's initial value at each element is a function of
(seed, parameter name, element position) alone.

Why: a rank of a large model holds only its shards (rows, columns or blocks of a tensor, under
any DTensor placement, pipeline stage or expert split) and must initialise exactly those, without
generating the full tensor, while every layout still starts from weights bitwise equal to one
process's. A stateful generator (torch's Mersenne Twister, or Philox advanced by DTensor's RNG
tracker as in TorchTitan) gives values that depend on the order in which they were drawn, hence
on the layout. Here element i of parameter `name` is SplitMix64 in counter mode (Steele, Lea and
Flood 2014: the output stream is mix64(key + (i + 1) * gamma)), its 64 bits turned into a
standard normal by Box-Muller.

Bitwise equality needs more than a counter: torch's vectorised `log`/`cos` kernels may round
differently from the scalar loops that handle a chunk's tail, so a value would depend on where it
falls in a shard. The logarithm and cosine are therefore evaluated here with IEEE basic operations
alone (+, -, *, /, sqrt and the exact `frexp`, `round`, `where`), each its own kernel, so no
fused multiply-add differs between paths either: in float64, to ~1e-15, before rounding to the
parameter's dtype. Integer arithmetic wraps modulo 2^64 (two's complement int64), on CPU and CUDA.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

STD = 0.02
# Elements computed per pass: small enough that a pass's float64 temporaries stay in cache.
CHUNK = 1 << 16
# Projections back into the residual stream get the depth-scaled deviation (GPT-2's rule).
RESIDUAL_OUTPUTS = ("wo.weight", "w2.weight", ".w2")


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
_LN2 = math.log(2.0)
_TWO_PI = 2.0 * math.pi
_MANTISSA = (1 << 52) - 1
_SQRT2_MANTISSA = struct.unpack("<q", struct.pack("<d", math.sqrt(2.0)))[0] & _MANTISSA
# ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172 for m in [sqrt(1/2), sqrt(2)), and
# cos y, sin y / y for y in [-pi/4, pi/4], as series in s^2 and y^2 (Taylor), each to 1e-12:
# far below float32's resolution.
_ATANH = [1.0 / (2 * k + 1) for k in range(7)]
_COS = [(-1.0) ** k / math.factorial(2 * k) for k in range(7)]
_SIN = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(7)]


def parameter_key(seed: int, name: str) -> int:
    """The 64-bit key of parameter `name` (its unparallelised name) under `seed`."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def canonical_name(name: str) -> str:
    """`name` as the checkpoint spells it: without activation checkpointing's wrapper level."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def parameter_std(name: str, n_layers: int) -> float | None:
    """The normal deviation of parameter `name`; None for norm weights, which start at 1."""
    if name.endswith("norm.weight"):
        return None
    return STD / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_OUTPUTS) else STD


class _Workspace:
    """Preallocated buffers for one chunk: every operation writes into one of them (`out=` or
    in place), as a fresh allocation per operation costs more in page faults than the
    arithmetic."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.z, self.t, self.j, self.k = (
            torch.empty(n, dtype=torch.int64, device=device) for _ in range(4)
        )
        self.a, self.b, self.c, self.d, self.e, self.f, self.g = (
            torch.empty(n, dtype=torch.float64, device=device) for _ in range(7)
        )
        self.exponent = torch.empty(n, dtype=torch.int32, device=device)
        self.mask = torch.empty(n, dtype=torch.bool, device=device)

    def first(self, n: int) -> _Workspace:
        """The same buffers cut to their first n elements (for the last, shorter chunk)."""
        view = _Workspace.__new__(_Workspace)
        for name, buffer in vars(self).items():
            setattr(view, name, buffer[:n])
        return view


def _shift_right(z: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int64 `z` into `out` (torch's `>>` on int64 is arithmetic)."""
    return torch.bitwise_right_shift(z, bits, out=out).bitwise_and_((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor, t: torch.Tensor) -> None:
    """SplitMix64's finaliser, in place on `z` (`t`: scratch)."""
    z.bitwise_xor_(_shift_right(z, 30, t)).mul_(_MIX1)
    z.bitwise_xor_(_shift_right(z, 27, t)).mul_(_MIX2)
    z.bitwise_xor_(_shift_right(z, 31, t))


def _horner(x: torch.Tensor, coefficients: list[float], out: torch.Tensor) -> torch.Tensor:
    """sum_k coefficients[k] * x^k into `out`, one basic operation per kernel."""
    out.fill_(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out.mul_(x).add_(c)
    return out


def _log_radius(z: torch.Tensor, ws: _Workspace) -> torch.Tensor:
    """sqrt(-2 ln u1), u1 = ((z >> 32) + 1) / 2^32 in (0, 1], into ws.d (uses a, e, f, g, j,
    k, t). ln x = e ln 2 + ln m with x = m 2^e, m in [sqrt(1/2), sqrt(2)), read off x's bits."""
    x = ws.a.copy_(_shift_right(z, 32, ws.t).add_(1))  # an integer in [1, 2^32]: exact
    bits = x.view(torch.int64)
    mantissa = torch.bitwise_and(bits, _MANTISSA, out=ws.k)
    # 1 where m >= sqrt(2) (then m / 2 and e + 1), else 0.
    halve = _shift_right(torch.sub(mantissa, _SQRT2_MANTISSA, out=ws.j), 63, ws.t).neg_().add_(1)
    exponent = ws.e.copy_(torch.bitwise_right_shift(bits, 52, out=ws.j).add_(halve).sub_(1023))
    bits.copy_(mantissa.bitwise_or_(halve.neg_().add_(1023).bitwise_left_shift_(52)))
    s = torch.sub(x, 1.0, out=ws.d).div_(x.add_(1.0))
    series = _horner(torch.mul(s, s, out=ws.f), _ATANH, ws.g)
    log_u1 = s.mul_(series).mul_(2.0).add_(exponent.sub_(32.0).mul_(_LN2))
    return log_u1.mul_(-2.0).clamp_min_(0.0).sqrt_()


def _cos_turns(z: torch.Tensor, ws: _Workspace) -> torch.Tensor:
    """cos(2 pi u2), u2 = (z & (2^32 - 1)) / 2^32 in [0, 1), into ws.f (uses a, b, c, e, g, j,
    k, t; z is overwritten). The quarter turn q nearest u2 and the remainder are integers, so
    the reduction to y in [-pi/4, pi/4] is exact."""
    low = z.bitwise_and_(0xFFFF_FFFF)
    quarter = _shift_right(torch.add(low, 1 << 29, out=ws.k), 30, ws.k)  # in 0..4
    y = ws.c.copy_(low.sub_(torch.bitwise_left_shift(quarter, 30, out=ws.t))).mul_(_TWO_PI / 2**32)
    y2 = torch.mul(y, y, out=ws.e)
    cos, sin = _horner(y2, _COS, ws.f), _horner(y2, _SIN, ws.g).mul_(y)
    # cos(y + q pi/2) is cos y, -sin y, -cos y, sin y, cos y for q = 0..4; selecting by
    # multiplying with 0 and 1 and adding is exact.
    odd = ws.a.copy_(torch.bitwise_and(quarter, 1, out=ws.t))
    cos.mul_(torch.sub(odd, 1.0, out=ws.b).neg_()).add_(sin.mul_(odd))
    negative = _shift_right(torch.add(quarter, 1, out=ws.j), 1, ws.t).bitwise_and_(1)
    return cos.mul_(ws.a.copy_(negative).mul_(-2.0).add_(1.0))


def _standard_normal(key: int, index: torch.Tensor, ws: _Workspace) -> torch.Tensor:
    """Standard normal float64 values (in ws.d) of positions `index` of the stream `key`:
    Box-Muller on the two 32-bit halves of SplitMix64's output."""
    z = torch.add(index, 1, out=ws.z).mul_(_GAMMA).add_(key)
    _mix64(z, ws.t)
    radius = _log_radius(z, ws)
    return radius.mul_(_cos_turns(z, ws))


def standard_normal(key: int, index: torch.Tensor) -> torch.Tensor:
    """Standard normal float64 values of positions `index` (1-D int64) of the stream `key`."""
    return _standard_normal(key, index, _Workspace(index.numel(), index.device)).clone()


def local_indices(param: torch.Tensor) -> list[torch.Tensor]:
    """For each dimension, the global positions along it of this rank's shard of `param`.

    A DTensor's placements are applied in mesh order to each dimension's positions, with the
    placements' own splitting (torch.chunk semantics, uneven shards, FSDP2's strided shards
    under tensor parallelism), so the result is exactly what DTensor computes for the local tensor.
    """
    shape = tuple(param.shape)
    views = [
        torch.arange(n).view([-1 if i == d else 1 for i in range(len(shape))])
        for d, n in enumerate(shape)
    ]
    if isinstance(param, DTensor):
        mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
        assert coordinate is not None, "a parameter's mesh always contains its rank"
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard | _StridedShard):
                d = placement.dim
                views[d] = placement._select_split_tensor(
                    views[d],
                    mesh.size(mesh_dim),
                    coordinate[mesh_dim],
                    with_padding=False,
                    contiguous=False,
                    clone=False,
                )
    return [v.flatten() for v in views]


def fill_normal(
    local: torch.Tensor, shape: tuple[int, ...], indices: list[torch.Tensor], key: int, std: float
) -> None:
    """Write std * standard_normal(key, position) into every element of `local`, a shard of a
    tensor of `shape` whose element at local coordinates (i, j, ...) sits at (indices[0][i],
    indices[1][j], ...) of the full tensor; position is that element's row-major index there."""
    local_shape = [len(ix) for ix in indices]
    if list(local.shape) != local_shape:
        raise RuntimeError(f"local shard of shape {list(local.shape)}, positions for {local_shape}")
    full_strides, local_strides = _strides(shape), _strides(local_shape)
    device = local.device
    indices = [ix.to(device) for ix in indices]
    flat = local.view(-1)
    whole = _Workspace(min(CHUNK, flat.numel()), device)
    with torch.no_grad():
        for start in range(0, flat.numel(), CHUNK):
            n = min(CHUNK, flat.numel() - start)
            ws = whole.first(n)
            j = torch.arange(start, start + n, out=ws.j)
            position = ws.z.zero_()
            dims = zip(indices, local_shape, local_strides, full_strides, strict=True)
            for ix, size, local_stride, full_stride in dims:
                coordinate = torch.floor_divide(j, local_stride, out=ws.k).remainder_(size)
                position.add_(torch.index_select(ix, 0, coordinate, out=ws.t).mul_(full_stride))
            position = ws.j.copy_(position)
            flat[start : start + n].copy_(_standard_normal(key, position, ws).mul_(std))


def _strides(shape: list[int] | tuple[int, ...]) -> list[int]:
    """Row-major strides of a contiguous tensor of `shape`."""
    strides, stride = [], 1
    for n in reversed(shape):
        strides.insert(0, stride)
        stride *= n
    return strides


def init_parameters(module: nn.Module, seed: int, n_layers: int) -> None:
    """Initialise every parameter of `module` (whole, or this rank's shards) in place."""
    for name, param in module.named_parameters():
        name = canonical_name(name)
        local = param.to_local() if isinstance(param, DTensor) else param
        std = parameter_std(name, n_layers)
        if std is None:
            with torch.no_grad():
                local.fill_(1.0)
            continue
        fill_normal(local, tuple(param.shape), local_indices(param), parameter_key(seed, name), std)
