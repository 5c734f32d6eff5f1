"""Recovery of a lost node from its peers' copies, against recovery from S3 alone.

The same 2-node chaos drill twice in this command (`scaletrain chaos --nodes 2`, one fault:
`kill-node`, which SIGKILLs node1's agent, ranks and ckptd, deletes its data dir and starts a
fresh ckptd in its place, a replaced machine): once with R=2 (each node's part copied to the
other node after every save) and once with R=1 (no copies: node1's part comes back from S3).
Recovery is timed from the fresh ckptd's start to the first training step of the restarted job
(telemetry's record of it), and the restore's bytes are counted per copy that served them
(memory@node0, SSD@node0, S3...), as the trainer reports them. The two drills alternate, one
pair after another, so that both see the same load.
Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/node_recovery.py [--pairs 1] [--dim 256]`.

With `--secure`, instead: the R=2 drill with the embedded stack's TLS and tokens (`scaletrain
chaos --secure`) beside the same drill in plaintext, alternating; the ratio of the recovery times
TLS / plaintext (goal <= 1.2).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path

from scaletrain.app.chaos import ChaosOptions, chaos, parse_schedule
from scaletrain.app.stack import Workdir


def drill(
    root: Path, replicas: int, args: argparse.Namespace, secure: bool = False
) -> tuple[float, dict[str, int]]:
    """(seconds from the fresh ckptd to the first step after the restart, bytes per source)."""
    options = ChaosOptions(
        workdir=Workdir(root),
        schedule=parse_schedule(f"kill-node@{args.fault_step}"),
        ranks=args.ranks,
        nodes=2,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        trainer_args=[
            *("--dim", str(args.dim), "--n-layers", str(args.layers)),
            *("--replicas", str(replicas)),
        ],
        secure=secure,
    )
    report = chaos(options, io.StringIO())
    if not report.completed:
        raise SystemExit(f"the R={replicas} drill failed; logs in {report.workdir}")
    (fault,) = report.faults
    recovery = report.recoveries[0]
    if fault["fresh_ckptd_at"] is None or recovery["first_step_at"] is None:
        raise SystemExit(f"the R={replicas} drill has no recovery to time: {report.faults}")
    return recovery["first_step_at"] - fault["fresh_ckptd_at"], recovery["restored_from"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1, help="R=2/R=1 drill pairs")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--fault-step", type=int, default=14)
    parser.add_argument("--dim", type=int, default=256, help="model width (state size)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--secure", action="store_true", help="R=2 with TLS vs plaintext")
    args = parser.parse_args()
    if args.secure:
        secure_main(args)
        return
    seconds: dict[int, list[float]] = {2: [], 1: []}
    s3_bytes: dict[int, list[int]] = {2: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="node-recovery-bench-") as tmp:
        for pair in range(args.pairs):
            for r in (2, 1):
                took, sources = drill(Path(tmp) / f"pair{pair}-r{r}", r, args)
                seconds[r].append(took)
                s3_bytes[r].append(sources.get("S3", 0))
                print(f"R={r}: recovered in {took:.1f} s, restore read {sources}")
    med = {r: statistics.median(v) for r, v in seconds.items()}
    print(f"recovery from the peers' copies (R=2): {med[2]:.1f} s, {max(s3_bytes[2])} B from S3")
    print(f"recovery from S3 alone (R=1):          {med[1]:.1f} s, {max(s3_bytes[1])} B from S3")
    print(f"ratio recovery with replicas / from S3 only: {med[2] / med[1]:.2f}")
    print(json.dumps({
        "recovery_s": med, "s3_bytes": {r: max(v) for r, v in s3_bytes.items()},
        "ratio": round(med[2] / med[1], 3),
    }))  # fmt: skip


def secure_main(args: argparse.Namespace) -> None:
    seconds: dict[str, list[float]] = {"tls": [], "plain": []}
    sources: dict[str, list[dict[str, int]]] = {"tls": [], "plain": []}
    with tempfile.TemporaryDirectory(prefix="node-recovery-tls-bench-") as tmp:
        for pair in range(args.pairs):
            for name in ("tls", "plain"):
                took, served = drill(Path(tmp) / f"pair{pair}-{name}", 2, args, name == "tls")
                seconds[name].append(took)
                sources[name].append(served)
                print(f"R=2 {name}: recovered in {took:.1f} s, restore read {served}", flush=True)
    med = {n: statistics.median(v) for n, v in seconds.items()}
    s3 = {n: max(s.get("S3", 0) for s in v) for n, v in sources.items()}
    for name in ("tls", "plain"):
        print(f"recovery from peer copies, {name:<5}: {med[name]:.1f} s, {s3[name]} B from S3")
    print(f"ratio recovery TLS / plaintext: {med['tls'] / med['plain']:.2f} (goal <= 1.2)")
    print(json.dumps({
        "recovery_s": med, "s3_bytes": s3, "sources": sources,
        "ratio": round(med["tls"] / med["plain"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
