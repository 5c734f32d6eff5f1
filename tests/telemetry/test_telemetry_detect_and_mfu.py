"""The straggler detector, the live view of runs and the MFU formulas (no database, no network)."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from scaletrain.errors import NotFound
from scaletrain.v1 import telemetry_pb2
from telemetry import live as live_module
from telemetry import mfu
from telemetry.client import rank_step
from telemetry.detect import (
    Cusum,
    NodeFlag,
    StragglerDetector,
    StragglerFlag,
    StragglerPolicy,
    medians_without,
)
from telemetry.ingest import step_values
from telemetry.live import LiveRuns
from telemetry.models import Run
from telemetry.rollup import NodeMap


def detector(
    world: int, policy: StragglerPolicy | None = None, per_node: int = 1
) -> StragglerDetector:
    """A detector of `world` ranks, `per_node` ranks to a host (host0, host1, ...)."""
    nodes = NodeMap.of_hosts(world, {rank: f"host{rank // per_node}" for rank in range(world)})
    return StragglerDetector(nodes, policy)


def run_steps(
    detector: StragglerDetector, steps: range, times: dict[int, float]
) -> list[tuple[int, int]]:
    """Feed the same compute times for `steps`; return (step, rank) of every rank flag raised."""
    work = np.array([times[rank] for rank in range(len(times))])
    return [
        (flag.step, flag.rank)
        for step in steps
        for flag in detector.observe(step, work)
        if isinstance(flag, StragglerFlag)
    ]


def test_a_rank_twice_as_slow_as_its_peers_is_flagged_after_patience_steps_and_only_once() -> None:
    slow = detector(4, StragglerPolicy(patience=3))
    flags = run_steps(slow, range(1, 10), {0: 0.1, 1: 0.1, 2: 0.2, 3: 0.1})
    assert flags == [(3, 2)]
    assert slow.latest()[2].relative == pytest.approx(0.5)
    assert slow.latest()[0].relative == pytest.approx(1.0)


def test_a_rank_that_recovers_and_slows_down_again_is_flagged_again() -> None:
    pair = detector(2, StragglerPolicy(patience=2))
    slow, normal = {0: 0.1, 1: 0.3}, {0: 0.1, 1: 0.1}
    flags = run_steps(pair, range(1, 4), slow) + run_steps(pair, range(4, 6), normal)
    flags += run_steps(pair, range(6, 8), slow)
    # In a world of two, the peer of the slow rank is rank 0: only rank 1 is slower than its peer.
    assert flags == [(2, 1), (7, 1)]


def test_noise_on_a_clean_run_flags_nobody() -> None:
    rng = random.Random(7)
    clean = detector(8)
    flags = []
    for step in range(1, 500):
        # A shared machine: every rank is up to 30% off, now and then one takes 2x for one step.
        times = {rank: 0.1 * rng.uniform(0.85, 1.15) for rank in range(8)}
        if rng.random() < 0.2:
            times[rng.randrange(8)] *= 2
        flags += run_steps(clean, range(step, step + 1), times)
    assert flags == []


def test_a_world_of_one_is_scored_against_its_own_best() -> None:
    alone = detector(1, StragglerPolicy(patience=2))
    assert run_steps(alone, range(1, 5), {0: 0.1}) == []
    assert run_steps(alone, range(5, 8), {0: 0.3}) == [(6, 0)]
    assert alone.latest()[0].individual == pytest.approx(1 / 3)


def test_ranks_without_a_measured_time_are_not_scored() -> None:
    gaps = detector(3, StragglerPolicy(patience=1))
    assert run_steps(gaps, range(1, 3), {0: 0.1, 1: 0.0, 2: 0.1}) == []
    assert 1 not in gaps.latest()


def test_a_node_whose_ranks_are_all_slow_is_one_slow_node_naming_its_host() -> None:
    # 64 nodes of 8 ranks; every rank of host5 (ranks 40-47) and rank 3 alone take 1.6x. The
    # scores alone (no CUSUMs, which flag a step sooner): flagged after `patience` steps.
    cluster = detector(512, StragglerPolicy(patience=3, cusums=()), per_node=8)
    work = np.full(512, 0.1)
    work[40:48] = work[3] = 0.16
    flags = [flag for step in range(1, 10) for flag in cluster.observe(step, work)]
    nodes = [flag for flag in flags if isinstance(flag, NodeFlag)]
    ranks = [flag for flag in flags if isinstance(flag, StragglerFlag)]
    assert [(f.step, f.node, f.ranks, f.since_step) for f in nodes] == [
        (3, "host5", list(range(40, 48)), 1)
    ]
    assert nodes[0].relative == pytest.approx(0.1 / 0.16)
    assert [(f.step, f.rank, f.node) for f in ranks] == [(3, 3, "host0")]


def noisy_steps(
    cluster: StragglerDetector, steps: range, slow: dict[int, float], seed: int = 0
) -> list[StragglerFlag | NodeFlag]:
    """Feed `steps` of compute times with 3.5% log-normal noise per rank and step, as measured on
    this machine (bench/data/compute_noise.json), the ranks of `slow` slowed by their factor;
    return every flag raised."""
    rng = np.random.default_rng(seed)
    world = len(cluster.nodes.of_rank)
    factors = np.ones(world)
    factors[list(slow)] = list(slow.values())
    return [
        flag
        for step in steps
        for flag in cluster.observe(step, 0.06 * np.exp(rng.normal(0, 0.035, world)) * factors)
    ]


def test_a_rank_slowed_by_a_third_in_a_noisy_world_is_flagged_within_six_steps() -> None:
    # A 1.3x rank is 7.5 noise sigmas slow: the scores (flagging 1.43x) never see it; the CUSUMs
    # flag it by its 6th slow step (each adds the small CUSUM's most, h / 6), most often by its
    # 3rd (the large CUSUM: two or three steps; bench/straggler_scale.py).
    steps = []
    for seed in range(8):
        cluster = detector(512, per_node=8)
        assert noisy_steps(cluster, range(1, 11), {}, seed) == []
        flags = noisy_steps(cluster, range(11, 17), {77: 1.3}, seed)
        assert [(type(f), f.rank, f.node) for f in flags] == [(StragglerFlag, 77, "host9")]
        assert 5 <= flags[0].since_step <= 11
        steps.append(flags[0].step - 10)
    assert max(steps) <= 6 and sorted(steps)[len(steps) // 2] <= 3, steps
    # A 1.1x rank (2.7 sigmas) takes longer, but not forever.
    cluster = detector(512, per_node=8)
    flags = noisy_steps(cluster, range(1, 31), {300: 1.1})
    assert [(f.rank, f.step <= 25) for f in flags] == [(300, True)]


def test_a_clean_noisy_world_flags_nobody() -> None:
    cluster = detector(512, per_node=8)
    assert noisy_steps(cluster, range(1, 501), {}, seed=11) == []


def test_a_whole_slow_node_is_one_node_flag_not_a_flag_per_rank() -> None:
    for factor in (1.1, 1.3, 2.0):
        cluster = detector(512, per_node=8)
        slow = dict.fromkeys(range(40, 48), factor)
        flags = noisy_steps(cluster, range(1, 41), slow, seed=3)
        assert [(type(f), f.node, f.ranks) for f in flags] == [
            (NodeFlag, "host5", list(range(40, 48)))
        ], factor
        assert flags[0].relative == pytest.approx(1 / factor, rel=0.1)


def test_a_hiccup_of_one_step_is_no_straggler_however_slow() -> None:
    # One step 3x slower, a rank or a whole node: never flagged (one step never alarms a CUSUM).
    cluster = detector(512, per_node=8)
    assert noisy_steps(cluster, range(1, 5), {}) == []
    assert noisy_steps(cluster, range(5, 6), {3: 3.0, **dict.fromkeys(range(40, 48), 3.0)}) == []
    assert noisy_steps(cluster, range(6, 30), {}) == []


def test_a_policy_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        StragglerPolicy(slow_below=1.5)
    with pytest.raises(ValueError, match="patience must be at least 1"):
        StragglerPolicy(patience=0)
    with pytest.raises(ValueError, match="node_share"):
        StragglerPolicy(node_share=0)
    with pytest.raises(ValueError, match="one step alarms"):
        Cusum(k=1.0, h=2.0, clip=3.0)
    with pytest.raises(ValueError, match="clip > k"):
        Cusum(k=1.0, h=2.0, clip=0.5)


def test_the_median_of_the_others_matches_the_plain_median_for_every_value() -> None:
    rng = random.Random(3)
    for _ in range(500):
        values = [rng.choice([0.1, 0.2, rng.random()]) for _ in range(rng.randint(2, 9))]
        medians = medians_without(np.array(values))
        for index in range(len(values)):
            rest = values[:index] + values[index + 1 :]
            assert medians[index] == statistics.median(rest)


@pytest.mark.parametrize(
    ("device", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA H200", "fp8", 1978.9),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156),
        ("NVIDIA B200", "bf16", 2250),
        ("NVIDIA H200", "fp32", 66.9),
    ],
)
def test_the_peak_table_gives_the_dense_datasheet_figure(
    device: str, precision: str, tflops: float
) -> None:
    assert mfu.dense_peak(device, precision) == pytest.approx(tflops * 1e12)


def test_an_unknown_device_or_precision_has_no_peak() -> None:
    assert mfu.dense_peak("NVIDIA GeForce RTX 4090", "bf16") is None
    assert mfu.dense_peak("NVIDIA A100-SXM4-80GB", "fp8") is None


def test_mfu_and_hfu_match_a_hand_computation() -> None:
    # 7B parameters, 3,000 tokens/s per device on 8 devices of 989.4 TFLOP/s:
    # 6 * 7e9 * 24,000 / (8 * 989.4e12) = 1.008e15 / 7.9152e15 = 0.1273499...
    model = mfu.model_flops_per_token(7_000_000_000)
    assert mfu.utilization(model, 24_000, 8, 989.4e12) == pytest.approx(0.12734991)
    # Full activation recomputation: 8 N per token, 1.344e15 / 7.9152e15.
    hardware = mfu.hardware_flops_per_token(7_000_000_000, 1.0)
    assert mfu.utilization(hardware, 24_000, 8, 989.4e12) == pytest.approx(0.16979988)
    assert math.isnan(mfu.utilization(model, 24_000, 8, 0.0))


def backlog_rows(rank: int, compute: float, steps: int = 500) -> list[tuple[object, ...]]:
    """One rank's rows of steps 1..steps, as its client sends its backlog after an outage."""
    return [
        step_values(0, rank_step("r", step, rank, loss=1.0, tokens=10,
                                 times={"step": 1.0, "compute": compute}))
        for step in range(1, steps + 1)
    ]  # fmt: skip


