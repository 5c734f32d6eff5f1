"""The health checks as plain functions: spike statistics, SDC decisions, fault flags, snapshots."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainer.health.faults import FaultPlan, LossSpikeFault, SdcFault
from trainer.health.inject import FaultInjector
from trainer.health.sdc import RankStats, check, classify, float_bits, minority
from trainer.health.snapshot import StateSnapshot, checksum
from trainer.health.stats import RollingSignal, SpikeRule


def stats(**changes: dict[int, int]) -> list[RankStats]:
    """Four ranks that agree on everything; `changes` maps a field to {rank: value}."""
    base = {
        "global_loss": float_bits(2.5),
        "grad_norm": float_bits(0.8),
        "local_loss": 0,
        "grads": 0,
        "state": 0,
        "at_rest_ok": 1,
    }
    rows = []
    for rank in range(4):
        row = dict(base, local_loss=rank, grads=10 + rank, state=20 + rank % 2)
        for field, per_rank in changes.items():
            row[field] = per_rank.get(rank, row[field])
        rows.append(RankStats(**row))
    return rows


def warmed(values: list[float], rule: SpikeRule | None = None) -> RollingSignal:
    signal = RollingSignal(rule or SpikeRule())
    for value in values:
        signal.add(value)
    return signal


def test_a_loss_that_falls_fast_with_noise_never_spikes_but_a_jump_does() -> None:
    rng = random.Random(1)
    signal = RollingSignal(SpikeRule())
    for step in range(200):
        value = 5.5 * math.exp(-step / 40) + 2.0 + rng.uniform(-0.1, 0.1)
        assert signal.spike(value) is None
        signal.add(value)
    spike = signal.spike(4.0)
    # By step 200 the curve is at 2 + 5.5 e^-5 = 2.04, give or take the noise.
    assert spike is not None and spike.median == pytest.approx(2.04, abs=0.1)


def test_a_value_that_is_not_finite_always_spikes_and_nothing_spikes_before_enough_history() -> (
    None
):
    young = warmed([1.0, 1.0])
    assert young.spike(100.0) is None
    assert young.spike(math.inf) is not None
    assert young.spike(math.nan) is not None


def test_the_step_after_a_data_spike_is_excused_once_but_never_a_value_that_is_not_finite() -> None:
    signal = warmed([2.0] * 20)
    signal.excuse_next()
    assert signal.spike(3.0) is None  # the data spike's aftermath
    assert signal.spike(3.0) is not None  # only once
    signal.excuse_next()
    assert signal.spike(math.inf) is not None


def test_a_rise_must_exceed_the_minimum_relative_rise_when_the_signal_is_flat() -> None:
    flat = warmed([2.0] * 20)
    assert flat.spike(2.2) is None
    assert flat.spike(2.4) is not None


def test_a_step_whose_all_reduced_values_disagree_names_the_odd_rank() -> None:
    view = stats(grad_norm={3: float_bits(0.9)})
    suspicion = check(view, [], warmed([2.5] * 20), warmed([0.8] * 20))
    assert suspicion is not None
    assert suspicion.ranks == [3]
    assert suspicion.reasons == ["the all-reduced grad norm differs on ranks [3]"]


def test_replicas_holding_different_state_are_suspicious() -> None:
    # Ranks 0 and 2 replicate one shard, 1 and 3 another (state 20 / 21); rank 2 drifts.
    view = stats(state={2: 99})
    suspicion = check(view, [[0, 2], [1, 3]], warmed([2.5] * 20), warmed([0.8] * 20))
    assert suspicion is not None
    # Two replicas cannot outvote each other: both are named, the replay decides.
    assert suspicion.ranks == [0, 2]
    assert check(stats(), [[0, 2], [1, 3]], warmed([2.5] * 20), warmed([0.8] * 20)) is None


def test_a_loss_spike_is_suspicious_with_the_consensus_values() -> None:
    view = stats(global_loss={r: float_bits(9.0) for r in range(4)})
    suspicion = check(view, [], warmed([2.5] * 20), warmed([0.8] * 20))
    assert suspicion is not None and suspicion.loss_spike is not None
    assert (suspicion.loss, suspicion.ranks) == (9.0, [])


def test_a_replay_that_reproduces_every_rank_says_data() -> None:
    verdict = classify(stats(), stats(), [])
    assert (verdict.corrupted, verdict.stage, verdict.ranks) == (False, "data", [])


@pytest.mark.parametrize(
    ("original", "replay", "stage", "ranks"),
    [
        (stats(local_loss={1: 77}), stats(), "forward", [1]),
        # A corrupted gradient changes every rank's state through the clipping: the gradients,
        # which the step computes first, name the rank.
        (stats(grads={2: 5}, state={0: 1, 1: 2, 2: 3, 3: 4}), stats(), "gradients", [2]),
        (stats(global_loss={0: float_bits(3.0)}), stats(), "reduction", [0]),
        (stats(state={3: 8}), stats(), "optimizer", [3]),
    ],
    ids=["forward", "gradients", "reduction", "optimizer"],
)
def test_a_replay_that_differs_names_the_rank_at_the_first_stage_that_differs(
    original: list[RankStats], replay: list[RankStats], stage: str, ranks: list[int]
) -> None:
    verdict = classify(original, replay, [])
    assert (verdict.corrupted, verdict.stage, verdict.ranks) == (True, stage, ranks)


def test_minority_is_everyone_on_a_tie_and_nobody_when_all_agree() -> None:
    assert minority([1, 1, 2]) == [2]
    assert minority([1, 2]) == [0, 1]
    assert minority([5, 5]) == []


@pytest.mark.parametrize(
    ("flag", "text", "problem"),
    [
        ("sdc", "step=3", "missing rank"),
        ("sdc", "step=0,rank=1", "step: must be a step number of 1 or more"),
        ("sdc", "step=3,rank=1,target=activations", "target: must be one of grad, param, "),
        ("sdc", "step=3,rank=1,colour=red", "expected step=...,rank=...,target=...,bit=..."),
        ("straggler", "rank=1,delay=-2", "delay: must be a positive number of seconds"),
        ("loss_spike", "step=x", "step: invalid literal"),
    ],
)
def test_a_bad_fault_flag_is_refused_with_one_line_naming_it(
    flag: str, text: str, problem: str
) -> None:
    names = {"sdc": "--inject-sdc", "straggler": "--inject-straggler"}
    with pytest.raises(ValueError, match=problem) as caught:
        FaultPlan.parse(
            **{{"sdc": "sdc", "straggler": "stragglers", "loss_spike": "loss_spikes"}[flag]: [text]}
        )
    assert str(caught.value).startswith(names.get(flag, "--inject-loss-spike"))
    assert "\n" not in str(caught.value)


def test_fault_flags_parse_and_a_rank_outside_the_world_is_refused() -> None:
    plan = FaultPlan.parse(
        sdc=["step=3,rank=1", "step=5,rank=0,target=param,bit=20"], loss_spikes=["step=9"]
    )
    assert plan.sdc == (SdcFault(3, 1), SdcFault(5, 0, "param", 20))
    assert plan.loss_spikes == (LossSpikeFault(9),)
    with pytest.raises(ValueError, match="--inject-sdc rank=1 is outside the world of 1 ranks"):
        plan.check_world(1)


def test_a_loss_spike_batch_holds_bytes_outside_text_and_other_steps_are_untouched() -> None:
    injector = FaultInjector(
        FaultPlan(loss_spikes=(LossSpikeFault(4),)), 0, 256, torch.device("cpu")
    )
    inputs, targets = torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), 65)
    assert injector.corrupt_batch(3, inputs, targets)[1] is targets
    assert injector.corrupt_batch(4, inputs, targets)[1].unique().tolist() == [193]


def test_a_gradient_flip_hits_the_largest_element_whose_top_exponent_bit_is_clear() -> None:
    # Ranks can hold all-zero gradient shards (embedding rows of bytes no text has): skip them.
    zeros = torch.nn.Parameter(torch.zeros(4))
    zeros.grad = torch.zeros(4)
    weights = torch.nn.Parameter(torch.zeros(3))
    weights.grad = torch.tensor([0.5, -0.75, 3.0])  # 3.0 has the bit set already
    plan = FaultPlan(sdc=(SdcFault(2, 0),))
    FaultInjector(plan, 0, 256, torch.device("cpu")).flip_gradient(2, [zeros, weights])
    assert zeros.grad.tolist() == [0.0] * 4
    assert weights.grad[0] == 0.5 and weights.grad[2] == 3.0
    assert weights.grad[1] == -0.75 * 2.0**128


def test_a_restarted_job_computing_a_step_again_is_not_struck_again() -> None:
    # The run computed steps up to 5 before this job: the flip of step 4 struck then, once.
    plan = FaultPlan(sdc=(SdcFault(4, 0), SdcFault(6, 0)))
    injector = FaultInjector(plan, 0, 256, torch.device("cpu"), computed_before=5)
    weights = torch.nn.Parameter(torch.zeros(2))
    weights.grad = torch.tensor([0.5, 0.25])
    injector.flip_gradient(4, [weights])
    assert weights.grad.tolist() == [0.5, 0.25]
    injector.flip_gradient(6, [weights])
    assert weights.grad[0] == 0.5 * 2.0**128


def test_a_snapshot_sees_any_change_at_rest_and_restores_state_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    snapshot = StateSnapshot(model, optimizer)
    snapshot.capture()  # no optimizer state yet
    before = snapshot.before_checksum()

    def train_step() -> None:
        model(torch.ones(2, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()
    assert not snapshot.unchanged()
    snapshot.restore()
    assert snapshot.unchanged() and optimizer.state == {}
    assert snapshot.stage() == before

    train_step()
    after_one = snapshot.stage()
    snapshot.commit()
    with torch.no_grad():
        model.bias.view(torch.int32)[1] ^= 1  # the lowest mantissa bit
    assert not snapshot.unchanged()
    snapshot.restore()
    assert snapshot.unchanged() and snapshot.stage() == after_one


def test_a_held_step_result_survives_a_replay_and_can_be_put_back() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    snapshot = StateSnapshot(model, optimizer)
    snapshot.capture()

    def train_step(scale: float) -> None:
        (scale * model(torch.ones(2, 4))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step(1.0)
    result = snapshot.stage()
    snapshot.hold()
    snapshot.restore()
    train_step(2.0)  # a replay that came out differently
    assert snapshot.stage() != result
    snapshot.restore_held()
    assert snapshot.stage() == result


def test_a_checksum_sees_a_single_flipped_bit_anywhere() -> None:
    tensors = [torch.randn(50), torch.randn(7, 3)]
    reference = checksum(tensors)
    for tensor in tensors:
        for bit in (0, 17, 31):
            tensor.view(-1).view(torch.int32)[3] ^= 1 << bit
            assert checksum(tensors) != reference
            tensor.view(-1).view(torch.int32)[3] ^= 1 << bit
    assert checksum(tensors) == reference
    assert checksum(reversed(tensors)) != reference
