"""Reading a prepared directory (`trainer.data.prepare`): its token shards memory-mapped as one
token stream, packed into fixed windows, and blends of several directories.

Packing: documents are already joined with EOS between them; window w of a run with sequence
length S is tokens [w*S, w*S + S + 1) of the stream (inputs and next-token targets), so every
token is read once per epoch and no padding is spent. Document masking finds each window's
documents by their EOS (`trainer.model.llama.document_layout`).

A blend draws sample i of the run from a fixed source and position computable in O(1): a
period of P samples is laid out once (each source's share of P in proportion to its weight,
spread by largest remaining deficit), so sample i belongs to source `table[i % P]`, at that
source's sample `(i // P) * share + rank`. The run's whole data state stays one global sample
index, at any data-parallel degree.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.errors import UserError
from trainer.data.prepare import FORMAT, MANIFEST, read_manifest
from trainer.data.sources import file_sha256

BLEND_PERIOD = 1000  # samples per blend period: weights are honoured to 0.1%


class PreparedData:
    """The token stream of one prepared directory. With `verify`, every shard's SHA-256 is
    checked on open, so a damaged shard is named before training reads from it."""

    def __init__(self, directory: Path, verify: bool = True) -> None:
        self.directory = directory
        self.manifest = read_manifest(directory)
        if self.manifest.get("format") != FORMAT:
            raise UserError(
                f"{directory / MANIFEST}: format {self.manifest.get('format')!r}, this "
                f"scaletrain reads format {FORMAT}; prepare it again with `scaletrain data prepare`"
            )
        if not self.manifest.get("complete"):
            raise UserError(f"{directory}: the prepare did not finish; run it again to continue")
        self.dtype = np.dtype(self.manifest["dtype"])
        tok = self.manifest["tokenizer"]
        self.vocab_size, self.eos_id, self.pad_id = tok["vocab_size"], tok["eos_id"], tok["pad_id"]
        self._shards: list[np.ndarray] = []
        ends: list[np.ndarray] = []
        offset = 0
        for shard in self.manifest["shards"]:
            bin_path = directory / shard["file"]
            if verify and (not bin_path.is_file() or file_sha256(bin_path) != shard["sha256"]):
                raise UserError(
                    f"{bin_path}: fails its checksum (the manifest's SHA-256 is "
                    f"{shard['sha256'][:16]}...); prepare the data again"
                )
            tokens = np.memmap(bin_path, dtype=self.dtype, mode="r")
            if tokens.size != shard["tokens"]:
                raise UserError(f"{bin_path}: holds {tokens.size} tokens, not {shard['tokens']}")
            self._shards.append(np.asarray(tokens))  # a view: slicing a memmap costs more
            ends.append(np.fromfile(directory / shard["index"], dtype=np.int64) + offset)
            offset += tokens.size
        self.tokens = offset
        # Where each shard starts in the stream (plain ints: a read's bisect stays cheap), and
        # every document's end in the stream.
        self._bounds = [0, *itertools.accumulate(s.size for s in self._shards)]
        self.document_ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)

    @property
    def sha256(self) -> str:
        """One digest of the data: the shards' checksums and the tokenizer's, in order."""
        parts = [s["sha256"] for s in self.manifest["shards"]]
        return hashlib.sha256(
            ",".join([self.manifest["tokenizer"]["sha256"], *parts]).encode()
        ).hexdigest()

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, across shard boundaries (a view of the
        mapped shard when they lie in one)."""
        end = start + length
        if start < 0 or length < 0 or end > self.tokens:
            raise IndexError(f"tokens [{start}, {end}) of {self.tokens}")
        bounds = self._bounds
        shard = bisect.bisect_right(bounds, start) - 1
        base = bounds[shard]
        if end <= bounds[shard + 1]:
            return self._shards[shard][start - base : end - base]
        pieces = []
        while start < end:
            stop = min(end, bounds[shard + 1])
            pieces.append(self._shards[shard][start - bounds[shard] : stop - bounds[shard]])
            start, shard = stop, shard + 1
        return np.concatenate(pieces)

    def windows(self, seq_len: int) -> int:
        """How many packed windows of `seq_len` inputs (plus one target) the stream holds."""
        return max((self.tokens - 1) // seq_len, 0)

    def window(self, index: int, seq_len: int) -> np.ndarray:
        """Packed window `index`: seq_len + 1 tokens (inputs, and targets shifted by one)."""
        return self.read(index * seq_len, seq_len + 1)

    def check_fits(self, seq_len: int, global_batch: int) -> None:
        """Refuse a dataset too small for one global batch of windows."""
        if self.windows(seq_len) < global_batch:
            raise UserError(
                f"{self.directory}: {self.tokens:,} tokens make {self.windows(seq_len):,} "
                f"windows of {seq_len} tokens, fewer than one global batch of {global_batch}"
            )


def data_tokenizer(spec: str) -> dict:
    """The tokenizer of `--data` (a directory or a blend) as its manifest describes it (kind,
    sha256, vocab_size, eos_id, pad_id), from the manifest alone: what the model is sized to
    before any shard is read. (A blend's parts must share the tokenizer; `Blend` checks that
    when the data is opened.)"""
    return dict(read_manifest(parse_blend(spec)[0].directory)["tokenizer"])


@dataclass(frozen=True)
class BlendPart:
    directory: Path
    weight: float


def parse_blend(spec: str) -> list[BlendPart]:
    """`DIR` or `DIR_A:0.7,DIR_B:0.3` (weights need not sum to 1; each must be > 0)."""
    parts = []
    for item in spec.split(","):
        path, sep, weight = item.rpartition(":")
        if not sep:
            path, weight = item, "1"
        try:
            value = float(weight)
        except ValueError:
            raise UserError(f"--data {spec}: weight {weight!r} of {path} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise UserError(f"--data {spec}: weight {weight} of {path} must be positive")
        if not path:
            raise UserError(f"--data {spec}: an entry names no directory")
        parts.append(BlendPart(Path(path), value))
    return parts


def blend_table(weights: list[float], period: int = BLEND_PERIOD) -> np.ndarray:
    """The source of each sample of one period, each source's share in proportion to its weight
    (largest remainders), interleaved by largest deficit so any prefix is close to the weights."""
    total = sum(weights)
    exact = [w / total * period for w in weights]
    shares = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True):
        if sum(shares) == period:
            break
        shares[i] += 1
    table = np.empty(period, dtype=np.int64)
    taken = [0] * len(weights)
    for n in range(period):
        # The source furthest behind its share at this point of the period.
        best = max(range(len(weights)), key=lambda i: shares[i] * (n + 1) / period - taken[i])
        table[n] = best
        taken[best] += 1
    return table


class Blend:
    """Several prepared directories as one source of samples, each sample's origin a function
    of its global index alone."""

    def __init__(self, parts: list[BlendPart], verify: bool = True) -> None:
        self.sources = [PreparedData(p.directory, verify) for p in parts]
        first = self.sources[0].manifest["tokenizer"]["sha256"]
        for part, source in zip(parts, self.sources, strict=True):
            if source.manifest["tokenizer"]["sha256"] != first:
                raise UserError(
                    f"--data: {part.directory} was prepared with another tokenizer than "
                    f"{parts[0].directory}; a blend needs one tokenizer"
                )
        self.parts = [(s, p.weight) for s, p in zip(self.sources, parts, strict=True)]
        self.sha256 = hashlib.sha256(
            ",".join(f"{s.sha256}:{w!r}" for s, w in self.parts).encode()
        ).hexdigest()
        self.table = blend_table([p.weight for p in parts])
        self.shares = np.bincount(self.table, minlength=len(parts))
        # rank[n]: how many samples of table[n]'s source come before position n of the period.
        self.rank = np.zeros(len(self.table), dtype=np.int64)
        seen = np.zeros(len(parts), dtype=np.int64)
        for n, source in enumerate(self.table):
            self.rank[n] = seen[source]
            seen[source] += 1

    def locate(self, sample: int) -> tuple[int, int]:
        """(source, that source's sample index) of the run's sample `sample`."""
        period, n = divmod(sample, len(self.table))
        source = int(self.table[n])
        return source, period * int(self.shares[source]) + int(self.rank[n])
