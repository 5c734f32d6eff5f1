"""The `scaletrain` command: argument parsing and printing over the packages, nothing more.

    scaletrain run        the embedded stack and a training job, then a summary
    scaletrain ckptd      the checkpoint daemon
    scaletrain telemetry  the telemetry service
    scaletrain ui         the run-health UI
    scaletrain ckpt       list and export checkpoints

Every error is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

# gRPC's core logs its own copy of errors we report in one line (a port in use, say); set
# GRPC_VERBOSITY=debug to see them. This must happen before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from scaletrain.errors import ScaletrainError, UserError

DEFAULT_WORKDIR = Path(".scaletrain")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    root = _Parser(prog="scaletrain", description=__doc__.split("\n\n")[0])
    sub = root.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run the embedded stack and a training job")
    _workdir_arg(run)
    run.add_argument("--ranks", type=int, default=4, help="training processes (default 4)")
    run.add_argument("--steps", type=int, default=300)
    run.add_argument("--ckpt-every", type=int, default=100)
    run.add_argument("--run-id", help="name of the run (default: a new one)")
    run.add_argument("--resume", action="store_true", help="continue the last run of --workdir")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.add_argument("--ckpt-policy", choices=("wait", "skip"), help="save while one streams")
    run.add_argument("--log-every", type=int, help="print progress every N steps")
    run.add_argument("--seq-len", type=int)
    run.add_argument("--global-batch", type=int)
    run.add_argument("--dp-replicate", type=int)
    run.add_argument("--dim", type=int)
    run.add_argument("--n-layers", type=int)
    run.add_argument("--fp8", metavar="RECIPE", help="FP8 recipe of the linears (default none)")
    run.add_argument(
        "--fp8-all-gather", action="store_true", help="all-gather the FP8 linears' weights in FP8"
    )

    ckptd = sub.add_parser("ckptd", help="serve the checkpoint daemon")
    ckptd.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT")
    ckptd.add_argument("--data-dir", type=Path, required=True, help="SSD tier and catalog")
    ckptd.add_argument("--memory-budget-mb", type=int, default=1024)
    ckptd.add_argument("--s3-endpoint", help="S3 endpoint URL; without it the S3 tier is off")
    ckptd.add_argument("--s3-bucket", default="scaletrain")
    ckptd.add_argument("--s3-region", default="us-east-1")
    ckptd.add_argument("--telemetry", help="HOST:PORT of telemetry, to record tier commits")

    tel = sub.add_parser("telemetry", help="serve the telemetry service")
    tel.add_argument("--listen", default="127.0.0.1:50052", help="HOST:PORT")
    tel.add_argument("--db", help="database URL (default: $SCALETRAIN_DB_URL or ./telemetry.db)")

    ui = sub.add_parser("ui", help="open the run-health UI")
    _workdir_arg(ui)
    ui.add_argument("--db", help="database URL (overrides --workdir)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=8501)

    ckpt = sub.add_parser("ckpt", help="list and export checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=_Parser)
    ls = ckpt_sub.add_parser("ls", help="list checkpoints and the tiers that hold them")
    _workdir_arg(ls)
    ls.add_argument("--ckptd", help="HOST:PORT of a running ckptd (instead of --workdir)")
    ls.add_argument("--run", help="only this run")
    ls.add_argument("--json", action="store_true")
    export = ckpt_sub.add_parser("export", help="write a standard DCP checkpoint directory")
    _workdir_arg(export)
    export.add_argument("--ckptd", help="HOST:PORT of a running ckptd (instead of --workdir)")
    export.add_argument("run")
    export.add_argument("step", type=int)
    export.add_argument("dest", type=Path)
    return root


def _workdir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", type=Path, default=DEFAULT_WORKDIR, help="state directory (./.scaletrain)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("scaletrain: interrupted; every child process was stopped", file=sys.stderr)
        return 130
    except (UserError, ScaletrainError) as exc:
        print(f"scaletrain {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        print(
            f"scaletrain: error: missing dependency {exc.name!r}; run `make install`",
            file=sys.stderr,
        )
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        return _run(args)
    if args.command == "ckptd":
        return _ckptd(args)
    if args.command == "telemetry":
        return _telemetry(args)
    if args.command == "ui":
        return _ui(args)
    return _ckpt(args)


def _run(args: argparse.Namespace) -> int:
    from scaletrain.embedded import RunOptions, run
    from scaletrain.stack import Workdir

    if args.fp8 is not None:
        from trainer.fp8.recipes import RECIPE_CHOICES

        if args.fp8 not in RECIPE_CHOICES:
            raise UserError(
                f"--fp8 {args.fp8!r} is not a recipe; valid: {', '.join(RECIPE_CHOICES)}"
            )
    passthrough = {
        "--seq-len": args.seq_len,
        "--global-batch": args.global_batch,
        "--dp-replicate": args.dp_replicate,
        "--dim": args.dim,
        "--n-layers": args.n_layers,
        "--ckpt-policy": args.ckpt_policy,
        "--log-every": args.log_every,
        "--fp8": args.fp8,
    }
    trainer_args = [x for k, v in passthrough.items() if v is not None for x in (k, str(v))]
    if args.fp8_all_gather:
        trainer_args.append("--fp8-all-gather")
    options = RunOptions(
        workdir=Workdir(args.workdir),
        ranks=args.ranks,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        run_id=args.run_id,
        resume=args.resume,
        trainer_args=trainer_args,
    )
    # With --json, stdout carries only the summary: progress goes to stderr.
    summary = run(options, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        _print_summary(summary)
    return 0


def _print_summary(s) -> None:
    def fmt(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    print(f"\nrun          {s.run_id}")
    print(f"steps        {s.steps}")
    print(f"loss         {fmt(s.first_loss, '.4f')} -> {fmt(s.last_loss, '.4f')}")
    print(f"tokens/s     {fmt(s.tokens_per_s, ',.0f')}")
    print(f"params       sha256 {s.params_sha256}")
    print(f"wall time    {s.wall_s:.1f} s")
    print(f"checkpoints  {len(s.checkpoints)} committed")
    for c in s.checkpoints:
        print(f"  step {c['step']:>6}  {c['bytes'] / 1e6:8.2f} MB  tiers: {', '.join(c['tiers'])}")
    print(f"open the UI  {s.ui_command}")


def _ckptd(args: argparse.Namespace) -> int:
    from ckptd.config import CkptdConfig, S3Config
    from ckptd.server import serve

    s3 = S3Config.from_env(args.s3_endpoint, args.s3_bucket) if args.s3_endpoint else None
    if s3 is not None and args.s3_region:
        s3 = S3Config(**{**vars(s3), "region": args.s3_region})
    serve(
        CkptdConfig(
            data_dir=args.data_dir,
            listen=args.listen,
            memory_budget_bytes=args.memory_budget_mb << 20,
            s3=s3,
            telemetry=args.telemetry,
        )
    )
    return 0


def _telemetry(args: argparse.Namespace) -> int:
    from telemetry.config import TelemetryConfig
    from telemetry.server import serve

    db = args.db or os.environ.get("SCALETRAIN_DB_URL") or "sqlite:///telemetry.db"
    serve(TelemetryConfig(db_url=db, listen=args.listen))
    return 0


def _ui(args: argparse.Namespace) -> int:
    from scaletrain.stack import Workdir
    from ui.launch import run_ui

    db = args.db or os.environ.get("SCALETRAIN_DB_URL")
    if db is None:
        workdir = Workdir(args.workdir)
        if not workdir.telemetry_db.exists():
            raise UserError(f"no telemetry database in {workdir.root}; run `scaletrain run` first")
        db = workdir.db_url
    return run_ui(db, host=args.host, port=args.port)


def _ckpt(args: argparse.Namespace) -> int:
    from scaletrain import checkpoints

    if args.ckpt_command == "ls":
        rows = checkpoints.list_checkpoints(args.workdir, args.ckptd, args.run)
        if args.json:
            print(json.dumps(rows, indent=2))
        elif not rows:
            print("no checkpoints")
        else:
            print(f"{'run':<28} {'step':>8} {'MB':>9}  tiers")
            for r in rows:
                print(
                    f"{r['run']:<28} {r['step']:>8} {r['bytes'] / 1e6:>9.2f}  "
                    f"{', '.join(r['tiers']) or '-'}"
                )
        return 0
    files = checkpoints.export(args.workdir, args.ckptd, args.run, args.step, args.dest)
    print(f"exported {args.run}@{args.step}: {len(files)} files to {args.dest}")
    return 0
