"""FP8 products: within the error their formats imply of the fp32 product, the same on every path,
and on the path the probe chose for this device, with the reason any faster one was refused."""

from __future__ import annotations

import pytest
import torch
from fp8_testing import error_bound, varied

from trainer.fp8 import gemm as gemm_paths
from trainer.fp8.gemm import GemmPath, _swizzled_e8m0, block_scaled_mm, run_path
from trainer.fp8.linear import _OPERANDS, Fp8Plan, Gemm
from trainer.fp8.quantize import quantize
from trainer.fp8.recipes import RECIPES, Fp8Recipe

M, K, N = 256, 512, 384


def _operands(recipe: Fp8Recipe, gemm: Gemm):
    """Sources a (M, K), b (K, N) and their FP8 casts as the recipe makes them for `gemm`."""
    a_role, b_role = _OPERANDS[gemm]
    a, b = varied(M, K, seed=1), varied(K, N, seed=2)
    casts = []
    for x, role, contract_dim in ((a, a_role, 1), (b, b_role, 0)):
        block = recipe.block(tuple(x.shape), role, contract_dim)
        fmt = recipe.format_of(role)
        casts.append(quantize(x, fmt, block, power_of_two=recipe.power_of_two_scales))
    return a, b, casts[0], casts[1]


def _paths_that_run(qa, qb) -> dict[GemmPath, torch.Tensor]:
    results = {}
    for path in GemmPath:
        try:
            results[path] = run_path(path, qa, qb, torch.float32)
        except (RuntimeError, ValueError):
            continue
    return results


@pytest.mark.parametrize("gemm", list(Gemm))
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=lambda r: r.name)
def test_an_fp8_product_is_within_the_bound_its_formats_imply_of_the_fp32_product(recipe, gemm):
    a, b, qa, qb = _operands(recipe, gemm)
    err_a = error_bound(a, qa, qa.fmt)
    err_b = error_bound(b, qb, qb.fmt)
    # |da||b| + |a||db| + |da||db|, plus fp32 accumulation over K terms.
    bound = err_a @ b.abs() + a.abs() @ err_b + err_a @ err_b
    bound += K * 2.0**-24 * (a.abs() @ b.abs())
    reference = a.double() @ b.double()
    results = _paths_that_run(qa, qb)
    assert GemmPath.EMULATED in results
    for path, y in results.items():
        assert torch.all((y.double() - reference).abs() <= bound.double()), path


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=lambda r: r.name)
def test_every_path_that_runs_gives_the_emulated_product_up_to_fp32_summation_order(recipe):
    _, _, qa, qb = _operands(recipe, Gemm.FORWARD)
    results = _paths_that_run(qa, qb)
    emulated = results.pop(GemmPath.EMULATED)
    assert results, "no real FP8 path ran on this device"
    atol = 2e-6 * emulated.abs().max().item()
    for path, y in results.items():
        torch.testing.assert_close(y, emulated, rtol=2e-6, atol=atol, msg=f"{path} differs")


def test_on_cpu_per_tensor_products_are_real_scaled_mm_and_blocks_run_row_wise_per_block():
    chosen = {}
    for name, recipe in RECIPES.items():
        plan = Fp8Plan(recipe)
        chosen[name] = {gemm: plan.resolve(gemm, "cpu", torch.float32) for gemm in Gemm}
    for name in ("tensorwise", "tensorwise-delayed"):
        for choice in chosen[name].values():
            # One real _scaled_mm either way: per tensor, or row-wise with the tensor's scale on
            # every row where this CPU's per-tensor kernel is oneDNN's slow reference one.
            assert choice.path in (GemmPath.SCALED_MM, GemmPath.ROWWISE_PER_BLOCK)
            if choice.path is GemmPath.ROWWISE_PER_BLOCK:
                assert "slower than emulation here" in choice.passed_over[GemmPath.SCALED_MM]
    blockwise = chosen["blockwise"]
    assert {c.path for c in blockwise.values()} == {GemmPath.ROWWISE_PER_BLOCK}
    refusal = blockwise[Gemm.FORWARD].passed_over[GemmPath.SCALED_MM]
    assert "Invalid scaling configuration" in refusal
    # One GEMM launch per 32 values of K is no FP8 speed-up anywhere: MX without MX hardware is
    # emulated exactly (powers of two times FP8 values are exact in fp32).
    mx = chosen["mxfp8"]
    assert {c.path for c in mx.values()} == {GemmPath.EMULATED}
    assert GemmPath.SCALED_MM in mx[Gemm.FORWARD].passed_over


def test_a_path_far_slower_than_emulation_is_passed_over_with_the_reason(monkeypatch):
    monkeypatch.setattr(gemm_paths, "_CHOICES", {})
    monkeypatch.setattr(gemm_paths, "_seconds", lambda product, a: next(timings))
    # On the small product: scaled_mm, emulation; then row-wise per block, emulation.
    timings = iter([0.5, 0.001, 0.001, 0.001])
    choice = Fp8Plan(RECIPES["tensorwise"]).resolve(Gemm.FORWARD, "cpu", torch.float32)
    assert choice.path is GemmPath.ROWWISE_PER_BLOCK
    assert choice.passed_over == {GemmPath.SCALED_MM: "runs, but 500x slower than emulation here"}


def test_mx_scales_are_laid_out_in_cublas_128x4_tiles():
    rows, cols = 256, 8
    exponents = torch.arange(rows * cols).reshape(rows, cols) % 200 - 100
    swizzled = _swizzled_e8m0(torch.exp2(exponents.float())).view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * (cols // 4) + c // 4
            offset = tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
            assert swizzled[offset] == exponents[r, c] + 127


def test_a_block_scaled_product_stays_inside_one_compiled_graph_and_computes_as_eager():
    """Block scaling needs `F.scaled_mm`; through the `block_scaled_mm` operator the product
    compiles whole, whatever the compiler makes of `F.scaled_mm` itself (checked with the
    scalings a CPU has)."""
    a, b = varied(M, K, seed=1), varied(K, N, seed=2)
    qa = quantize(a, RECIPES["tensorwise"].forward_format, tuple(a.shape))
    qb = quantize(b.t().contiguous(), RECIPES["tensorwise"].forward_format, (N, K)).t()

    def product(a_data, b_data, scale_a, scale_b):
        return block_scaled_mm(
            a_data, b_data, scale_a, "tensor", scale_b, "tensor", torch.float32, False
        )

    args = (qa.data, qb.data, qa.scale.reshape(()), qb.scale.reshape(()))
    compiled = torch.compile(product, fullgraph=True)  # raises at any graph break
    torch.testing.assert_close(compiled(*args), product(*args), rtol=0, atol=0)
    torch.testing.assert_close(product(*args), run_path(GemmPath.EMULATED, qa, qb, torch.float32))
