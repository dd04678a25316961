"""The example GPT: size, shapes, causality, that it learns, and its factory's checks."""

from __future__ import annotations

import math

import pytest
import torch

from examples.gpt_diloco.data import load_corpus
from examples.gpt_diloco.model import (
    GPTConfig,
    build_model,
    count_parameters,
    lm_loss,
    transformer_blocks,
)

SMALL = {"seq_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}


def _expected_parameters(c: GPTConfig) -> int:
    d, f = c.d_model, c.d_ff
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return c.vocab_size * d + c.seq_len * d + c.n_layers * block + 2 * d + c.vocab_size * d


def test_default_model_size_matches_architecture_and_range() -> None:
    model = build_model()
    n = count_parameters(model)
    assert n == _expected_parameters(GPTConfig())
    assert 0.5e6 <= n <= 3e6
    assert len(transformer_blocks(model)) == GPTConfig().n_layers


def test_state_dict_keys_are_the_documented_stable_names() -> None:
    keys = set(build_model(**SMALL).state_dict())
    assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "head.weight"} <= keys
    for i in range(SMALL["n_layers"]):
        for part in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc", "mlp.proj"):
            assert f"blocks.{i}.{part}.weight" in keys and f"blocks.{i}.{part}.bias" in keys
    assert len(keys) == 4 + 1 + 12 * SMALL["n_layers"]  # + ln_f.bias


def test_initialisation_depends_on_init_seed_not_global_rng() -> None:
    torch.manual_seed(1)
    a = build_model(**SMALL, init_seed=3).state_dict()
    torch.manual_seed(2)
    b = build_model(**SMALL, init_seed=3).state_dict()
    c = build_model(**SMALL, init_seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["head.weight"], c["head.weight"])


def test_forward_shapes_and_length_limit() -> None:
    model = build_model(**SMALL)
    for t in (1, 7, SMALL["seq_len"]):
        assert model(torch.randint(0, 256, (3, t))).shape == (3, t, 256)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.randint(0, 256, (1, SMALL["seq_len"] + 1)))


def test_attention_is_causal() -> None:
    model = build_model(**SMALL).eval()
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    k = 11
    changed = idx.clone()
    changed[:, k] = (changed[:, k] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert torch.equal(before[:, :k], after[:, :k])
    # Positions at and after k see the change, so the comparison above could have failed.
    assert not torch.allclose(before[:, k:], after[:, k:])


def test_adamw_on_real_corpus_batches_reduces_loss() -> None:
    corpus = load_corpus()
    torch.manual_seed(0)
    model = build_model(**{**SMALL, "d_model": 64, "d_ff": 128})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seq = SMALL["seq_len"]
    probe_x, probe_y = corpus.site_batch(0, 1, 0, 10_000, 0, 1, 8, seq_len=seq)
    with torch.no_grad():
        start = float(lm_loss(model(probe_x), probe_y))
    # Untrained logits are near zero, so the loss starts near uniform over 256 bytes.
    assert abs(start - math.log(256)) < 0.1
    for step in range(20):
        x, y = corpus.site_batch(0, 1, 0, step, 0, 1, 8, seq_len=seq)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        end = float(lm_loss(model(probe_x), probe_y))
    assert end < start - 1.0


def test_build_model_rejects_unknown_and_invalid_kwargs() -> None:
    with pytest.raises(TypeError, match="'n_layer'"):
        build_model(n_layer=2)
    with pytest.raises(ValueError, match="divisible"):
        build_model(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        build_model(n_layers=0)
    assert build_model(**SMALL).config == GPTConfig(**SMALL)


def test_transformer_blocks_refuses_other_modules() -> None:
    with pytest.raises(TypeError, match="blocks"):
        transformer_blocks(torch.nn.Linear(2, 2))
