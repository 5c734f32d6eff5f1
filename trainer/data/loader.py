"""A deterministic loader whose whole state is one global sample index.

Sample i of the run is a window of seq_len+1 tokens given by a fixed affine permutation of the
source's windows, so any rank computes any sample in O(1). At every step the global batch is
samples [g, g + global_batch); data-parallel rank r reads the contiguous slice
[g + r*local_batch, g + (r+1)*local_batch). Resuming needs only g, and resuming at another
data-parallel degree keeps the same global sample order.

Sources:
- the stdlib byte corpus (`Corpus`): every byte offset starts a window (they overlap);
- a prepared directory (`PreparedData`): packed, non-overlapping windows of the token stream;
- a blend (`Blend`): sample i comes from the source and that source's sample index the blend's
  table gives (`Blend.locate`), each source walking its own permutation.
"""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from scaletrain.errors import UserError
from trainer.data.corpus import Corpus, stdlib_corpus
from trainer.data.shards import Blend, PreparedData, parse_blend

Source = Corpus | PreparedData | Blend


def open_source(data: str | None, corpus_bytes: int) -> Source:
    """What `--data` names: a prepared directory or a blend of them; without it, the stdlib
    byte corpus of `corpus_bytes`."""
    if not data:
        return stdlib_corpus(corpus_bytes)
    parts = parse_blend(data)
    if len(parts) == 1 and parts[0].weight == 1:
        return PreparedData(parts[0].directory)
    return Blend(parts)


def source_identity(source: Source) -> dict[str, object]:
    """What the run trains on, as its checkpoints and telemetry record it, and what a resume
    must find unchanged: the data's digest and tokens, and its tokenizer's digest and kind."""
    if isinstance(source, Corpus):
        return {"kind": "stdlib-bytes", "sha256": source.sha256, "tokenizer": "bytes",
                "tokens": len(source)}  # fmt: skip
    if isinstance(source, PreparedData):
        return {
            "kind": "prepared",
            "sha256": source.sha256,
            "tokenizer": source.manifest["tokenizer"]["sha256"],
            "tokenizer_kind": source.manifest["tokenizer"]["kind"],
            "tokens": source.tokens,
        }
    first = source.sources[0].manifest["tokenizer"]
    return {
        "kind": "blend",
        "sha256": source.sha256,
        "tokenizer": first["sha256"],
        "tokenizer_kind": first["kind"],
        "tokens": sum(s.tokens for s in source.sources),
        "parts": [{"sha256": s.sha256, "weight": w, "tokens": s.tokens} for s, w in source.parts],
    }


def check_same_data(saved: dict[str, object], now: dict[str, object]) -> None:
    """Refuse a resume on other data, naming both."""
    if saved != now:
        raise UserError(
            f"--resume: the checkpoint was trained on {saved.get('kind')} data "
            f"{str(saved.get('sha256'))[:12]} (tokenizer {str(saved.get('tokenizer'))[:12]}), "
            f"not on this {now.get('kind')} data {str(now.get('sha256'))[:12]} "
            f"(tokenizer {str(now.get('tokenizer'))[:12]}); resume with the same --data"
        )


@dataclass(frozen=True)
class LoaderOffset:
    """Where the next step starts: the global index, this rank's first index, and the epoch."""

    global_sample: int
    rank_sample: int
    epoch: int


class PermutedWindows:
    """The windows of one source in a fixed pseudo-random order, a fresh order each epoch."""

    def __init__(self, source: Corpus | PreparedData, seq_len: int, seed: int) -> None:
        self.source, self.seq_len = source, seq_len
        if isinstance(source, Corpus):
            self.windows = len(source) - seq_len - 1
        else:
            self.windows = source.windows(seq_len)
        if self.windows < 2:
            raise ValueError(f"a corpus of {len(source)} tokens is too small for seq_len {seq_len}")
        rng = random.Random(seed)
        self._stride = self._coprime_stride(rng)
        self._shift = rng.randrange(self.windows)

    def _coprime_stride(self, rng: random.Random) -> int:
        while True:
            stride = rng.randrange(1, self.windows)
            if math.gcd(stride, self.windows) == 1:
                return stride

    def window_index(self, sample: int) -> int:
        """The window of this source's sample `sample`."""
        epoch, index = divmod(sample, self.windows)
        return (self._stride * index + self._shift + epoch * 7919) % self.windows

    def tokens(self, sample: int) -> torch.Tensor:
        w = self.window_index(sample)
        if isinstance(self.source, Corpus):
            return self.source.tokens[w : w + self.seq_len + 1]
        return torch.from_numpy(self.source.window(w, self.seq_len).astype(np.int64))


