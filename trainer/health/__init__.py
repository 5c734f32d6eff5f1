"""Training health: the dense peak MFU divides by, silent-data-corruption and loss-spike detection
with step replay, and the faults that prove them (bit flips, stragglers, bad batches).

The loop in `trainer.train` calls into here from a few lines; everything that decides lives here.
Straggler detection needs every rank's times, so it runs in the telemetry service on what arrives.
"""

from __future__ import annotations

import argparse

# What the step guard may do with a suspicious step (see trainer.health.guard). This module imports
# no torch, so that `scaletrain run` offers the same options as the trainer without loading it.
POLICIES = ("rollback", "skip", "alert", "off")
FAULT_FLAGS = ("--inject-sdc", "--inject-straggler", "--inject-loss-spike", "--inject-bad-device")
# Options with a value that `scaletrain run` hands to the trainer unchanged when given.
VALUE_FLAGS = (
    "--health-policy",
    "--peak-flops",
    "--collective-timeout-s",
    "--watchdog-min-s",
    "--watchdog-factor",
    "--heartbeat-s",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The health options of the trainer, which `scaletrain run` passes through."""
    parser.add_argument(
        "--health-policy",
        choices=POLICIES,
        help="what to do with a suspicious step (default rollback)",
    )
    parser.add_argument("--peak-flops", type=float, help="dense peak FLOP/s of one device, for MFU")
    parser.add_argument(
        "--collective-timeout-s", type=float, help="timeout of every collective (default 600)"
    )
    parser.add_argument(
        "--watchdog-min-s",
        type=float,
        help="a phase without progress this long fails the rank, at the least (default 120)",
    )
    parser.add_argument(
        "--watchdog-factor",
        type=float,
        help="... or this many times the slowest recent step, if longer (default 10)",
    )
    parser.add_argument(
        "--heartbeat-s", type=float, help="seconds between heartbeats to telemetry (default 10)"
    )
    for flag, metavar, what in zip(
        FAULT_FLAGS,
        ("step=K,rank=R[,target=grad|param][,bit=B]", "rank=R,delay=SECONDS", "step=K", "rank=R"),
        (
            "flip a bit of a gradient or parameter",
            "make a rank slower in every step",
            "train step K on a bad batch",
            "make a rank's device fail the health check before start",
        ),
        strict=True,
    ):
        parser.add_argument(flag, action="append", default=[], metavar=metavar, help=what)
