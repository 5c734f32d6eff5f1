"""What the launchers (`run`, `chaos`) and `plan` share: the trainer options they pass through,
--steps and --ckpt-every, --nodes and its neighbours, the job a command line resolves to, what
`run` and `chaos` give the stack they start alike, and how they print what it returns."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeVar

from scaletrain.app.rendezvous import CAPACITY_WAIT_S
from scaletrain.cordon import CORDON_AFTER
from scaletrain.errors import UserError
from trainer import options
from trainer.health.faults import FaultPlan


class Reported(Protocol):
    """What a launcher's start returns: `run`'s summary, `chaos`'s report."""

    def to_dict(self) -> dict[str, object]: ...


Result = TypeVar("Result", bound=Reported)

# `run`'s own defaults of trainer options it sets itself (a config file overrides them), which
# `plan` plans with too; `chaos` has its own (chaos.CHAOS_DEFAULTS).
RUN_DEFAULTS: dict[str, options.Value] = {"steps": 300, "ckpt_every": 100}


def launcher_args(parser: argparse.ArgumentParser, defaults: dict[str, options.Value]) -> None:
    """--steps and --ckpt-every, which a launcher hands the trainer itself."""
    for dest, value in defaults.items():
        o = options.BY_DEST[dest]
        parser.add_argument(
            o.flag, type=int, default=argparse.SUPPRESS, help=f"{o.help} (default {value})"
        )


def trainer_options(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Every trainer option a launcher passes through (but `exclude`, which the launcher's own
    flags shadow: a config file still reaches them), and --config / --print-config."""
    options.add_arguments(parser, launcher=True, exclude=exclude)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved job config (TOML) and start nothing",
    )


def _node_range(text: str) -> tuple[int, int]:
    from scaletrain.app.stack import parse_nodes

    try:
        return parse_nodes(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cluster_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the embedded cluster `run` and `chaos` start alike: its nodes (elastic or
    not), spares, cordoning and security."""
    parser.add_argument(
        "--nodes",
        type=_node_range,
        default=(1, 1),
        metavar="N|MIN:MAX",
        help="simulated nodes on loopback, each with its own ckptd and torchrun agent; --ranks "
        "is split evenly over them (default 1). MIN:MAX is elastic: a node lost with no spare "
        "left, the job re-forms on the survivors (at least MIN), resharded, with the same "
        "global batch and data order, and grows back as nodes return",
    )
    parser.add_argument(
        "--capacity-wait-s",
        type=float,
        default=CAPACITY_WAIT_S,
        metavar="S",
        help="with --nodes MIN:MAX: fewer than MIN nodes left, the job waits this long for a "
        "machine to join, then stops; its newest checkpoint stays for --resume (default "
        f"{CAPACITY_WAIT_S:g}, torchrun's join timeout)",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="hot spare machines beside the nodes (--nodes 2 or more): a warm ckptd and agent "
        "each, that take a lost node's place (default 0)",
    )
    parser.add_argument(
        "--cordon-after",
        type=int,
        default=CORDON_AFTER,
        metavar="N",
        help="with --spares: a node whose ranks failed N times, each soon after the last (10 "
        "steps), is cordoned, its agent stopped for good and a waiting spare taking its place "
        f"(0: never; default {CORDON_AFTER})",
    )
    parser.add_argument(
        "--secure", action="store_true", help="TLS and per-run tokens between every part"
    )


def resolve_job(
    args: argparse.Namespace, defaults: dict[str, options.Value]
) -> dict[str, options.Value]:
    """The trainer options of this command line and its --config file (resuming, over the run's
    own stored job), resolved and checked now, in one line, rather than after the whole stack
    has started."""
    given = options.given(args)
    resuming = given.get("resume") and hasattr(args, "workdir")  # not for `plan`
    stored = _stored_job(args.workdir, given, defaults) if resuming else None
    job = options.resolve(given, args.config, defaults, stored)
    if job["init_from_hf"] and not resuming:
        chosen = {**(options.read_config(args.config) if args.config else {}), **given}
        job |= _hf_shape(Path(str(job["init_from_hf"])), chosen)
    FaultPlan.parse(*(job[d] for d in options.FAULT_METAVARS))
    return job


def stack_options(args: argparse.Namespace, job: dict[str, options.Value]) -> dict[str, Any]:
    """What `run` and `chaos` give the stack they start alike, from the command line and its
    resolved job: the ranks, the nodes (elastic or not) and spares, the steps and checkpoint
    interval, the trainer's own arguments and the restarts allowed."""
    return {
        "ranks": args.ranks,
        "min_nodes": args.nodes[0],
        "capacity_wait_s": args.capacity_wait_s,
        "nodes": args.nodes[1],
        "spares": args.spares,
        "cordon_after": args.cordon_after,
        "secure": args.secure,
        "steps": int(job["steps"]),
        "ckpt_every": int(job["ckpt_every"]),
        "trainer_args": options.to_argv(options.passed_on(job)),
        "max_restarts": args.max_restarts,
    }


def start_and_print(
    start: Callable[[Any, TextIO], Result],
    launch: Any,
    as_json: bool,
    printer: Callable[[Result], None],
) -> Result:
    """`start(launch, progress)`, then its result printed: by `printer`, or with --json as JSON,
    stdout then carrying only that (progress goes to stderr)."""
    result = start(launch, sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        printer(result)
    return result


def _hf_shape(directory: Path, chosen: dict[str, options.Value]) -> dict[str, options.Value]:
    """The model shape of the Hugging Face model a run starts from (its config.json, as
    `HFModel.options` maps it), over the preset's; an option the user set to another value is
    refused in one line naming both."""
    from trainer.interop.hf import read_hf_model

    shape = read_hf_model(directory).options
    for dest, value in shape.items():
        if dest in chosen and chosen[dest] != value:
            flag = options.BY_DEST[dest].flag
            raise UserError(
                f"{flag} {chosen[dest]} contradicts --init-from-hf {directory}, whose "
                f"config.json gives {value}; leave {flag} out to take the model's"
            )
    return dict(shape)


def _stored_job(
    workdir: Path, given: dict[str, options.Value], defaults: dict[str, options.Value]
) -> dict[str, object] | None:
    """The job a run being resumed (`--run-id`, else the work directory's last run) was started
    with, as telemetry recorded it: every option of it but those of one launch (addresses, the
    faults it injected, the Hugging Face weights it started from; its steps and checkpoint
    interval stay). None when there is no earlier run to resume (the launch says so)."""
    from scaletrain.app.stack import Workdir
    from telemetry.db import reading
    from telemetry.queries import job_config

    work = Workdir(workdir)
    run_id = str(given.get("run_id") or "") or work.last_run_id()
    if not run_id:
        return None
    job = None
    if work.telemetry_db.exists():
        with reading(work.db_url) as engine:
            job = job_config(engine, run_id)
    if job is None:
        raise UserError(
            f"--resume: telemetry in {work.root} has no job config of run {run_id} to resume "
            "with; give the run's options again (or its --config file)"
        )
    once = {*options.FAULT_METAVARS, "init_from_hf"}
    return {
        dest: value
        for dest, value in job.items()
        if dest in options.BY_DEST
        and dest not in once
        and (not options.BY_DEST[dest].launcher or dest in defaults)
    }
