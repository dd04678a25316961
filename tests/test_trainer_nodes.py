"""The node ranks a multi-node site's hosts gave, checked once the trainers have met."""

from site_client.trainer.nodes import node_ranks_problem


def test_every_node_rank_once_or_more_ranks_per_node_is_fine() -> None:
    assert node_ranks_problem([0, 0, 1, 1], 2) is None
    assert node_ranks_problem([1, 0, 2, 2, 0, 1], 3) is None


def test_two_hosts_with_one_node_rank_are_named_with_the_one_missing() -> None:
    problem = node_ranks_problem([0, 0, 0, 0], 2)
    assert problem is not None
    assert "node ranks [0]" in problem and "no host is node 1" in problem
    assert "--node-rank" in problem and "0..1" in problem
    problem = node_ranks_problem([1, 1, 2, 2], 3)
    assert problem is not None and "no host is node 0" in problem


def test_a_node_rank_beyond_the_count_is_a_problem() -> None:
    problem = node_ranks_problem([0, 0, 2, 2], 2)
    assert problem is not None and "no host is node 1" in problem
    problem = node_ranks_problem([0, 1, 2], 2)  # every node there, and one more
    assert problem is not None and "[0, 1, 2], some outside 0..N-1" in problem
    assert "no host is node" not in problem and "0..1" in problem
