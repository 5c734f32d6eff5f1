"""`scaletrain ckpt`: list, show, verify, export and remove checkpoints."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from scaletrain.app.commands.common import Parser, workdir_arg
from scaletrain.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    ckpt = sub.add_parser("ckpt", help="list, show, verify, export and remove checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=Parser)
    ls = _ckpt_parser(ckpt_sub, "ls", "list checkpoints and the tiers that hold them", _ckpt_ls)
    ls.add_argument("--run", help="only this run")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    show = _ckpt_parser(ckpt_sub, "show", "one checkpoint: files, tiers, retention", _ckpt_show)
    _checkpoint_args(show, required=False)
    show.add_argument(
        "--node-loss-safe",
        action="store_true",
        help="the run's newest node-loss-safe checkpoint: each part with its R copies "
        "(asks --ckptd)",
    )
    show.add_argument("--json", action="store_true", help="print the checkpoint as JSON")
    verify = _ckpt_parser(
        ckpt_sub,
        "verify",
        "read every copy of a checkpoint and check its checksums; with no RUN, of every "
        "checkpoint of every run",
        _ckpt_verify,
    )
    _checkpoint_args(verify, required=False, no_run="every checkpoint of every run")
    verify.add_argument(
        "--json",
        action="store_true",
        help="print each tier's verdict as JSON (with no RUN: a list, one object a checkpoint)",
    )
    export = _ckpt_parser(
        ckpt_sub,
        "export",
        "write a standard DCP checkpoint directory, or a Hugging Face model",
        _ckpt_export,
    )
    _checkpoint_args(export, required=True)
    export.add_argument("dest", type=Path)
    export.add_argument("--json", action="store_true", help="print what was written as JSON")
    export.add_argument(
        "--format",
        choices=("dcp", "hf"),
        default="dcp",
        help="dcp: the checkpoint's files as they are; hf: the model as safetensors shards, "
        "config.json and the tokenizer, for transformers, vLLM, SGLang (default dcp)",
    )
    export.add_argument(
        "--overwrite", action="store_true", help="replace DEST if it exists and is not empty"
    )
    export.add_argument(
        "--shard-mb",
        type=int,
        default=5000,
        help="--format hf: largest safetensors shard in MB (default 5000, as transformers)",
    )
    rm = _ckpt_parser(ckpt_sub, "rm", "delete a checkpoint from every tier", _ckpt_rm)
    _checkpoint_args(rm, required=True)
    rm.add_argument(
        "--dry-run", action="store_true", help="list what would be removed, and remove nothing"
    )
    rm.add_argument(
        "--force",
        action="store_true",
        help="remove the run's newest checkpoint too (where --resume goes on from)",
    )


def _ckpt_parser(
    sub: argparse._SubParsersAction,
    name: str,
    summary: str,
    handler: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=summary)
    parser.set_defaults(handler=handler)
    workdir_arg(parser)
    parser.add_argument("--ckptd", help="HOST:PORT of a running ckptd (instead of --workdir)")
    return parser


def _checkpoint_args(
    parser: argparse.ArgumentParser, required: bool, no_run: str | None = None
) -> None:
    """RUN and STEP naming a checkpoint; "latest" or "last" for either names the newest (the
    work directory's last run, the run's newest step), as leaving them out does where they may
    be, unless `no_run` says what leaving RUN out means instead."""
    optional = {} if required else {"nargs": "?"}
    if required:
        default = ""
    elif no_run:
        default = f" (none: {no_run})"
    else:
        default = " (default)"
    parser.add_argument("run", help="a run id, or latest/last" + default, **optional)
    parser.add_argument(
        "step",
        type=_step,
        help="a step, or latest/last" + ("" if required else " (default)"),
        **optional,
    )


def _step(text: str) -> int | None:
    from scaletrain.app.checkpoints import parse_step

    try:
        return parse_step(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ckpt_ls(args: argparse.Namespace) -> int:
    from scaletrain.app import checkpoints

    rows = checkpoints.list_checkpoints(args.workdir, args.ckptd, args.run)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no checkpoints")
    else:
        print(f"{'run':<28} {'step':>8} {'MB':>9}  {'safe':<4}  tiers")
        for r in rows:
            safe = {True: "yes", False: "no", None: "-"}[r["node_loss_safe"]]
            print(
                f"{r['run']:<28} {r['step']:>8} {r['bytes'] / 1e6:>9.2f}  {safe:<4}  "
                f"{', '.join(r['tiers']) or '-'}"
            )
    return 0


def _ckpt_show(args: argparse.Namespace) -> int:
    from scaletrain.app import checkpoints

    shown = checkpoints.show(args.workdir, args.ckptd, args.run, args.step, args.node_loss_safe)
    if args.json:
        print(json.dumps(shown, indent=2))
    else:
        _print_show(shown)
    return 0


def _named(args: argparse.Namespace) -> tuple[str, int]:
    """The (run, step) of the checkpoint the command line names (see `_checkpoint_args`)."""
    from scaletrain.app import checkpoints

    info = checkpoints.checkpoint(args.workdir, args.ckptd, args.run, args.step)
    return info.ref.run, info.ref.step


def _ckpt_verify(args: argparse.Namespace) -> int:
    from scaletrain.app import checkpoints

    if args.run is None:
        return _ckpt_verify_all(args)
    run, step = _named(args)
    results = checkpoints.verify(args.workdir, args.ckptd, run, step)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{run}@{step}")
        for tier, verdict in results.items():
            print(f"{tier:<7} {verdict}")
    bad = [tier for tier, verdict in results.items() if verdict != "ok"]
    if bad:
        raise UserError(f"{run}@{step}: damaged copy on {', '.join(bad)}")
    return 0


def _ckpt_verify_all(args: argparse.Namespace) -> int:
    """`ckpt verify` with no RUN: every checkpoint of every run, a line each as it is done
    (its verdict, then each tier's), and a summary line; an error when any copy failed."""
    from scaletrain.app import checkpoints

    infos = checkpoints.every_checkpoint(args.workdir, args.ckptd)
    width = max(len(f"{i.ref.run}@{i.ref.step}") for i in infos)
    shown, failed = [], []
    for info, results in checkpoints.verify_each(args.workdir, args.ckptd, infos):
        name = f"{info.ref.run}@{info.ref.step}"
        bad = [tier for tier, verdict in results.items() if verdict != "ok"]
        ok = bool(results) and not bad
        if not ok:
            failed.append(f"{name} ({', '.join(bad) or 'no copy'})")
        if args.json:
            shown.append({"run": info.ref.run, "step": info.ref.step, "ok": ok, "tiers": results})
            continue
        tiers = "; ".join(
            f"{tier} ok" if verdict == "ok" else f"{tier}: {verdict}"
            for tier, verdict in results.items()
        )
        tiers = tiers or "no committed copy on any tier"
        print(f"{name:<{width}}  {'ok' if ok else 'FAILED':<6}  {tiers}", flush=True)
    runs = len({i.ref.run for i in infos})
    if args.json:
        print(json.dumps(shown, indent=2))
    else:
        print(
            f"verified {len(infos)} checkpoint(s) of {runs} run(s): "
            f"{len(infos) - len(failed)} ok, {len(failed)} failed"
        )
    if failed:
        raise UserError(f"{len(failed)} of {len(infos)} checkpoint(s) failed: {', '.join(failed)}")
    return 0


def _ckpt_rm(args: argparse.Namespace) -> int:
    from scaletrain.app import checkpoints

    info = checkpoints.checkpoint(args.workdir, args.ckptd, args.run, args.step)
    run, step = info.ref.run, info.ref.step
    if args.dry_run:
        tiers = ", ".join(checkpoints.tier_names(info)) or "no tier"
        print(
            f"would remove {run}@{step}: {len(info.files)} files, {info.total_bytes / 1e6:.2f} "
            f"MB, from {tiers} (nothing removed: --dry-run)"
        )
        return 0
    if not args.force:
        checkpoints.guard_removal(args.workdir, args.ckptd, info)
    removed, pending = checkpoints.remove(args.workdir, args.ckptd, run, step)
    line = f"removed {run}@{step} from {', '.join(removed) or 'no tier'}"
    if pending:
        line += f"; removal from {', '.join(pending)} continues in the background"
    print(line)
    return 0


def _ckpt_export(args: argparse.Namespace) -> int:
    from scaletrain.app import checkpoints

    run, step = _named(args)
    if args.format == "hf":
        hf = checkpoints.export_hf(
            args.workdir, args.ckptd, run, step, args.dest, args.overwrite, args.shard_mb * 10**6
        )
        if args.json:
            _print_exported(run, step, args.dest, [*hf.shards, *hf.files], hf.weight_bytes)
            return 0
        print(
            f"exported {run}@{step} for Hugging Face: {len(hf.shards)} safetensors "
            f"shards ({hf.weight_bytes / 1e6:,.1f} MB) and {', '.join(hf.files)} to {args.dest}"
        )
        return 0
    files = checkpoints.export(
        args.workdir, args.ckptd, run, step, args.dest, overwrite=args.overwrite
    )
    if args.json:
        _print_exported(run, step, args.dest, [f.name for f in files], None)
        return 0
    print(f"exported {run}@{step}: {len(files)} files to {args.dest}")
    return 0


def _print_exported(
    run: str, step: int, dest: Path, files: list[str], weight_bytes: int | None
) -> None:
    """What `ckpt export --json` prints: the checkpoint, where it went, and its files."""
    shown: dict[str, object] = {"run": run, "step": step, "dest": str(dest), "files": files}
    if weight_bytes is not None:
        shown["weight_bytes"] = weight_bytes
    print(json.dumps(shown, indent=2))


def _print_show(shown: dict) -> None:
    print(f"checkpoint   {shown['run']}@{shown['step']}  (world size {shown['world_size']})")
    print(f"size         {shown['bytes'] / 1e6:.2f} MB in {len(shown['files'])} files")
    for tier, state in shown["tier_states"].items():
        error = f"  ({state['error']})" if state["error"] else ""
        print(f"  {tier:<7}  {state['state']}{error}")
    if shown["retention"]:
        r = shown["retention"]
        print(
            f"retention    memory last {r['memory_last']}, SSD last {r['ssd_last']}, "
            f"S3 every {r['s3_every']} + latest, replicas {r['replicas'] or 'default'}"
        )
    if shown["labels"]:
        print("labels       " + ", ".join(f"{k}={v}" for k, v in shown["labels"].items()))
    for f in shown["files"]:
        print(f"  {f['path']:<24} rank {f['rank']:>4}  {f['bytes']:>14,} B  crc32c {f['crc32c']}")
