"""FP8 products as an H200 runs them, checked without one: torch's CUDA `_scaled_mm` acceptance
rules (bench/fp8_hopper.py) stand in for the GPU, so a layout cuBLAS would refuse fails here
rather than in the few minutes of a lent GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fp8_testing import SEQ_LEN, tiny_model, varied

from trainer.fp8 import gemm as gemm_paths
from trainer.fp8 import linear as fp8_linear
from trainer.fp8.gemm import GemmPath, PathChoice
from trainer.fp8.linear import Fp8Plan, Gemm
from trainer.fp8.quantize import quantize
from trainer.fp8.recipes import RECIPES, make_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fp8_hopper

CUBLAS_RECIPES = ("tensorwise", "tensorwise-delayed", "blockwise")


@pytest.fixture
def hopper(monkeypatch):
    """This test's FP8 products go through the H200 stand-ins, its paths probed afresh."""
    monkeypatch.setattr(torch, "_scaled_mm", fp8_hopper.scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm_v2", fp8_hopper.scaled_mm_v2)
    monkeypatch.setattr(gemm_paths, "_CHOICES", {})


def _choices(recipe, out_dtype=torch.bfloat16) -> dict[Gemm, PathChoice]:
    plan = Fp8Plan(recipe)
    return {gemm: plan.resolve(gemm, "cpu", out_dtype) for gemm in Gemm}


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", CUBLAS_RECIPES)
def test_on_an_h200_each_product_of_the_per_tensor_and_blockwise_recipes_is_one_cublas_call(
    hopper, name, out_dtype
):
    for gemm, choice in _choices(RECIPES[name], out_dtype).items():
        assert (choice.path, choice.passed_over) == (GemmPath.SCALED_MM, {}), gemm


def test_on_an_h200_blockwise_gradients_in_e5m2_would_be_refused_hence_the_e4m3_default(hopper):
    choices = _choices(make_recipe("blockwise", ["backward_format=e5m2"]))
    assert choices[Gemm.FORWARD].path is GemmPath.SCALED_MM
    for gemm in (Gemm.GRAD_INPUT, Gemm.GRAD_WEIGHT):
        assert choices[gemm].path is GemmPath.ROWWISE_PER_BLOCK
        assert "Float8_e4m3fn operands only" in choices[gemm].passed_over[GemmPath.SCALED_MM]


def test_on_an_h200_mxfp8_is_emulated_because_mx_scaling_needs_blackwell(hopper):
    for choice in _choices(RECIPES["mxfp8"]).values():
        assert choice.path is GemmPath.EMULATED
        assert "Blackwell" in choice.passed_over[GemmPath.SCALED_MM]


def test_the_h200_stand_in_refuses_scales_in_the_wrong_layout_and_says_which(hopper):
    a = quantize(varied(256, 512, seed=1), RECIPES["blockwise"].forward_format, (1, 128))
    b = quantize(varied(512, 256, seed=2), RECIPES["blockwise"].forward_format, (128, 128))
    data_b = b.data.t().contiguous().t()
    with pytest.raises(ValueError, match=r"Invalid scaling configuration.*BlockWise1x128"):
        F.scaled_mm(  # 1x128 scales row-major: cuBLAS reads them outer-dimension-major
            a.data,
            data_b,
            a.scale.contiguous(),
            F.ScalingType.BlockWise1x128,
            b.scale.t().contiguous().t(),
            F.ScalingType.BlockWise128x128,
        )
    with pytest.raises(RuntimeError, match="row-major and column-major"):
        torch._scaled_mm(a.data, b.data, a.scale[:1, :1], b.scale[:1, :1])


@pytest.mark.parametrize("name", CUBLAS_RECIPES)
def test_a_training_step_on_h200_products_computes_what_the_emulated_products_compute(
    hopper, monkeypatch, name
):
    inputs = torch.randint(0, 256, (2, SEQ_LEN))

    def gradients() -> dict[str, torch.Tensor]:
        model, _ = tiny_model(name)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1).float(), inputs.flatten()).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    on_hopper = gradients()
    assert {c.path for c in gemm_paths._CHOICES.values()} == {GemmPath.SCALED_MM}
    monkeypatch.setattr(fp8_linear, "choose_path", lambda kind: PathChoice(GemmPath.EMULATED, {}))
    emulated = gradients()
    for param, grad in emulated.items():
        torch.testing.assert_close(on_hopper[param], grad, rtol=1e-3, atol=1e-5, msg=param)
