"""False alarms of the run-health detectors on clean runs: how often do they cry wolf?

Clean `scaletrain run`s (no fault injected) on real prepared data (the example dataset of
`scaletrain data example`: stdlib sources, a BPE trained in seconds), over several layouts and
seeds, each through the whole embedded stack with every detector on as by default: the step
guard (loss spikes, replays, the cross-replica SDC check where the layout has replicas) and
telemetry's straggler detector. Every verdict counts as a false alarm, since nothing was wrong:
SDC verdicts, straggler flags, loss spikes not found to be the data's, and replays. The goal
(issue 38): 0 SDC verdicts, and at most 1 replay per 1,000 steps.

    OMP_NUM_THREADS=1 .venv/bin/python bench/false_alarms.py [--steps 2500] [--seeds 0,1]

prints a row per run and the totals per 1,000 steps, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> (ranks, layout flags): FSDP alone, HSDP (replicas: the cross-replica SDC check), TP.
LAYOUTS = {
    "fsdp2": (2, []),
    "hsdp2x2": (4, ["--dp-replicate", "2"]),
    "tp2": (2, ["--tp", "2"]),
}
# What counts as a false alarm on a clean run, from the summary's health events.
ALARMS = ("sdc", "straggler", "loss_spike", "replay", "alert")


def scaletrain(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args], env=env, capture_output=True, text=True
    )


def clean_run(root: Path, data: Path, layout: str, seed: int, steps: int) -> dict[str, object]:
    """One clean run's alarms (its summary's health events, the data's spikes apart)."""
    ranks, flags = LAYOUTS[layout]
    done = scaletrain(
        "run", "--workdir", str(root / f"{layout}-{seed}"), "--ranks", str(ranks), *flags,
        "--data", str(data / "train"), "--seed", str(seed), "--steps", str(steps),
        "--ckpt-every", str(steps), "--json",
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{layout} seed {seed} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout)
    events = summary["health_events"]
    alarms = {kind: int(events.get(kind, 0)) for kind in ALARMS}
    # A loss spike the step guard found to be the data's closed its own alert: not an alarm.
    alarms["loss_spike"] -= int(summary.get("data_spikes", 0))
    return {"layout": layout, "seed": seed, "steps": steps, **alarms,
            "data_spikes": int(summary.get("data_spikes", 0)),
            "tokens_per_s": summary["tokens_per_s"], "wall_s": summary["wall_s"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2500, help="steps of each run")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="false-alarms-") as tmp:
        root = Path(tmp)
        made = scaletrain("data", "example", "--out", str(root / "data"))
        if made.returncode != 0:
            raise SystemExit(f"scaletrain data example failed:\n{made.stderr[-3000:]}")
        print(f"{'layout':<9}{'seed':>5}{'steps':>7}" + "".join(f"{a:>11}" for a in ALARMS)
              + f"{'data spikes':>13}")  # fmt: skip
        for layout in args.layouts.split(","):
            for seed in seeds:
                row = clean_run(root, root / "data", layout, seed, args.steps)
                rows.append(row)
                print(f"{layout:<9}{seed:>5}{args.steps:>7}"
                      + "".join(f"{row[a]:>11}" for a in ALARMS)
                      + f"{row['data_spikes']:>13}", flush=True)  # fmt: skip
    steps = sum(int(r["steps"]) for r in rows)
    totals = {a: sum(int(r[a]) for r in rows) for a in ALARMS}
    per_1000 = {a: 1000 * n / steps for a, n in totals.items()}
    counted = ", ".join(f"{a} {n}" for a, n in totals.items())
    rates = ", ".join(f"{a} {v:.2f}" for a, v in per_1000.items())
    print(f"{steps:,} clean steps: {counted}; per 1,000 steps: {rates}")
    met = totals["sdc"] == 0 and per_1000["replay"] <= 1.0
    print(f"goal (0 SDC verdicts, at most 1 replay per 1,000 steps): {'met' if met else 'NOT met'}")
    print(json.dumps({"steps": steps, "totals": totals, "per_1000": per_1000, "met": met,
                      "runs": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
