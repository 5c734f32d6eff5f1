"""The tokenizer files of an HF export: those of the prepared dataset a run trained on.

A prepared directory (`scaletrain data prepare`) holds its tokenizer's file and records its kind,
SHA-256 and special ids in `manifest.json`; `transformers`' `AutoTokenizer` needs that file plus
a `tokenizer_config.json` naming the class that reads it and the special tokens.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from scaletrain.errors import UserError
from trainer.data.prepare import read_manifest
from trainer.data.shards import parse_blend

# Our tokenizer kinds and the `transformers` class that reads each one's file.
TOKENIZER_CLASSES = {"hf": "PreTrainedTokenizerFast", "sentencepiece": "LlamaTokenizer"}


def _manifest_tokenizer(data: str) -> tuple[Path, dict] | None:
    """The prepared directory of `--data` (a blend's parts share one tokenizer) and its
    manifest's tokenizer entry; None for the built-in byte corpus."""
    if not data:
        return None
    directory = parse_blend(data)[0].directory
    try:
        return directory, read_manifest(directory)["tokenizer"]
    except UserError as exc:
        raise UserError(f"the run's tokenizer is missing: {exc}") from None


def special_ids(data: str) -> dict[str, int | None]:
    """config.json's token ids for the run's `--data` (none for the built-in byte corpus)."""
    found = _manifest_tokenizer(data)
    tokenizer = found[1] if found else {}
    return {"bos_token_id": None, "eos_token_id": tokenizer.get("eos_id"),
            "pad_token_id": tokenizer.get("pad_id")}  # fmt: skip


def write_tokenizer(data: str, out: Path, max_seq_len: int) -> list[str]:
    """Copy the tokenizer of `--data` into `out` with its `tokenizer_config.json`; the names
    written (none for the byte corpus or a bytes tokenizer, which `transformers` has no class
    for). UserError in one line when the prepared directory or its tokenizer file is missing or
    is not the one the run trained on."""
    found = _manifest_tokenizer(data)
    if found is None or found[1]["kind"] not in TOKENIZER_CLASSES:
        return []
    directory, tokenizer = found
    kind = tokenizer["kind"]
    source = directory / tokenizer["file"]
    try:
        raw = source.read_bytes()
    except OSError as exc:
        raise UserError(f"the run's tokenizer is missing: {source} ({exc.strerror})") from None
    if hashlib.sha256(raw).hexdigest() != tokenizer["sha256"]:
        raise UserError(f"{source}: not the tokenizer the run trained on (SHA-256 differs from "
                        f"{directory}/manifest.json)")  # fmt: skip
    shutil.copyfile(source, out / source.name)
    config = {
        "tokenizer_class": TOKENIZER_CLASSES[kind],
        "eos_token": _token(kind, raw, tokenizer["eos_id"]),
        "pad_token": _token(kind, raw, tokenizer["pad_id"]),
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [source.name, "tokenizer_config.json"]


def _token(kind: str, raw: bytes, token_id: int) -> str:
    """The text of token `token_id` in a tokenizer file of `kind`."""
    if kind == "hf":
        from tokenizers import Tokenizer

        return Tokenizer.from_str(raw.decode()).id_to_token(token_id)
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_proto=raw).IdToPiece(token_id)
