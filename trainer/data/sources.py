"""The documents of a corpus, in one fixed order: text files, `.jsonl` (optionally gzipped)
and Parquet, given as files or directories.

The order is the inputs' as given, a directory's files sorted by path, then each file's own
order, so the same inputs always give the same document stream (and so the same shards).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class Source:
    """One input file and how its documents are read."""

    path: Path
    kind: str  # "text", "jsonl" or "parquet"

    def sha256(self) -> str:
        return file_sha256(self.path)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read 1 MiB at a time (inputs and shards may be large)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def find_sources(inputs: list[str]) -> list[Source]:
    """The input files, directories expanded (sorted, recursively, known suffixes only)."""
    sources: list[Source] = []
    for spec in inputs:
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
            if not found:
                raise UserError(
                    f"{spec}: no .txt, .md, .jsonl(.gz) or .parquet file in this directory"
                )
            sources += [Source(p, _kind(p) or "text") for p in found]
        elif path.is_file():
            # A file named explicitly is read as text unless its suffix says otherwise.
            sources.append(Source(path, _kind(path) or "text"))
        else:
            raise UserError(f"{spec}: no such file or directory")
    return sources


def _decode(data: bytes, where: str, errors: str) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{where}: invalid UTF-8 at byte {exc.start}; pass --utf8-errors replace to replace "
            "invalid bytes with U+FFFD"
        ) from None


def documents(source: Source, field: str, errors: str) -> Iterator[str]:
    """The documents of one input: a whole text file, each `.jsonl` line's `field`, or each
    Parquet row's `field` column. Empty documents are skipped (they would be a bare EOS)."""
    where = str(source.path)
    try:
        if source.kind == "text":
            text = _decode(source.path.read_bytes(), where, errors)
            if text:
                yield text
        elif source.kind == "jsonl":
            yield from _jsonl(source.path, field, errors)
        else:
            yield from _parquet(source.path, field)
    except OSError as exc:
        raise UserError(f"{where}: cannot read it ({exc.strerror or exc})") from None


def _jsonl(path: Path, field: str, errors: str) -> Iterator[str]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(_decode(raw, where, errors))
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: not a JSON object ({exc.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise UserError(f"{where}: no field {field!r} (choose it with --field)")
            text = record[field]
            if not isinstance(text, str):
                raise UserError(f"{where}: field {field!r} holds {type(text).__name__}, not text")
            if text:
                yield text


def _parquet(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise UserError(f"{path}: not a Parquet file ({exc})") from None
    names = table.schema_arrow.names
    if column not in names:
        raise UserError(
            f"{path}: no column {column!r} (it has {', '.join(names)}; choose one with --field)"
        )
    for batch in table.iter_batches(columns=[column], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text:
                yield str(text)
