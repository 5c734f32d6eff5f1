"""The two FP8 formats (OCP FP8: E4M3 and E5M2) and the figures the scaling code needs of each.

E4M3 keeps one more mantissa bit and has the range for activations and weights (max 448); E5M2
trades that bit for range (max 57344), which gradients need. The recipes pick one per direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float  # largest finite magnitude: a scaled value above it saturates
    min_subnormal: float  # smallest nonzero magnitude: a scaled value below half of it is lost
    mantissa_bits: int

    @property
    def relative_step(self) -> float:
        """Spacing of representable values relative to their magnitude (2^-mantissa_bits).

        Round-to-nearest is off by at most half of it for a value in the normal range: the error
        bound every round-trip and GEMM test derives from.
        """
        return 2.0**-self.mantissa_bits

    @property
    def saturation_threshold(self) -> float:
        """Magnitudes above this lose more than rounding when clamped to `max`: it is `max` plus
        half the spacing of values at the top of the range."""
        top_exponent = math.floor(math.log2(self.max))
        return self.max + 2.0 ** (top_exponent - self.mantissa_bits - 1)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-9, 3)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-16, 2)
FORMATS = {f.name: f for f in (E4M3, E5M2)}


def fp8_format(name: str) -> Fp8Format:
    """The format called `name`; ValueError naming the valid ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown FP8 format {name!r}; valid formats: {', '.join(FORMATS)}"
        ) from None
