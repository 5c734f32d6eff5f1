"""A deterministic loader whose whole state is one global sample index.

Sample i of the run is the window of seq_len+1 bytes starting at a position given by a fixed
affine permutation of the window starts, so any rank can compute any sample in O(1). At every step
the global batch is samples [g, g + global_batch); data-parallel rank r reads the contiguous slice
[g + r*local_batch, g + (r+1)*local_batch). Resuming needs only g, and resuming at another
data-parallel degree keeps the same global sample order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from trainer.data.corpus import Corpus


@dataclass(frozen=True)
class LoaderOffset:
    """Where the next step starts: the global index, this rank's first index, and the epoch."""

    global_sample: int
    rank_sample: int
    epoch: int


class DeterministicLoader:
    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        if global_batch % dp_size:
            raise ValueError(
                f"global batch {global_batch} is not divisible by the data-parallel degree "
                f"{dp_size}; use a multiple of {dp_size}"
            )
        self.tokens = corpus.tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.windows = len(corpus) - seq_len - 1
        if self.windows < global_batch:
            raise ValueError(f"corpus of {len(corpus)} bytes is too small for seq_len {seq_len}")
        rng = random.Random(seed)
        self._stride = self._coprime_stride(rng)
        self._shift = rng.randrange(self.windows)
        self.global_sample = 0

    def _coprime_stride(self, rng: random.Random) -> int:
        while True:
            stride = rng.randrange(1, self.windows)
            if math.gcd(stride, self.windows) == 1:
                return stride

    def window_start(self, sample: int) -> int:
        """Start of sample `sample`: a permutation of window starts, fresh order per epoch."""
        epoch, index = divmod(sample, self.windows)
        return (self._stride * index + self._shift + epoch * 7919) % self.windows

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets of this rank's slice of the next global batch."""
        first = self.global_sample + self.dp_rank * self.local_batch
        starts = [self.window_start(first + i) for i in range(self.local_batch)]
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).long()
        self.global_sample += self.global_batch
        return rows[:, :-1], rows[:, 1:]

    def offset(self) -> LoaderOffset:
        return LoaderOffset(
            global_sample=self.global_sample,
            rank_sample=self.global_sample + self.dp_rank * self.local_batch,
            epoch=self.global_sample // self.windows,
        )

    def state_dict(self) -> dict[str, int]:
        return {"global_sample": self.global_sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.global_sample = int(state["global_sample"])
