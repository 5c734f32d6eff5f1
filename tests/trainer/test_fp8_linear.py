"""The FP8 linear layer and model conversion: accuracy against nn.Linear, what stays in high
precision, refused shapes, delayed scaling's history, FP8 weights for FSDP all-gathers, and
what the run's log is told."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_testing import TINY, TinyTrainer, tiny_model
from torch import nn

from trainer.fp8 import convert_to_fp8, make_recipe
from trainer.fp8.convert import matches
from trainer.fp8.fsdp import Fp8ShardedWeight, Fp8Weight
from trainer.fp8.linear import Fp8Linear
from trainer.fp8.quantize import quantize
from trainer.fp8.recipes import RECIPES, Role
from trainer.model.llama import ModelArgs, Transformer

LINEARS_PER_BLOCK = 7  # wq, wk, wv, wo, w1, w2, w3


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm() / want.norm()).detach())


@pytest.mark.parametrize("name", list(RECIPES))
def test_an_fp8_linear_gives_the_output_and_gradients_of_nn_linear_within_fp8_error(name):
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 384, bias=True)
    x = torch.randn(2, 128, 256, generator=gen, requires_grad=True)
    grad_y = torch.randn(2, 128, 384, generator=gen)
    reference = F.linear(x, linear.weight, linear.bias)
    want = torch.autograd.grad(reference, (x, linear.weight, linear.bias), grad_y)

    model = nn.Sequential(linear)
    convert_to_fp8(model, make_recipe(name), keep_high_precision=())
    assert isinstance(model[0], Fp8Linear) and model[0].weight is linear.weight
    y = model(x)
    got = torch.autograd.grad(y, (x, linear.weight, linear.bias), grad_y)
    # E4M3 operands (2^-4 steps) make the output; an E5M2 gradient (2^-3 steps) the others.
    assert _relative(y, reference) < 0.04
    assert _relative(got[0], want[0]) < 0.08
    assert _relative(got[1], want[1]) < 0.08
    assert torch.allclose(got[2], want[2])


def test_conversion_keeps_the_head_and_named_layers_and_shares_fp32_parameters():
    model = Transformer(TINY)
    before = {name: p for name, p in model.named_parameters()}
    fp8 = convert_to_fp8(
        model, make_recipe("tensorwise"), keep_high_precision=("output", "layers.0")
    )
    assert isinstance(model.output, nn.Linear) and not isinstance(model.output, Fp8Linear)
    assert not any(isinstance(m, Fp8Linear) for m in model.layers["0"].modules())
    assert len(fp8.layers) == LINEARS_PER_BLOCK * (TINY.n_layers - 1)
    block_0 = [f"layers.0.attention.{w}" for w in ("wq", "wk", "wv", "wo")]
    block_0 += [f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")]
    assert fp8.kept == [*block_0, "output"]
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert all(p.dtype == torch.float32 for p in after.values())
    assert isinstance(model.tok_embeddings, nn.Embedding)


def test_master_weights_and_optimizer_state_stay_fp32_while_the_products_run_in_fp8():
    model, _ = tiny_model("tensorwise")
    trainer = TinyTrainer(model, steps=2)
    trainer.step()
    for param in model.parameters():
        state = trainer.optimizer.state[param]
        assert param.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_names_match_whole_dotted_parts_in_a_row():
    assert matches("layers.3.moe.router.gate", "router")
    assert matches("layers.3.feed_forward.w2", "feed_forward.w2")
    assert not matches("layers.3.feed_forward.w2", "w")
    assert not matches("layers.13.attention.wq", "layers.1")


def test_strict_fp8_names_a_layer_that_does_not_split_into_blocks_and_leaves_the_model():
    model = Transformer(ModelArgs(dim=128, n_heads=4, n_kv_heads=2))  # wk: 64 x 128
    with pytest.raises(
        ValueError,
        match=r"fp8 blockwise: layers\.0\.attention\.wk weight: a 64x128 matrix does not split "
        r"into 128x128 blocks .*--fp8-keep-high-precision layers\.0\.attention\.wk",
    ):
        convert_to_fp8(model, make_recipe("blockwise"), strict=True)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def test_linears_whose_shape_does_not_fit_the_recipe_stay_high_precision_and_are_listed():
    # wk, wv: 64 x 128; the feed-forward's hidden size 352 is no multiple of 128 either.
    model = Transformer(ModelArgs(dim=128, n_heads=4, n_kv_heads=2))
    fp8 = convert_to_fp8(model, make_recipe("blockwise"))
    unfit_parts = ("attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w2",
                   "feed_forward.w3")  # fmt: skip
    unfit = [f"layers.{i}.{part}" for i in range(4) for part in unfit_parts]
    assert fp8.unfit == unfit
    for name in unfit:
        assert type(model.get_submodule(name)) is torch.nn.Linear
    assert isinstance(model.get_submodule("layers.0.attention.wq"), Fp8Linear)
    assert "layers.3.attention.wv" in fp8.describe(torch.device("cpu"), torch.float32)


def test_training_on_a_token_count_that_does_not_split_into_blocks_names_the_layer():
    model, _ = tiny_model("blockwise")
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.wq input: a 96x128 matrix"):
        model(torch.zeros(1, 96, dtype=torch.long)).sum().backward()


def test_an_evaluation_pass_needs_no_whole_token_blocks_and_leaves_delayed_state_alone():
    model, fp8 = tiny_model("tensorwise-delayed")
    TinyTrainer(model, steps=2).step()
    before = {k: v.clone() for k, v in fp8.state_dict().items()}
    with torch.no_grad():
        logits = model(torch.arange(40).view(1, 40))  # 40 tokens: no gradient GEMM to split
    assert torch.isfinite(logits).all()
    assert not fp8.history.has_pending
    fp8.update()
    assert all(torch.equal(v, before[k]) for k, v in fp8.state_dict().items())


def test_delayed_scaling_starts_from_the_current_amax_then_uses_the_history_with_its_margin():
    linear = nn.Sequential(nn.Linear(64, 32, bias=False))
    fp8 = convert_to_fp8(linear, make_recipe("tensorwise-delayed", ["margin=1"]), ())
    history = fp8.history
    x = torch.full((16, 64), 2.0)
    amax = torch.tensor([[2.0]])
    # No history yet: the scale is the dynamic one (with the margin).
    assert history.scale(0, Role.INPUT, amax, fp8.recipe.forward_format).item() == 448.0 / 2 / 2
    linear(x).sum().backward()
    fp8.update()
    assert history.history[0, Role.INPUT, 0] == 2.0
    assert history.history[0, Role.GRAD_OUTPUT, 0] == 1.0  # d(sum)/dy
    assert history.history[0, Role.WEIGHT, 0] == linear[0].weight.abs().max()
    # Now the history decides, whatever the current tensor holds.
    scale = history.scale(0, Role.INPUT, torch.tensor([[100.0]]), fp8.recipe.forward_format)
    assert scale.item() == 448.0 / 2.0 / 2
    # Even for a tensor with no nonzero amax in its history: scale 1, never its own amax, so no
    # cast after the first step waits for a reduction over the tensor it casts.
    history.history[0, Role.INPUT].zero_()
    scale = history.scale(0, Role.INPUT, torch.tensor([[100.0]]), fp8.recipe.forward_format)
    assert scale.item() == 1.0


def test_the_history_keeps_the_last_steps_newest_first_and_takes_their_max_or_the_newest():
    for compute, used in (("max", 3.0), ("most_recent", 1.0)):
        linear = nn.Sequential(nn.Linear(16, 16, bias=False))
        fp8 = convert_to_fp8(
            linear,
            make_recipe("tensorwise-delayed", ["amax_history_len=3", f"amax_compute={compute}"]),
            (),
        )
        for amax in (5.0, 3.0, 2.0, 1.0):
            fp8.history.record(0, Role.INPUT, torch.tensor(amax))
            fp8.update()
        assert fp8.history.history[0, Role.INPUT].tolist() == [1.0, 2.0, 3.0]
        scale = fp8.history.scale(0, Role.INPUT, torch.tensor([[9.0]]), fp8.recipe.forward_format)
        assert scale.item() == pytest.approx(448.0 / used)


def test_delayed_scaling_under_torch_compile_records_the_same_history_as_eager():
    def two_steps(compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        # Two layers compiled apart, as a run compiles its blocks: the second's graph writes the
        # state the first's backward reads.
        linear = nn.Sequential(nn.Linear(128, 128, bias=False), nn.Linear(128, 128, bias=False))
        fp8 = convert_to_fp8(linear, make_recipe("tensorwise-delayed"), ())
        fp8.describe(torch.device("cpu"), torch.float32)  # resolves the GEMM paths, as a run does
        forward = nn.Sequential(*map(torch.compile, linear)) if compiled else linear
        for step in range(2):
            x = torch.randn(128, 128, generator=torch.Generator().manual_seed(step))
            forward(x).square().sum().backward()
            fp8.update()
        return fp8.history.history.clone()

    torch._dynamo.reset()
    eager, compiled = two_steps(False), two_steps(True)
    assert (eager[:, :, :2] > 0).all()  # input, weight and gradient amax of both steps
    assert torch.equal(compiled, eager)


def test_delayed_state_round_trips_through_its_state_dict_bitwise():
    model, fp8 = tiny_model("tensorwise-delayed")
    TinyTrainer(model, steps=2).losses(2)
    saved = {k: v.clone() for k, v in fp8.state_dict().items()}
    assert len(saved) == LINEARS_PER_BLOCK * TINY.n_layers
    _, fresh = tiny_model("tensorwise-delayed")
    fresh.load_state_dict(saved)
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(ValueError, match=r"missing \['layers\.0\.attention\.wq'\]"):
        fresh.load_state_dict({k: v for k, v in saved.items() if k != "layers.0.attention.wq"})


def test_the_run_is_told_each_products_path_and_the_counts_of_lost_values():
    model, fp8 = tiny_model("blockwise")
    TinyTrainer(model, steps=2).step()
    text = fp8.describe(torch.device("cpu"), torch.bfloat16)
    assert "14 linears in FP8, kept in high precision: output" in text
    assert "forward rowwise_per_block; scaled_mm refused: Invalid scaling configuration" in text
    counts = fp8.counts()
    assert counts["values"] > 0 and counts["saturated"] == 0
    assert "saturated 0.0000%" in fp8.summary()
    fp8.count_every = 5
    assert fp8.summary().endswith(" values cast (counted every 5 steps)")


def _train_counting(count_every: int, steps: int) -> tuple[list[float], list[int]]:
    """Losses, and values counted after each step, of the tiny delayed-scaling model."""
    model, fp8 = tiny_model("tensorwise-delayed")
    fp8.count_every = count_every
    trainer, losses, counted = TinyTrainer(model, steps), [], []
    for step in range(1, steps + 1):
        fp8.begin_step(step)
        losses.append(trainer.step())
        counted.append(fp8.counts()["values"])
    return losses, counted


def test_lost_values_are_counted_on_every_nth_step_only_and_counting_changes_no_value():
    every_losses, every_counted = _train_counting(1, 4)
    sampled_losses, sampled_counted = _train_counting(3, 4)
    assert sampled_losses == every_losses
    per_step = every_counted[0]
    assert every_counted == [per_step, 2 * per_step, 3 * per_step, 4 * per_step]
    assert sampled_counted == [per_step, per_step, per_step, 2 * per_step]  # steps 1 and 4


def test_a_count_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="fp8 count_every must be at least 1, got 0"):
        convert_to_fp8(Transformer(TINY), make_recipe("tensorwise"), count_every=0)


def test_mxfp8_weights_are_not_all_gathered_in_fp8_and_the_refusal_says_why():
    with pytest.raises(ValueError, match="fp8 mxfp8: weights are cast along each dimension"):
        tiny_model("mxfp8", all_gather=True)


def test_a_model_set_to_all_gather_fp8_weights_trains_alone_exactly_as_without():
    plain, _ = tiny_model("tensorwise-delayed")
    gathered, fp8 = tiny_model("tensorwise-delayed", all_gather=True)
    assert all(isinstance(layer.weight, Fp8ShardedWeight) for layer in fp8.layers.values())
    assert gathered.state_dict().keys() == plain.state_dict().keys()
    assert TinyTrainer(gathered, steps=3).losses(3) == TinyTrainer(plain, steps=3).losses(3)


def test_a_gathered_fp8_weight_is_its_fp8_matrix_to_the_linear_and_plain_values_to_other_ops():
    x = torch.randn(256, 128)
    q = quantize(x, RECIPES["blockwise"].forward_format, (128, 128), power_of_two=True)
    weight = Fp8Weight(q, torch.float32)
    assert weight.detach().quantized is q
    assert weight.view(256, 128).quantized is q
    assert torch.equal(weight * 1, q.dequantize())
