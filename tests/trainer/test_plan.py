"""`scaletrain plan` without a GPU: parameter counts of a meta-device build, per-rank memory
measured under FakeTensorMode that matches a real CPU run's peak, and layouts refused in one line
as `scaletrain run` refuses them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from scaletrain.app import cli
from scaletrain.app.plan import (
    AllToAll,
    Plan,
    _TransientPeak,
    all_to_all,
    expert_rows,
    measure,
    plan,
    render,
)
from trainer import options
from trainer.config import from_values
from trainer.model.llama import Transformer, next_token_loss
from trainer.optim import build_optimizer
from trainer.parallel.dims import validate_layout
from trainer.parallel.recompute import apply_activation_checkpointing


def job(**values: options.Value) -> dict[str, options.Value]:
    return options.resolve({"run_id": "plan", **values})


def measured_peak(values: dict[str, options.Value]) -> int:
    """Peak bytes of real steps (forward, backward, optimizer) in this process, on the CPU."""
    cfg = from_values(values)
    model = Transformer(cfg.model)
    if cfg.parallel.activation_checkpointing:
        apply_activation_checkpointing(model)
    optimizer = build_optimizer(model, cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.global_batch, cfg.seq_len + 1))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(2):  # the second step has optimizer state: a steady step
            next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()  # one step's module stats at a time (its peak stays)
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return peak["Total"]


@pytest.mark.parametrize(
    "shape",
    [
        {"preset": "debug"},
        {"preset": "debug", "n_layers": 6, "activation_checkpointing": True},
    ],
    ids=["debug", "debug-6-layers-recomputed"],
)
def test_plan_memory_is_within_15_percent_of_a_real_cpu_runs_peak(
    shape: dict[str, options.Value],
) -> None:
    values = job(**shape, global_batch=4)
    estimated = plan(values, world=1).memory["total"]
    real = measured_peak(values)
    assert abs(estimated / real - 1) < 0.15, (estimated, real)


def test_uniform_routing_allocates_what_a_real_routed_step_does() -> None:
    """Without a capacity factor every token's top_k copies are computed whatever the router
    chose, so the planning-only routing (fixed shapes under FakeTensorMode) must allocate what a
    real step with the data-dependent routing does on the CPU: its activations' peak and what
    its forward keeps for the backward."""
    cfg = from_values(job(preset="moe-small", global_batch=4))
    planned = measure(cfg, cfg.model.n_layers, 4, cfg.seq_len, torch.float32)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.seq_len + 1))
    tracker = _TransientPeak()
    tracker.track_external(model, optimizer)
    with tracker:
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        (forward,) = tracker.get_tracker_snapshot("current").values()
        loss.backward()
    named = {str(getattr(k, "value", k)): v for k, v in forward.items()}
    kept = sum(named.get(k, 0) for k in ("Activation", "Temp", "Buffer"))
    assert planned["transient"] == pytest.approx(tracker.transient, rel=0.01)
    assert planned["kept"] == pytest.approx(kept, rel=0.01)


def test_plan_counts_the_parameters_of_a_meta_device_build() -> None:
    values = job(preset="llama3-8b", seq_len=8192, global_batch=1, mixed_precision=True,
                 activation_checkpointing=True)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(from_values(values).model)
    assert plan(values, world=1).params == model.num_params(exclude_embedding=False)


def test_plan_shards_memory_over_the_layout_of_a_405b_job_on_16384_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The published layout: 126 layers, one fewer on the first and last of 16 stages.
    argv = ["plan", "--ranks", "16384", "--preset", "llama3-405b", "--tp", "8", "--pp", "16",
            "--pp-first-stage-less-layers", "1", "--pp-last-stage-less-layers", "1",
            "--pp-microbatches", "16", "--seq-len", "8192",
            "--global-batch", "2048", "--mixed-precision", "--activation-checkpointing",
            "--tokens-per-s", "2.2e6"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "16,384 ranks: dp_shard=128 tp=8 pp=16" in out
    # Every stage then weighs 8 blocks (the embedding and the head a block each): 1F1B's formula.
    assert "bubble        48.4%  (p-1)/(v*m+p-1)" in out and "on 16,384 x h200" in out
    # 128 layers split evenly leave the first and last stage a block heavier: a longer bubble.
    even = [arg for arg in argv if "less-layers" not in arg and arg != "1"] + ["--n-layers", "128"]
    assert cli.main(even) == 0
    assert "bubble        53.4%  1 - v*m*mean/((v*m+p-1)*max) over stages of 8..9 blocks" in (
        capsys.readouterr().out
    )
    assert "fits          yes: " in out and "of one h200" in out


def test_a_405b_stage_without_recomputation_does_not_fit_a_wide_models_activations_counted() -> (
    None
):
    """The issue's reading: at 405B width the total peaks at the end of the backward, where the
    blocks' activations are freed; a block's own peak (11.5 GiB in fp32 at b=1, s=8192), over 8
    blocks and 1F1B's 16 micro-batches in flight, is about 184 GiB a rank at TP 8. And under
    pipelining the stage's 8 blocks stay gathered, their gradients unsharded."""
    values = job(preset="llama3-405b", n_layers=128, tp=8, pp=16, pp_microbatches=16,
                 seq_len=8192, global_batch=2048)  # fmt: skip
    p = plan(values, world=16384)
    gib = 1 << 30
    assert 170 * gib < p.memory["activations"] < 220 * gib, p.memory
    # 8 blocks of 3.3 B parameters over TP 8, fp32: gathered, and their gradients whole.
    assert p.memory["fsdp all-gather buffers"] == p.memory["unsharded gradients"]
    assert 11 * gib < p.memory["unsharded gradients"] < 13 * gib
    assert "fits          no: " in render(p)


