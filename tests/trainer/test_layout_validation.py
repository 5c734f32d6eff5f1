"""Every layout is checked before any process group exists; a bad one names what to change.

These run in the test process: no rank is ever started for a layout that cannot run.
"""

from __future__ import annotations

import dataclasses

import pytest

from trainer.config import ParallelConfig, TrainConfig
from trainer.model.llama import ModelArgs
from trainer.model.moe import MoEArgs
from trainer.parallel.dims import LayoutError, ParallelDims, elastic_accumulation, validate_layout

MODEL = ModelArgs(dim=64, n_layers=4, n_heads=8, n_kv_heads=4)


def _cfg(
    model: ModelArgs = MODEL, seq_len: int = 32, global_batch: int = 8, **parallel
) -> TrainConfig:
    return TrainConfig(
        run_id="r",
        seq_len=seq_len,
        global_batch=global_batch,
        model=model,
        parallel=ParallelConfig(**parallel),
    )


def test_data_parallel_shards_take_every_rank_the_other_degrees_leave():
    assert ParallelDims(4).dp_shard == 4
    assert ParallelDims(8, dp_replicate=2).dp_size == 8
    dims = ParallelDims(8, tp=2, pp=2)
    assert (dims.dp_shard, dims.dp_size) == (2, 2)


def test_hsdp_replicas_can_take_the_ranks_instead_so_that_a_lost_node_takes_a_replica():
    dims = ParallelDims(6, dp_replicate=-1, dp_shard=2)
    assert (dims.dp_replicate, dims.dp_shard) == (3, 2)
    assert ParallelDims(4, dp_replicate=-1, dp_shard=2).dp_replicate == 2
    with pytest.raises(LayoutError, match="dp_replicate and dp_shard are both -1: one at most"):
        ParallelDims(4, dp_replicate=-1)
    with pytest.raises(LayoutError, match=r"unchanged: dp_shard in \[1, 2, 4\] \(dp_replicate -1"):
        ParallelDims(4, dp_replicate=-1, dp_shard=3)


def test_every_composition_of_the_issue_is_a_valid_layout():
    moe = dataclasses.replace(MODEL, moe=MoEArgs(n_experts=4))
    for world, model, parallel in [
        (4, MODEL, {"dp_shard": 2, "tp": 2}),
        (4, MODEL, {"pp": 2}),
        (4, MODEL, {"cp": 2, "tp": 2}),
        (4, moe, {"ep": 2}),
        (8, MODEL, {"dp_shard": 2, "tp": 2, "pp": 2}),
        (8, MODEL, {"cp": 2, "tp": 2}),
        (8, moe, {"tp": 2, "pp": 2, "ep": 2}),
    ]:
        dims = validate_layout(_cfg(model, **parallel), world)
        assert dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp * dims.pp == world


def test_degrees_that_do_not_fill_the_world_say_which_dp_shard_fits():
    with pytest.raises(
        LayoutError,
        match=r"unchanged: dp_shard 2 \(or -1\) \(dp_replicate 2 x dp_shard 3 .* world size 4\)",
    ):
        ParallelDims(4, dp_replicate=2, dp_shard=3)


def test_degrees_that_do_not_divide_the_world_name_the_values_that_would():
    # The valid choices lead; the arithmetic follows.
    with pytest.raises(
        LayoutError,
        match=r"^the layout does not fit 4 ranks; valid with the others unchanged: tp in "
        r"\[1, 2, 4\] \(.*tp 3 x pp 1 must equal the world size 4\)$",
    ):
        ParallelDims(4, tp=3)
    with pytest.raises(LayoutError, match=r"unchanged: tp in \[1, 2, 4\] \(dp_replicate"):
        ParallelDims(8, tp=3, pp=2)


def test_expert_parallelism_must_divide_the_ranks_it_borrows():
    with pytest.raises(LayoutError, match=r"ep 3 does not divide dp_shard x cp = 4.*\[1, 2, 4\]"):
        ParallelDims(4, ep=3)
    with pytest.raises(LayoutError, match=r"ep 4 does not divide dp_shard x cp = 2"):
        ParallelDims(8, tp=2, pp=2, ep=4)
    assert ParallelDims(8, cp=2, tp=2, ep=4).ep == 4


def test_tensor_parallelism_must_split_whole_heads():
    model = dataclasses.replace(MODEL, n_heads=8, n_kv_heads=2)
    with pytest.raises(
        LayoutError,
        match=r"n_kv_heads 2 is not divisible by tp 4.*nearest valid n_kv_heads: 4; "
        r"valid tp for this model: \[1, 2\]",
    ):
        validate_layout(_cfg(model, tp=4), 4)


def test_a_sequence_must_split_into_load_balanced_context_chunks():
    with pytest.raises(
        LayoutError,
        match=r"seq_len 30 is not a multiple of 4 \(cp 2 x 2 .*\); nearest valid seq_len: 28 or 32",
    ):
        validate_layout(_cfg(seq_len=30, cp=2), 4)
    with pytest.raises(LayoutError, match=r"seq_len 36 is not a multiple of 8 .*tp 4.*32 or 40"):
        validate_layout(_cfg(seq_len=36, cp=2, tp=4), 8)


