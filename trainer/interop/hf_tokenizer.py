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


def special_ids(data: str) -> dict[str, int | None]:
    """config.json's token ids for the run's `--data` (empty: the built-in byte corpus)."""
    if not data:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    tokenizer = read_manifest(parse_blend(data)[0].directory)["tokenizer"]
    return {"bos_token_id": None, "eos_token_id": tokenizer["eos_id"],
            "pad_token_id": tokenizer["pad_id"]}  # fmt: skip


def write_tokenizer(data: str, out: Path, max_seq_len: int) -> list[str]:
    """Copy the tokenizer of `--data` (a prepared directory, or a blend: its parts share one)
    into `out` with its `tokenizer_config.json`; the names written (none for the byte corpus or
    a bytes tokenizer, which `transformers` has no class for). UserError in one line when the
    prepared directory or its tokenizer file is missing or is not the one the run trained on."""
    if not data:
        return []
    directory = parse_blend(data)[0].directory
    try:
        tokenizer = read_manifest(directory)["tokenizer"]
    except UserError as exc:
        raise UserError(f"the run's tokenizer is missing: {exc}") from None
    kind = tokenizer["kind"]
    if kind not in TOKENIZER_CLASSES:
        return []
    source = directory / tokenizer["file"]
    try:
        raw = source.read_bytes()
    except OSError as exc:
        raise UserError(f"the run's tokenizer is missing: {source} ({exc.strerror})") from None
    if hashlib.sha256(raw).hexdigest() != tokenizer["sha256"]:
        raise UserError(f"{source}: not the tokenizer the run trained on (SHA-256 differs from "
                        f"{directory}/manifest.json)")  # fmt: skip
    shutil.copyfile(source, out / source.name)
    eos = _token(kind, raw, tokenizer["eos_id"])
    pad = _token(kind, raw, tokenizer["pad_id"])
    config = {
        "tokenizer_class": TOKENIZER_CLASSES[kind],
        "eos_token": eos,
        "pad_token": pad,
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
