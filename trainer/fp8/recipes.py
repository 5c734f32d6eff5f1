"""FP8 recipes: which FP8 format each tensor gets, how finely it is scaled, and from what amax.

    tensorwise-delayed  one scale per tensor from a history of recent amax values (Transformer
                        Engine's original recipe): no reduction over the tensor before its cast
    tensorwise          one scale per tensor from its current amax (dynamic)
    blockwise           one scale per 1x128 tile of activations and gradients and per 128x128
                        block of weights, fp32 accumulation between blocks, E4M3 gradients
                        (DeepSeek-V3)
    mxfp8               one power-of-two (E8M0) scale per 32 contiguous values along the
                        contraction dimension (OCP Microscaling)

The block is always laid along the contraction dimension of the GEMM the tensor feeds, so a tensor
feeding two GEMMs over different dimensions (an activation: the forward over features, the weight
gradient over tokens) is quantized once per orientation; 128x128 weight blocks serve both.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from trainer.fp8.formats import E4M3, E5M2, Fp8Format, fp8_format
from trainer.fp8.quantize import oriented


class Granularity(enum.StrEnum):
    TENSOR = "tensor"
    BLOCK = "block"
    MX = "mx"


class Role(enum.IntEnum):
    """The three tensors of a linear layer that are cast to FP8 (and index its delayed state)."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


AMAX_COMPUTE = ("max", "most_recent")

# Smallest dimension multiple cuBLAS accepts for FP8 GEMMs; blocks are multiples of it.
TENSORWISE_MULTIPLE = 16


@dataclass(frozen=True)
class Fp8Recipe:
    name: str
    granularity: Granularity
    delayed: bool = False
    forward_format: Fp8Format = E4M3
    backward_format: Fp8Format = E5M2
    block_size: int = 0  # elements per scale along the contraction dimension (0: whole tensor)
    power_of_two_scales: bool = False
    amax_history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0  # delayed scaling leaves 2^margin of headroom below the format's maximum

    def __post_init__(self) -> None:
        if self.amax_history_len < 1:
            raise ValueError(
                f"fp8 amax_history_len must be at least 1, got {self.amax_history_len}"
            )
        if self.amax_compute not in AMAX_COMPUTE:
            raise ValueError(
                f"fp8 amax_compute must be one of {', '.join(AMAX_COMPUTE)}, "
                f"got {self.amax_compute!r}"
            )
        if self.margin < 0:
            raise ValueError(f"fp8 margin must be 0 or more, got {self.margin}")
        if self.granularity is Granularity.MX and not self.power_of_two_scales:
            raise ValueError("mxfp8 scales are E8M0 powers of two: power_of_two_scales must be on")

    @property
    def dimension_multiple(self) -> int:
        """Every dimension an FP8 GEMM contracts or produces must be a multiple of this."""
        return self.block_size or TENSORWISE_MULTIPLE

    def format_of(self, role: Role) -> Fp8Format:
        return self.backward_format if role is Role.GRAD_OUTPUT else self.forward_format

    def extent(self, role: Role) -> tuple[int, int] | None:
        """Values per scale (across, along) the contraction dimension; None for a whole tensor."""
        if self.granularity is Granularity.TENSOR:
            return None
        if self.granularity is Granularity.BLOCK and role is Role.WEIGHT:
            return (self.block_size, self.block_size)
        return (1, self.block_size)

    def scaling(self, role: Role) -> str:
        """The scaling of `role` as the GEMM paths name it: "tensor", "1x128", "128x128", ..."""
        extent = self.extent(role)
        return "tensor" if extent is None else f"{extent[0]}x{extent[1]}"

    def block(self, shape: tuple[int, int], role: Role, contract_dim: int) -> tuple[int, int]:
        """The block sharing one scale in a 2-D tensor of `role` contracted over `contract_dim`."""
        extent = self.extent(role)
        return shape if extent is None else oriented(extent, contract_dim)

    def describe(self) -> str:
        what = {
            Granularity.TENSOR: "per-tensor "
            + (f"delayed (amax history {self.amax_history_len}, {self.amax_compute})"
               if self.delayed else "dynamic"),
            Granularity.BLOCK: f"1x{self.block_size} activation / "
            f"{self.block_size}x{self.block_size} weight blocks",
            Granularity.MX: f"1x{self.block_size} blocks, E8M0 scales",
        }[self.granularity]  # fmt: skip
        pow2 = ", power-of-two scales" if self.power_of_two_scales else ""
        margin = f", margin {self.margin}" if self.margin else ""
        return (
            f"{self.name}: {what}, {self.forward_format.name} forward, "
            f"{self.backward_format.name} gradients{pow2}{margin}"
        )


RECIPES: dict[str, Fp8Recipe] = {
    r.name: r
    for r in (
        Fp8Recipe("tensorwise-delayed", Granularity.TENSOR, delayed=True),
        Fp8Recipe("tensorwise", Granularity.TENSOR),
        # Power-of-two block scales (as Transformer Engine's blockwise recipe) dequantize exactly.
        # Gradients in E4M3 as DeepSeek-V3 does: a 1x128 tile's own scale makes E5M2's range
        # unnecessary, and its extra mantissa bit matters (tiny model, 200 steps, 3 seeds: loss
        # +1.35% over bf16 with E5M2 gradients, -0.23% with E4M3).
        Fp8Recipe(
            "blockwise",
            Granularity.BLOCK,
            backward_format=E4M3,
            block_size=128,
            power_of_two_scales=True,
        ),
        Fp8Recipe("mxfp8", Granularity.MX, block_size=32, power_of_two_scales=True),
    )
}
RECIPE_CHOICES = ("none", *RECIPES)

# What `--fp8-option KEY=VALUE` may change, and how its value is read.
_OPTIONS = {
    "forward_format": fp8_format,
    "backward_format": fp8_format,
    "amax_history_len": int,
    "amax_compute": str,
    "margin": int,
    "power_of_two_scales": lambda v: {"true": True, "false": False}[v.lower()],
}


def make_recipe(name: str, options: tuple[str, ...] | list[str] = ()) -> Fp8Recipe:
    """The recipe `name` with `KEY=VALUE` overrides; ValueError naming any bad name or option."""
    if name not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {name!r}; valid recipes: {', '.join(RECIPE_CHOICES)}")
    changes: dict[str, object] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in _OPTIONS:
            raise ValueError(
                f"bad --fp8-option {option!r}: expected KEY=VALUE with KEY one of "
                f"{', '.join(_OPTIONS)}"
            )
        try:
            changes[key] = _OPTIONS[key](value)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"bad --fp8-option {option!r}: {exc}") from None
    return dataclasses.replace(RECIPES[name], **changes)
