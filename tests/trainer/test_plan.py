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
from scaletrain.app.plan import plan, render
from trainer import options
from trainer.config import from_values
from trainer.model.llama import Transformer, next_token_loss
from trainer.optim import build_optimizer
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
    [{"preset": "debug"}, {"preset": "debug", "n_layers": 6, "activation_checkpointing": True}],
    ids=["debug", "debug-6-layers-recomputed"],
)
def test_plan_memory_is_within_15_percent_of_a_real_cpu_runs_peak(
    shape: dict[str, options.Value],
) -> None:
    values = job(**shape, global_batch=4)
    estimated = plan(values, world=1).memory["total"]
    real = measured_peak(values)
    assert abs(estimated / real - 1) < 0.15, (estimated, real)


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
    it leaves once the caching allocator and NCCL have theirs; sharded over 2, with 8,192-token
    sequences whose activations are recomputed, it fits (69 GiB)."""
    values = job(preset="llama3-8b", seq_len=8192, global_batch=2, mixed_precision=True)
    recomputed = values | {"activation_checkpointing": True}
    alone = render(plan(recomputed | {"global_batch": 1}, world=1))
    assert "fits          no: " in alone
    assert "of the 119.8 GiB usable of one h200's 131.3 GiB" in alone
    assert "less 8% for the caching allocator's fragmentation and 1 GiB for NCCL's buffers" in alone
    two = plan(recomputed, world=2)
    assert "fits          yes: " in render(two)
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


def test_an_moe_plan_names_the_layout_it_found_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--preset", "moe-small", "--ranks", "4", "--ep", "2"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "above" not in line and "its layout on 4 ranks (dp_shard=4 ep=2) is valid" in line


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
