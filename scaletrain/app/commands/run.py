"""`scaletrain run`: the embedded stack and a training job, then a summary."""

from __future__ import annotations

import argparse
from pathlib import Path

from scaletrain.app.commands import launch
from scaletrain.app.commands.common import (
    badput_line,
    join_tiers,
    print_other_badput,
    print_tensorboard,
    workdir_arg,
)
from scaletrain.errors import UserError
from trainer import options


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run the embedded stack and a training job")
    run.set_defaults(handler=_run)
    workdir_arg(run)
    run.add_argument("--ranks", type=int, default=4, help="training processes (default 4)")
    launch.cluster_args(run)
    launch.launcher_args(run, launch.RUN_DEFAULTS)
    run.add_argument(
        "--run-id", default=argparse.SUPPRESS, help="name of the run (default: a new one)"
    )
    run.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=argparse.SUPPRESS,
        metavar="RUN[@STEP]",
        help="continue a run with the job it was started with (flags given again override it): "
        "the last run of --workdir, or RUN; @STEP checks that STEP is the run's newest "
        "checkpoint, where it goes on from",
    )
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.add_argument(
        "--tensorboard",
        type=Path,
        metavar="DIR",
        help="when the run ends, write its curves from telemetry as TensorBoard event files "
        "under DIR/RUN",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restarts of the job after a rank fails, each from the latest committed checkpoint "
        "(default 0: a failure ends the run, --resume continues it)",
    )
    launch.trainer_options(run)


def _run(args: argparse.Namespace) -> int:
    from scaletrain.app.embedded import RunOptions, run
    from scaletrain.app.stack import Workdir

    _resume_target(args)
    job = launch.resolve_job(args, launch.RUN_DEFAULTS)
    if args.print_config:
        print(options.to_toml(job), end="")
        return 0
    if job["init_from_hf"]:
        _check_init_from_hf(job)
    run_options = RunOptions(
        workdir=Workdir(args.workdir),
        **launch.stack_options(args, job),
        run_id=str(job["run_id"]) or None,
        resume=bool(job["resume"]),
    )
    summary = launch.start_and_print(run, run_options, args.json, _print_summary)
    if args.tensorboard is not None:
        print_tensorboard(None, args, summary.run_id)
    return 0


def _check_init_from_hf(job: dict[str, options.Value]) -> None:
    """Refuse an HF directory the model cannot start from now, in one line, rather than after
    the stack has started (the trainer checks it again)."""
    from trainer.config import from_values
    from trainer.interop.hf_import import check_init

    check_init(Path(str(job["init_from_hf"])), from_values(job | {"run_id": "check"}).model)


def _resume_target(args: argparse.Namespace) -> None:
    """`--resume RUN[@STEP]` as `--resume --run-id RUN`, once STEP is checked to be RUN's newest
    checkpoint in the work directory (a run goes on from its newest: an older STEP is refused,
    naming the newer ones, which only `ckpt rm` takes away)."""
    from scaletrain.app import checkpoints

    target = getattr(args, "resume", False)
    if not isinstance(target, str):
        return
    run, _, step = target.partition("@")
    given = getattr(args, "run_id", None)
    if given and given != run:
        raise UserError(f"--resume {target} names run {run}, --run-id {given}: give one")
    args.resume, args.run_id = True, run
    if not step:
        return
    try:
        wanted = checkpoints.parse_step(step)
    except ValueError as exc:
        raise UserError(f"--resume {target}: {exc}") from None
    found = checkpoints.checkpoint(args.workdir, None, run, wanted).ref.step
    newer = checkpoints.steps_after(args.workdir, run, found)
    if newer:
        raise UserError(
            f"--resume {target}: run {run} goes on from its newest checkpoint, step {newer[-1]}; "
            f"to go back to step {found}, remove the newer ones first (steps "
            f"{', '.join(map(str, newer))}: scaletrain ckpt rm {run} STEP --force)"
        )


def _print_summary(s) -> None:
    def fmt(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    print(f"\nrun          {s.run_id}")
    print(f"steps        {s.steps}")
    print(f"loss         {fmt(s.first_loss, '.4f')} -> {fmt(s.last_loss, '.4f')}")
    print(f"tokens/s     {fmt(s.tokens_per_s, ',.0f')}")
    print(f"params       sha256 {s.params_sha256}")
    print(f"wall time    {s.wall_s:.1f} s")
    print(f"mfu          {s.mfu_label}")
    print(f"goodput      {fmt(s.goodput, '.1%')}  badput: {badput_line(s.badput_s)}")
    print_other_badput(s.badput_s, indent=13)
    print(f"health       {_findings(s.health_events, s.data_spikes)}")
    for q in s.quarantined:
        print(
            f"quarantine   rank {q.rank} ({q.node or 'host unknown'}): named by the corruption "
            f"checks at steps {', '.join(map(str, q.steps))}; {q.policy}"
        )
    print(f"checkpoints  {len(s.checkpoints)} committed")
    for c in s.checkpoints:
        safe = "  node-loss safe" if c.get("node_loss_safe") else ""
        print(
            f"  step {c['step']:>6}  {c['bytes'] / 1e6:8.2f} MB  "
            f"tiers: {join_tiers(c['tiers'])}{safe}"
        )
        for part in c["parts"] if len(c["parts"]) > 1 else []:
            where = (
                f"{part['files']:>3} files  tiers: {join_tiers(part['tiers'])}"
                if part["reachable"]
                else f"unreachable: {part['error']}"
            )
            copies = [n for n, tiers in part.get("replicas", {}).items() if tiers]
            if copies and part["files"]:
                where += f"  copies on: {', '.join(copies)}"
            print(f"    {part['node']:<11}{part['bytes'] / 1e6:8.2f} MB  {where}")
    print(f"open the UI  {s.ui_command}")


def _findings(counts: dict[str, int], data_spikes: int) -> str:
    """The health line: the open findings by kind, then the loss spikes the data caused (closed
    as soon as found), the steps replayed and the restarts."""
    open_counts = counts | {"loss_spike": counts.get("loss_spike", 0) - data_spikes}
    shown = [
        f"{count} {kind}"
        for kind, count in open_counts.items()
        if count and kind not in ("replay", "restart")
    ]
    line = ", ".join(shown) or "no open alert (straggler, loss spike, silent data corruption)"
    closed = [f"{data_spikes} loss spike(s) from the data, closed"] if data_spikes else []
    closed += [f"{counts['replay']} step(s) replayed"] if counts.get("replay") else []
    closed += [f"{counts['restart']} restart(s)"] if counts.get("restart") else []
    return line + (f"; {', '.join(closed)}" if closed else "")
