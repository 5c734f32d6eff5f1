"""How much silent data corruption does the step guard catch, and where are its holes?

Single bit flips (--inject-sdc ...,element=random,bits=CLASS) at random elements, of every class
of bit (sign, exponent, upper and lower half of the mantissa), into every target the injector
reaches (`trainer.health.faults`): gradients as the optimizer reads them (grad), parameters and
optimizer state at rest (param, optim), a block's forward output (activation), the gradient
backward sends into a block (backward), an FSDP reduce-scatter's result (reduction); on every
4-rank layout of the trainer that reduce-scatters: HSDP 2x2, FSDP 4, FSDP 2 x TP 2, PP 2 x FSDP 2.

One spawned 4-rank gloo job runs everything with the trainer's own step (`trainer.step.train_step`)
under the trainer's own guard (policy rollback), on a small Llama. Per layout it trains
`PREFIX` clean steps (the spike rule needs that much history), copies the state, and then runs
every trial from that copy: steps PREFIX+1..PREFIX+3 under a fresh guard that carries on the
prefix's loss history, the flip striking step PREFIX+1 on a rank drawn at random. Each trial is
  detected  the guard raised an SDC event: % of trials, % naming exactly the struck rank, and the
            latency (steps from the flip to the step whose check raised it: 0 for a flip caught
            in its own step, 1 for one at rest caught before the next);
  harmless  not detected, and the final loss and parameters equal a clean run's within fp32 noise
            (every element within 1e-6 relative, ~8 ulps, of the clean run's);
  missed    not detected, and training was changed beyond that.
Each trial runs twice: without (before) and with (after) the reduce-scatter check of
`trainer.health.reduction`, which closes the hole the first matrix shows (a reduce-scatter's
result has no replica to compare with). Then the check's cost: steps with it off and on, in
alternating blocks, median step times and their ratio (goal <= 1.01).

    OMP_NUM_THREADS=1 .venv/bin/python bench/sdc_coverage.py [--trials 2]
    OMP_NUM_THREADS=1 .venv/bin/python bench/sdc_coverage.py --quick   # a smoke run
    OMP_NUM_THREADS=1 .venv/bin/python bench/sdc_coverage.py --trials 0 --layouts fsdp4 \
        --seq-len 128 --global-batch 32 --cost-blocks 8   # the cost at 1,024 tokens a rank

prints the matrix (before | after), the totals per target, the cost, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.data.corpus import stdlib_corpus
from trainer.data.loader import DeterministicLoader
from trainer.health.faults import BIT_CLASSES, SDC_TARGETS, FaultPlan, SdcFault
from trainer.health.guard import StepGuard, replica_groups
from trainer.health.inject import FaultInjector
from trainer.health.snapshot import StateSnapshot, local
from trainer.health.stats import SpikeRule
from trainer.optim import build_optimizer
from trainer.parallel.dims import MESH_DIMS, validate_layout
from trainer.parallel.parallelize import ParallelModel, build_model
from trainer.parallel.probe import config_from_layout
from trainer.step import train_step

WORLD = 4
LAYOUTS = {
    "hsdp2x2": {"dp_replicate": 2},
    "fsdp4": {},
    "dp2.tp2": {"tp": 2},
    "pp2.dp2": {"pp": 2},
}
MODEL = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4}
# Clean steps before the trials: the spike rule judges nothing with less history.
PREFIX = SpikeRule().min_history
STRIKE = PREFIX + 1
# Steps of a trial: the struck one and the next (a flip at rest is caught before it).
TRIAL_STEPS = 2
# fp32 noise: how far from the clean run the final loss may end, and each parameter tensor's
# elements, relative to the largest, for a flip to be harmless (~8 ulps).
NOISE = 1e-6
MODES = ("before", "after")


@dataclass(frozen=True)
class Trial:
    """One flip and what came of it, as rank 0 saw it."""

    mode: str
    layout: str
    target: str
    bits: str
    rank: int
    detected: bool
    # The ranks the SDC events named, and the step whose check raised the first.
    named: list[int]
    latency: int | None
    # How far the final loss and parameters ended from a clean run's (see `deviation`), and
    # whether that is within fp32 noise.
    deviation: float
    harmless: bool
    stages: list[str]


@dataclass(frozen=True)
class Final:
    """Where a trial ended: the loss of its last step and this rank's parameter shards."""

    loss: float
    params: list[torch.Tensor]


