"""Every parallel layout trains like one process: same losses, gradient norms and parameters.

One torchrun job per world size (4, then 8) runs every layout of that size in turn through
`trainer.parallel.probe`, because starting a job costs ~12 s on 2 cores. The test process computes
the single-process reference of each model: the plain model on the whole global batch, torch's
own gradient clipping, no parallelism at all. After STEPS optimizer steps we compare each step's
loss and gradient norm, and every parameter gathered in full (element-wise and by a float64
checksum). Some layouts are also checkpointed through a real ckptd with the trainer's
Checkpointer, restored into a fresh copy of the layout, and exported to a stock DCP directory that
a plain one-process model loads. Before any step, every layout's parameters gathered in full must
equal the reference's initial ones bit for bit: each rank built the model on the meta device and
initialised only its own shards (trainer.model.init).

The validation loss after the last step (`ParallelModel.evaluate`: forward only, a pipeline
schedule's eval) is compared the same way.

Tolerances (fp32): loss, validation loss and gradient norm within 2e-5 relative; parameters within
1e-4 absolute (AdamW moves each by up to lr = 3e-3 a step, so last-bit differences in tiny
gradients show up there first); checksum within 1e-6 relative. Layouts that do the same arithmetic
as another (activation checkpointing) must match it bit for bit. bf16 mixed precision is compared
with the fp32 reference: losses and the first step's gradient norm within 2e-2 relative; later
gradient norms within 1e-1, as AdamW turns bf16's rounding of tiny gradients into whole-lr steps of
their parameters (measured on a CPU with AMX bf16 kernels: 0.04%, 0.4%, 5.5% over three steps,
losses within 2e-4).
The measured differences are written to test-artifacts/parallel_layouts.json.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.config import CkptdConfig
from ckptd.server import start
from scaletrain.app.checkpoints import export
from trainer.checkpoint.digest import state_sha256
from trainer.model.llama import Transformer
from trainer.parallel.pipeline import V_SHAPED
from trainer.parallel.probe import ProbeResult, config_from_layout, launch, reference

STEPS = 3
DENSE = {"dim": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4}
MOE = DENSE | {"moe": {"n_experts": 4, "top_k": 2, "n_shared": 1}}
# Experts in 2 groups of 2 ranks; each token picks its 2 experts inside one group.
NODE_LIMITED = DENSE | {"moe": {"n_experts": 4, "top_k": 2, "n_groups": 2, "topk_groups": 1}}
AUX_LOSS = DENSE | {"moe": {"n_experts": 4, "top_k": 2, "balance": "aux_loss"}}

WORLD_4 = {
    "dp4": ({}, DENSE),
    "hsdp2x2": ({"dp_replicate": 2}, DENSE),
    "tp4": ({"tp": 4}, DENSE),
    "cp4": ({"cp": 4}, DENSE),
    "pp4": ({"pp": 4}, DENSE),
    "ep4-node-limited": ({"ep": 4}, NODE_LIMITED),
    "dp2.tp2": ({"tp": 2}, DENSE),
    "pp2.dp2": ({"pp": 2}, DENSE),
    "cp2.tp2": ({"cp": 2, "tp": 2}, DENSE),
    "ep2-in-dp4": ({"ep": 2}, MOE),
    "ep2-in-dp2.cp2-aux-loss": ({"cp": 2, "ep": 2}, AUX_LOSS),
    "pp2.dp2-gpipe": ({"pp": 2, "pp_schedule": "GPipe"}, DENSE),
    "pp2.dp2-interleaved-1f1b": ({"pp": 2, "pp_schedule": "Interleaved1F1B"}, DENSE),
    "pp2.dp2-interleaved-zero-bubble": ({"pp": 2, "pp_schedule": "InterleavedZeroBubble"}, DENSE),
    "pp2.dp2-zbv-zero-bubble": ({"pp": 2, "pp_schedule": "ZBVZeroBubble"}, DENSE),
    "pp2.dp2-dualpipev": ({"pp": 2, "pp_schedule": "DualPipeV"}, DENSE),
    # Uneven stages: 1 and 3 blocks (the first stage carries the embedding), and 3 and 1.
    "pp2.dp2-first-stage-less": ({"pp": 2, "pp_first_stage_less_layers": 2}, DENSE),
    "pp2.dp2-layers-per-stage": ({"pp": 2, "pp_layers_per_stage": ["3", "1"]}, DENSE),
    "dp4-activation-checkpointing": ({"activation_checkpointing": True}, DENSE),
    "dp4-bf16": ({"mixed_precision": True}, DENSE),
    "dp4-compiled": ({"compile": True}, DENSE),
    "dp2.tp2-compiled": ({"tp": 2, "compile": True}, DENSE),
}
WORLD_8 = {
    "dp2.tp2.pp2": ({"tp": 2, "pp": 2}, DENSE),
    "dp2.cp2.tp2": ({"cp": 2, "tp": 2}, DENSE),
    "ep2-in-dp2.tp2.pp2": ({"tp": 2, "pp": 2, "ep": 2}, MOE),
    "hsdp2x2.tp2": ({"dp_replicate": 2, "tp": 2}, DENSE),
    "pp2.cp2.tp2-interleaved-1f1b": (
        {"cp": 2, "tp": 2, "pp": 2, "pp_schedule": "Interleaved1F1B"},
        DENSE,
    ),
    "ep4-in-dp2.cp2.tp2": ({"cp": 2, "tp": 2, "ep": 4}, MOE),
}
CHECKPOINTED = {
    "pp2.dp2-interleaved-1f1b",
    "ep2-in-dp4",
    "cp2.tp2",
    "ep2-in-dp2.tp2.pp2",
    "dp4-activation-checkpointing",
}
BF16 = {"dp4-bf16"}
BITWISE_TWINS = {"dp4-activation-checkpointing": "dp4"}

ARTIFACT = Path("test-artifacts/parallel_layouts.json")


def _layouts(table: dict[str, tuple[dict, dict]]) -> list[dict[str, Any]]:
    return [
        {"name": name, "parallel": parallel, "model": model, "seq_len": 32, "global_batch": 8,
         "checkpoint": name in CHECKPOINTED}
        for name, (parallel, model) in table.items()
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ckptd(tmp_path_factory: pytest.TempPathFactory):
    running = start(CkptdConfig(data_dir=tmp_path_factory.mktemp("ckptd")))
    yield running.address
    running.stop(grace=1)


@pytest.fixture(scope="module")
def measured(ckptd: str):
    """Both jobs' results by layout name, and the differences recorded for the artifact."""
    results = launch(4, _layouts(WORLD_4), STEPS, ckptd) | launch(
        8, _layouts(WORLD_8), STEPS, ckptd
    )
    diffs: dict[str, dict[str, Any]] = {}
    yield results, diffs
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_text(json.dumps(diffs, indent=1, sort_keys=True))


