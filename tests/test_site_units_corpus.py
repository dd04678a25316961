"""Shared-data mode's batches: unit k is the same data whichever site trains it."""

from __future__ import annotations

import pytest
import torch

from examples.gpt_diloco.data import CorpusConfig, load_corpus

SEQ = 32
H = 4
B = 8


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(CorpusConfig(max_bytes=1 << 20, seq_len=SEQ))


def starts(corpus, unit: int, step: int) -> torch.Tensor:
    return corpus.shared_stream().window_starts(unit, step, H, B)


def test_unit_batches_are_a_pure_function_of_unit_and_step(corpus) -> None:
    rng = torch.get_rng_state()
    x, y = corpus.unit_batch(5, 2, H, 0, 1, B)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is neither used nor moved
    torch.manual_seed(99)
    again = load_corpus(CorpusConfig(max_bytes=1 << 20, seq_len=SEQ, seed=0))
    x2, y2 = again.unit_batch(5, 2, H, 0, 1, B)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == (B, SEQ) and torch.equal(x[:, 1:], y[:, :-1])
    # Another unit, another step of the same unit, another seed: other data.
    for other in (corpus.unit_batch(6, 2, H, 0, 1, B), corpus.unit_batch(5, 3, H, 0, 1, B)):
        assert not torch.equal(other[0], x)
    assert not torch.equal(corpus.unit_batch(5, 2, H, 0, 1, B, seed=1)[0], x)


def test_units_of_one_epoch_share_no_window_and_cover_the_whole_split(corpus) -> None:
    window = SEQ + 1
    per_epoch = (len(corpus.train) - window + 1) // window
    x = corpus.unit_batch(2, 1, H, 0, 1, B)[0]
    assert torch.equal(
        x, torch.stack([corpus.train[s : s + SEQ].long() for s in starts(corpus, 2, 1)])
    )
    units = per_epoch // (H * B)
    seen = torch.cat([starts(corpus, u, s) for u in range(units) for s in range(H)])
    assert len(seen) == len(set(seen.tolist()))  # no window twice within an epoch
    assert len(seen) > per_epoch - H * B  # all but the windows of the epoch's last partial unit
    phase = int(seen.min()) % window
    assert ((seen - phase) % window == 0).all() and seen.max() + window <= len(corpus.train)
    # Later epochs go on with a fresh order, within bounds, across the epoch boundary too.
    later = torch.cat([starts(corpus, u, s) for u in range(units, units + 3) for s in range(H)])
    assert later.min() >= 0 and later.max() + window <= len(corpus.train)


def test_ranks_split_the_units_batch_whatever_the_world_size(corpus) -> None:
    whole = corpus.unit_batch(3, 1, H, 0, 1, B)[0]
    for world in (2, 4):
        parts = [corpus.unit_batch(3, 1, H, r, world, B)[0] for r in range(world)]
        assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ((-1, 0, H, 0, 1, B), "unit_index"),
        ((0, H, H, 0, 1, B), "inner_step"),
        ((0, 0, H, 2, 2, B), "local_rank"),
        ((0, 0, H, 0, 16, B), "batch_size"),
    ],
)
def test_bad_coordinates_are_refused(corpus, args, why) -> None:
    with pytest.raises(ValueError, match=why):
        corpus.unit_batch(*args)