class Layout:
    """One layout built on this rank, trained to the end of the prefix, and its trials."""

    def __init__(self, name: str, rank: int, device: torch.device, shape: dict[str, int]) -> None:
        """`shape`: the batch's seq_len and global_batch."""
        layout = {"name": name, "parallel": LAYOUTS[name], "model": MODEL, **shape}
        self.cfg = config_from_layout(layout)
        self.rank, self.device = rank, device
        mesh = validate_layout(self.cfg, WORLD).build_mesh(device.type)
        self.replicas = replica_groups(mesh.world.mesh, MESH_DIMS.index("dp_replicate"))
        self.parallel: ParallelModel = build_model(self.cfg, mesh, device)[0]
        self.optimizer = build_optimizer(self.parallel.model, self.cfg)
        loader = DeterministicLoader(
            stdlib_corpus(self.cfg.corpus_bytes), self.cfg.seq_len, self.cfg.global_batch,
            mesh.dp_rank, mesh.dims.dp_size, seed=self.cfg.seed,
        )  # fmt: skip
        self.batches = [loader.next_batch() for _ in range(PREFIX + TRIAL_STEPS)]
        self.events: list[tuple[str, int, int, dict[str, str]]] = []
        self.prefix = self.guard(self.injector(FaultPlan()), check=True)
        for step in range(1, PREFIX + 1):
            self.step(self.prefix, step)
        self.saved = StateSnapshot(self.parallel.model, self.optimizer)
        self.saved.capture()
        self.clean = {mode: self.run(FaultPlan(), mode == "after")[0] for mode in MODES}
        # A clean run raises nothing, with or without the check (counted as false alarms).
        self.false_alarms = len(self.events)

    def injector(self, plan: FaultPlan) -> FaultInjector:
        return FaultInjector(plan, self.rank, self.cfg.model.vocab_size, self.device)

    def guard(self, faults: FaultInjector, check: bool) -> StepGuard:
        return StepGuard(
            "rollback", self.parallel.model, self.optimizer, replica_groups=self.replicas,
            faults=faults, device=self.device, check_reductions=check,
            report=lambda kind, step, rank, _message, attrs: self.events.append(
                (kind, step, rank, attrs)
            ),
        )  # fmt: skip

    def step(self, guard: StepGuard, step: int) -> float:
        batch = self.batches[step - 1]
        result = train_step(
            self.parallel, self.optimizer, batch, max_grad_norm=self.cfg.max_grad_norm,
            guard=guard, step=step,
        )  # fmt: skip
        return result.global_loss

    def run(self, plan: FaultPlan, check: bool) -> tuple[Final, list[tuple[float, float]]]:
        """The trial steps from the saved state under a guard injecting `plan`; the final state
        and each step's wall and CPU seconds (this process's, gloo's threads included)."""
        self.saved.restore()
        faults = self.injector(plan)
        guard = self.guard(faults, check)
        guard.resume_signals(self.prefix)
        seconds, loss = [], float("nan")
        for step in range(STRIKE, STRIKE + TRIAL_STEPS):
            wall, cpu = time.perf_counter(), time.process_time()
            loss = self.step(guard, step)
            seconds.append((time.perf_counter() - wall, time.process_time() - cpu))
        faults.detach()
        params = [local(p).detach().clone() for p in self.parallel.model.parameters()]
        return Final(loss, params), seconds

    def trial(self, mode: str, target: str, bits: str, index: int) -> Trial:
        draw = random.Random(f"{self.cfg.run_id}/{target}/{bits}/{index}")
        struck = draw.randrange(WORLD)
        fault = SdcFault(STRIKE, struck, target, element="random", bits=bits, seed=index)
        self.events.clear()
        final, _ = self.run(FaultPlan(sdc=(fault,)), mode == "after")
        deviation = self.deviation(final, self.clean[mode])
        sdc = [(rank, attrs) for kind, _, rank, attrs in self.events if kind == "sdc"]
        raised = [int(a.get("detected_before_step", STRIKE)) for _, a in sdc]
        return Trial(
            mode, self.cfg.run_id, target, bits, struck, detected=bool(sdc),
            named=sorted({rank for rank, _ in sdc}),
            latency=min(raised) - STRIKE if raised else None,
            deviation=deviation, harmless=deviation <= NOISE,
            stages=sorted({a["stage"] for _, a in sdc}),
        )  # fmt: skip

    def deviation(self, final: Final, clean: Final) -> float:
        """How far `final` ended from `clean` (a collective): the larger of the loss's relative
        change and, over every rank's parameter shards, the largest change of an element
        relative to its tensor's largest element (an element near zero changes by more than
        its own few ulps when its neighbours' rounding moves: their scale is the noise's)."""
        changes = [abs(final.loss - clean.loss) / abs(clean.loss)]
        for got, want in zip(final.params, clean.params, strict=True):
            if want.numel():
                changes.append(float((got - want).abs().max() / want.abs().max()))
        # A flip that made anything infinite or NaN is as far as can be.
        largest = torch.tensor(max(c if math.isfinite(c) else math.inf for c in changes))
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return float(largest)

    def cost(self, blocks: int) -> dict[str, float]:
        """Rank 0's median wall and CPU seconds a step without and with the reduce-scatter
        check, over `blocks` alternating blocks of trial steps (a faultless plan). Four ranks
        share two cores here, and others' work too: the CPU time is the steadier measure."""
        seconds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(blocks):
            for check in (False, True):
                seconds[check] += self.run(FaultPlan(), check)[1]
        cost = {}
        for index, clock in enumerate(("wall", "cpu")):
            off, on = (statistics.median(s[index] for s in seconds[c]) for c in (False, True))
            cost |= {f"{clock}_off_s": off, f"{clock}_on_s": on, f"{clock}_ratio": on / off}
        return cost


