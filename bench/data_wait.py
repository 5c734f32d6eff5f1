"""How long training waits for its data, at `make run`'s configuration.

`make run` trains the debug model on 4 CPU ranks on the example dataset (`scaletrain data
example`: BPE tokens of stdlib sources) with document masking and a validation loss. The loader
reads each next batch in a background thread while the step trains, so a step's data phase is
only the wait for a batch that is not ready yet. This runs the same `scaletrain run` (fewer
steps) and reads every rank's phases back from telemetry: the data wait over the step time, both
summed over every rank and step after the first (its batch cannot have been read ahead), in one
run (target < 1%).

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/data_wait.py [--steps 60] [--ranks 4]`.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path


def scaletrain(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        sys.exit(f"scaletrain {args[0]} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="data-wait-") as tmp:
        root = Path(tmp)
        scaletrain("data", "example", "--out", str(root / "data"))
        summary = json.loads(
            scaletrain(
                "run", "--workdir", str(root / "work"), "--json", "--ranks", str(args.ranks),
                "--steps", str(args.steps), "--ckpt-every", str(max(args.steps // 3, 1)),
                "--data", str(root / "data" / "train"), "--document-masking",
                "--eval-data", str(root / "data" / "heldout"), "--eval-every",
                str(max(args.steps // 6, 1)),
            )
        )  # fmt: skip
        with sqlite3.connect(root / "work" / "telemetry.db") as db:
            data_s, step_s, worst = db.execute(
                "SELECT SUM(data_s), SUM(step_s), MAX(data_s / step_s) FROM rank_steps "
                "WHERE run_id = ? AND step > 1",
                (summary["run_id"],),
            ).fetchone()
    ratio = data_s / step_s
    print(
        f"steps 2..{args.steps} on {args.ranks} ranks: data wait {data_s:.3f} s of "
        f"{step_s:.1f} s of steps (summed over ranks); worst single step {worst:.2%}"
    )
    print(f"ratio data wait/step time: {ratio:.4f} ({ratio:.2%}; target < 1%)")


if __name__ == "__main__":
    main()
