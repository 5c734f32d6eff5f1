"""`scaletrain data prepare`: a corpus made into memory-mapped token shards, once, before training.

Tokenizing while training costs every rank CPU time on every step and makes the token stream
depend on the loader's threads; a prepared directory is read by offset, so any rank computes any
sample in O(1) and a resume at another data-parallel degree reads the same samples.

A prepared directory holds:
- `shard-NNNNN.bin`: the tokens of whole documents, each followed by EOS (uint16 when the
  vocabulary fits, else uint32);
- `shard-NNNNN.idx`: each document's end offset in its shard (int64, cumulative);
- the tokenizer's file (`tokenizer.json` or `tokenizer.model`; none for `bytes`);
- `manifest.json`: the format version, every input's SHA-256, the tokenizer's kind, SHA-256,
  vocabulary, EOS and padding, and each shard's documents, tokens and SHA-256.

Shards are cut at document boundaries after `--shard-tokens` tokens, so where they are cut
depends on the document stream alone: the same inputs give the same bytes, and a prepare that was
interrupted continues after its last complete shard (recorded in the manifest, which is replaced
atomically after each shard) and ends with the same bytes as one that never stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import signal
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from scaletrain.errors import UserError
from trainer.data.sources import Source, documents, file_sha256, find_sources
from trainer.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

FORMAT = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 64 << 20
# A test kills the prepare after this many shards of one invocation (a real process death).
CRASH_ENV = "SCALETRAIN_PREPARE_CRASH_AFTER"
ENCODE_BATCH = 512  # documents per call into the tokenizer's thread pool


@dataclass
class PrepareOptions:
    inputs: list[str]
    out: Path
    tokenizer: str = "bytes"
    train_tokenizer: int | None = None  # train a BPE of this vocabulary on the inputs
    text_field: str = "text"  # the .jsonl field or Parquet column
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    utf8_errors: str = "strict"  # or "replace"
    eos: str | None = None  # the EOS token's name, where the tokenizer's is not a known one
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)


# Where --train-tokenizer saves the BPE it trained, in the prepared directory.
TRAINED_TOKENIZER = "tokenizer.json"


def shard_name(index: int, suffix: str) -> str:
    return f"shard-{index:05d}.{suffix}"


def dtype_for(vocab_size: int) -> np.dtype:
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise UserError(f"a vocabulary of {vocab_size:,} does not fit uint32 token shards")


def _write_atomically(path: Path, data: bytes) -> None:
    """Write, fsync and rename into place: a reader (or a continued prepare) sees the old file or
    the new one, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Progress:
    """One line on a terminal (or every few seconds elsewhere): documents, tokens, tokens/s."""

    def __init__(self, out: IO[str] | None) -> None:
        self.out = out
        self.started = self.shown = time.monotonic()
        self.tty = bool(out is not None and out.isatty())

    def show(self, documents: int, tokens: int, final: bool = False) -> None:
        if self.out is None:
            return
        now = time.monotonic()
        if not final and now - self.shown < (0.5 if self.tty else 5.0):
            return
        self.shown = now
        rate = tokens / max(now - self.started, 1e-9)
        line = f"[data] {documents:,} documents, {tokens:,} tokens, {rate:,.0f} tokens/s"
        end = "\n" if final or not self.tty else ""
        self.out.write(("\r" if self.tty else "") + line + end)
        self.out.flush()


class _Manifest:
    """The manifest of a prepare in progress or done; `fingerprint` is what must match for a
    continued prepare to add to it."""

    def __init__(self, out: Path, fingerprint: dict, tokenizer: dict, dtype: np.dtype) -> None:
        self.out, self.fingerprint = out, fingerprint
        self.body: dict = {
            "format": FORMAT,
            "complete": False,
            **fingerprint,
            "tokenizer": tokenizer,
            "dtype": dtype.name,
            "documents": 0,
            "tokens": 0,
            "shards": [],
        }

    def resume_from(self, existing: dict) -> None:
        """Keep the shards of an interrupted prepare whose files still match their checksums."""
        for shard in existing.get("shards", []):
            bin_path, idx_path = self.out / shard["file"], self.out / shard["index"]
            if not (bin_path.is_file() and idx_path.is_file()):
                break
            if file_sha256(bin_path) != shard["sha256"]:
                break
            self.add(shard)

    def add(self, shard: dict) -> None:
        self.body["shards"].append(shard)
        self.body["documents"] += shard["documents"]
        self.body["tokens"] += shard["tokens"]

    def save(self, complete: bool = False) -> None:
        self.body["complete"] = complete
        _write_atomically(self.out / MANIFEST, json.dumps(self.body, indent=1).encode() + b"\n")