def test_plan_says_whether_the_busiest_rank_fits_one_device_with_headroom() -> None:
    """8B on one H200: fp32 weights, gradients and AdamW state take 120 GiB of its 131, more than
    it leaves once the caching allocator and NCCL have theirs, and the plan says by how much;
    sharded over 2, with 8,192-token sequences whose activations are recomputed, it fits."""
    values = job(preset="llama3-8b", seq_len=8192, global_batch=2, mixed_precision=True)
    recomputed = values | {"activation_checkpointing": True}
    alone = plan(recomputed | {"global_batch": 1}, world=1)
    (fits,) = [line for line in render(alone).splitlines() if line.startswith("fits")]
    over = -alone.spare / (1 << 30)
    assert fits == (
        f"fits          no: {alone.memory['total'] / (1 << 30):.2f} GiB of one h200's 131.3 GiB "
        f"(141 GB): over by {over:.2f} GiB once it leaves 11.5 GiB for the caching allocator's "
        "fragmentation (8%) and NCCL's buffers (1 GiB)"
    )
    assert 5 < over < 10
    assert alone.headroom == {"allocator fragmentation": 0.08 * 141e9, "nccl buffers": 1 << 30}
    two = plan(recomputed, world=2)
    assert "fits          yes: " in render(two)
    assert "GiB to spare" in render(two) and two.spare > 0
    assert "fits          unknown" in render(
        dataclasses.replace(two, gpu="tpu", device_memory=None)
    )


def test_a_target_that_needs_a_busy_pipeline_above_60_percent_mfu_is_flagged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The issue's example: 36% MFU with a 48% bubble is about 70% while busy."""
    argv = ["plan", "--ranks", "16384", "--preset", "llama3-405b", "--tp", "8", "--pp", "16",
            "--pp-first-stage-less-layers", "1", "--pp-last-stage-less-layers", "1",
            "--pp-microbatches", "16", "--seq-len", "8192", "--global-batch", "2048",
            "--mixed-precision", "--activation-checkpointing"]  # fmt: skip
    assert cli.main([*argv, "--tokens-per-s", "2.2e6"]) == 0
    assert "warning       that is 69% MFU while the pipeline is busy (its bubble idles 48%" in (
        capsys.readouterr().out
    )
    assert cli.main([*argv, "--tokens-per-s", "1.5e6"]) == 0
    assert "while the pipeline is busy" not in capsys.readouterr().out


