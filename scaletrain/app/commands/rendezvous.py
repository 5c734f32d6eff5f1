"""`scaletrain rendezvous`: a training job's c10d rendezvous store, off the training nodes."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    rendezvous = sub.add_parser(
        "rendezvous",
        help="host a training job's c10d rendezvous store, off the training nodes",
    )
    rendezvous.set_defaults(handler=_rendezvous)
    rendezvous.add_argument(
        "--listen", required=True, help="HOST:PORT torchrun's --rdzv-endpoint names"
    )


def _rendezvous(args: argparse.Namespace) -> int:
    from scaletrain.app.rendezvous import serve

    serve(args.listen)
    return 0