def read_manifest(directory: Path) -> dict:
    """A prepared directory's manifest; UserError in one line when it is missing or unreadable."""
    path = directory / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{directory}: not a prepared dataset (no {MANIFEST})") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable ({exc})") from None


def _existing_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.is_file():
        if any(out.glob("shard-*.bin")):
            raise UserError(f"--out {out}: holds token shards but no {MANIFEST}; delete it")
        return None
    existing = read_manifest(out)
    if existing.get("format") != FORMAT:
        raise UserError(
            f"{path}: prepared with format {existing.get('format')!r}, this scaletrain writes "
            f"and reads format {FORMAT}; prepare it again into a new --out"
        )
    return existing


def _all_documents(options: PrepareOptions, sources: list[Source]) -> Iterator[str]:
    """Every input's documents, in the corpus's fixed order."""
    for source in sources:
        yield from documents(source, options.text_field, options.utf8_errors)


def _tokenizer(options: PrepareOptions, sources: list[Source]) -> Tokenizer:
    if options.train_tokenizer is None:
        return load_tokenizer(options.tokenizer, options.threads, options.eos)
    trained = options.out / TRAINED_TOKENIZER
    if not trained.is_file():  # kept from an interrupted prepare: the same training's result
        train_bpe(_all_documents(options, sources), options.train_tokenizer, options.out)
    return load_tokenizer(str(trained), options.threads, options.eos)


def prepare(options: PrepareOptions, progress: IO[str] | None = None) -> dict:
    """Prepare `options.inputs` into `options.out`; returns the manifest. Continues an
    interrupted prepare of the same inputs and tokenizer; refuses a directory holding another."""
    if options.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be at least 1, got {options.shard_tokens}")
    if options.utf8_errors not in ("strict", "replace"):
        raise UserError(f"--utf8-errors must be strict or replace, got {options.utf8_errors!r}")
    sources = find_sources(options.inputs)
    options.out.mkdir(parents=True, exist_ok=True)
    existing = _existing_manifest(options.out)
    tokenizer = _tokenizer(options, sources)
    dtype = dtype_for(tokenizer.vocab_size)
    fingerprint = {
        "inputs": [{"path": str(s.path), "kind": s.kind, "sha256": s.sha256()} for s in sources],
        "field": options.text_field,
        "train_tokenizer": options.train_tokenizer,
        "shard_tokens": options.shard_tokens,
        "utf8_errors": options.utf8_errors,
    }
    tokenizer_info = {
        "kind": tokenizer.kind,
        "file": tokenizer.save(options.out),
        "sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
    }
    manifest = _Manifest(options.out, fingerprint, tokenizer_info, dtype)
    if existing is not None:
        theirs = {k: existing.get(k) for k in fingerprint} | {"tokenizer": existing["tokenizer"]}
        if theirs != fingerprint | {"tokenizer": tokenizer_info}:
            raise UserError(
                f"--out {options.out}: holds a prepare of other inputs or another tokenizer; "
                "choose another --out or delete it"
            )
        if existing.get("complete"):
            return existing
        manifest.resume_from(existing)
    _write_shards(options, sources, tokenizer, dtype, manifest, _Progress(progress))
    manifest.save(complete=True)
    return manifest.body


def _write_shards(
    options: PrepareOptions,
    sources: list[Source],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    manifest: _Manifest,
    progress: _Progress,
) -> None:
    done = manifest.body["documents"]
    texts = itertools.islice(_all_documents(options, sources), done, None)
    crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
    written = 0
    pending: list[np.ndarray] = []  # the documents of the shard being filled, EOS included
    pending_tokens = 0
    for encoded in _encoded(texts, tokenizer):
        for ids in encoded:
            doc = np.empty(len(ids) + 1, dtype=dtype)
            doc[:-1] = ids
            doc[-1] = tokenizer.eos_id
            pending.append(doc)
            pending_tokens += doc.size
            if pending_tokens >= options.shard_tokens:
                _flush(manifest, pending)
                pending, pending_tokens = [], 0
                written += 1
                if written == crash_after:
                    os.kill(os.getpid(), signal.SIGKILL)
        progress.show(
            manifest.body["documents"] + len(pending), manifest.body["tokens"] + pending_tokens
        )
    if pending:
        _flush(manifest, pending)
    if manifest.body["tokens"] == 0:
        raise UserError(f"{', '.join(options.inputs)}: the corpus holds no text")
    progress.show(manifest.body["documents"], manifest.body["tokens"], final=True)


