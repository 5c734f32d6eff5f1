"""How fast does the straggler detector flag a rank or a node slowed 1.1x, 1.3x or 2x at 16,384
ranks, and how often does it flag a clean rank, under the compute-time noise of real runs?

The noise is this machine's: `bench/data/compute_noise.json` holds, for every rank and step of
finished runs (warm-up steps left out), log(compute_s / the step's median compute_s across
ranks), and the median step time that turns steps into hours (`--from-db PATH`, once per
telemetry database, measures them again and rewrites the file). The median of a few ranks moves
with each of them, so those residuals are narrower than a rank's noise about the median of a
large cluster; they are widened by the factor that undoes this for the source's world size
(by simulation, stored in the file).

16,384 ranks on nodes of 8 (`NodeMap` as in `bench/telemetry_detect.py`) each compute
base x exp(noise) seconds a step, the noise drawn from those residuals independently per rank and
step, with a little Gaussian jitter (a smoothed bootstrap, so a few hundred residuals are not a
few hundred exact values); `--block L` draws runs of L consecutive residuals of one rank instead,
keeping the noise's correlation from step to step; `--noise-scale` multiplies it. Cases, each with
the detector's default policy (`--relative-only`: its relative-score rule alone, the detector as
it was before the CUSUM):
  - clean: no rank slowed, `--clean-steps` steps; every flag is a false flag, counted per
    rank-hour (ranks x steps x measured step time) and per 1,000 steps of the whole cluster; with
    none, the rate is below 3 / rank-hours at 95% confidence ("< x" in the table);
  - a rank slowed 1.1x, 1.3x, 2x from step `--start` on, `--trials` times (a fresh detector and a
    random rank each time): steps to flag = how many slowed steps the detector had seen when a
    flag first named that rank (flagged at step `--start` itself: 1);
  - a node (its 8 ranks) slowed the same: steps to a NodeFlag naming it, and how many rank flags
    named its ranks (0: the node is one finding), watched `--after` steps past its flag.
"never" means not flagged within `--max-steps` slowed steps. Prints a table and one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python bench/straggler_scale.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/straggler_scale.py --relative-only   # before
    OMP_NUM_THREADS=1 .venv/bin/python bench/straggler_scale.py --noise-scale 0.25
    OMP_NUM_THREADS=1 .venv/bin/python bench/straggler_scale.py \\
        --from-db /tmp/hsdp-ref/telemetry.db --from-db /tmp/fsdp-ref/telemetry.db
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from telemetry.detect import NodeFlag, StragglerDetector, StragglerFlag, StragglerPolicy
from telemetry.rollup import NodeMap

NOISE_FILE = Path(__file__).parent / "data" / "compute_noise.json"
# Steps left out at the start of every run: the first compiles and warms caches (5x slower here).
WARMUP_STEPS = 3
FACTORS = (1.1, 1.3, 2.0)
# The goals: steps to flag a slowed rank, false flags per rank-hour.
GOAL_STEPS = {1.1: 5, 1.3: 2}
GOAL_FALSE_PER_RANK_HOUR = 0.001


def median_spread_widening(world: int, samples: int = 200_000) -> float:
    """How much wider a rank's noise is than its residual about the median of `world` ranks (the
    median moves with the rank): 1 / std(e - median(e)) for unit normal e, by simulation."""
    if world < 2:
        return 1.0
    e = np.random.default_rng(0).standard_normal((samples, world))
    return float(1 / (e - np.median(e, axis=1, keepdims=True)).std())


def noise_from_dbs(paths: list[str], warmup: int = WARMUP_STEPS) -> dict[str, object]:
    """The compute-time noise of every finished run in the telemetry databases at `paths`: per
    run attempt and rank, log(compute_s / the step's median across ranks), warm-up steps left out
    (and any step some rank did not report)."""
    series: list[list[float]] = []
    sources = []
    step_s, compute_s, worlds = [], [], []
    for path in paths:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            runs = db.execute(
                "SELECT run_id, world_size, hardware, started_at, status, dp_replicate, dp_shard,"
                " tp, pp FROM runs WHERE status = 'finished' ORDER BY started_at"
            ).fetchall()
            for run_id, world, hardware, started, status, dpr, dps, tp, pp in runs:
                rows = db.execute(
                    "SELECT attempt, step, rank, compute_s, step_s FROM rank_steps"
                    " WHERE run_id = ? AND compute_s > 0 ORDER BY attempt, step, rank",
                    (run_id,),
                ).fetchall()
                attempts = sorted({row[0] for row in rows})
                for attempt in attempts:
                    steps: dict[int, dict[int, tuple[float, float]]] = {}
                    for _, step, rank, compute, wall in (r for r in rows if r[0] == attempt):
                        steps.setdefault(step, {})[rank] = (compute, wall)
                    kept = [s for s in sorted(steps)[warmup:] if len(steps[s]) == world]
                    if not kept:
                        continue
                    times = np.array([[steps[s][r][0] for r in range(world)] for s in kept])
                    walls = np.array([[steps[s][r][1] for r in range(world)] for s in kept])
                    residual = np.log(times / np.median(times, axis=1, keepdims=True))
                    series += [[round(float(v), 6) for v in residual[:, r]] for r in range(world)]
                    step_s.append(float(np.median(walls)))
                    compute_s.append(float(np.median(times)))
                    worlds.append(world)
                    sources.append({
                        "db": path, "run_id": run_id, "attempt": attempt, "started_at": started,
                        "status": status, "hardware": hardware, "world_size": world,
                        "layout": f"dp_replicate={dpr} dp_shard={dps} tp={tp} pp={pp}",
                        "steps_used": f"{kept[0]}-{kept[-1]} ({len(kept)})",
                        "median_step_s": round(step_s[-1], 4),
                        "median_compute_s": round(compute_s[-1], 4),
                    })  # fmt: skip
    if not series:
        raise SystemExit(f"no finished run with compute times in {paths}")
    flat = np.concatenate([np.array(s) for s in series])
    widening = median_spread_widening(min(worlds))
    quartiles = np.percentile(flat, [25, 75])
    lag1 = [float(np.corrcoef(s[:-1], s[1:])[0, 1]) for s in map(np.array, series) if len(s) > 2]
    return {
        "what": "log(compute_s / median compute_s of the step across ranks), one list per run "
        "attempt and rank, in step order; bench/straggler_scale.py draws its noise from them",
        "sources": sources,
        "warmup_steps_left_out": warmup,
        "median_step_s": round(statistics.median(step_s), 4),
        "median_compute_s": round(statistics.median(compute_s), 4),
        "widening": round(widening, 4),
        "widening_why": f"the median of {min(worlds)} ranks moves with each of them: residuals "
        "about it are narrower than a rank's noise about a large cluster's median by this factor "
        "(simulated, normal noise; 1.10 for t(4) noise)",
        "summary": {
            "residuals": int(flat.size),
            "std": round(float(flat.std()), 4),
            "robust_std": round(float((quartiles[1] - quartiles[0]) / 1.349), 4),
            "percentiles_0.5_1_5_50_95_99_99.5": [
                round(float(v), 4) for v in np.percentile(flat, [0.5, 1, 5, 50, 95, 99, 99.5])
            ],
            "min": round(float(flat.min()), 4),
            "max": round(float(flat.max()), 4),
            "lag1_autocorrelation_mean": round(statistics.fmean(lag1), 3),
        },
        "residuals": series,
    }


class Noise:
    """Draws log compute-time noise for `ranks` ranks, a step at a time, from the residuals."""

    def __init__(self, data: dict, ranks: int, scale: float, block: int, seed: int) -> None:
        self.series = [np.array(s, dtype=float) for s in data["residuals"]]
        flat = np.concatenate(self.series)
        self.flat = flat * data["widening"] * scale
        # Where a run of `block` residuals of one rank may start.
        ends = np.cumsum([len(s) for s in self.series])
        self.starts = np.concatenate(
            [
                np.arange(end - len(s), end - block + 1)
                for s, end in zip(self.series, ends, strict=True)
            ]
        )
        # Silverman's bandwidth for the jitter of the smoothed bootstrap.
        spread = min(self.flat.std(), np.subtract(*np.percentile(self.flat, [75, 25])) / 1.349)
        self.jitter = 0.9 * spread * flat.size ** (-1 / 5)
        self.ranks, self.block = ranks, block
        self.rng = np.random.default_rng(seed)

    def steps(self, chunk: int = 64) -> Iterator[np.ndarray]:
        """Every rank's noise, one step after another, forever."""
        blocks = max(1, chunk // self.block)
        while True:
            starts = self.rng.choice(self.starts, size=(blocks, self.ranks))
            picked = starts[:, None, :] + np.arange(self.block)[None, :, None]
            noise = self.flat[picked].reshape(blocks * self.block, self.ranks)
            noise += self.rng.normal(0.0, self.jitter, noise.shape)
            yield from noise


@dataclass
class World:
    nodes: NodeMap
    policy: StragglerPolicy
    base_s: float

    def detector(self) -> StragglerDetector:
        return StragglerDetector(self.nodes, self.policy)


def clean(world: World, noise: Noise, steps: int) -> dict[str, int]:
    """Flags raised on a clean cluster over `steps` steps: all false."""
    detector, draws = world.detector(), noise.steps()
    ranks = nodes = 0
    for step in range(1, steps + 1):
        for flag in detector.observe(step, world.base_s * np.exp(next(draws))):
            ranks += isinstance(flag, StragglerFlag)
            nodes += isinstance(flag, NodeFlag)
    return {"rank_flags": ranks, "node_flags": nodes}


def slowed(
    world: World, noise: Noise, factor: float, node: bool, args: argparse.Namespace, seed: int
) -> dict[str, object]:
    """Steps to flag one rank (or node) slowed by `factor` from step `args.start`, per trial."""
    rng = np.random.default_rng(seed)
    ranks = len(world.nodes.of_rank)
    found: list[int | None] = []
    other = split = 0
    for _ in range(args.trials):
        detector, draws = world.detector(), noise.steps()
        if node:
            target = int(rng.integers(len(world.nodes.names)))
            slow = np.flatnonzero(world.nodes.of_rank == target)
        else:
            slow = np.array([int(rng.integers(ranks))])
        name = world.nodes.names[world.nodes.of_rank[slow[0]]]
        flagged_at = None
        last = args.start + args.max_steps - 1
        step = 0
        while step < last or (flagged_at is not None and step < flagged_at + args.after):
            step += 1
            work = world.base_s * np.exp(next(draws))
            if step >= args.start:
                work[slow] *= factor
            for flag in detector.observe(step, work):
                if isinstance(flag, NodeFlag if node else StragglerFlag) and (
                    flag.node == name if node else flag.rank == slow[0]
                ):
                    flagged_at = step if flagged_at is None else flagged_at
                elif isinstance(flag, StragglerFlag) and flag.rank in slow:
                    split += 1
                else:
                    other += 1
            if flagged_at is not None and step >= flagged_at + args.after:
                break
        found.append(None if flagged_at is None else flagged_at - args.start + 1)
    caught = sorted(s for s in found if s is not None)
    return {
        "steps": found,
        "median": statistics.median(caught) if len(caught) == len(found) else None,
        "max": max(caught) if len(caught) == len(found) else None,
        "never": len(found) - len(caught),
        "within_goal": sum(1 for s in caught if s <= GOAL_STEPS.get(factor, math.inf)),
        "rank_flags_on_slow_node": split,
        "other_flags": other,
    }


def describe(result: dict[str, object], trials: int, max_steps: int) -> str:
    if result["never"] == trials:
        return f"never within {max_steps}"
    if result["never"]:
        caught = sorted(s for s in result["steps"] if s is not None)
        return f"{result['never']}/{trials} never; {caught[0]}-{caught[-1]}"
    return f"median {result['median']:g}, max {result['max']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--clean-steps", type=int, default=20_000)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--start", type=int, default=10, help="first slowed step")
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--after", type=int, default=20, help="steps watched past a node's flag")
    parser.add_argument("--noise-scale", type=float, default=1.0)
    parser.add_argument("--block", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--relative-only", action="store_true")
    parser.add_argument("--from-db", action="append", default=[], metavar="PATH")
    args = parser.parse_args()
    if args.from_db:
        NOISE_FILE.parent.mkdir(exist_ok=True)
        NOISE_FILE.write_text(json.dumps(noise_from_dbs(args.from_db), indent=1) + "\n")
    data = json.loads(NOISE_FILE.read_text())
    nodes = NodeMap.of_hosts(
        args.ranks, {r: f"node-{r // args.per_node:05d}" for r in range(args.ranks)}
    )
    policy = StragglerPolicy(cusums=()) if args.relative_only else StragglerPolicy()
    world = World(nodes, policy, data["median_compute_s"])
    noise = Noise(data, args.ranks, args.noise_scale, args.block, args.seed)
    began = time.perf_counter()
    false = clean(world, noise, args.clean_steps)
    total = false["rank_flags"] + false["node_flags"]
    rank_hours = args.ranks * args.clean_steps * data["median_step_s"] / 3600
    per_rank_hour = total / rank_hours if total else 3 / rank_hours
    cases = {}
    for index, factor in enumerate(FACTORS):
        for node in (False, True):
            key = f"{'node' if node else 'rank'} {factor:g}x"
            cases[key] = slowed(world, noise, factor, node, args, args.seed + 1 + 2 * index + node)
    seconds = time.perf_counter() - began
    noise_std = float(noise.flat.std())
    print(
        f"{args.ranks} ranks on nodes of {args.per_node}, policy {policy}\n"
        f"noise: {data['summary']['residuals']} residuals of {len(data['sources'])} run(s), "
        f"std {noise_std:.4f} (x{args.noise_scale:g}, widened x{data['widening']:.3f}), "
        f"jitter {noise.jitter:.4f}, blocks of {args.block}; step {data['median_step_s']} s"
    )
    print(f"{'case':<12}{'steps to flag':<28}{'goal':<12}{'split':>6}{'other':>7}")
    for key, result in cases.items():
        factor = float(key.split()[1][:-1])
        goal = GOAL_STEPS.get(factor)
        met = f"{result['within_goal']}/{args.trials} <= {goal}" if goal else ""
        print(
            f"{key:<12}{describe(result, args.trials, args.max_steps):<28}{met:<12}"
            f"{result['rank_flags_on_slow_node']:>6}{result['other_flags']:>7}"
        )
    bound = "" if total else "< "
    print(
        f"clean: {total} false flags ({false['rank_flags']} rank, {false['node_flags']} node) in "
        f"{args.clean_steps} steps = {rank_hours:,.0f} rank-hours: {bound}{per_rank_hour:.2g} per "
        f"rank-hour (goal {GOAL_FALSE_PER_RANK_HOUR}), {total / args.clean_steps * 1000:.2g} per "
        f"1,000 steps; {seconds:.0f} s"
    )
    report = {
        "ranks": args.ranks,
        "relative_only": args.relative_only,
        "noise_scale": args.noise_scale,
        "block": args.block,
        "noise_std": round(noise_std, 4),
        "step_s": data["median_step_s"],
        "clean_steps": args.clean_steps,
        "false_flags": false,
        "rank_hours": round(rank_hours, 1),
        "false_per_rank_hour": (None if not total else round(per_rank_hour, 6)),
        "false_per_rank_hour_below_95pct": None if total else round(per_rank_hour, 6),
        "false_per_1000_steps": round(total / args.clean_steps * 1000, 3),
        "cases": {key: {k: v for k, v in r.items() if k != "steps"} for key, r in cases.items()},
        "steps_to_flag": {key: r["steps"] for key, r in cases.items()},
        "seconds": round(seconds, 1),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