_REFERENCES: dict[str, ProbeResult] = {}


def _reference(table: dict, name: str) -> ProbeResult:
    """The one-process run of the layout's model (cached: layouts share models)."""
    layout = _layouts(table)[[*table].index(name)]
    key = json.dumps(layout["model"], sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(config_from_layout(layout), STEPS)
    return _REFERENCES[key]


def _checksum(state: dict[str, torch.Tensor]) -> float:
    """Sum of every parameter in float64: one number that moves with any of them."""
    return sum(float(t.double().sum()) for t in state.values())


def _compare(name: str, got: dict[str, Any], ref: ProbeResult) -> dict[str, Any]:
    assert sorted(got["state"]) == sorted(ref.state), "checkpoint keys must stay unparallelised"
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref.losses, strict=True))
    norms = [abs(a - b) / b for a, b in zip(got["grad_norms"], ref.grad_norms, strict=True)]
    param = max(float((got["state"][k].float() - v).abs().max()) for k, v in ref.state.items())
    checksum = abs(_checksum(got["state"]) - _checksum(ref.state)) / abs(_checksum(ref.state))
    return {
        "loss_rel": loss,
        "grad_norm_rel": max(norms),
        "first_grad_norm_rel": norms[0],
        "param_max_abs": param,
        "checksum_rel": checksum,
        "bitwise": state_sha256(got["state"]) == state_sha256(ref.state),
        "final_loss": got["losses"][-1],
        "eval_loss_rel": abs(got["eval_loss"] - ref.eval_loss) / abs(ref.eval_loss),
    }


