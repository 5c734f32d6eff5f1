"""The model and the parallel degrees validate their shapes before any work starts."""

from __future__ import annotations

import pytest
import torch

from trainer.checkpoint.digest import state_sha256
from trainer.config import TrainConfig
from trainer.model.llama import ModelArgs, Transformer
from trainer.model.moe import MoE, MoEArgs


def test_the_model_predicts_one_distribution_per_position():
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    model.init_weights(0)
    logits = model(torch.randint(0, 256, (2, 10)))
    assert logits.shape == (2, 10, 256)


def test_the_same_seed_gives_the_same_weights_and_another_seed_does_not():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    a, b, c = Transformer(args), Transformer(args), Transformer(args)
    a.init_weights(1), b.init_weights(1), c.init_weights(2)
    assert state_sha256(a.state_dict()) == state_sha256(b.state_dict())
    assert state_sha256(a.state_dict()) != state_sha256(c.state_dict())


def test_the_model_is_causal():
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    model.init_weights(0)
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    assert torch.equal(model(tokens)[0, :-1], model(changed)[0, :-1])


def test_rope_buffers_are_not_part_of_the_checkpoint():
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2))
    assert not any("rope" in name for name in model.state_dict())


def test_heads_that_do_not_divide_the_hidden_size_are_refused():
    with pytest.raises(ValueError, match="dim 100 is not divisible by n_heads 3"):
        ModelArgs(dim=100, n_heads=3, n_kv_heads=1)


def test_a_sequence_longer_than_the_model_allows_is_refused():
    with pytest.raises(ValueError, match="--seq-len must be between 1 and 1024"):
        TrainConfig(run_id="r", seq_len=4096)


def test_a_run_id_that_could_escape_the_store_is_refused():
    with pytest.raises(ValueError, match="--run-id"):
        TrainConfig(run_id="../etc")


def test_a_validation_forward_counts_no_expert_load_so_it_changes_no_later_step():
    model = Transformer(ModelArgs(moe=MoEArgs(n_experts=4, top_k=2)))
    model.init_weights(1)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    model.eval()
    with torch.no_grad():
        model(tokens)
    model.train()
    assert all(int(m.tokens_per_expert.sum()) == 0 for m in moes)
    model(tokens)
    assert all(int(m.tokens_per_expert.sum()) == 2 * 16 * 2 for m in moes)


def test_mfu_counts_the_routed_experts_a_token_is_sent_to_not_all_of_them():
    dense = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(dense)
    assert model.active_params() == model.num_params()
    moe = MoEArgs(n_experts=8, top_k=2, hidden=16)
    with torch.device("meta"):
        model = Transformer(ModelArgs(**{**vars(dense), "moe": moe}))
    experts = sum(
        sum(p.numel() for p in block.feed_forward.experts.parameters())
        for block in model.layers.values()
    )
    assert model.active_params() == model.num_params() - experts * 6 // 8
