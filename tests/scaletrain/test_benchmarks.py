"""The benchmarks still run as their docstrings say, each on a tiny workload.

Their figures are not checked here (speed is never asserted in a test); what is checked is that
a user who runs one gets its ratios instead of a traceback from code that moved on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--mib", "4", "--runs", "1"]


def run_bench(script: str, *args: str) -> str:
    """What `bench/<script> args` prints, after checking that it exited cleanly."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(
    ("script", "args", "prints"),
    [
        ("ckptd_ingest.py", SMALL, "ratio ckptd fast path/raw"),
        ("ckptd_ssd.py", SMALL, "ratio SSD tier / dd"),
        ("ckptd_restore.py", SMALL, "ratio memory/SSD"),
        ("ckptd_s3.py", SMALL, "ratio S3 tier / boto3"),
        ("ckptd_cluster.py", SMALL, "ratio commit latency 2 nodes/1 node"),
        ("ckpt_stall.py", ["--dim", "96", "--layers", "1", "--steps", "2"], '"ours_over_floor"'),
    ],
)
def test_each_checkpoint_benchmark_runs_and_prints_its_ratio(
    script: str, args: list[str], prints: str
) -> None:
    assert prints in run_bench(script, *args)


def test_the_fp8_speed_benchmark_runs_on_a_cpu_and_says_where_the_step_time_went() -> None:
    printed = run_bench(
        "fp8_gpu.py", "--device", "cpu", "--dims", "256,128,2,4,4,384,2,128", "--steps", "1",
        "--baseline", "", "--recipes", "tensorwise", "--modes", "eager", "--profile",
    )  # fmt: skip
    report = json.loads(printed[printed.index("\n{") :])
    fp8 = report["tensorwise eager"]
    assert fp8["x_bf16"] > 0
    assert fp8["profile"]["ms_by_kind"]["fp8 gemm"] > 0  # real FP8 products, found by name
    assert fp8["profile"]["ms_total"] > 0
    assert "fp8 gemm" not in report["bf16 eager"]["profile"]["ms_by_kind"]


def test_the_fp8_traffic_benchmark_shows_what_counting_lost_values_adds_to_a_compiled_step():
    printed = run_bench(
        "fp8_traffic.py", "--dims", "256,128,1,4,4,384,1,128", "--recipes", "tensorwise-delayed"
    )
    report = json.loads(printed[printed.index("\n{") :])
    assert report["naive"]["mb"] > report["bf16"]["mb"] > 0
    counted = report["tensorwise-delayed counting=True"]
    uncounted = report["tensorwise-delayed counting=False"]
    assert counted["mb"] > uncounted["mb"] and counted["kernels"] > uncounted["kernels"]
