"""The checked-in fuzz corpus replayed, and a short coverage-guided run of each target.

The long campaign is a documented command (README, "Security"; `run.py`); here each target runs
for a few seconds from the corpus so that `make test` catches a parser change that crashes on
inputs close to the known ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz_targets import ORDER, TARGETS

HERE = Path(__file__).parent
CORPUS = HERE / "corpus"
SECONDS = int(os.environ.get("SCALETRAIN_FUZZ_SECONDS", "2"))


@pytest.mark.parametrize(
    "target,path",
    [(t, p) for t in TARGETS for p in sorted((CORPUS / t).iterdir())],
    ids=lambda value: value if isinstance(value, str) else value.name,
)
def test_every_corpus_input_is_parsed_or_refused_in_one_line(target: str, path: Path) -> None:
    TARGETS[target](path.read_bytes())


def test_a_short_coverage_guided_run_of_every_target_finds_no_crash(tmp_path: Path) -> None:
    seeds, found = tmp_path / "seeds", tmp_path / "found"
    seeds.mkdir()
    found.mkdir()
    for number, target in enumerate(ORDER):  # the first byte picks the target (`every`)
        for path in (CORPUS / target).iterdir():
            (seeds / f"{target}-{path.name}").write_bytes(bytes([number]) + path.read_bytes())
    run = subprocess.run(
        [
            sys.executable,
            str(HERE / "run.py"),
            "every",
            f"-max_total_time={SECONDS}",
            "-print_final_stats=1",
            str(found),
            str(seeds),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    stats = dict(
        line.removeprefix("stat::").split(":", 1)
        for line in run.stderr.splitlines()
        if line.startswith("stat::")
    )
    print(f"fuzz: {stats['number_of_executed_units'].strip()} executions in {SECONDS}s")
