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
        ("datapath_tls.py", SMALL, "ratio peer TLS/bare TLS"),
        ("ckptd_s3.py", SMALL, "ratio S3 tier / boto3"),
        ("ckptd_cluster.py", SMALL, "ratio commit latency 2 nodes/1 node"),
        ("ckptd_tenants.py", ["--mib", "1", "--saves", "1", "--rounds", "1"], "without abuser"),
        ("ckptd_replicas.py", [*SMALL, "--train-pairs", "0"], "ratio replication (on disk)"),
        ("ckpt_stall.py", ["--dim", "96", "--layers", "1", "--steps", "2"], '"ours_over_floor"'),
    ],
)
def test_each_checkpoint_benchmark_runs_and_prints_its_ratio(
    script: str, args: list[str], prints: str
) -> None:
    assert prints in run_bench(script, *args)


def test_the_data_benchmark_prepares_a_corpus_and_prints_both_ratios() -> None:
    printed = run_bench("data_prepare.py", "--mib", "1", "--vocab", "600", "--runs", "1",
                        "--windows", "200")  # fmt: skip
    assert "prepare / encode_batch" in printed and "window reads / memmap" in printed


def test_the_data_wait_benchmark_trains_on_the_example_data_and_prints_its_ratio() -> None:
    printed = run_bench("data_wait.py", "--steps", "4", "--ranks", "2")
    assert "ratio data wait/step time: " in printed


def test_the_model_build_memory_benchmark_runs_both_paths_and_prints_their_ratio() -> None:
    printed = run_bench(
        "model_build_memory.py",
        "--ranks",
        "2",
        "--dim",
        "64",
        "--layers",
        "2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "256",
    )
    assert "ratio old/new peak RSS added" in printed


def test_the_hf_interop_benchmark_exports_and_imports_a_tiny_model_and_prints_both_ratios():
    printed = run_bench("hf_interop.py", "--dim", "64", "--layers", "1", "--vocab", "256",
                        "--ranks", "2", "--runs", "1")  # fmt: skip
    assert "ratio HF export / DCP export" in printed and "ratio HF import / dcp.load" in printed


def test_the_fp8_speed_benchmark_runs_on_a_cpu_and_says_where_the_step_time_went() -> None:
    printed = run_bench(
        "fp8_gpu.py",
        "--device",
        "cpu",
        "--dims",
        "256,128,2,4,4,384,2,128",
        "--steps",
        "1",
        "--baseline",
        "",
        "--recipes",
        "tensorwise",
        "--modes",
        "eager",
        "--profile",
    )
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


def test_the_cluster_ingest_benchmark_runs_a_small_cluster_and_prints_its_ratios() -> None:
    printed = run_bench(
        "telemetry_cluster.py",
        "--ranks",
        "64",
        "--duration-s",
        "4",
        "--processes",
        "1",
        "--baseline-steps",
        "2",
    )
    report = json.loads(printed)
    assert report["records_stored"] == report["records_offered"] == 64 * 2
    assert report["ratio_stored_to_offered"] > 0 and report["ratio_offered_to_baseline"] > 0


def test_the_detection_cost_benchmark_prints_its_ratio_per_world_size() -> None:
    report = json.loads(run_bench("telemetry_detect.py", "--ranks", "64,512", "--steps", "2"))
    assert set(report) == {"64 ranks", "512 ranks"}
    assert all(sizes["ratio_scoring_to_baseline"] > 0 for sizes in report.values())


def test_the_straggler_benchmark_flags_every_slowed_rank_and_node_of_a_small_world() -> None:
    printed = run_bench(
        "straggler_scale.py",
        "--ranks",
        "512",
        "--clean-steps",
        "200",
        "--trials",
        "2",
        "--max-steps",
        "30",
    )
    report = json.loads(printed[printed.index('{"ranks"') :])
    assert report["ranks"] == 512 and report["false_flags"] == {"rank_flags": 0, "node_flags": 0}
    assert all(case["never"] == 0 for case in report["cases"].values()), report["cases"]


def test_the_sdc_coverage_benchmark_prints_its_matrix_and_catches_every_flip_at_rest() -> None:
    printed = run_bench("sdc_coverage.py", "--quick")
    assert "per target, all layouts and bit classes:" in printed
    report = json.loads(printed[printed.index('{"totals"') :])
    assert report["false_alarms"] == {"hsdp2x2": 0}
    assert all(report["totals"][t][m]["detected_pct"] == 100 for t in ("param", "optim")
               for m in ("before", "after"))  # fmt: skip
    assert report["cost"]["hsdp2x2"]["cpu_ratio"] > 0


def test_the_page_benchmark_fills_a_small_cluster_run_and_prints_its_ratios(tmp_path: Path) -> None:
    printed = run_bench(
        "telemetry_pages.py",
        "--db",
        f"sqlite:///{tmp_path / 'pages.db'}",
        "--ranks",
        "64",
        "--steps",
        "10",
    )
    report = json.loads(printed[printed.index("{") :])
    assert report["ratio_run_page_warm_to_baseline"] > 0 and report["goodput_s"] > 0


def test_the_recovery_benchmark_imports_what_it_drills_with() -> None:
    """Only its start: each of its drills takes minutes (the chaos suite runs a drill's records)."""
    assert "cold restart" in run_bench("recovery.py", "--help")
