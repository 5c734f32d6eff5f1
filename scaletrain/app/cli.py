"""The `scaletrain` command: argument parsing and printing over the packages, nothing more.

    scaletrain run        the embedded stack and a training job, then a summary
    scaletrain chaos      the same under a schedule of injected faults, then a report
    scaletrain plan       a job's parameters, memory per rank, FLOPs, bubble and MFU, no GPU
    scaletrain ckptd      the checkpoint daemon
    scaletrain telemetry  the telemetry service
    scaletrain ui         the run-health UI
    scaletrain ckpt       list, show, verify, export and remove checkpoints
    scaletrain certs      a development CA and server and client certificates
    scaletrain token      mint a token and record its hash in a tokens file

Every error is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

# gRPC's core logs its own copy of errors we report in one line (a port in use, say); set
# GRPC_VERBOSITY=debug to see them. This must happen before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from scaletrain.app.rendezvous import CAPACITY_WAIT_S
from scaletrain.cordon import CORDON_AFTER
from scaletrain.errors import ScaletrainError, UserError
from trainer import options
from trainer.data.prepare import EXAMPLE_VOCAB
from trainer.data.prepare import add_arguments as prepare_args
from trainer.health.faults import FaultPlan

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from ckptd.config import DataLimits

DEFAULT_WORKDIR = Path(".scaletrain")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line.

    `epilog_from` makes the epilog only when help is shown, so that a command's startup does not
    import what only its help needs.
    """

    def __init__(self, *args: Any, epilog_from: Callable[[], str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._epilog_from = epilog_from

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        if self._epilog_from is not None:
            self.epilog = self._epilog_from()
        return super().format_help()


DESCRIPTION = (
    "Train Llama-style models (dense and MoE, five parallelisms, FP8) on an embedded stack of "
    "services where checkpoints, run health and recovery are one system: ckptd tiers "
    "checkpoints from memory to SSD to S3, telemetry keeps every rank's statistics, and a "
    "failed rank, node or service is recovered from. `scaletrain COMMAND --help` for each."
)


def build_parser() -> argparse.ArgumentParser:
    root = _Parser(prog="scaletrain", description=DESCRIPTION)
    root.add_argument(
        "--version", action="version", version=f"scaletrain {metadata.version('scaletrain')}"
    )
    sub = root.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run the embedded stack and a training job")
    run.set_defaults(handler=_run)
    _workdir_arg(run)
    run.add_argument("--ranks", type=int, default=4, help="training processes (default 4)")
    _nodes_arg(run)
    _launcher_args(run, RUN_DEFAULTS)
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
    run.add_argument(
        "--secure", action="store_true", help="TLS and per-run tokens between every part"
    )
    _trainer_options(run)

    rendezvous = sub.add_parser(
        "rendezvous",
        help="host a training job's c10d rendezvous store, off the training nodes",
    )
    rendezvous.set_defaults(handler=_rendezvous)
    rendezvous.add_argument(
        "--listen", required=True, help="HOST:PORT torchrun's --rdzv-endpoint names"
    )

    drill = sub.add_parser(
        "chaos",
        help="train on the embedded stack under a schedule of faults, then a report",
        epilog_from=_fault_kinds,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    drill.set_defaults(handler=_chaos)
    _workdir_arg(drill)
    drill.add_argument("--ranks", type=int, default=4, help="training processes (default 4)")
    _nodes_arg(drill)
    _launcher_args(drill, CHAOS_DEFAULTS)
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
    _trainer_options(drill, exclude=CHAOS_SHADOWED)

    planner = sub.add_parser(
        "plan", help="a job's parameters, per-rank memory, FLOPs, bubble and MFU, without a GPU"
    )
    planner.set_defaults(handler=_plan)
    planner.add_argument(
        "--ranks",
        "--gpus",
        action=options.Renamed,
        type=int,
        default=8,
        help="ranks (one a GPU) of the job, as run --ranks (default 8; --gpus: the old name)",
    )
    planner.add_argument(
        "--device",
        "--gpu",
        action=options.Renamed,
        default="h200",
        help="the GPU model whose memory and dense peak the plan uses (default h200; --gpu: the "
        "old name)",
    )
    planner.add_argument(
        "--tokens-per-s", type=float, help="the target throughput whose MFU to show"
    )
    planner.add_argument("--json", action="store_true", help="print the plan as JSON")
    planner.add_argument(
        "--min-nodes",
        type=int,
        help="also plan the job on every node count from its own down to this one, as an "
        "elastic job (--nodes MIN:MAX) re-forms after losing nodes",
    )
    planner.add_argument(
        "--ranks-per-node",
        "--gpus-per-node",
        action=options.Renamed,
        type=int,
        default=8,
        help="ranks a node, for --min-nodes (default 8; --gpus-per-node: the old name)",
    )
    _launcher_args(planner, RUN_DEFAULTS)
    _trainer_options(planner)

    ckptd = sub.add_parser("ckptd", help="serve the checkpoint daemon")
    ckptd.set_defaults(handler=_ckptd)
    ckptd.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT")
    ckptd.add_argument("--data-dir", type=Path, required=True, help="SSD tier and catalog")
    ckptd.add_argument(
        "--memory-budget-mb", type=int, default=1024, help="memory tier plus data in flight"
    )
    ckptd.add_argument("--s3-endpoint", help="S3 endpoint URL; without it the S3 tier is off")
    ckptd.add_argument("--s3-bucket", default="scaletrain", help="S3 bucket (default scaletrain)")
    ckptd.add_argument(
        "--s3-region", default="us-east-1", help="S3 region to sign for (default us-east-1)"
    )
    ckptd.add_argument("--s3-part-mb", type=int, default=16, help="multipart part size")
    ckptd.add_argument(
        "--s3-parallel-parts", type=int, default=4, help="parts uploaded at once per file (4)"
    )
    ckptd.add_argument("--s3-backoff-max-s", type=float, default=30.0, help="longest retry wait")
    ckptd.add_argument("--telemetry", help="HOST:PORT of telemetry, to record tier commits")
    ckptd.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics here, as telemetry --metrics (default: none)",
    )
    ckptd.add_argument(
        "--metrics-port",
        type=int,
        action=options.Renamed,
        renamed="--metrics HOST:PORT",
        help="deprecated: --metrics HOST:PORT (with --metrics-host, default 127.0.0.1)",
    )
    ckptd.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        action=options.Renamed,
        renamed="--metrics HOST:PORT",
        help="deprecated: --metrics HOST:PORT",
    )
    ckptd.add_argument("--keep-memory", type=int, default=2, help="newest N in memory, per run")
    ckptd.add_argument("--keep-ssd", type=int, default=5, help="newest N on SSD, per run")
    ckptd.add_argument(
        "--s3-every", type=int, default=1, help="S3 keeps every Nth step + the latest (1: all)"
    )
    ckptd.add_argument(
        "--abandon-after-s", type=float, default=600.0, help="abort a save idle this long"
    )
    ckptd.add_argument(
        "--log-format",
        choices=("json", "text"),
        default="json",
        help="json lines with run, step, tier and bytes as fields, or text for people (json)",
    )
    ckptd.add_argument(
        "--node",
        help="this node's name, unique in the cluster (default: the name its data dir was "
        "given, or the host name for a new one)",
    )
    ckptd.add_argument(
        "--peers",
        default="",
        help="HOST:PORT[,HOST:PORT...] of the other nodes' ckptds (a static membership)",
    )
    ckptd.add_argument(
        "--peers-dns",
        help="HOST:PORT: every address HOST resolves to is a peer, re-resolved as nodes come "
        "and go (a Kubernetes headless Service)",
    )
    ckptd.add_argument(
        "--advertise", help="HOST:PORT peers reach this ckptd at (default: --listen)"
    )
    ckptd.add_argument(
        "--sync-interval-s",
        type=float,
        default=5.0,
        help="how often in-doubt saves are resolved and missed commits fetched from peers",
    )
    ckptd.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="R of a run that does not ask: copies of each node's part on distinct nodes "
        "(at most the nodes there are; 1: no replicas)",
    )
    ckptd.add_argument(
        "--zone",
        default=os.environ.get("SCALETRAIN_ZONE", ""),
        help="this node's failure domain (zone or rack): replicas go to other domains first "
        "(default: $SCALETRAIN_ZONE)",
    )
    ckptd.add_argument(
        "--replica-mb-s",
        type=float,
        default=256.0,
        help="most MB/s this node copies from its peers to make replicas (0: no limit)",
    )
    _security_args(ckptd)
    _limit_args(ckptd)

    tel = sub.add_parser(
        "telemetry", help="serve the telemetry service, or export a stored run's curves"
    )
    tel.set_defaults(handler=_telemetry)
    tel.add_argument(
        "action",
        nargs="?",
        choices=("serve", "export", "health"),
        default="serve",
        help="serve (default); export: write --run's scalars as TensorBoard event files; "
        "health: a run's MFU, goodput and badput by cause, stragglers, SDC and recoveries",
    )
    tel.add_argument(
        "health_run",
        nargs="?",
        metavar="RUN",
        help="health: the run (default, or latest/last: the work directory's last run)",
    )
    tel.add_argument("--tensorboard", type=Path, metavar="DIR", help="export: write under DIR/RUN")
    tel.add_argument("--run", help="export: the run")
    tel.add_argument("--json", action="store_true", help="health: print it as JSON")
    _workdir_arg(tel)
    tel.add_argument("--listen", default="127.0.0.1:50052", help="HOST:PORT")
    tel.add_argument(
        "--db",
        help="database URL without a password (default: $SCALETRAIN_DB_URL, the file named by "
        "$SCALETRAIN_DB_URL_FILE, or ./telemetry.db); a password comes from "
        "$SCALETRAIN_DB_PASSWORD or $SCALETRAIN_DB_PASSWORD_FILE",
    )
    tel.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics of the runs here (default: $SCALETRAIN_METRICS_LISTEN)",
    )
    tel.add_argument(
        "--keep-steps",
        metavar="N",
        help="keep per-rank rows of each run's latest N steps; rollups are kept for the whole run "
        "(default: $SCALETRAIN_TELEMETRY_KEEP_STEPS, or 1000)",
    )

    _security_args(tel)

    ui = sub.add_parser("ui", help="open the run-health UI")
    ui.set_defaults(handler=_ui)
    _workdir_arg(ui)
    ui.add_argument("--db", help="database URL (overrides --workdir)")
    ui.add_argument("--host", default="127.0.0.1", help="address to serve on (127.0.0.1)")
    ui.add_argument("--port", type=int, default=8501, help="port to serve on (8501)")

    data = sub.add_parser("data", help="prepare a corpus as token shards for --data")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    prepare = data_sub.add_parser(
        "prepare", help="tokenize text, .jsonl or Parquet into token shards"
    )
    prepare.set_defaults(handler=_data_prepare)
    prepare_args(prepare)
    example = data_sub.add_parser(
        "example",
        help="prepare the example dataset every machine has (what `make run` trains on): "
        "OUT/train and OUT/heldout from the standard library's sources, with a BPE trained on "
        "the first",
    )
    example.set_defaults(handler=_data_example)
    example.add_argument("--out", type=Path, required=True, help="where train/ and heldout/ go")
    example.add_argument("--vocab", type=int, default=EXAMPLE_VOCAB, help="the BPE's vocabulary")
    for made in (prepare, example):
        made.add_argument("--json", action="store_true", help="print the manifests made as JSON")

    ckpt = sub.add_parser("ckpt", help="list, show, verify, export and remove checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=_Parser)
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

    certs = sub.add_parser("certs", help="write a development CA and certificates signed by it")
    certs.set_defaults(handler=_certs)
    certs.add_argument("dir", type=Path, help="where to write ca.pem, server.*, client.*")
    certs.add_argument(
        "--host", action="append", default=[], help="another name of the server (repeatable)"
    )
    token = sub.add_parser("token", help="mint a token; only its hash is kept in the tokens file")
    token.set_defaults(handler=_token)
    token.add_argument("--tokens", type=Path, required=True, help="the tokens file (JSON)")
    token.add_argument(
        "--role",
        choices=("reader", "trainer", "admin"),
        required=True,
        help="reader reads checkpoints, trainer also writes checkpoints and telemetry, admin "
        "also deletes; each within --run",
    )
    token.add_argument("--run", default="*", help="the run it is good for (default: every run)")
    token.add_argument("--name", default="", help="a label for audit lines")
    return root


# The launchers' own defaults of trainer options they set themselves (a config file overrides them).
RUN_DEFAULTS: dict[str, options.Value] = {"steps": 300, "ckpt_every": 100}
CHAOS_DEFAULTS: dict[str, options.Value] = {"steps": 400, "ckpt_every": 5}
# Trainer options a launcher's own flag of the same name shadows (chaos --seed picks the ranks
# faults strike); its --config file still sets them.
CHAOS_SHADOWED = ("seed",)


def _launcher_args(parser: argparse.ArgumentParser, defaults: dict[str, options.Value]) -> None:
    """--steps and --ckpt-every, which a launcher hands the trainer itself."""
    for dest, value in defaults.items():
        o = options.BY_DEST[dest]
        parser.add_argument(
            o.flag, type=int, default=argparse.SUPPRESS, help=f"{o.help} (default {value})"
        )


def _trainer_options(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Every trainer option a launcher passes through (but `exclude`, which the launcher's own
    flags shadow: a config file still reaches them), and --config / --print-config."""
    options.add_arguments(parser, launcher=True, exclude=exclude)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved job config (TOML) and start nothing",
    )


def _security_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="listen without TLS on an address other than loopback (TLS: $SCALETRAIN_TLS_DIR, "
        "tokens: $SCALETRAIN_TOKENS_FILE)",
    )


# ckptd's fair shares (ckptd.config.DataLimits): flag -> (field, unit, what it limits).
_LIMIT_FLAGS = {
    "--uploads-per-caller": ("uploads_per_caller", 1, "uploads open at once, per caller"),
    "--uploads-per-run": ("uploads_per_run", 1, "the same per run"),
    "--max-uploads": ("uploads", 1, "the same on the node"),
    "--flight-mb-per-caller": ("flight_bytes_per_caller", 1 << 20,
                               "MiB received on the data socket, not yet written, per caller"),
    "--flight-mb-per-run": ("flight_bytes_per_run", 1 << 20, "the same per run"),
    "--max-flight-mb": ("flight_bytes", 1 << 20, "the same on the node"),
    "--waiting-connections-per-host": ("waiting_connections_per_host", 1,
                                       "data connections without a ticket yet, per host"),
    "--max-waiting-connections": ("waiting_connections", 1, "the same on the node"),
    "--ticket-wait-s": ("ticket_wait_s", 1, "close a data connection without a ticket by then"),
    "--data-read-timeout-s": ("read_timeout_s", 1, "fail an upload silent this long"),
    "--reads-per-caller": ("reads_per_caller", 1, "reads opened on the data socket, not yet "
                           "sent, per caller"),
    "--reads-per-run": ("reads_per_run", 1, "the same per run"),
    "--max-reads": ("reads", 1, "the same on the node"),
    "--calls-per-client": ("calls_per_client", 1, "gRPC calls at once per client"),
    "--log-every-s": ("log_every_s", 1, "one line per this interval for repeated warnings"),
}  # fmt: skip


def _limit_args(parser: argparse.ArgumentParser) -> None:
    """ckptd's limits per caller, per run and per node (README, "Security")."""
    from ckptd.config import DataLimits

    defaults = DataLimits()
    for flag, (name, unit, what) in _LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        parser.add_argument(
            flag,
            dest=name,
            type=type(default),
            default=default // unit if unit > 1 else default,
            help=f"{what} (default: %(default)s)",
        )


def _limits(args: argparse.Namespace) -> DataLimits:
    from ckptd.config import DataLimits

    return DataLimits(
        **{name: getattr(args, name) * unit for name, unit, _ in _LIMIT_FLAGS.values()}
    )


def _ckpt_parser(
    sub: argparse._SubParsersAction,
    name: str,
    summary: str,
    handler: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=summary)
    parser.set_defaults(handler=handler)
    _workdir_arg(parser)
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


def _node_range(text: str) -> tuple[int, int]:
    from scaletrain.app.stack import parse_nodes

    try:
        return parse_nodes(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nodes_arg(parser: argparse.ArgumentParser) -> None:
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


def _workdir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", type=Path, default=DEFAULT_WORKDIR, help="state directory (./.scaletrain)"
    )


class Terminated(BaseException):
    """SIGTERM (`kill`, `timeout`, a pod's end): unwinds like Ctrl-C, so that every child process
    is stopped on the way out; a BaseException, so no `except Exception` on the way stops it."""


def _terminated(signum: int, frame: object) -> NoReturn:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The services' own commands (ckptd, telemetry, rendezvous) install their own handler.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("scaletrain: interrupted; every child process was stopped", file=sys.stderr)
        return 130
    except Terminated:
        print("scaletrain: terminated; every child process was stopped", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (UserError, ScaletrainError, ValueError) as exc:
        print(f"scaletrain {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        print(
            f"scaletrain: error: missing dependency {exc.name!r}; run `make install`",
            file=sys.stderr,
        )
        return 1


def _rendezvous(args: argparse.Namespace) -> int:
    from scaletrain.app.rendezvous import serve

    serve(args.listen)
    return 0


def _data_example(args: argparse.Namespace) -> int:
    """`data example`: progress on stderr, what was made on stdout."""
    from trainer.data.prepare import prepare_example, summary

    made = zip(("train", "heldout"), prepare_example(args.out, args.vocab, sys.stderr), strict=True)
    manifests = {str(args.out / name): manifest for name, manifest in made}
    _print_made(manifests, args.json, summary)
    return 0


def _print_made(manifests: dict[str, dict], as_json: bool, summary: Callable[[dict], str]) -> None:
    """What `data` made: directory -> its manifest, as JSON or a line each."""
    if as_json:
        print(json.dumps(manifests, indent=2))
        return
    for out, manifest in manifests.items():
        print(f"[data] {out}: {summary(manifest)}")


def _data_prepare(args: argparse.Namespace) -> int:
    """`data prepare`: progress on stderr, what was made on stdout."""
    from trainer.data.prepare import options_from, prepare, summary

    manifest = prepare(options_from(args), progress=sys.stderr)
    _print_made({str(args.out): manifest}, args.json, summary)
    return 0


def _job(args: argparse.Namespace, defaults: dict[str, options.Value]) -> dict[str, options.Value]:
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


def _run(args: argparse.Namespace) -> int:
    from scaletrain.app.embedded import RunOptions, run
    from scaletrain.app.stack import Workdir

    _resume_target(args)
    job = _job(args, RUN_DEFAULTS)
    if args.print_config:
        print(options.to_toml(job), end="")
        return 0
    if job["init_from_hf"]:
        _check_init_from_hf(job)
    run_options = RunOptions(
        workdir=Workdir(args.workdir),
        ranks=args.ranks,
        min_nodes=args.nodes[0],
        capacity_wait_s=args.capacity_wait_s,
        nodes=args.nodes[1],
        spares=args.spares,
        cordon_after=args.cordon_after,
        steps=int(job["steps"]),
        ckpt_every=int(job["ckpt_every"]),
        run_id=str(job["run_id"]) or None,
        resume=bool(job["resume"]),
        trainer_args=options.to_argv(options.passed_on(job)),
        max_restarts=args.max_restarts,
        secure=args.secure,
    )
    # With --json, stdout carries only the summary: progress goes to stderr.
    summary = run(run_options, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        _print_summary(summary)
    if args.tensorboard is not None:
        _print_tensorboard(None, args, summary.run_id)
    return 0


def _check_init_from_hf(job: dict[str, options.Value]) -> None:
    """Refuse an HF directory the model cannot start from now, in one line, rather than after
    the stack has started (the trainer checks it again)."""
    from trainer.config import from_values
    from trainer.interop.hf_import import check_init

    check_init(Path(str(job["init_from_hf"])), from_values(job | {"run_id": "check"}).model)


def _plan(args: argparse.Namespace) -> int:
    from scaletrain.app.plan import elastic_sizes, plan, render, render_elastic

    job = _job(args, RUN_DEFAULTS)
    if args.print_config:
        print(options.to_toml(job), end="")
        return 0
    job = job | {"run_id": job["run_id"] or "plan"}
    planned = plan(job, args.ranks, args.device, args.tokens_per_s)
    sizes = None
    if args.min_nodes is not None:
        sizes = elastic_sizes(job, args.ranks, args.ranks_per_node, args.min_nodes, args.device)
    if args.json:
        shown = dataclasses.asdict(planned) | {"mfu": planned.mfu}
        if sizes is not None:
            shown["elastic"] = [dataclasses.asdict(size) for size in sizes]
        print(json.dumps(shown, indent=2))
        return 0
    print(render(planned))
    if sizes is not None:
        print(render_elastic(sizes, args.ranks_per_node))
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
    print(f"mfu          {s.mfu_label}")
    print(f"goodput      {fmt(s.goodput, '.1%')}  badput: {_badput(s.badput_s)}")
    _print_other(s.badput_s, indent=13)
    print(f"health       {_findings(s.health_events, s.data_spikes)}")
    print(f"checkpoints  {len(s.checkpoints)} committed")
    for c in s.checkpoints:
        safe = "  node-loss safe" if c.get("node_loss_safe") else ""
        print(
            f"  step {c['step']:>6}  {c['bytes'] / 1e6:8.2f} MB  tiers: {_tiers(c['tiers'])}{safe}"
        )
        for part in c["parts"] if len(c["parts"]) > 1 else []:
            where = (
                f"{part['files']:>3} files  tiers: {_tiers(part['tiers'])}"
                if part["reachable"]
                else f"unreachable: {part['error']}"
            )
            copies = [n for n, tiers in part.get("replicas", {}).items() if tiers]
            if copies and part["files"]:
                where += f"  copies on: {', '.join(copies)}"
            print(f"    {part['node']:<11}{part['bytes'] / 1e6:8.2f} MB  {where}")
    print(f"open the UI  {s.ui_command}")


def _tiers(names: list[str]) -> str:
    return ", ".join(names) or "none"


def _chaos(args: argparse.Namespace) -> int:
    from scaletrain.app.chaos import ChaosOptions, chaos, default_schedule, parse_schedule
    from scaletrain.app.stack import Workdir

    job = _job(args, CHAOS_DEFAULTS)
    if args.print_config:
        print(options.to_toml(job), end="")
        return 0
    chaos_options = ChaosOptions(
        workdir=Workdir(args.workdir),
        schedule=parse_schedule(args.schedule or default_schedule(args.nodes[1])),
        ranks=args.ranks,
        min_nodes=args.nodes[0],
        capacity_wait_s=args.capacity_wait_s,
        nodes=args.nodes[1],
        spares=args.spares,
        cordon_after=args.cordon_after,
        steps=int(job["steps"]),
        ckpt_every=int(job["ckpt_every"]),
        trainer_args=options.to_argv(options.passed_on(job)),
        max_restarts=args.max_restarts,
        seed=args.fault_seed,
        ssd_mb=args.ssd_mb,
    )
    report = chaos(chaos_options, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
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
    print(f"goodput              {goodput}  badput: {_badput(r.badput_s)}")
    _print_other(r.badput_s, indent=21)
    print(f"badput by fault      {_badput(r.badput_by_fault_s)}")
    effective = "n/a" if r.effective_training is None else f"{r.effective_training:.1%}"
    print(f"effective training   {effective} of the job's wall time in steps that were kept")
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
            f"reading {_tiers([f'{t} {b / 1e6:.2f} MB' for t, b in rec['bytes_per_tier'].items()])}"
        )
    return (
        f"detected {after(rec['detected_at'])}, first step {after(rec['first_step_at'])}"
        f"{restore}; cost {rec['badput_s']:.1f}s"
    )


def _badput(seconds: dict[str, float]) -> str:
    shown = [f"{cause} {value:.1f}s" for cause, value in seconds.items() if value >= 0.05]
    return ", ".join(shown) or "none"


def _print_other(seconds: dict[str, float], indent: int) -> None:
    """Under a badput line that shows "other": what it is."""
    if seconds.get("other", 0.0) >= 0.05:
        from telemetry.efficiency import OTHER_BADPUT

        print(f"{'':{indent}}other: {OTHER_BADPUT}")


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


def _ckptd(args: argparse.Namespace) -> int:
    from ckptd.config import CkptdConfig, ClusterConfig, S3Config
    from ckptd.retention import RetentionPolicy
    from ckptd.server import serve
    from scaletrain.security import ServerSecurity

    if args.s3_part_mb < 5 or args.s3_parallel_parts < 1:
        raise UserError("--s3-part-mb must be >= 5 (S3's minimum) and --s3-parallel-parts >= 1")
    s3 = None
    if args.s3_endpoint:
        s3 = S3Config(
            **{
                **vars(S3Config.from_env(args.s3_endpoint, args.s3_bucket)),
                "region": args.s3_region,
                "part_bytes": args.s3_part_mb << 20,
                "parallel_parts": args.s3_parallel_parts,
                "backoff_max_s": args.s3_backoff_max_s,
            }
        )
    metrics = args.metrics
    if metrics is None and args.metrics_port is not None:
        metrics = f"{args.metrics_host}:{args.metrics_port}"
    try:
        config = CkptdConfig(
            data_dir=args.data_dir,
            listen=args.listen,
            memory_budget_bytes=args.memory_budget_mb << 20,
            s3=s3,
            telemetry=args.telemetry,
            retention=RetentionPolicy(args.keep_memory, args.keep_ssd, args.s3_every),
            abandon_after_s=args.abandon_after_s,
            metrics_listen=metrics,
            security=ServerSecurity.from_env(allow_plaintext=args.allow_plaintext),
            limits=_limits(args),
            cluster=ClusterConfig(
                node=args.node,
                peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
                peers_dns=args.peers_dns,
                advertise=args.advertise,
                sync_interval_s=args.sync_interval_s,
                zone=args.zone,
                replicas=args.replicas,
                replica_bytes_s=args.replica_mb_s * (1 << 20),
            ),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    serve(config, log_format=args.log_format)
    return 0


def _telemetry(args: argparse.Namespace) -> int:
    if args.action == "export":
        return _telemetry_export(args)
    if args.action == "health":
        return _telemetry_health(args)
    from scaletrain.security import ServerSecurity, database_url
    from telemetry.config import TelemetryConfig, retention_policy
    from telemetry.server import serve

    db = database_url(args.db, default="sqlite:///telemetry.db")
    metrics = args.metrics or os.environ.get("SCALETRAIN_METRICS_LISTEN") or None
    security = ServerSecurity.from_env(allow_plaintext=args.allow_plaintext)
    retention = retention_policy(args.keep_steps)
    serve(
        TelemetryConfig(
            db_url=db,
            listen=args.listen,
            metrics_listen=metrics,
            security=security,
            retention=retention,
        )
    )
    return 0


def _telemetry_export(args: argparse.Namespace) -> int:
    """`telemetry export --tensorboard DIR --run RUN`: from --db, $SCALETRAIN_DB_URL or the
    work directory's database."""
    if args.tensorboard is None or not args.run:
        raise UserError("telemetry export needs --tensorboard DIR and --run RUN")
    _print_tensorboard(args.db or os.environ.get("SCALETRAIN_DB_URL"), args, args.run)
    return 0


def _telemetry_health(args: argparse.Namespace) -> int:
    """`telemetry health [RUN] [--json]`: the run's health from --db, $SCALETRAIN_DB_URL or the
    work directory's database."""
    from scaletrain.app.checkpoints import NEWEST
    from scaletrain.app.stack import Workdir
    from telemetry.health import render, run_health

    run_id = args.health_run
    if not run_id or run_id in NEWEST:
        run_id = Workdir(args.workdir).last_run_id()
        if not run_id:
            raise UserError(f"no run in {Workdir(args.workdir).root}: name one (health RUN)")
    with _reading(args.db or os.environ.get("SCALETRAIN_DB_URL"), args) as engine:
        health = run_health(engine, run_id, max_findings=10)
    if args.json:
        print(json.dumps(dataclasses.asdict(health), indent=2, default=str))
    else:
        print(render(health))
    return 0


def _reading(db: str | None, args: argparse.Namespace) -> contextlib.AbstractContextManager[Engine]:
    """A read-only engine on `db`, else on the work directory's telemetry database."""
    from scaletrain.app.stack import Workdir
    from telemetry.db import reading

    if db is None:
        workdir = Workdir(args.workdir)
        if not workdir.telemetry_db.exists():
            raise UserError(f"no telemetry database in {workdir.root}; run `scaletrain run` first")
        db = workdir.db_url
    return reading(db)


def _print_tensorboard(db: str | None, args: argparse.Namespace, run_id: str) -> None:
    """Write `run_id`'s scalars under --tensorboard and say where."""
    from telemetry.tensorboard import write_tensorboard

    with _reading(db, args) as engine:
        logdir, count = write_tensorboard(engine, run_id, args.tensorboard)
    print(f"tensorboard: {count} scalars of run {run_id} in {logdir} "
          f"(tensorboard --logdir {args.tensorboard})", file=sys.stderr)  # fmt: skip


def _certs(args: argparse.Namespace) -> int:
    from scaletrain import security

    files = security.generate_certs(args.dir, tuple(args.host))
    print(f"wrote a development CA and certificates to {files.root}")
    print(f"serve and connect with TLS: export {security.TLS_DIR_ENV}={files.root.resolve()}")
    print(f"require client certificates too: export {security.TLS_CLIENT_AUTH_ENV}=1")
    return 0


def _token(args: argparse.Namespace) -> int:
    from scaletrain import security

    if args.run != security.ALL_RUNS:
        from ckptd.names import check_run

        check_run(args.run)
    # The token goes to stdout alone (for `export SCALETRAIN_TOKEN=$(scaletrain token ...)`);
    # the file keeps its hash.
    print(security.add_token(args.tokens, args.role, args.run, args.name))
    return 0


def _ui(args: argparse.Namespace) -> int:
    from scaletrain.app.stack import Workdir
    from ui.launch import run_ui

    db = args.db or os.environ.get("SCALETRAIN_DB_URL")
    if db is None:
        workdir = Workdir(args.workdir)
        if not workdir.telemetry_db.exists():
            raise UserError(f"no telemetry database in {workdir.root}; run `scaletrain run` first")
        db = workdir.db_url
    return run_ui(db, host=args.host, port=args.port)


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