def live_runs(world_size: int) -> LiveRuns:
    def unknown(run_id: str) -> Run:
        raise NotFound(run_id)

    live = LiveRuns(
        unknown, lambda run_id: NodeMap.of_hosts(world_size, {}), StragglerPolicy(patience=3)
    )
    live.registered(telemetry_pb2.RegisterRunRequest(run_id="r", world_size=world_size), attempt=0)
    return live


def test_live_runs_complete_every_step_when_one_ranks_backlog_arrives_before_the_others() -> None:
    live = live_runs(3)

    # After an outage each client sends its whole backlog: rank 0's 500 steps arrive first.
    first = [live.observe_steps(backlog_rows(rank, 0.1)) for rank in (0, 1)]
    assert [(o.flags, o.summaries, o.incomplete) for o in first] == [([], [], [])] * 2
    observed = live.observe_steps(backlog_rows(2, 0.3))
    assert [(flag.step, flag.rank) for flag in observed.flags] == [(3, 2)]
    assert "rank 2 on rank2 computes 3.0x slower" in observed.flags[0].message
    # Every step was rolled up as it completed, none left incomplete.
    assert [summary.rollup["step"] for summary in observed.summaries] == list(range(1, 501))
    assert observed.incomplete == []
    (view,) = live.views()
    assert (view.step, view.records, view.tokens_per_s) == (500, 1500, 30.0)
    assert view.ranks[2].scores is not None and view.ranks[2].scores.relative == pytest.approx(
        1 / 3
    )


def test_live_runs_hold_a_bounded_number_of_rows_and_leave_the_oldest_steps_to_the_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(live_module, "_MAX_PENDING_ROWS", 100)
    live = live_runs(3)
    observed = []
    for rank in range(3):
        observed.append(live.observe_steps(backlog_rows(rank, 0.1, steps=250)))
        pending = live._runs["r"].pending
        assert live._runs["r"].pending_rows == sum(map(len, pending.values())) <= 100
    # Rank 0 ran 250 steps ahead of the others: past the bound its oldest steps were given up, to
    # be rolled up from the stored rows like any incomplete step.
    assert observed[0].incomplete == [("r", 0, step) for step in range(1, 151)]
    rolled_up = {summary.rollup["step"] for o in observed for summary in o.summaries}
    left_to_the_database = {step for o in observed for _, _, step in o.incomplete}
    still_pending = {step for _, step in live._runs["r"].pending}
    assert rolled_up | left_to_the_database | still_pending == set(range(1, 251))
