"""The pieces of each parallelism, checked in one process (no ranks started).

Ring attention's per-block forward and backward are run for every rank of a simulated ring and
reassembled; the MoE block's routing, capacity, balancing and dispatch permutation; the pipeline's
stage placement; the command line reaching every parallel option; and a whole training step on
the probe's one-process model.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from trainer.config import from_args, parser
from trainer.model.llama import CausalAttention, ModelArgs, Transformer
from trainer.model.moe import MoE, MoEArgs
from trainer.parallel.context import _pairs, backward_block, chunk_positions, forward_block
from trainer.parallel.expert import _source_major_to_expert_major, balance_experts
from trainer.parallel.pipeline import (
    bubble_formula,
    expected_bubble,
    split_into_stages,
    stage_indices,
    stage_layers,
    stage_sizes,
)
from trainer.parallel.probe import OneProcess
from trainer.step import train_step


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_blocks_reassemble_causal_attention_and_its_gradients(cp: int):
    torch.manual_seed(0)
    b, heads, kv_heads, seq, d = 2, 4, 2, 16, 8
    q = torch.randn(b, heads, seq, d, requires_grad=True)
    k = torch.randn(b, kv_heads, seq, d, requires_grad=True)
    v = torch.randn(b, kv_heads, seq, d, requires_grad=True)
    expected = CausalAttention()(q, k, v)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)

    positions = [chunk_positions(seq, cp, r) for r in range(cp)]
    blocks = [torch.stack([k[:, :, p], v[:, :, p]]).detach() for p in positions]
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dkv = torch.zeros(2, b, kv_heads, seq, d)
    for rank, mine in enumerate(positions):
        q_local, dout = q[:, :, mine].detach(), grad_out[:, :, mine]
        o, lse = torch.zeros_like(q_local), torch.full(q_local.shape[:-1], float("-inf"))
        for src in range(cp):
            forward_block(q_local, blocks[src], rank, src, cp, o, lse)
        delta, dq_local = (dout * o).sum(dim=-1), torch.zeros_like(q_local)
        for src in range(cp):
            grad = backward_block(q_local, blocks[src], dout, lse, delta, rank, src, cp, dq_local)
            dkv[:, :, :, positions[src]] += grad
        out[:, :, mine], dq[:, :, mine] = o, dq_local

    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dq, q.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dkv[0], k.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dkv[1], v.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_head_tail_chunks_give_every_rank_the_same_causal_work_at_every_ring_step(cp: int):
    covered = set()
    for step in range(cp):
        work = set()
        for rank in range(cp):
            src = (rank - step) % cp
            pairs = _pairs(rank, src, cp, local_seq=4)
            # A causal (diagonal) half-block costs half a full one.
            work.add(sum(0.5 if causal else 1.0 for _, _, causal in pairs))
            q_chunks, k_chunks = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
            for qs, ks, _ in pairs:
                covered.add((q_chunks[qs.start // 2], k_chunks[ks.start // 2]))
        assert work == {2.0}
    assert covered == {(qc, kc) for qc in range(2 * cp) for kc in range(qc + 1)}


def _moe(**options) -> MoE:
    torch.manual_seed(0)
    return MoE(dim=16, dense_hidden=32, args=MoEArgs(**options))


def test_a_full_expert_drops_the_tokens_beyond_its_capacity():
    moe = _moe(n_experts=4, top_k=1, capacity_factor=1.0, balance="none")
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[2] = 1.0  # every token prefers expert 2
    x = torch.rand(1, 12, 16) + 0.1
    out = moe(x)
    # Capacity ceil(1.0 * 12 tokens * 1 / 4 experts) = 3: nine tokens pass through no expert.
    assert moe.tokens_per_expert.tolist() == [0, 0, 3, 0]
    assert moe.tokens_dropped.item() == 9
    assert (out[0, :3].abs().sum(dim=-1) > 0).all() and (out[0, 3:] == 0).all()


def test_node_limited_routing_keeps_each_tokens_experts_in_its_best_groups():
    moe = _moe(n_experts=8, top_k=2, n_groups=4, topk_groups=1)
    _, experts, _ = moe.router(torch.randn(64, 16))
    # Groups of 2 experts, one group per token: both experts of a token share their group.
    assert (experts[:, 0] // 2 == experts[:, 1] // 2).all()
    unlimited = _moe(n_experts=8, top_k=2)
    _, free, _ = unlimited.router(torch.randn(64, 16))
    assert not (free[:, 0] // 2 == free[:, 1] // 2).all()


def test_the_auxiliary_loss_adds_gradient_without_changing_the_output():
    x = torch.randn(2, 8, 16)
    plain, balanced = _moe(balance="none"), _moe(balance="aux_loss", aux_loss_coef=1.0)
    out_plain, out_balanced = plain(x), balanced(x)
    assert torch.equal(out_plain, out_balanced)
    out_plain.sum().backward(), out_balanced.sum().backward()
    gate_plain, gate_balanced = plain.router.gate.weight.grad, balanced.router.gate.weight.grad
    assert not torch.allclose(gate_plain, gate_balanced)
    torch.testing.assert_close(plain.experts.w1.grad, balanced.experts.w1.grad)


def test_rows_received_by_source_are_regrouped_by_local_expert():
    # counts[source, expert]: 2 sources sent rows to 3 local experts.
    counts = torch.tensor([[1, 0, 2], [2, 1, 0]])
    # Received rows: s0e0 | s0e2 s0e2 | s1e0 s1e0 | s1e1  ->  e0: s0, s1, s1 | e1: s1 | e2: s0, s0
    assert _source_major_to_expert_major(counts).tolist() == [0, 3, 4, 5, 1, 2]


def test_aux_free_balancing_favours_the_experts_that_got_fewer_tokens():
    model = Transformer(
        ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, moe=MoEArgs(n_experts=4))
    )
    moe = model.layers["0"].feed_forward
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 4.0, 2.0]))
    load = balance_experts(model, None)
    assert load is not None and load.per_layer == {"0": [10, 0, 4, 2]}
    assert load.imbalance == pytest.approx(10 / 4)
    assert torch.sign(moe.router.expert_bias).tolist() == [-1.0, 1.0, 0.0, 1.0]
    assert moe.tokens_per_expert.sum() == 0


def test_looped_schedules_deal_stages_round_robin_and_v_schedules_fold_them():
    assert [stage_indices("Interleaved1F1B", r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_indices("ZBVZeroBubble", r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [stage_indices("1F1B", r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]


def test_a_pipeline_rank_keeps_only_its_stages_under_their_original_names():
    model = Transformer(ModelArgs(dim=16, n_layers=4, n_heads=2, n_kv_heads=1))
    stages = split_into_stages(model, "ZBVZeroBubble", rank=0, pp=2, v=2, sizes=[1, 1, 1, 1])
    assert [(index, list(stage.layers)) for index, stage in stages] == [(0, ["0"]), (3, ["3"])]
    assert sorted(model.layers) == ["0", "3"]
    assert model.tok_embeddings is not None and model.output is not None
    looped = Transformer(ModelArgs(dim=16, n_layers=4, n_heads=2, n_kv_heads=1))
    split_into_stages(looped, "Interleaved1F1B", rank=1, pp=2, v=2, sizes=[1, 1, 1, 1])
    assert sorted(looped.layers) == ["1", "3"]
    assert looped.tok_embeddings is None and looped.output is not None
    assert "tok_embeddings.weight" not in looped.state_dict()


def test_the_bubble_formula_shrinks_with_micro_batches_and_interleaving():
    assert bubble_formula(4, 4) == pytest.approx(3 / 7)
    assert bubble_formula(4, 12) == pytest.approx(3 / 15)
    assert bubble_formula(4, 4, stages_per_rank=2) == pytest.approx(3 / 11)
    assert expected_bubble("Interleaved1F1B", 4, 4, 2) == pytest.approx(3 / 11)
    assert expected_bubble("ZBVZeroBubble", 4, 4, 2) is None


def test_every_parallel_option_reaches_the_trainer_config_from_the_command_line():
    cfg = from_args(parser().parse_args([
        "--run-id", "r", "--dp-replicate", "2", "--dp-shard", "2", "--tp", "2", "--pp", "2",
        "--cp", "2", "--ep", "4", "--pp-schedule", "ZBVZeroBubble", "--pp-microbatches", "4",
        "--pp-stages-per-rank", "2", "--mixed-precision", "--activation-checkpointing",
        "--n-experts", "8", "--top-k", "2", "--shared-experts", "1", "--capacity-factor", "1.5",
        "--moe-balance", "aux_loss", "--expert-groups", "4", "--topk-groups", "2",
    ]))  # fmt: skip
    par, moe = cfg.parallel, cfg.model.moe
    assert (par.dp_replicate, par.dp_shard, par.tp, par.pp, par.cp, par.ep) == (2, 2, 2, 2, 2, 4)
    assert (par.pp_schedule, par.pp_microbatches, par.pp_stages_per_rank) == ("ZBVZeroBubble", 4, 2)
    assert par.mixed_precision and par.activation_checkpointing
    assert moe == MoEArgs(n_experts=8, top_k=2, n_shared=1, capacity_factor=1.5,
                          balance="aux_loss", n_groups=4, topk_groups=2)  # fmt: skip


def test_stages_split_evenly_or_with_fewer_blocks_where_the_embedding_and_head_sit():
    assert stage_sizes(8, 4) == [2, 2, 2, 2]
    # Llama 3 405B: 126 blocks on 16 stages, one fewer on the first and the last.
    assert stage_sizes(126, 16, 1, 1) == [7] + [8] * 14 + [7]
    assert stage_sizes(4, 2, explicit=("3", "1")) == [3, 1]
    assert stage_layers(1, [7, 8, 8]) == [str(i) for i in range(7, 15)]
    with pytest.raises(ValueError, match=r"n_layers 126 does not split into 16 equal stages; "
                       r"nearest valid n_layers: 112 or 128"):  # fmt: skip
        stage_sizes(126, 16)
    with pytest.raises(ValueError, match=r"with 1 fewer on the first and 0 on the last; nearest "
                       r"valid n_layers: 111 or 127"):  # fmt: skip
        stage_sizes(126, 16, 1, 0)
    with pytest.raises(ValueError, match=r"must give each of the 2 stages at least one block, 4"):
        stage_sizes(4, 2, explicit=("4", "0"))
    with pytest.raises(ValueError, match="expected whole numbers"):
        stage_sizes(4, 2, explicit=("a", "b"))


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_a_step_reports_its_loss_without_torchs_requires_grad_warning(grad_accum_steps: int):
    """The step's loss is reported from a detached tensor (`ParallelModel.mean_of`): float() of
    one that requires grad makes torch print "Consider using tensor.detach() first" on every
    rank of a normal run."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32))
    model.init_weights(0)
    tokens = torch.randint(0, 32, (2, 9))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # torch gives this warning once per process; another test may have had it already.
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train_step(
                OneProcess(model),
                optimizer,
                (tokens[:, :-1], tokens[:, 1:]),
                max_grad_norm=1.0,
                grad_accum_steps=grad_accum_steps,
            )
    finally:
        torch.set_warn_always(warn_always)
    assert math.isfinite(result.loss) and result.loss == pytest.approx(result.global_loss)
    assert [str(w.message) for w in caught] == []
