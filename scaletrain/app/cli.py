"""The `scaletrain` command: argument parsing and printing over the packages, nothing more.
This module is the entry point (the top parser and the one-line errors); each command has a
module of its own in scaletrain/app/commands/ (its flags, its handler and its printing).

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
import os
import signal
import sys
from importlib import metadata
from typing import NoReturn

# gRPC's core logs its own copy of errors we report in one line (a port in use, say); set
# GRPC_VERBOSITY=debug to see them. This must happen before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from scaletrain.app.commands import (
    chaos,
    ckpt,
    ckptd,
    credentials,
    data,
    plan,
    rendezvous,
    run,
    telemetry,
    ui,
)
from scaletrain.app.commands.common import Parser
from scaletrain.errors import ScaletrainError, UserError

DESCRIPTION = (
    "Train Llama-style models (dense and MoE, five parallelisms, FP8) on an embedded stack of "
    "services where checkpoints, run health and recovery are one system: ckptd tiers "
    "checkpoints from memory to SSD to S3, telemetry keeps every rank's statistics, and a "
    "failed rank, node or service is recovered from. `scaletrain COMMAND --help` for each."
)


# Each command's module (scaletrain/app/commands/), in the order `scaletrain --help` lists them.
COMMANDS = (run, rendezvous, chaos, plan, ckptd, telemetry, ui, data, ckpt, credentials)


def build_parser() -> argparse.ArgumentParser:
    root = Parser(prog="scaletrain", description=DESCRIPTION)
    root.add_argument(
        "--version", action="version", version=f"scaletrain {metadata.version('scaletrain')}"
    )
    sub = root.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return root


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
