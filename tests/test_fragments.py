"""``wire.fragments``: the ``[streaming]`` table and the fragment plan (which tensors a round
syncs), a pure function of names, shapes and the config."""

from __future__ import annotations

import math

import pytest

from wire.config_table import ConfigError
from wire.fragments import StreamingConfig, block_of, fragment_plan, streaming_from_job


def _model(blocks: int = 4, d: int = 8) -> dict[str, tuple[int, ...]]:
    shapes = {"embed.weight": (100, d), "head.weight": (100, d), "norm.weight": (d,)}
    for b in range(blocks):
        shapes[f"blocks.{b}.attn.w"] = (d, d)
        shapes[f"blocks.{b}.mlp.w"] = (4 * d, d)
    return shapes


def _cfg(**table) -> StreamingConfig:
    return streaming_from_job({"streaming": table})


def test_no_table_is_none_and_defaults_are_plain_diloco():
    assert streaming_from_job({"rounds": {}}) is None
    cfg = _cfg()
    assert (cfg.fragments, cfg.pattern, cfg.delay_steps, cfg.merge_alpha) == (1, "strided", 0, 0)
    plan = fragment_plan(_model(), cfg)
    assert plan.fragments == (tuple(sorted(_model())),)
    assert plan.names(0) == plan.names(7)


def test_block_is_the_first_integer_component():
    assert block_of("blocks.3.attn.w") == 3
    assert block_of("layers.12.mlp.0.w") == 12
    assert block_of("embed.weight") is None


def test_strided_puts_block_b_in_fragment_b_mod_p():
    plan = fragment_plan(_model(blocks=4), _cfg(fragments=2))
    frag0, frag1 = plan.fragments
    assert {n for n in frag0 if n.startswith("blocks")} == {
        f"blocks.{b}.{k}.w" for b in (0, 2) for k in ("attn", "mlp")
    }
    assert {n for n in frag1 if n.startswith("blocks")} == {
        f"blocks.{b}.{k}.w" for b in (1, 3) for k in ("attn", "mlp")
    }
    assert [plan.names(r) for r in range(4)] == [frag0, frag1, frag0, frag1]
    assert plan.index_of("blocks.3.mlp.w") == 1
    with pytest.raises(KeyError):
        plan.index_of("nope")


def test_sequential_puts_contiguous_blocks_together():
    plan = fragment_plan(_model(blocks=4), _cfg(fragments=2, pattern="sequential"))
    blocks = [{block_of(n) for n in f if block_of(n) is not None} for f in plan.fragments]
    assert blocks == [{0, 1}, {2, 3}]


def test_loose_tensors_go_largest_first_to_the_lightest_fragment():
    shapes = _model(blocks=2)
    plan = fragment_plan(shapes, _cfg(fragments=2))
    sizes = [sum(math.prod(shapes[n]) for n in f) for f in plan.fragments]
    # Both blocks weigh the same; the two 800-element tensors go one to each fragment.
    assert {plan.index_of("embed.weight"), plan.index_of("head.weight")} == {0, 1}
    assert abs(sizes[0] - sizes[1]) <= 8
    every = sorted(n for f in plan.fragments for n in f)
    assert every == sorted(shapes)  # each tensor in exactly one fragment
    assert all(list(f) == sorted(f) for f in plan.fragments)


def test_rules_come_first_and_the_plan_does_not_depend_on_dict_order():
    cfg = _cfg(fragments=3, rules=[{"match": "embed*", "fragment": 2}])
    shapes = _model(blocks=3)
    plan = fragment_plan(shapes, cfg)
    assert plan.index_of("embed.weight") == 2
    assert fragment_plan(dict(reversed(shapes.items())), cfg) == plan


def test_an_empty_fragment_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^streaming.fragments: 4 fragments, but fragment"):
        fragment_plan({"a": (2,), "b": (3,)}, _cfg(fragments=4))


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"fragments": 0}, "streaming.fragments"),
        ({"pattern": "random"}, "streaming.pattern"),
        ({"delay_steps": -1}, "streaming.delay_steps"),
        ({"merge_alpha": 1.0}, "streaming.merge_alpha"),
        ({"fragmnets": 2}, "streaming.fragmnets"),
        ({"fragments": 2, "rules": [{"match": "x", "fragment": 2}]}, "streaming.rules[0].fragment"),
        ({"rules": [{"match": "", "fragment": 0}]}, "streaming.rules[0].match"),
        ({"rules": [{"match": "x", "fragment": 0, "extra": 1}]}, "streaming.rules[0].extra"),
    ],
)
def test_config_errors_name_the_key(table, key):
    with pytest.raises(ConfigError, match="^" + key.replace("[", r"\[").replace("]", r"\]")):
        _cfg(**table)


def test_check_steps_names_the_keys():
    _cfg(fragments=4, delay_steps=2).check_steps(40)  # H/P = 10 > tau
    with pytest.raises(ConfigError, match=r"^streaming.fragments: rounds.inner_steps \(10\)"):
        _cfg(fragments=4).check_steps(10)
    with pytest.raises(ConfigError, match=r"^streaming.delay_steps: .* got 10"):
        _cfg(fragments=4, delay_steps=10).check_steps(40)
    assert _cfg(fragments=4).fragment_of_round(9) == 1
