"""`scaletrain data prepare` and `data example`: corpora as token shards for --data."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from scaletrain.app.commands.common import Parser
from trainer.data.prepare import EXAMPLE_VOCAB
from trainer.data.prepare import add_arguments as prepare_args


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="prepare a corpus as token shards for --data")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=Parser)
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


def _data_prepare(args: argparse.Namespace) -> int:
    """`data prepare`: progress on stderr, what was made on stdout."""
    from trainer.data.prepare import options_from, prepare, summary

    manifest = prepare(options_from(args), progress=sys.stderr)
    _print_made({str(args.out): manifest}, args.json, summary)
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