class DeterministicLoader:
    def __init__(
        self,
        source: Corpus | PreparedData | Blend,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        prefetch: int = 0,
    ) -> None:
        if global_batch % dp_size:
            raise ValueError(
                f"global batch {global_batch} is not divisible by the data-parallel degree "
                f"{dp_size}; use a multiple of {dp_size}"
            )
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._blend = source if isinstance(source, Blend) else None
        sources = source.sources if isinstance(source, Blend) else [source]
        # Each source of a blend its own order (seeded by its place in the blend).
        self._parts = [PermutedWindows(s, seq_len, seed + i) for i, s in enumerate(sources)]
        self.windows = sum(p.windows for p in self._parts)
        if self.windows < global_batch:
            raise ValueError(
                f"the data's {self.windows} windows of {seq_len} tokens are fewer than one "
                f"global batch of {global_batch}"
            )
        self._identity = source_identity(source)
        self.global_sample = 0
        # Batches being read ahead, by their first global sample: a batch is a function of that
        # index alone, so reading ahead in a thread changes no batch, and a restore only drops
        # the ones read for other indices.
        self._prefetch = prefetch
        self._ahead: dict[int, Future[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._reader = ThreadPoolExecutor(1, "data-prefetch") if prefetch else None

    def window_start(self, sample: int) -> int:
        """The window of sample `sample` (of a single source: its start in the corpus)."""
        return self._parts[0].window_index(sample)

    def sample_tokens(self, sample: int) -> torch.Tensor:
        """The seq_len+1 tokens of the run's sample `sample`."""
        if self._blend is None:
            return self._parts[0].tokens(sample)
        source, index = self._blend.locate(sample)
        return self._parts[source].tokens(index)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of this rank's slice of the next global batch; with
        `prefetch`, read ahead in a background thread while the step trains (the wait for it is
        the step's data phase)."""
        start = self.global_sample
        ahead = self._ahead.pop(start, None)
        batch = ahead.result() if ahead is not None else self._batch(start)
        self.global_sample += self.global_batch
        if self._reader is not None:
            for n in range(1, self._prefetch + 1):
                later = start + n * self.global_batch
                if later not in self._ahead:
                    self._ahead[later] = self._reader.submit(self._batch, later)
        return batch

    def _batch(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch that begins at global sample `start`."""
        first = start + self.dp_rank * self.local_batch
        rows = torch.stack([self.sample_tokens(first + i) for i in range(self.local_batch)]).long()
        return rows[:, :-1], rows[:, 1:]

    def close(self) -> None:
        """Stop reading ahead (batches already being read finish first)."""
        if self._reader is not None:
            self._reader.shutdown(cancel_futures=True)

    def offset(self) -> LoaderOffset:
        return LoaderOffset(
            global_sample=self.global_sample,
            rank_sample=self.global_sample + self.dp_rank * self.local_batch,
            epoch=self.global_sample // self.windows,
        )

    def state_dict(self) -> dict[str, int | str]:
        """The global sample index, and for prepared data what it was (the built-in corpus keeps
        the keys it always had): a resume on other data is refused by `load_state_dict`."""
        state: dict[str, int | str] = {"global_sample": self.global_sample}
        if self._identity["kind"] != "stdlib-bytes":
            state["data"] = json.dumps(self._identity, sort_keys=True)
        return state

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        if "data" in state:
            check_same_data(json.loads(str(state["data"])), self._identity)
        self.global_sample = int(state["global_sample"])
        self._ahead = {g: f for g, f in self._ahead.items() if g >= self.global_sample}
