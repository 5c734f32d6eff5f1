"""Training blocked per save with two simulated nodes, against one: each rank saves to its own
node's ckptd, so a second node should cost the loop nothing.

Runs the same job twice in this command with `scaletrain run`'s embedded stack, on one node (every
rank to one ckptd) and on two (half the ranks each, two ckptds, the two-phase commit), and reads
from telemetry how long each save blocked training (the trainer's staging into host buffers) and
how long it streamed in the background (to committed on every node). Medians over the saves,
the first of each run left out (it allocates the buffers). The runs alternate, one pair after
another, so both see the same load. Run:
`OMP_NUM_THREADS=1 .venv/bin/python bench/multinode_save.py [--ranks 4] [--steps 24] [--pairs 1]`.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path

from scaletrain.app.embedded import RunOptions, run
from scaletrain.app.stack import Workdir
from telemetry.db import connect
from telemetry.views.checkpoints import checkpoint_timeline


def one_run(root: Path, nodes: int, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Blocking and background seconds of every save but the first of one run."""
    workdir = Workdir(root / f"nodes{nodes}")
    options = RunOptions(
        workdir=workdir,
        ranks=args.ranks,
        nodes=nodes,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        trainer_args=["--dim", str(args.dim), "--n-layers", str(args.layers)],
        upload_wait_s=0,
    )
    summary = run(options, io.StringIO())
    engine = connect(workdir.db_url)
    try:
        timeline = checkpoint_timeline(engine, summary.run_id)
    finally:
        engine.dispose()
    saves = timeline.dropna(subset=["blocking_s"]).sort_values("step").iloc[1:]
    return list(saves["blocking_s"]), list(saves["background_s"].dropna())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--ckpt-every", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256, help="model width (state size)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=1, help="one-node/two-node run pairs")
    args = parser.parse_args()
    blocking: dict[int, list[float]] = {1: [], 2: []}
    background: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="multinode-bench-") as tmp:
        for pair in range(args.pairs):
            for nodes in (1, 2):
                b, g = one_run(Path(tmp) / f"pair{pair}", nodes, args)
                blocking[nodes] += b
                background[nodes] += g
    med = {n: (statistics.median(blocking[n]), statistics.median(background[n])) for n in (1, 2)}
    for n in (1, 2):
        print(
            f"{n} node(s): blocked {med[n][0] * 1000:.1f} ms per save, background "
            f"{med[n][1] * 1000:.0f} ms ({len(blocking[n])} saves)"
        )
    ratio = med[2][0] / med[1][0]
    print(f"ratio blocked per save 2 nodes/1 node: {ratio:.2f} (target <= 1.1)")
    print(f"ratio background per save 2 nodes/1 node: {med[2][1] / med[1][1]:.2f}")
    print(
        json.dumps(
            {"blocked_ratio": round(ratio, 3), "blocked_ms": {n: med[n][0] * 1e3 for n in (1, 2)}}
        )
    )


if __name__ == "__main__":
    main()