def _check_layout(table: dict, name: str, measured) -> None:
    results, diffs = measured
    diff = _compare(name, results[name], _reference(table, name))
    diffs[name] = diff
    if name in BF16:
        assert diff["loss_rel"] < 2e-2 and diff["first_grad_norm_rel"] < 2e-2, diff
        assert diff["grad_norm_rel"] < 1e-1, diff
        assert diff["eval_loss_rel"] < 2e-2, diff
        return
    assert diff["loss_rel"] < 2e-5, diff
    # Only a schedule that cannot run forward alone has no validation loss (--eval-every refuses).
    if table[name][0].get("pp_schedule") in V_SHAPED:
        assert math.isnan(results[name]["eval_loss"])
    else:
        assert diff["eval_loss_rel"] < 2e-5, diff
    assert diff["grad_norm_rel"] < 2e-5, diff
    assert diff["param_max_abs"] < 1e-4, diff
    assert diff["checksum_rel"] < 1e-6, diff


@pytest.mark.parametrize("name", list(WORLD_4))
def test_a_layout_on_4_ranks_trains_like_one_process(name: str, measured):
    _check_layout(WORLD_4, name, measured)


@pytest.mark.parametrize("name", list(WORLD_8))
def test_a_layout_on_8_ranks_trains_like_one_process(name: str, measured):
    _check_layout(WORLD_8, name, measured)


@pytest.mark.parametrize("name", list(WORLD_4) + list(WORLD_8))
def test_every_layout_starts_from_the_weights_of_one_process_bit_for_bit(name: str, measured):
    """Each rank built the model on the meta device and initialised only its own shards."""
    results, _ = measured
    table = WORLD_4 if name in WORLD_4 else WORLD_8
    initial = results[name]["initial_state"]
    assert sorted(initial) == sorted(_reference(table, name).initial_state)
    assert state_sha256(initial) == state_sha256(_reference(table, name).initial_state)


@pytest.mark.parametrize("name, twin", list(BITWISE_TWINS.items()))
def test_a_layout_doing_the_same_arithmetic_matches_its_twin_bit_for_bit(name, twin, measured):
    results, _ = measured
    assert results[name]["losses"] == results[twin]["losses"]
    assert state_sha256(results[name]["state"]) == state_sha256(results[twin]["state"])


@pytest.mark.parametrize("name", [n for n, (_, m) in (WORLD_4 | WORLD_8).items() if "moe" in m])
def test_expert_parallel_layouts_route_every_token_as_one_process_does(name: str, measured):
    results, _ = measured
    table = WORLD_4 if name in WORLD_4 else WORLD_8
    ref = _reference(table, name)
    assert [load["per_layer"] for load in results[name]["expert_loads"]] == [
        load.per_layer for load in ref.expert_loads
    ]


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_a_checkpointed_layout_restores_every_parameter_into_a_fresh_copy(name: str, measured):
    results, _ = measured
    assert results[name]["restored_equal"] is True


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_a_layouts_checkpoint_loads_into_a_one_process_model_with_stock_dcp(
    name: str, measured, ckptd: str, tmp_path: Path
):
    results, _ = measured
    export(tmp_path, ckptd, name, STEPS, tmp_path / "export")
    table = WORLD_4 if name in WORLD_4 else WORLD_8
    model = Transformer(config_from_layout(_layouts(table)[[*table].index(name)]).model)
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path / "export")))
    assert state_sha256(state["model"]) == state_sha256(results[name]["state"])


def test_the_trainer_runs_a_composed_layout_given_on_its_command_line():
    """pp2 x cp2 with ep2 borrowed from cp, a zero-bubble schedule, bf16 and recomputation."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "trainer",
            "--run-id",
            "composed",
            "--steps",
            "2",
            "--log-every",
            "1",
            "--seq-len",
            "32",
            "--global-batch",
            "4",
            "--pp",
            "2",
            "--cp",
            "2",
            "--ep",
            "2",
            "--n-experts",
            "4",
            "--pp-schedule",
            "ZBVZeroBubble",
            "--mixed-precision",
            "--activation-checkpointing",
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[trainer] step 2 loss" in proc.stdout and "expert load max/mean" in proc.stdout
    assert "[trainer] done: final loss" in proc.stdout