def worker(rank: int, port: int, out: str, layouts: list[str], bit_classes: list[str],
           trials: int, cost_blocks: int, shape: dict[str, int]) -> None:  # fmt: skip
    """One rank of the job: every layout's trials; rank 0 writes them to `out` as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.use_deterministic_algorithms(True)
    device = torch.device("cpu")
    report: dict[str, object] = {"trials": [], "false_alarms": {}, "cost": {}}
    for name in layouts:
        layout = Layout(name, rank, device, shape)
        report["false_alarms"][name] = layout.false_alarms  # type: ignore[index]
        for mode in MODES:
            for target in SDC_TARGETS:
                for bits in bit_classes:
                    for index in range(trials):
                        trial = layout.trial(mode, target, bits, index)
                        report["trials"].append(asdict(trial))  # type: ignore[attr-defined]
        report["cost"][name] = layout.cost(cost_blocks)  # type: ignore[index]
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summarize(trials: list[dict]) -> dict[str, object]:
    """A cell's figures: trials, detected %, named-right % (of detected), mean latency,
    harmless and missed counts."""
    detected = [t for t in trials if t["detected"]]
    undetected = [t for t in trials if not t["detected"]]
    latencies = [t["latency"] for t in detected]
    return {
        "trials": len(trials),
        "detected_pct": 100 * len(detected) / len(trials),
        "right_rank_pct": (
            100 * sum(t["named"] == [t["rank"]] for t in detected) / len(detected)
            if detected
            else None
        ),
        "latency": statistics.fmean(latencies) if latencies else None,
        "harmless": sum(t["harmless"] for t in undetected),
        "missed": sum(not t["harmless"] for t in undetected),
    }


def _cells(trials: list[dict], *keys: str) -> Iterator[tuple[tuple, dict[str, dict]]]:
    """The trials grouped by `keys`, each group summarized per mode, in first-seen order."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for t in trials:
        groups.setdefault(tuple(t[k] for k in keys), {}).setdefault(t["mode"], []).append(t)
    for key, modes in groups.items():
        yield key, {mode: summarize(modes[mode]) for mode in MODES}


