"""FP8 training: linear layers whose matrix products run in FP8 under a pluggable recipe.

recipes.py   the recipes (per-tensor delayed and dynamic, 1x128/128x128 blockwise, MXFP8)
formats.py   E4M3 and E5M2
quantize.py  block scales, the cast, saturation and underflow counts
delayed.py   amax histories of delayed scaling (replicated, checkpointed)
gemm.py      FP8 products: scaled_mm, row-wise per block, or exact emulation, chosen by probe
linear.py    the autograd function and the FP8 linear module
fsdp.py      FP8 weights for FSDP2 all-gathers
convert.py   swapping a model's linears, and the run's handle on them
"""

from trainer.fp8.convert import DEFAULT_KEEP_HIGH_PRECISION, Fp8Training, convert_to_fp8
from trainer.fp8.recipes import RECIPE_CHOICES, Fp8Recipe, make_recipe

__all__ = [
    "DEFAULT_KEEP_HIGH_PRECISION",
    "RECIPE_CHOICES",
    "Fp8Recipe",
    "Fp8Training",
    "convert_to_fp8",
    "make_recipe",
]
