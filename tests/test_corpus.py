"""The stdlib byte corpus: real content, a stable split, and a deterministic per-site data order."""

from __future__ import annotations

import math
from pathlib import Path, PurePosixPath

import pytest
import torch

from examples.gpt_diloco.data import Corpus, CorpusConfig, evaluate, load_corpus
from examples.gpt_diloco.model import build_model

SEQ = 32


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(CorpusConfig(seq_len=SEQ))


def test_corpus_is_real_python_source_within_the_cap(corpus) -> None:
    text = bytes(corpus.train[:1_000_000].numpy())
    assert b"def " in text and b"import " in text
    assert len(corpus.val) > 10 * (SEQ + 1)
    assert (
        0
        < len(corpus.train) + len(corpus.val)
        <= corpus.config.max_bytes + 2 * (len(corpus.train_files) + len(corpus.val_files))
    )
    skipped = {"test", "tests", "idlelib", "site-packages"}
    for name in corpus.train_files + corpus.val_files:
        assert name.endswith(".py")
        assert not skipped & set(PurePosixPath(name).parts[:-1])


def test_split_is_by_file_and_independent_of_the_cap(corpus) -> None:
    assert not set(corpus.train_files) & set(corpus.val_files)
    n_files = len(corpus.train_files) + len(corpus.val_files)
    assert 0.01 < len(corpus.val_files) / n_files < 0.15
    small = load_corpus(CorpusConfig(max_bytes=2 * 2**20))
    small_files = set(small.train_files) | set(small.val_files)
    assert len(small_files) < n_files
    assert set(small.val_files) == small_files & set(corpus.val_files)


def test_corpus_is_cached_and_shared_across_batching_defaults(corpus) -> None:
    assert load_corpus(CorpusConfig(seq_len=SEQ)) is corpus
    other = load_corpus(CorpusConfig(seq_len=SEQ + 1, seed=5))
    assert other.config.seq_len == SEQ + 1
    assert other.train.data_ptr() == corpus.train.data_ptr()


def test_batches_are_a_pure_function_of_their_coordinates(corpus) -> None:
    args = (1, 3, 4, 7, 0, 1, 8)
    rng = torch.get_rng_state()
    x1, y1 = corpus.site_batch(*args)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is neither used nor moved
    torch.manual_seed(1234)
    x2, y2 = corpus.site_batch(*args)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (8, SEQ) and x1.dtype == torch.long
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    for changed in ((1, 3, 4, 8, 0, 1, 8), (1, 3, 5, 7, 0, 1, 8), (2, 3, 4, 7, 0, 1, 8)):
        assert not torch.equal(corpus.site_batch(*changed)[0], x1)
    assert not torch.equal(corpus.site_batch(*args, seed=1)[0], x1)


def test_sites_read_disjoint_shards(corpus) -> None:
    num_sites, window = 3, SEQ + 1
    shard = len(corpus.train) // num_sites
    for site in range(num_sites):
        for step in range(20):
            starts = corpus.site_window_starts(site, num_sites, 0, step, 0, 1, 16)
            assert starts.min() >= site * shard and starts.max() + window <= (site + 1) * shard
            x, _ = corpus.site_batch(site, num_sites, 0, step, 0, 1, 16)
            assert torch.equal(x[0], corpus.train[starts[0] : starts[0] + SEQ].long())


def test_ranks_of_a_site_split_the_same_site_batch(corpus) -> None:
    batch = 6
    whole = corpus.site_batch(0, 2, 1, 3, 0, 1, batch)[0]
    for world in (2, 3):
        parts = [corpus.site_batch(0, 2, 1, 3, r, world, batch)[0] for r in range(world)]
        assert [len(p) for p in parts] == [batch // world] * world
        assert torch.equal(torch.cat(parts), whole)
    starts = corpus.site_window_starts(0, 2, 1, 3, 0, 1, batch).sort().values
    assert (starts.diff() >= SEQ + 1).all()  # rows never share a token
    with pytest.raises(ValueError, match="no rows"):
        corpus.site_batch(0, 2, 1, 3, 0, 8, batch)
    with pytest.raises(ValueError, match="local_rank"):
        corpus.site_batch(0, 2, 1, 3, 2, 2, batch)


def test_validation_batches_are_fixed_windows_of_held_out_text(corpus) -> None:
    a = corpus.validation_batches(3, 4)
    b = corpus.validation_batches(3, 4)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (4, SEQ)
    assert torch.equal(a[0][0][0], corpus.val[:SEQ].long())
    assert torch.equal(a[-1][1][-1], corpus.val[-SEQ:].long())


def test_evaluate_gives_uniform_loss_for_untrained_model_and_keeps_mode(corpus) -> None:
    model = build_model(seq_len=SEQ, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    model.train()
    loss = evaluate(model, corpus, n_batches=2, batch_size=4)
    assert model.training
    assert abs(loss - math.log(256)) < 0.1
    assert evaluate(model, corpus, n_batches=2, batch_size=4) == loss


def test_the_corpus_is_the_stdlib_of_the_python_that_runs_it(tmp_path) -> None:
    """What the README's determinism claim rests on: the same Python installation gives the
    same corpus bytes (fingerprint); other sources give others, and so other losses."""
    import sysconfig

    a = Corpus(CorpusConfig(max_bytes=1 << 20))
    b = Corpus(CorpusConfig(max_bytes=1 << 20))
    assert a.root == Path(sysconfig.get_paths()["stdlib"])
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 12
    for i in range(40):  # enough files that some land in the validation split
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n" * 50)
    other = Corpus(CorpusConfig(max_bytes=1 << 20, root=str(tmp_path), val_fraction=0.2))
    assert other.fingerprint != a.fingerprint