def test_plan_states_what_it_assumed_and_warns_of_a_large_model_with_debug_defaults() -> None:
    shown = render(plan(job(preset="llama3-8b"), world=8))
    assert (
        "assumed       seq_len 128, global batch 16 (2 a data-parallel rank, 1 micro-batch(es) "
        "a step), fp32 (no --mixed-precision), activation checkpointing off"
    ) in shown
    assert "warning       a 8.03B model with the debug model's seq_len 128" in shown
    real = job(preset="llama3-8b", seq_len=8192, global_batch=8, mixed_precision=True)
    shown = render(plan(real | {"activation_checkpointing": True}, world=8))
    assert "seq_len 8192, global batch 8 (1 a data-parallel rank" in shown
    assert "bf16 mixed precision, activation checkpointing on" in shown
    assert "warning" not in shown
    assert "warning" not in render(plan(job(), world=2))  # the debug model itself


def moe_plan(world: int = 8, per_node: int = 8, **values: options.Value) -> Plan:
    """A plan of the small MoE (8 experts, top 2, 1 shared, dim 256, 4 layers)."""
    return plan(job(preset="moe-small", **values), world=world, per_node=per_node)


def test_routed_experts_per_ep_rank_halve_when_ep_doubles_and_are_not_split_by_tp() -> None:
    """8 experts of 3 x 256 x 256 over 4 layers: ep 2 keeps 4 a rank, ep 4 keeps 2. FSDP shards
    them over the other dp_shard / ep ranks, so what a rank holds between uses stays 1/8; they
    are whole on every tp rank (trainer/parallel/tensor.py), so tp 2 leaves them as they are."""
    expert = 3 * 256 * 256
    p = moe_plan(ep=2)
    two, four = p.moe, moe_plan(ep=4).moe
    assert two is not None and four is not None
    assert (two.per_ep_rank, four.per_ep_rank) == (4, 2)
    assert two.params_per_ep_rank == 4 * expert * 4 == 2 * four.params_per_ep_rank
    assert two.params_held == four.params_held == 8 * expert * 4 / 8
    # The measured states' expert share agrees with the count: fp32 parameters and gradients.
    assert two.memory_held["parameters"] == pytest.approx(4 * two.params_held)
    assert two.memory_held["gradients"] == pytest.approx(4 * two.params_held)
    split = moe_plan(world=16, ep=2, tp=2).moe
    assert split is not None and split.params_per_ep_rank == two.params_per_ep_rank
    assert split.params_held == two.params_held
    # A token computes with its top 2 of the 8 routed experts: 6N counts what it activates.
    assert p.active_params == p.params - p.embedding_params - 4 * 8 * expert * 3 // 4
    assert p.flops_per_token_6n == 6 * p.active_params


def test_uniform_routing_activations_grow_with_top_k() -> None:
    """Each token sends top_k copies through the experts: more copies, more activations (one
    block measured); the capacity factor caps the rows an expert computes as the trainer drops
    them."""
    transient = []
    for k in (1, 2, 4):
        cfg = from_values(job(preset="moe-small", top_k=k))
        transient.append(measure(cfg, 1, 1, cfg.seq_len, torch.float32)["transient"])
    assert transient[0] < transient[1] < transient[2], transient
    moe = from_values(job(preset="moe-small", top_k=4)).model.moe
    assert moe is not None and expert_rows(128, moe) == [64] * 8
    capped = dataclasses.replace(moe, capacity_factor=0.5)
    assert expert_rows(128, capped) == [32] * 8  # ceil(0.5 * 128 * 4 / 8)


def a2a(world: int = 8, per_node: int = 2, **values: options.Value) -> AllToAll:
    """The all-to-all of the small MoE's 4 layers, one micro-batch of 256 tokens a rank."""
    cfg = from_values(job(preset="moe-small", **values))
    moved = all_to_all(cfg, validate_layout(cfg, world), 256, 4, per_node)
    assert moved is not None
    return moved