def _encoded(texts: Iterator[str], tokenizer: Tokenizer) -> Iterator[list[list[int]]]:
    while batch := list(itertools.islice(texts, ENCODE_BATCH)):
        yield tokenizer.encode_batch(batch)


def _flush(manifest: _Manifest, docs: list[np.ndarray]) -> None:
    """Write one shard (tokens, then document ends), then record it in the manifest."""
    index = len(manifest.body["shards"])
    tokens = np.concatenate(docs)
    ends = np.cumsum([d.size for d in docs], dtype=np.int64)
    bin_name, idx_name = shard_name(index, "bin"), shard_name(index, "idx")
    data = tokens.tobytes()
    _write_atomically(manifest.out / bin_name, data)
    _write_atomically(manifest.out / idx_name, ends.tobytes())
    manifest.add(
        {
            "file": bin_name,
            "index": idx_name,
            "documents": len(docs),
            "tokens": int(tokens.size),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    )
    manifest.save()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`scaletrain data prepare`'s options."""
    parser.add_argument("inputs", nargs="+", help="text, .jsonl(.gz) or .parquet files, or dirs")
    parser.add_argument("--out", type=Path, required=True, help="the prepared directory")
    parser.add_argument(
        "--tokenizer", default="bytes", help="a tokenizer.json, a SentencePiece .model, or bytes"
    )
    parser.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE of this vocabulary on the inputs (saved in --out)",
    )
    parser.add_argument("--field", default="text", help="the .jsonl field or Parquet column")
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens a shard file holds (default {DEFAULT_SHARD_TOKENS})",
    )
    parser.add_argument(
        "--utf8-errors",
        choices=("strict", "replace"),
        default="strict",
        help="text that is not UTF-8: strict refuses it, replace substitutes U+FFFD (strict)",
    )
    parser.add_argument("--eos", help="the end-of-sequence token, if not a usual name")


def options_from(args: argparse.Namespace) -> PrepareOptions:
    return PrepareOptions(
        inputs=args.inputs,
        out=args.out,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        text_field=args.field,
        shard_tokens=args.shard_tokens,
        utf8_errors=args.utf8_errors,
        eos=args.eos,
    )


# The example dataset every machine can make (`scaletrain data example`, what `make run` trains
# on): packages of the Python standard library's own sources, some to train on, others held out.
EXAMPLE_TRAIN = ("email", "asyncio", "logging")
EXAMPLE_HELD_OUT = ("json", "http")
EXAMPLE_VOCAB = 2048


def prepare_example(
    out: Path, vocab: int = EXAMPLE_VOCAB, progress: IO[str] | None = None
) -> tuple[dict, dict]:
    """`out`/train (a BPE of `vocab` trained on it, in seconds) and `out`/heldout (the same
    tokenizer) from the standard library's sources; their manifests. Done again, it finds both
    complete and changes nothing."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train = prepare(
        PrepareOptions(
            inputs=[str(stdlib / p) for p in EXAMPLE_TRAIN],
            out=out / "train",
            train_tokenizer=vocab,
        ),
        progress,
    )
    held_out = prepare(
        PrepareOptions(
            inputs=[str(stdlib / p) for p in EXAMPLE_HELD_OUT],
            out=out / "heldout",
            tokenizer=str(out / "train" / TRAINED_TOKENIZER),
        ),
        progress,
    )
    return train, held_out


def summary(manifest: dict) -> str:
    tok = manifest["tokenizer"]
    return (
        f"{manifest['documents']:,} documents, {manifest['tokens']:,} tokens in "
        f"{len(manifest['shards'])} shard(s) of {manifest['dtype']}; tokenizer {tok['kind']} "
        f"(vocabulary {tok['vocab_size']:,}, EOS {tok['eos_id']})"
    )
