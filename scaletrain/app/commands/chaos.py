"""`scaletrain chaos`: training on the embedded stack under a schedule of faults, then a report."""

from __future__ import annotations

import argparse

from scaletrain.app.commands import launch
from scaletrain.app.commands.common import badput_line, join_tiers, print_other_badput, workdir_arg
from scaletrain.errors import UserError
from trainer import options

# The drill's own defaults of trainer options it sets itself (a config file overrides them), as
# launch.RUN_DEFAULTS are `run`'s.
CHAOS_DEFAULTS: dict[str, options.Value] = {"steps": 400, "ckpt_every": 5}
# Trainer options a launcher's own flag of the same name shadows (chaos --seed picks the ranks
# faults strike); its --config file still sets them.
CHAOS_SHADOWED = ("seed",)


def register(sub: argparse._SubParsersAction) -> None:
    drill = sub.add_parser(
        "chaos",
        help="train on the embedded stack under a schedule of faults, then a report",
        epilog_from=_fault_kinds,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    drill.set_defaults(handler=_chaos)
    workdir_arg(drill)
    drill.add_argument("--ranks", type=int, default=4, help="training processes (default 4)")
    launch.cluster_args(drill)
    launch.launcher_args(drill, CHAOS_DEFAULTS)
    drill.add_argument(
        "--schedule",
        help="KIND@STEP[:SECONDS] (once, after step STEP) or KIND@everyNs[:SECONDS] (every N "
        "seconds of the job),... with KIND one of the fault kinds below (default: 16 faults "
        "of every kind but those that need --spares; 13 on one node, without the node kinds)",
    )
    drill.add_argument(
        "--max-restarts",
        type=int,
        help="default: one per fault that needs a restart, plus 2 (and 20 for repeating ones)",
    )
    drill.add_argument(
        "--seed",
        dest="fault_seed",
        type=int,
        default=0,
        help="picks the ranks the faults strike (the trainer's seed: in --config)",
    )
    drill.add_argument(
        "--ssd-mb",
        type=int,
        default=256,
        help="size of the SSD tier's tmpfs for disk-full: room for the checkpoints the SSD keeps "
        "(--keep-ssd 5) and those that pile up while S3 is down (default 256)",
    )
    drill.add_argument("--json", action="store_true", help="print the report as JSON")
    launch.trainer_options(drill, exclude=CHAOS_SHADOWED)


def _chaos(args: argparse.Namespace) -> int:
    from scaletrain.app.chaos import ChaosOptions, chaos, default_schedule, parse_schedule
    from scaletrain.app.stack import Workdir

    job = launch.resolve_job(args, CHAOS_DEFAULTS)
    if args.print_config:
        print(options.to_toml(job), end="")
        return 0
    chaos_options = ChaosOptions(
        workdir=Workdir(args.workdir),
        schedule=parse_schedule(args.schedule or default_schedule(args.nodes[1])),
        **launch.stack_options(args, job),
        seed=args.fault_seed,
        ssd_mb=args.ssd_mb,
    )
    report = launch.start_and_print(chaos, chaos_options, args.json, _print_report)
    if not report.completed:
        raise UserError(f"the run did not survive the drill (exit code {report.exit_code})")
    if report.checkpoints_lost:
        raise UserError(f"committed checkpoints lost: steps {report.checkpoints_lost}")
    return 0


def _fault_kinds() -> str:
    from scaletrain.app.chaos import kinds_help

    return kinds_help()


def _print_report(r) -> None:
    goodput = "n/a" if r.goodput is None else f"{r.goodput:.1%}"
    print(f"\nrun                  {r.run_id} ({'completed' if r.completed else 'FAILED'})")
    print(f"faults injected      {r.faults_injected} of {r.faults_scheduled} scheduled")
    print(f"faults survived      {r.faults_survived}")
    print(f"checkpoints lost     {len(r.checkpoints_lost)} of {r.checkpoints_committed} committed")
    print(f"restarts             {r.restarts}")
    print(f"steps replayed       {r.steps_replayed} after restarts, "
          f"{r.steps_replayed_in_place} in place (step guard)")  # fmt: skip
    print(f"goodput              {goodput}  badput: {badput_line(r.badput_s)}")
    print_other_badput(r.badput_s, indent=21)
    print(f"badput by fault      {badput_line(r.badput_by_fault_s)}")
    effective = "n/a" if r.effective_training is None else f"{r.effective_training:.1%}"
    print(f"effective training   {effective} of the job's wall time in steps that were kept")
    for q in r.quarantined:
        print(
            f"quarantine           rank {q['rank']} ({q['node'] or 'host unknown'}) named at steps "
            f"{', '.join(map(str, q['steps']))}: {q['policy']}"
        )
    print(f"final loss           {r.last_loss!r}  params sha256 {r.params_sha256}")
    print(f"wall time            {r.wall_s:.1f} s")
    for f, rec in zip(r.faults, r.fault_recoveries, strict=True):
        print(f"  step {f['step']:>5}  {f['kind']:<15} {f['target']:<10} {f['detail']}")
        print(f"{'':14}{_recovery_line(rec)}")
    for recovery in r.recoveries:
        from ckptd.readpath import describe_sources

        print(
            f"  restore from step {recovery['step']:>5}: "
            f"{describe_sources(recovery['restored_from'])}"
        )


def _recovery_line(rec: dict) -> str:
    """A fault's recovery record, seconds after its strike."""

    def after(at: float | None) -> str:
        return "never" if at is None else f"+{at - rec['injected_at']:.1f}s"

    restore = ""
    if rec["resumed_from"] is not None:
        restore = (
            f", resumed from step {rec['resumed_from']} ({rec['steps_lost']} steps lost) "
            "reading "
            f"{join_tiers([f'{t} {b / 1e6:.2f} MB' for t, b in rec['bytes_per_tier'].items()])}"
        )
    return (
        f"detected {after(rec['detected_at'])}, first step {after(rec['first_step_at'])}"
        f"{restore}; cost {rec['badput_s']:.1f}s"
    )
