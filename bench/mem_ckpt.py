"""Memory checkpoints every step (--mem-ckpt-every 1): what they cost training.

The same `scaletrain run` (debug model, --ranks on 2 simulated nodes, a durable checkpoint every
--ckpt-every steps) with and without `--mem-ckpt-every 1`, tokens/s from its summary, the runs
alternating pair after pair in one command; printed: both, their ratio (the issue's target:
>= 0.95), and how many of the memory saves due were skipped because the previous save was still
streaming (each skip is a step a loss then costs on top).

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/mem_ckpt.py [--pairs 2] [--ranks 4] [--steps 40]
[--ckpt-every 10]`.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import tempfile
from pathlib import Path

from scaletrain.app.embedded import RunOptions, run
from scaletrain.app.stack import Workdir

_SKIPPED = re.compile(r"\[trainer\] memory checkpoints: (\d+) of (\d+) skipped")


def train(root: Path, mem_every: int, args: argparse.Namespace) -> tuple[float, int, int]:
    """(tokens/s, memory saves skipped, memory saves due) of one run, the last two from the
    trainer's closing line about them."""
    out = io.StringIO()
    options = RunOptions(
        workdir=Workdir(root),
        ranks=args.ranks,
        nodes=2,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        trainer_args=["--mem-ckpt-every", str(mem_every)] if mem_every else [],
        upload_wait_s=0,
    )
    tokens_s = run(options, out).tokens_per_s
    found = _SKIPPED.search(out.getvalue())
    return tokens_s, int(found.group(1)) if found else 0, int(found.group(2)) if found else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="with/without run pairs")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=10)
    args = parser.parse_args()
    speed: dict[int, list[float]] = {0: [], 1: []}
    skipped = due = 0
    with tempfile.TemporaryDirectory(prefix="mem-ckpt-bench-") as tmp:
        for pair in range(args.pairs):
            for every in (1, 0):
                tokens_s, skips, dues = train(Path(tmp) / f"pair{pair}-m{every}", every, args)
                speed[every].append(tokens_s)
                skipped, due = skipped + skips, due + dues
                print(f"pair {pair}, --mem-ckpt-every {every}: {tokens_s:,.0f} tokens/s")
    med = {k: statistics.median(v) for k, v in speed.items()}
    ratio = med[1] / med[0]
    print(f"training without memory checkpoints      {med[0]:9,.0f} tokens/s")
    print(f"training with --mem-ckpt-every 1         {med[1]:9,.0f} tokens/s")
    print(f"memory saves skipped (the previous save still streaming): {skipped} of {due}")
    print(f"ratio with / without: {ratio:.3f} (target >= 0.95)")
    summary = {"tokens_s_without": med[0], "tokens_s_with": med[1], "ratio": ratio}
    print(json.dumps({k: round(v, 3) for k, v in summary.items()} | {"skipped": skipped}))


if __name__ == "__main__":
    main()