def test_all_to_all_bytes_match_the_formula_worked_by_hand() -> None:
    """ep 4 over nodes of 2 ranks, 2 sequences of 128 tokens a rank, top 2, dim 256 in fp32:
    512 token copies of 1 KiB, 3/4 of them leaving the rank, in 4 all-to-alls a layer (dispatch
    and combine, forward and backward), over 4 layers; 1 of the 3 other ep ranks shares the
    node. Recomputing the forward adds its two; a capacity factor sends only the kept copies."""
    p = moe_plan(ep=4, global_batch=16, per_node=2)
    assert p.moe is not None and p.moe.all_to_all == a2a(ep=4, global_batch=16)
    a = p.moe.all_to_all
    assert a.per_layer == 4 * 512 * 1024 * 3 / 4 == 1_572_864
    assert a.per_step == 4 * a.per_layer
    assert (a.intra_node, a.inter_node) == (a.per_step / 3, a.per_step * 2 / 3)
    assert (a.ep_per_node, a.nodes) == (2, 2)
    assert a2a(ep=4, activation_checkpointing=True).per_layer == 6 * 512 * 1024 * 3 / 4
    # Each of the 8 experts keeps ceil(0.5 * 256 * 2 / 8) = 32 of its 64 copies.
    assert a2a(ep=4, capacity_factor=0.5).per_layer == 4 * (8 * 32) * 1024 * 3 / 4
    # bf16 halves the bytes; tp 2 puts half as many ep ranks on a node of 2 (ep ranks are tp
    # apart); ep 1 moves nothing.
    assert a2a(ep=4, mixed_precision=True).per_layer == a.per_layer / 2
    assert a2a(world=16, ep=4, tp=2).ep_per_node == 1
    cfg = from_values(job(preset="moe-small"))
    assert all_to_all(cfg, validate_layout(cfg, 8), 256, 4, 2) is None


def test_node_limited_routing_bounds_the_nodes_a_token_reaches() -> None:
    """ep 8 over 4 nodes of 2: top 2 reaches 2 nodes; from 1 of 4 groups (a group: 2 ep ranks,
    one node) a token's copies stay on 1 node, which halves what would cross nodes were each
    token sent once a node. Uniform routing's expected bytes do not change: this trainer sends
    every copy."""
    free = a2a(ep=8)
    limited = a2a(ep=8, expert_groups=4, topk_groups=1)
    assert (free.nodes_per_token, limited.nodes_per_token) == (2, 1)
    once = limited.inter_node_once_a_node
    assert once == free.inter_node_once_a_node / 2
    assert once == 4 * 256 * 1 * 1024 * 4  # 4 exchanges x 256 tokens x 1 node x 1 KiB x 4 layers
    assert limited.inter_node == free.inter_node
    # 2 of 4 groups: 2 nodes.
    assert a2a(ep=8, expert_groups=4, topk_groups=2).nodes_per_token == 2


