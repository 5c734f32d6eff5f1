"""The checkpoint benchmarks still run as their docstrings say, each on a tiny workload.

Their figures are not checked here (speed is never asserted in a test); what is checked is that
a user who runs one gets its ratios instead of a traceback from code that moved on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--mib", "4", "--runs", "1"]


@pytest.mark.parametrize(
    ("script", "args", "prints"),
    [
        ("ckptd_ingest.py", SMALL, "ratio ckptd fast path/raw"),
        ("ckptd_ssd.py", SMALL, "ratio SSD tier / dd"),
        ("ckptd_restore.py", SMALL, "ratio memory/SSD"),
        ("ckptd_s3.py", SMALL, "ratio S3 tier / boto3"),
        ("ckpt_stall.py", ["--dim", "96", "--layers", "1", "--steps", "2"], '"ours_over_floor"'),
    ],
)
def test_each_checkpoint_benchmark_runs_and_prints_its_ratio(
    script: str, args: list[str], prints: str
) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert prints in result.stdout
