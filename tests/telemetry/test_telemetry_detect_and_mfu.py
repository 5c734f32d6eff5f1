"""The straggler detector, the live view of runs and the MFU formulas (no database, no network)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from scaletrain.errors import NotFound
from scaletrain.v1 import telemetry_pb2
from telemetry import mfu
from telemetry.client import rank_step
from telemetry.detect import StragglerDetector, StragglerPolicy, median_without
from telemetry.ingest import step_values
from telemetry.live import LiveRuns
from telemetry.models import Run


def run_steps(
    detector: StragglerDetector, steps: range, times: dict[int, float]
) -> list[tuple[int, int]]:
    """Feed the same compute times for `steps`; return (step, rank) of every flag raised."""
    return [(flag.step, flag.rank) for step in steps for flag in detector.observe(step, times)]


def test_a_rank_twice_as_slow_as_its_peers_is_flagged_after_patience_steps_and_only_once() -> None:
    detector = StragglerDetector(StragglerPolicy(patience=3))
    flags = run_steps(detector, range(1, 10), {0: 0.1, 1: 0.1, 2: 0.2, 3: 0.1})
    assert flags == [(3, 2)]
    assert detector.latest[2].relative == pytest.approx(0.5)
    assert detector.latest[0].relative == pytest.approx(1.0)


def test_a_rank_that_recovers_and_slows_down_again_is_flagged_again() -> None:
    detector = StragglerDetector(StragglerPolicy(patience=2))
    slow, normal = {0: 0.1, 1: 0.3}, {0: 0.1, 1: 0.1}
    flags = run_steps(detector, range(1, 4), slow) + run_steps(detector, range(4, 6), normal)
    flags += run_steps(detector, range(6, 8), slow)
    # In a world of two, the peer of the slow rank is rank 0: only rank 1 is slower than its peer.
    assert flags == [(2, 1), (7, 1)]


def test_noise_on_a_clean_run_flags_nobody() -> None:
    rng = random.Random(7)
    detector = StragglerDetector()
    flags = []
    for step in range(1, 500):
        # A shared machine: every rank is up to 30% off, now and then one takes 2x for one step.
        times = {rank: 0.1 * rng.uniform(0.85, 1.15) for rank in range(8)}
        if rng.random() < 0.2:
            times[rng.randrange(8)] *= 2
        flags += detector.observe(step, times)
    assert flags == []


def test_a_world_of_one_is_scored_against_its_own_best() -> None:
    detector = StragglerDetector(StragglerPolicy(patience=2))
    assert run_steps(detector, range(1, 5), {0: 0.1}) == []
    assert run_steps(detector, range(5, 8), {0: 0.3}) == [(6, 0)]
    assert detector.latest[0].individual == pytest.approx(1 / 3)


def test_ranks_without_a_measured_time_are_not_scored() -> None:
    detector = StragglerDetector(StragglerPolicy(patience=1))
    assert run_steps(detector, range(1, 3), {0: 0.1, 1: 0.0, 2: 0.1}) == []
    assert 1 not in detector.latest


def test_a_policy_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        StragglerPolicy(slow_below=1.5)
    with pytest.raises(ValueError, match="patience must be at least 1"):
        StragglerPolicy(patience=0)


def test_the_median_without_one_value_matches_the_plain_median() -> None:
    rng = random.Random(3)
    for _ in range(500):
        values = sorted(rng.choice([0.1, 0.2, rng.random()]) for _ in range(rng.randint(2, 9)))
        left_out = rng.choice(values)
        rest = list(values)
        rest.remove(left_out)
        assert median_without(values, left_out) == statistics.median(rest)


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


def test_live_runs_complete_every_step_when_one_ranks_backlog_arrives_before_the_others() -> None:
    def unknown(run_id: str) -> Run:
        raise NotFound(run_id)

    live = LiveRuns(unknown, StragglerPolicy(patience=3))
    live.registered(telemetry_pb2.RegisterRunRequest(run_id="r", world_size=3), attempt=0)

    def rows(rank: int, compute: float) -> list[tuple[object, ...]]:
        return [
            step_values(0, rank_step("r", step, rank, loss=1.0, tokens=10,
                                     times={"step": 1.0, "compute": compute}))
            for step in range(1, 501)
        ]  # fmt: skip

    # After an outage each client sends its whole backlog: rank 0's 500 steps arrive first.
    flags = live.observe_steps(rows(0, 0.1)) + live.observe_steps(rows(1, 0.1))
    assert flags == []
    flags = live.observe_steps(rows(2, 0.3))
    assert [(flag.step, flag.rank) for flag in flags] == [(3, 2)]
    (view,) = live.views()
    assert (view.step, view.records, view.tokens_per_s) == (500, 1500, 30.0)
    assert view.ranks[2].scores is not None and view.ranks[2].scores.relative == pytest.approx(
        1 / 3
    )