def test_a_deepseek_v3_like_plan_on_2048_gpus_renders_in_seconds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """DeepSeek-V3's published layout: PP 16, EP 64 over nodes of 8, the rest data parallel
    (dp_shard 128); 61 layers in 16 stages, the first with one fewer and the last two fewer."""
    argv = ["plan", "--ranks", "2048", "--preset", "deepseek-v3-like", "--pp", "16", "--ep", "64",
            "--pp-first-stage-less-layers", "1", "--pp-last-stage-less-layers", "2",
            "--seq-len", "4096", "--global-batch", "15360", "--pp-microbatches", "120",
            "--mixed-precision", "--activation-checkpointing", "--tokens-per-s", "3e6"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2,048 ranks: dp_shard=128 pp=16 ep=64" in out
    assert "a token activates 37,754,336,256 (37.75B: top 8 of 256 routed experts)" in out
    assert "256 routed (top 8) and 1 shared a layer; 4 routed an EP rank" in out
    assert "4,096 tokens a micro-batch on every rank, at most 128 rows an expert" in out
    assert "a token's copies reach at most 4 of the 8 node(s)" in out
    assert "fits          yes: " in out
    assert "while the pipeline is busy" not in out
    # 6 x 32,768 copies x 7,168 bf16 x 63/64 a layer and micro-batch.
    assert "6 x 32,768 token copies x 14,336 B x (ep-1)/ep" in out


def test_an_moe_target_that_needs_a_busy_pipeline_above_60_percent_mfu_is_flagged() -> None:
    p = dataclasses.replace(moe_plan(ep=2, pp=2, global_batch=16), target_tokens_s=1.0)
    assert p.busy_mfu is not None and p.mfu is not None
    assert p.busy_mfu == pytest.approx(p.mfu / (1 - p.bubble))
    fast = dataclasses.replace(p, target_tokens_s=0.7 / p.busy_mfu)
    assert "warning       that is 70% MFU while the pipeline is busy" in render(fast)


def test_plan_refuses_a_layout_in_one_line_as_run_does(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--ranks", "16384", "--preset", "llama3-405b", "--tp", "8", "--pp", "16",
            "--global-batch", "2048"]  # fmt: skip
    assert cli.main(argv) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "n_layers 126 does not split into 16 equal stages" in line


def test_plan_tells_which_smaller_node_counts_an_elastic_job_can_continue_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 4 nodes of 2 ranks, tp 2 within each: 3 nodes leave 6 ranks, and a global batch of 8 does
    # not split over 3 data-parallel ranks; 2 nodes halve it, each rank running 2 micro-batches
    # of the full job's size; 1 node, 4 micro-batches.
    argv = ["plan", "--ranks", "8", "--ranks-per-node", "2", "--min-nodes", "1", "--preset",
            "debug", "--tp", "2", "--global-batch", "8"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("elastic       on fewer nodes (2 ranks a node)") :].splitlines()[1:]
    assert [line.split()[0] for line in table] == ["4", "3", "2", "1"]
    assert "dp_shard=4 tp=2; 1 micro-batch(es) a step" in table[0]
    assert "throughput ~1.00 of full" in table[0]
    assert "cannot run: global_batch 8 is not divisible by the data-parallel degree" in table[1]
    assert "dp_shard=2 tp=2; 2 micro-batch(es) a step" in table[2]
    assert "throughput ~0.50 of full" in table[2]
    assert "dp_shard=1 tp=2; 4 micro-batch(es) a step" in table[3]
    # The busiest rank's memory is that of the full job's micro-batch at every size (within the
    # optimizer state, which the fewer shards grow).
    gib = [float(line.split(" GiB a rank")[0].split()[-1]) for line in (table[0], table[3])]
    assert gib[1] >= gib[0]


def test_plan_refuses_a_min_nodes_the_job_cannot_have(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--ranks", "8", "--ranks-per-node", "2", "--min-nodes", "5"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "--min-nodes must be 1 to 4 (the job's nodes), got 5" in line


def test_the_old_flag_names_still_plan_with_a_one_line_notice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plan", "--gpus", "2", "--gpu", "h100", "--model", "debug"]) == 0
    captured = capsys.readouterr()
    assert "layout        2 ranks" in captured.out and "of one h100" in captured.out
    assert captured.err.splitlines() == [
        "scaletrain: --gpus is deprecated and goes in the next release: use --ranks",
        "scaletrain: --gpu is deprecated and goes in the next release: use --device",
        "scaletrain: --model is deprecated and goes in the next release: use --preset",
    ]


def test_a_plan_prints_as_json_with_its_elastic_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--ranks", "4", "--ranks-per-node", "2", "--min-nodes", "1", "--json"]
    assert cli.main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["world"] == 4 and shown["memory"]["total"] > 0 and shown["assumed"]
    assert [size["nodes"] for size in shown["elastic"]] == [2, 1]


def test_an_moe_plan_as_json_has_every_figure_and_says_which_are_measured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--preset", "moe-small", "--ranks", "8", "--ep", "4", "--ranks-per-node", "2",
            "--tokens-per-s", "1e5", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert set(shown["headroom"]) == {"allocator fragmentation", "nccl buffers"}
    assert shown["fits"] is True and shown["spare"] > 0 and shown["busy_mfu"] > 0
    assert shown["moe"]["all_to_all"]["per_step"] > 0
    assert "memory.activations" in shown["sources"]["measured"]
    assert "moe.all_to_all" in shown["sources"]["formula"]
    # Every figure the sources name is in the JSON.
    for figures in shown["sources"].values():
        for figure in figures:
            value = shown
            for key in figure.split("."):
                value = value[key]
            assert value is not None, figure