def test_the_global_batch_must_split_over_the_data_parallel_ranks():
    with pytest.raises(
        LayoutError, match=r"global_batch 6 .* = 4; nearest valid global_batch: 4 or 8"
    ):
        validate_layout(_cfg(global_batch=6), 4)


def test_experts_must_split_evenly_over_the_expert_ranks():
    model = dataclasses.replace(MODEL, moe=MoEArgs(n_experts=6))
    with pytest.raises(LayoutError, match=r"n_experts 6 is not divisible by ep 4.*4 or 8"):
        validate_layout(_cfg(model, ep=4), 4)
    with pytest.raises(LayoutError, match=r"ep 2 needs a mixture-of-experts model"):
        validate_layout(_cfg(ep=2), 4)


def test_layers_must_split_into_equal_pipeline_stages():
    with pytest.raises(
        LayoutError,
        match=r"n_layers 4 does not split into 8 equal stages; nearest valid n_layers: 8; .*"
        r"--pp-layers-per-stage \(pp 4 x 2 stages per rank\)",
    ):
        validate_layout(_cfg(pp=4, pp_schedule="Interleaved1F1B"), 4)


def test_pipeline_schedules_get_the_micro_batches_and_stages_they_need():
    with pytest.raises(LayoutError, match=r"1F1B needs at least pp = 4 micro-batches, got 2"):
        validate_layout(_cfg(pp=4, pp_microbatches=2), 4)
    with pytest.raises(LayoutError, match=r"pp_microbatches 3 does not divide the local batch 4"):
        validate_layout(_cfg(pp=2, pp_microbatches=3), 4)
    with pytest.raises(LayoutError, match=r"ZBVZeroBubble runs exactly 2 stages per rank, not 4"):
        validate_layout(_cfg(model=dataclasses.replace(MODEL, n_layers=8), pp=2,
                             pp_schedule="ZBVZeroBubble", pp_stages_per_rank=4), 4)  # fmt: skip
    with pytest.raises(LayoutError, match=r"pp_schedule 'Zero' is not one of"):
        validate_layout(_cfg(pp=2, pp_schedule="Zero"), 4)


def test_expert_options_that_cannot_route_are_refused():
    with pytest.raises(ValueError, match=r"n_expert_groups 3 does not divide n_experts 8"):
        MoEArgs(n_experts=8, n_groups=3)
    with pytest.raises(ValueError, match=r"top_k 4 exceeds the 2 experts of 1 groups of 2"):
        MoEArgs(n_experts=8, top_k=4, n_groups=4, topk_groups=1)


def test_document_masking_and_validation_loss_are_refused_where_the_layout_cannot_do_them():
    masked = {"data": "prepared", "document_masking": True}
    for parallel, degree in (({"pp": 2}, "pp 2"), ({"cp": 2}, "cp 2")):
        cfg = dataclasses.replace(_cfg(**parallel), **masked)
        with pytest.raises(LayoutError, match=rf"--document-masking with {degree}: this layout"):
            validate_layout(cfg, 4)
    validate_layout(dataclasses.replace(_cfg(tp=2), **masked), 4)  # dp, FSDP and tp mask
    evaluated = {"eval_data": "heldout", "eval_every": 10}
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        cfg = dataclasses.replace(_cfg(pp=2, pp_schedule=schedule), **evaluated)
        with pytest.raises(LayoutError, match=rf"--eval-every with pp_schedule {schedule}"):
            validate_layout(cfg, 4)
    validate_layout(dataclasses.replace(_cfg(pp=2, pp_schedule="GPipe"), **evaluated), 4)


def test_document_masking_needs_prepared_data_and_evaluation_needs_held_out_data():
    with pytest.raises(ValueError, match="--document-masking needs --data"):
        TrainConfig(run_id="r", document_masking=True)
    with pytest.raises(ValueError, match="--eval-every needs --eval-data"):
        TrainConfig(run_id="r", eval_every=5)


@pytest.mark.parametrize(
    ("world", "full", "parallel", "accum", "expected"),
    [
        (2, 4, {}, 1, 2),  # half the ranks: twice the micro-batches, the same micro-batch
        (4, 8, {"tp": 2}, 2, 4),  # dp 2 of 4: the tp pairs stay, dp absorbs the change
        (3, 4, {}, 1, 1),  # 4/3 is no whole number: each rank's batch grows instead
        (4, 4, {}, 2, 2),  # the full size: as configured
        (2, 4, {}, 4, 4),  # 8 would not divide the local batch of 12: as configured
        (2, 4, {"pp": 2}, 1, 1),  # the pipeline runs its own micro-batches
        # HSDP, a node of 2 lost: a replica goes, the shard pairs stay, twice the micro-batches
        (2, 4, {"dp_replicate": -1, "dp_shard": 2}, 1, 2),
    ],
)
def test_an_elastic_job_on_fewer_ranks_keeps_each_ranks_micro_batch_where_it_can(
    world: int, full: int, parallel: dict, accum: int, expected: int
):
    cfg = dataclasses.replace(_cfg(global_batch=24, **parallel), grad_accum_steps=accum)
    assert elastic_accumulation(cfg, world, full) == expected
    assert elastic_accumulation(cfg, world, 0) == accum  # not elastic
