"""`scaletrain ckptd`: the checkpoint daemon, its flags and its fair shares."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.app.commands.common import security_args
from scaletrain.errors import UserError
from trainer import options

if TYPE_CHECKING:
    from ckptd.config import DataLimits


def register(sub: argparse._SubParsersAction) -> None:
    from ckptd.config import CkptdConfig, ClusterConfig

    # The defaults are the dataclasses' own (the chart's values are held equal to them by tests).
    config = {f.name: f.default for f in dataclasses.fields(CkptdConfig)}
    cluster = ClusterConfig()
    ckptd = sub.add_parser("ckptd", help="serve the checkpoint daemon")
    ckptd.set_defaults(handler=_ckptd)
    ckptd.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT")
    ckptd.add_argument("--data-dir", type=Path, required=True, help="SSD tier and catalog")
    ckptd.add_argument(
        "--memory-budget-mb",
        type=int,
        default=config["memory_budget_bytes"] >> 20,
        help="memory tier plus data in flight",
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
        "--abandon-after-s",
        type=float,
        default=config["abandon_after_s"],
        help="abort a save idle this long",
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
        default=cluster.sync_interval_s,
        help="how often in-doubt saves are resolved and missed commits fetched from peers",
    )
    ckptd.add_argument(
        "--replicas",
        type=int,
        default=cluster.replicas,
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
        default=cluster.replica_bytes_s / (1 << 20),
        help="most MB/s this node copies from its peers to make replicas (0: no limit)",
    )
    security_args(ckptd)
    _limit_args(ckptd)


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


def _chart_name(flag: str) -> str:
    """The chart's value of a limit flag (--uploads-per-caller: uploadsPerCaller), which the
    template turns back into the flag with `kebabcase`."""
    first, *rest = flag.removeprefix("--").split("-")
    return first + "".join(word.capitalize() for word in rest)


def helm_schema() -> dict[str, object]:
    """The JSON schema of the chart's `ckptd.fairShare`: every limit flag by its chart name, typed
    as its DataLimits field and described as here (helm/scaletrain/values.schema.json holds it,
    so a flag added here is one the chart refuses until the schema is written again)."""
    from ckptd.config import DataLimits

    defaults = DataLimits()
    properties: dict[str, object] = {
        _chart_name(flag): {
            "type": "integer" if isinstance(getattr(defaults, name), int) else "number",
            "exclusiveMinimum": 0,
            "description": what,
        }
        for flag, (name, _, what) in _LIMIT_FLAGS.items()
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": list(properties),
    }


def _limits(args: argparse.Namespace) -> DataLimits:
    from ckptd.config import DataLimits

    return DataLimits(
        **{name: getattr(args, name) * unit for name, unit, _ in _LIMIT_FLAGS.values()}
    )


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


if __name__ == "__main__":
    # `python -m scaletrain.app.commands.ckptd`: put `helm_schema()` into the chart's schema after
    # a change to the limits, as `python -m trainer.options` does for the trainer's options.
    schema = json.loads(options.SCHEMA_FILE.read_text())
    schema["properties"]["ckptd"]["properties"]["fairShare"] = helm_schema()
    options.SCHEMA_FILE.write_text(json.dumps(schema, indent=2) + "\n")
