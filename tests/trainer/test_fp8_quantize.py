"""FP8 quantization: error bounds per recipe and format, counted saturation and underflow, the
advantage of fine scales around an outlier, power-of-two scales, and refused shapes."""

from __future__ import annotations

import pytest
import torch
from fp8_testing import error_bound, varied

from trainer.fp8.formats import E4M3, E5M2
from trainer.fp8.quantize import (
    QuantStats,
    block_amax,
    check_blocks,
    floor_power_of_two,
    quantize,
    quantize_with_scale,
    scale_for_amax,
)
from trainer.fp8.recipes import RECIPES, Role, make_recipe

FORMATS = [E4M3, E5M2]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=lambda r: r.name)
@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.name.lower())
def test_every_value_round_trips_within_half_a_step_of_its_format(recipe, role, fmt):
    x = varied()
    for contract_dim in (0, 1):
        block = recipe.block(tuple(x.shape), role, contract_dim)
        stats = QuantStats()
        q = quantize(x, fmt, block, power_of_two=recipe.power_of_two_scales, stats=stats)
        assert q.data.dtype == fmt.dtype and q.scale.shape == (256 // block[0], 512 // block[1])
        error = (q.dequantize() - x).abs()
        assert torch.all(error <= error_bound(x, q, fmt) * (1 + 2**-20))
        assert stats.counts()["saturated"] == 0


def test_a_delayed_scale_that_is_too_large_saturates_and_every_clipped_value_is_counted():
    x = varied()
    stale_amax = block_amax(x, tuple(x.shape)) / 8  # the history saw values 8x smaller
    scale = scale_for_amax(stale_amax, E4M3)
    stats = QuantStats()
    q = quantize_with_scale(x, E4M3, tuple(x.shape), scale, stats)
    clipped = int((x.abs() * scale > E4M3.saturation_threshold).sum())
    assert clipped > 100
    counts = stats.counts()
    assert (counts["values"], counts["saturated"]) == (x.numel(), clipped)
    assert q.dequantize().abs().max() == pytest.approx(E4M3.max / scale.item())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_values_that_underflow_to_zero_are_counted_exactly(fmt):
    x = varied()
    stats = QuantStats()
    q = quantize(x, fmt, tuple(x.shape), stats=stats)
    lost = int(((q.data.float() == 0) & (x != 0)).sum())
    assert stats.counts()["underflow"] == lost


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_one_outlier_costs_per_tensor_scaling_far_more_precision_than_blocks_or_mx(fmt):
    # The outlier is 64x beyond the format's normal range above the other values, so one scale
    # for the whole tensor pushes them below the smallest normal number.
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    normal_range = fmt.max / torch.finfo(fmt.dtype).tiny
    x[3, 5] = 64 * normal_range
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[3, 5] = False

    def error(block: tuple[int, int], power_of_two: bool) -> tuple[float, int]:
        stats = QuantStats()
        q = quantize(x, fmt, block, power_of_two=power_of_two, stats=stats)
        diff = (q.dequantize() - x)[rest]
        return float(diff.norm() / x[rest].norm()), stats.counts()["underflow"]

    per_tensor, lost_per_tensor = error((256, 256), False)
    blockwise, lost_blockwise = error((1, 128), True)
    mx, lost_mx = error((1, 32), True)
    assert per_tensor / blockwise > 10
    assert per_tensor / mx > 10
    assert lost_per_tensor > 100 * max(lost_blockwise, lost_mx, 1)


@pytest.mark.parametrize("name", ["blockwise", "mxfp8"])
def test_block_and_mx_scales_are_powers_of_two_and_mx_scales_are_exact_e8m0(name):
    recipe = make_recipe(name)
    x = varied()
    for role in Role:
        fmt = recipe.format_of(role)
        q = quantize(x, fmt, recipe.block(tuple(x.shape), role, 1), power_of_two=True)
        mantissa, _ = torch.frexp(q.scale)
        assert torch.all(mantissa == 0.5), "a scale is not a power of two"
        if name == "mxfp8":
            assert torch.equal(q.scale.to(torch.float8_e8m0fnu).float(), q.scale)


def test_per_tensor_scales_map_the_amax_onto_the_format_maximum():
    x = varied()
    for fmt in FORMATS:
        q = quantize(x, fmt, tuple(x.shape))
        assert q.data.float().abs().max() == fmt.max
        assert q.scale.item() == pytest.approx(x.abs().max().item() / fmt.max, rel=1e-6)


def test_rounding_a_scale_down_to_a_power_of_two_is_exact():
    values = torch.tensor([1.0, 1.5, 3.0, 448.0 / 3.7, 2.0**-100, 2.0**127])
    assert floor_power_of_two(values).tolist() == [1.0, 1.0, 2.0, 64.0, 2.0**-100, 2.0**127]


def test_an_all_zero_block_gets_a_finite_scale_and_stays_zero():
    x = torch.zeros(4, 64)
    x[0, :32] = 1.0
    q = quantize(x, E4M3, (1, 32), power_of_two=True)
    assert torch.all(torch.isfinite(q.scale)) and torch.equal(q.dequantize(), x)


def test_a_matrix_that_does_not_split_into_blocks_is_refused_with_its_shape():
    # MX blocks of an input along tokens (its weight-gradient GEMM): 100 tokens do not split.
    block = make_recipe("mxfp8").block((100, 128), Role.INPUT, contract_dim=0)
    with pytest.raises(ValueError, match=r"^x: a 100x128 matrix does not split into 32x1 blocks"):
        check_blocks((100, 128), block, "x")


def test_unknown_recipes_formats_and_options_are_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown fp8 recipe 'fp4'.*tensorwise-delayed"):
        make_recipe("fp4")
    with pytest.raises(ValueError, match=r"unknown FP8 format 'e3m4'.*e4m3, e5m2"):
        make_recipe("tensorwise", ["backward_format=e3m4"])
    with pytest.raises(ValueError, match=r"bad --fp8-option 'speed=11'.*amax_history_len"):
        make_recipe("tensorwise", ["speed=11"])
    with pytest.raises(ValueError, match="amax_history_len must be at least 1"):
        make_recipe("tensorwise-delayed", ["amax_history_len=0"])
    with pytest.raises(ValueError, match="mxfp8 scales are E8M0 powers of two"):
        make_recipe("mxfp8", ["power_of_two_scales=false"])


def test_recipe_options_change_formats_history_and_margin():
    recipe = make_recipe(
        "tensorwise-delayed",
        ["forward_format=e5m2", "backward_format=e4m3", "amax_history_len=4", "margin=2"],
    )
    assert (recipe.forward_format, recipe.backward_format) == (E5M2, E4M3)
    assert (recipe.amax_history_len, recipe.margin) == (4, 2)
