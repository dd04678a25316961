"""The shard plan: deterministic, balanced per fragment, whole tensors, clear refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.shard_plan import plan_shards

SIZES = {"emb": 800, "l0.w": 400, "l0.b": 4, "l1.w": 400, "l1.b": 4, "head": 400}


def test_one_shard_holds_everything():
    plan = plan_shards(SIZES, 1)
    assert plan.names(0) == tuple(sorted(SIZES)) and plan.imbalance() == 1.0


def test_largest_first_to_the_lightest_shard():
    plan = plan_shards(SIZES, 2)
    # emb (800) to 0; head, l0.w (400) to 1; l1.w to 0 (a tie: the lowest index); the
    # biases to 1, the lighter.
    assert plan.names(0) == ("emb", "l1.w")
    assert plan.names(1) == ("head", "l0.b", "l0.w", "l1.b")
    assert plan.bytes_of(0) + plan.bytes_of(1) == sum(SIZES.values())
    assert abs(plan.bytes_of(0) - plan.bytes_of(1)) <= 400


def test_a_tensor_larger_than_its_share_is_not_cut():
    plan = plan_shards({"big": 1000, "a": 10, "b": 10}, 4)
    assert plan.names(0) == ("big",) and plan.imbalance() > 3.5
    assert plan.names(3) == ()  # two small tensors for three other shards


def test_each_fragment_is_balanced_on_its_own():
    groups = {"emb": 0, "l0.w": 0, "l0.b": 0, "l1.w": 1, "l1.b": 1, "head": 1}
    plan = plan_shards(SIZES, 2, groups)
    for fragment in (0, 1):
        held = {plan.owner[n] for n, g in groups.items() if g == fragment}
        assert held == {0, 1}  # both shards take part in every round


def test_the_digest_names_the_assignment():
    a, b = plan_shards(SIZES, 2), plan_shards(dict(reversed(SIZES.items())), 2)
    assert a.digest() == b.digest() and a.owner == b.owner  # the order given does not matter
    assert plan_shards(SIZES, 3).digest() != a.digest()


def test_the_wrong_shard_is_told_which_one_owns_it():
    plan = plan_shards(SIZES, 2)
    assert plan.outside("emb", 0) is None
    msg = plan.outside("emb", 1, ["10.0.0.1:7070", "10.0.0.2:7071"])
    assert msg == "tensor 'emb' belongs to shard 0 (10.0.0.1:7070), not shard 1: send it there"
    assert "not in the model" in plan.outside("nope", 0)


@pytest.mark.parametrize("k", [0, 65, -1])
def test_a_shard_count_out_of_range_is_refused(k):
    with pytest.raises(ValueError, match=r"shards: must be in \[1, 64\]"):
        plan_shards(SIZES, k)


@given(
    st.dictionaries(
        st.text("abcdefgh.", min_size=1, max_size=6), st.integers(0, 10**6), max_size=30
    ),
    st.integers(1, 8),
)
def test_every_tensor_has_exactly_one_owner_and_the_plan_is_a_function(sizes, k):
    plan = plan_shards(sizes, k)
    assert sorted(n for i in range(k) for n in plan.names(i)) == sorted(sizes)
    assert plan_shards(dict(sorted(sizes.items())), k) == plan
    if sizes:
        biggest = max(sizes.values())
        mean = sum(sizes.values()) / k
        assert max(plan.bytes_of(i) for i in range(k)) <= mean + biggest  # LPT's bound
