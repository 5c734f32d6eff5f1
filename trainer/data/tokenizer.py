"""The tokenizers a prepared dataset can be made with: an HF `tokenizer.json`, a SentencePiece
`.model`, or raw bytes, behind one small interface.

A prepared directory keeps its own copy of the tokenizer file, so the trainer (vocabulary size,
EOS, padding) and a later `--resume` (the tokenizer's SHA-256) read it from the data alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from scaletrain.errors import UserError

# Names an end-of-sequence token goes by in published tokenizers, most specific first.
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "<|eos|>", "</s>", "<eos>", "<|im_end|>")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
# The tokens a BPE trained by `data prepare --train-tokenizer` reserves.
TRAINED_SPECIALS = ("<|eos|>", "<|pad|>")
HF_FILE, SENTENCEPIECE_FILE = "tokenizer.json", "tokenizer.model"


class Tokenizer(Protocol):
    kind: str  # "hf", "sentencepiece" or "bytes"
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens, in the library's own thread pool."""
        ...

    def save(self, directory: Path) -> str:
        """Copy the tokenizer into `directory`; returns the file name ("" for bytes)."""
        ...

    @property
    def sha256(self) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """One token per UTF-8 byte (0-255), and EOS = 256 (pad is EOS)."""

    kind: str = "bytes"
    vocab_size: int = 257
    eos_id: int = 256
    pad_id: int = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode()) for text in texts]

    def save(self, directory: Path) -> str:
        return ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(b"scaletrain bytes tokenizer v1").hexdigest()


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library, whose `encode_batch` uses every core."""

    kind = "hf"

    def __init__(self, path: Path, eos: str | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._raw = path.read_bytes()
            self._tok = RustTokenizer.from_str(self._raw.decode())
        except Exception as exc:  # the library raises plain Exception on a bad file
            raise UserError(f"--tokenizer {path}: not a readable tokenizer.json ({exc})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._special(path, (eos,) if eos else EOS_NAMES, "end-of-sequence")
        pads = [self._tok.token_to_id(name) for name in PAD_NAMES]
        self.pad_id = next((p for p in pads if p is not None), self.eos_id)

    def _special(self, path: Path, names: tuple[str, ...], what: str) -> int:
        for name in names:
            token = self._tok.token_to_id(name)
            if token is not None:
                return token
        raise UserError(
            f"--tokenizer {path}: no {what} token among {', '.join(names)}; name it with --eos"
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def save(self, directory: Path) -> str:
        (directory / HF_FILE).write_bytes(self._raw)
        return HF_FILE

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._raw).hexdigest()


class SentencePieceTokenizer:
    """A SentencePiece `.model`; its `encode` takes a thread count."""

    kind = "sentencepiece"

    def __init__(self, path: Path, threads: int) -> None:
        import sentencepiece

        try:
            self._raw = path.read_bytes()
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=self._raw)
        except (OSError, RuntimeError) as exc:
            raise UserError(f"--tokenizer {path}: not a SentencePiece model ({exc})") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise UserError(f"--tokenizer {path}: the model defines no end-of-sequence piece")
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
        self._threads = threads

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=self._threads)

    def save(self, directory: Path) -> str:
        (directory / SENTENCEPIECE_FILE).write_bytes(self._raw)
        return SENTENCEPIECE_FILE

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._raw).hexdigest()


def load_tokenizer(spec: str, threads: int = 1, eos: str | None = None) -> Tokenizer:
    """`bytes`, a `tokenizer.json` (or a directory holding one), or a SentencePiece `.model`."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        for name in (HF_FILE, SENTENCEPIECE_FILE):
            if (path / name).is_file():
                path = path / name
                break
    if not path.is_file():
        raise UserError(
            f"--tokenizer {spec}: no such file (give a tokenizer.json, a SentencePiece .model "
            "or `bytes`)"
        )
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, threads)
    return HFTokenizer(path, eos)


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE on `texts` with `tokenizers` and save it as `out`/tokenizer.json.

    Byte-level, so any text encodes without unknown tokens; the training is deterministic for
    the same texts in the same order, which keeps a prepare reproducible."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(TRAINED_SPECIALS):
        raise UserError(
            f"--train-tokenizer {vocab_size}: a byte-level BPE needs a vocabulary of at least "
            f"{len(alphabet) + len(TRAINED_SPECIALS)}"
        )
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TRAINED_SPECIALS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_batched(texts), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    path = out / HF_FILE
    path.write_text(tok.to_str())
    return path


def _batched(texts: Iterable[str], size: int = 1024) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