def _figures(cell: dict[str, object]) -> str:
    def pct(value: object) -> str:
        return "-" if value is None else f"{value:.0f}%"

    latency = cell["latency"]
    return (f"{pct(cell['detected_pct']):>6}{pct(cell['right_rank_pct']):>7}"
            f"{'-' if latency is None else f'{latency:.1f}':>5}{cell['harmless']:>5}"
            f"{cell['missed']:>5}")  # fmt: skip


def print_matrix(trials: list[dict], keys: tuple[str, ...], show: Callable[[tuple], str]) -> None:
    head = f"{'det':>6}{'right':>7}{'lat':>5}{'ok':>5}{'miss':>5}"
    print(f"{'':<34}{'n':>3} | {'before':>6}{head[6:]} | {'after':>6}{head[6:]}")
    for key, modes in _cells(trials, *keys):
        print(f"{show(key):<34}{modes['before']['trials']:>3} | {_figures(modes['before'])} |"
              f" {_figures(modes['after'])}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=2, help="flips per cell and mode")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--bits", default=",".join(BIT_CLASSES), help="bit classes")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument(
        "--cost-blocks", type=int, default=6, help="alternating blocks of steps timed, off and on"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: a trial a cell, HSDP, 2 bit classes"
    )
    args = parser.parse_args()
    if args.quick:
        args.trials, args.layouts, args.cost_blocks = 1, "hsdp2x2", 1
        args.bits = "sign,mantissa-low"
    layouts, bit_classes = args.layouts.split(","), args.bits.split(",")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sdc-coverage-") as tmp:
        out = str(Path(tmp) / "report.json")
        shape = {"seq_len": args.seq_len, "global_batch": args.global_batch}
        work = (_free_port(), out, layouts, bit_classes, args.trials, args.cost_blocks, shape)
        mp.spawn(worker, args=work, nprocs=WORLD, start_method="spawn")
        report = json.loads(Path(out).read_text())
    trials = report["trials"]
    print("det: detected; right: of those, naming exactly the struck rank; lat: mean steps from "
          "the flip to its detection;\nok: undetected but harmless; miss: undetected, training "
          "changed. before/after: without/with the reduce-scatter check.\n")  # fmt: skip
    print_matrix(trials, ("layout", "target", "bits"), lambda k: f"{k[0]:<9}{k[1]:<11}{k[2]}")
    print("\nper target, all layouts and bit classes:")
    print_matrix(trials, ("target",), lambda k: k[0])
    print("\nper layout, all targets and bit classes:")
    print_matrix(trials, ("layout",), lambda k: k[0])
    print(f"\nfalse alarms of the clean runs (both modes): {report['false_alarms']}")
    print("cost of the reduce-scatter check, rank 0's median step, off -> on (ratio on/off):")
    for name, cost in report["cost"].items():
        print(f"  {name:<9}" + "   ".join(
            f"{clock} {cost[f'{clock}_off_s'] * 1e3:6.1f} -> {cost[f'{clock}_on_s'] * 1e3:6.1f} ms"
            f" ({cost[f'{clock}_ratio']:.3f})" for clock in ("wall", "cpu")))  # fmt: skip
    totals = {key[0]: modes for key, modes in _cells(trials, "target")}
    print(f"({len(trials)} trials in {time.perf_counter() - started:.0f} s)")
    print(json.dumps({"totals": totals, "false_alarms": report["false_alarms"],
                      "cost": report["cost"], "trials": trials}))  # fmt: skip


if __name__ == "__main__":
    main()
