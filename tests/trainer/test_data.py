"""The loader's position is one global sample index; every rank derives its slice from it."""

from __future__ import annotations

import pytest
import torch

from trainer.data.corpus import stdlib_corpus
from trainer.data.loader import DeterministicLoader, LoaderOffset


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus(1 << 20)


def _global_batches(corpus, dp_size: int, steps: int) -> list[torch.Tensor]:
    loaders = [DeterministicLoader(corpus, 32, 8, r, dp_size, seed=7) for r in range(dp_size)]
    batches = []
    for _ in range(steps):
        batches.append(torch.cat([loader.next_batch()[0] for loader in loaders]))
    return batches


def test_the_corpus_is_the_same_bytes_every_time(corpus):
    again = stdlib_corpus(1 << 20)
    assert corpus.sha256 == again.sha256
    assert len(corpus) == 1 << 20 and corpus.files > 10


def test_targets_are_the_inputs_shifted_by_one_byte(corpus):
    inputs, targets = DeterministicLoader(corpus, 16, 4, 0, 1, seed=1).next_batch()
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_the_global_sample_order_is_the_same_at_every_data_parallel_degree(corpus):
    one = _global_batches(corpus, 1, 3)
    for dp in (2, 4, 8):
        other = _global_batches(corpus, dp, 3)
        assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True))


def test_a_restored_loader_continues_with_the_next_sample(corpus):
    loader = DeterministicLoader(corpus, 32, 8, 1, 2, seed=3)
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    expected = loader.next_batch()
    resumed = DeterministicLoader(corpus, 32, 8, 1, 2, seed=3)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()[0], expected[0])


def test_the_offset_names_where_each_rank_starts_next(corpus):
    loader = DeterministicLoader(corpus, 32, 8, 3, 4, seed=3)
    loader.next_batch()
    assert loader.offset() == LoaderOffset(global_sample=8, rank_sample=14, epoch=0)


def test_samples_of_one_epoch_are_all_different_windows(corpus):
    loader = DeterministicLoader(corpus, 32, 8, 0, 1, seed=5)
    starts = {loader.window_start(i) for i in range(10_000)}
    assert len(starts) == 10_000


def test_a_batch_that_does_not_split_over_ranks_is_refused_with_its_values(corpus):
    with pytest.raises(ValueError, match=r"global batch 6 is not divisible .* 4"):
        DeterministicLoader(corpus, 32, 6, 0, 4, seed=1)


def test_reading_ahead_in_a_thread_gives_the_same_batches_and_state_as_reading_in_the_step(corpus):
    plain = DeterministicLoader(corpus, 32, 8, 1, 2, seed=3)
    ahead = DeterministicLoader(corpus, 32, 8, 1, 2, seed=3, prefetch=2)
    try:
        for _ in range(4):
            assert all(map(torch.equal, plain.next_batch(), ahead.next_batch()))
            assert ahead.state_dict() == plain.state_dict()
            assert ahead.offset() == plain.offset()
        # A restore to another place drops what was read ahead for the old one.
        state = {"global_sample": 8}
        plain.load_state_dict(state)
        ahead.load_state_dict(state)
        for _ in range(3):
            assert all(map(torch.equal, plain.next_batch(), ahead.next_batch()))
    finally:
        ahead.close()
