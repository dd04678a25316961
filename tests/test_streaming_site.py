"""The site's side of streaming outer steps, without processes: the late merge of a fragment
into the model (``site_client.trainer.shards.merge_pieces``), the fragment-only hand-off, and where
a (re)started task begins (``site_client.trainer.streaming_rounds.StreamingRounds._start``), and no
periodic checkpoint while a merge is pending."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from site_client.trainer.round import Round, RoundHooks, RoundSpec
from site_client.trainer.shards import Piece, merge_pieces, write_update
from site_client.trainer.streaming_rounds import StreamingRounds, _unless_merge_pending
from wire.fragments import StreamingConfig
from wire.safetensors_io import map_tensors, write_tensors


def pieces_of(tensors: dict[str, torch.Tensor]) -> list[Piece]:
    return [Piece(n, t, (0,) * t.dim(), tuple(t.shape), True) for n, t in tensors.items()]


@pytest.fixture
def theta_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    theta = {"a.0.w": torch.randn(4, 3, generator=g), "b.1.w": torch.randn(5, generator=g)}
    path = tmp_path / "theta.safetensors"
    write_tensors(path, theta)
    return theta, map_tensors(path)


def test_alpha_zero_copies_the_fragment_exactly_and_leaves_the_rest(theta_file):
    theta, mapped = theta_file
    local = {"a.0.w": torch.full((4, 3), -0.0), "b.1.w": torch.full((5,), 7.0)}
    wrong = merge_pieces(pieces_of(local), mapped, frozenset({"a.0.w"}), 0.0)
    assert wrong == []
    assert torch.equal(local["a.0.w"].view(torch.int32), theta["a.0.w"].view(torch.int32))
    assert torch.equal(local["b.1.w"], torch.full((5,), 7.0))  # not in the fragment


def test_alpha_mixes_local_and_global(theta_file):
    theta, mapped = theta_file
    before = torch.arange(5, dtype=torch.float32)
    local = {"a.0.w": torch.zeros(4, 3), "b.1.w": before.clone()}
    merge_pieces(pieces_of(local), mapped, frozenset({"b.1.w"}), 0.25)
    assert torch.equal(local["b.1.w"], before * 0.25 + theta["b.1.w"] * 0.75)
    assert torch.equal(local["a.0.w"], torch.zeros(4, 3))


def test_a_piece_unlike_the_file_is_named(theta_file):
    _, mapped = theta_file
    local = {"a.0.w": torch.zeros(2, 3)}
    assert merge_pieces(pieces_of(local), mapped, frozenset({"a.0.w"}), 0.5) == ["a.0.w"]
    assert merge_pieces(pieces_of(local), mapped, frozenset({"a.0.w"}), 0.0) == ["a.0.w"]


def test_the_hand_off_carries_only_the_fragment(theta_file, tmp_path):
    theta, mapped = theta_file
    local = {n: t + 1 for n, t in theta.items()}
    out = write_update(pieces_of(local), mapped, tmp_path / "d.safetensors", frozenset({"b.1.w"}))
    got = map_tensors(out).tensors
    assert set(got) == {"b.1.w"}
    assert torch.equal(got["b.1.w"], theta["b.1.w"] - local["b.1.w"])


class _Session:
    def __init__(self) -> None:
        self.loaded: list[int] = []

    def _load(self, pieces, theta, spec: RoundSpec) -> None:
        self.loaded.append(spec.round)


def start_of(extra, round_number: int, tau: int = 1, steps: int = 4):
    session = _Session()
    rounds = StreamingRounds(session, StreamingConfig(fragments=2, delay_steps=tau))
    rounds.theta = SimpleNamespace(tensors={})
    spec = RoundSpec(round_number, round_number, steps, 8, False, "x")
    return rounds._start(extra, spec), session.loaded


@pytest.mark.parametrize(
    ("extra", "round_number", "want", "loads"),
    [
        (None, 0, (0, False), [0]),  # the first task: theta_0 whole
        (None, 5, (0, False), [5]),  # joined late: theta_5 whole, nothing to merge
        ({"round": 4, "step": 4}, 5, (0, True), []),  # the end of the round before: merge
        ({"round": 3, "step": 4}, 5, (0, False), [5]),  # fell behind: theta_5 whole
        ({"round": 5, "step": 1}, 5, (1, True), []),  # mid-task, before the merge step
        ({"round": 5, "step": 3}, 5, (3, False), []),  # mid-task, after it
        ({"round": 5, "step": 1, "merge_pending": 0}, 5, (1, False), []),  # said so
        ({"round": 0, "step": 1}, 0, (1, False), []),  # round 0 has nothing to merge
    ],
)
def test_where_a_task_starts(extra, round_number, want, loads):
    assert start_of(extra, round_number) == (want, loads)


@pytest.mark.parametrize(("pending", "want"), [(True, [3]), (False, [1, 2, 3])])
def test_no_periodic_checkpoint_before_a_pending_merge(pending, want):
    """A site killed whole while its fragment is in flight is handed that round again: its
    newest checkpoint must still be the round's end, not a step ahead (a fault-matrix find)."""
    tau, written = 2, []

    def before_step(rnd: Round, step: int) -> bool:
        if step == tau:
            rnd.merge_pending = False  # what StreamingRounds._before_step does once merged
        return True

    hooks = RoundHooks(
        cancel_requested=lambda rnd, step: False,
        after_step=lambda rnd, step: None,
        checkpoint=_unless_merge_pending(lambda rnd, step: written.append(step)),
        settle=lambda: None,
        checkpoint_every=1,
        report=lambda **metrics: None,
        before_step=before_step,
    )
    rnd = Round(RoundSpec(5, -1, 4, 8, False), 0, hooks)
    rnd.merge_pending = pending
    assert list(rnd.steps()) == [0, 1, 2, 3]
    assert written == want  # step 4 is the task's end, written by the hand-over


def quiet_hooks(before_step=None) -> RoundHooks:
    """Hooks that do nothing around a step but ``before_step``."""
    return RoundHooks(
        cancel_requested=lambda rnd, step: False,
        after_step=lambda rnd, step: None,
        checkpoint=lambda rnd, step: None,
        settle=lambda: None,
        checkpoint_every=0,
        report=lambda **metrics: None,
        before_step=before_step,
    )


class _Agent:
    """A session whose agent has theta_{r+1} from the ``ready_at``-th ask on (counting from
    1); asks that wait (``_wait_round``) are told apart from those that do not."""

    def __init__(self, ready_at: int, round_number: int = 5) -> None:
        self.ready_at, self.asks, self.merged = ready_at, [], []
        self.spec = RoundSpec(round_number, 9, 4, 8, False, "theta")

    def _poll_round(self):
        self.asks.append("poll")
        return self.spec if len(self.asks) >= self.ready_at else None

    def _wait_round(self):
        self.asks.append("wait")
        return self.spec


def merged_at(merge: str, ready_at: int, steps: int = 6, tau: int = 2):
    agent = _Agent(ready_at)
    cfg = StreamingConfig(fragments=2, delay_steps=tau, merge=merge)
    rounds = StreamingRounds(agent, cfg)
    rounds.plan = SimpleNamespace(names=lambda r: ["w"])
    rounds._use = lambda spec: None
    rounds._merge = lambda names, spec, step: agent.merged.append(step)
    rnd = Round(RoundSpec(5, -1, steps, 8, False), 0, quiet_hooks(rounds._before_step))
    rnd.merge_pending = True
    assert list(rnd.steps()) == list(range(steps))  # no step is skipped or cancelled
    assert rnd.merge_pending is False
    return agent.merged, agent.asks


@pytest.mark.parametrize(
    ("ready_at", "step", "asks"),
    [
        (1, 2, ["poll"]),  # there at tau: merged there, as blocking would
        (3, 4, ["poll"] * 3),  # there two steps later: trained on, merged at step 4
        (99, 5, ["poll"] * 3 + ["wait"]),  # still not there: only the last step waits
    ],
)
def test_when_ready_trains_on_from_tau_and_merges_at_the_first_step_it_is_there(
    ready_at, step, asks
):
    assert merged_at("when_ready", ready_at) == ([step], asks)


def test_blocking_waits_at_tau_whatever_the_agent_has():
    assert merged_at("blocking", ready_at=99) == ([2], ["wait"])


def test_an_unknown_merge_mode_is_refused_naming_the_key():
    from wire.config_table import ConfigError, load_table

    with pytest.raises(ConfigError, match="streaming.merge"):
        load_table(StreamingConfig, {"fragments": 2, "merge": "eventually"}, "streaming")


class _Behind:
    """A session for ``StreamingRounds.run``: tasks of 4 steps; the agent's answer to a poll
    at each hand-over is ``polled`` (None: nothing newer yet)."""

    def __init__(self, polled: RoundSpec | None) -> None:
        self.polled, self.loaded, self.submitted = polled, [], []

    def _resume_extra(self, model, optimizer):
        return None

    def _wait_round(self):
        return RoundSpec(0, 0, 4, 8, False, "theta")

    def _poll_round(self):
        return self.polled

    def _hooks(self, model, optimizer, before_step=None, settle=None, cancel_requested=None):
        return quiet_hooks()

    def _load(self, pieces, theta, spec):
        self.loaded.append(spec.round)

    def _submit(self, pieces, theta, spec, rnd, durable, names=None):
        self.submitted.append(spec.round)

    def _checkpoint(self, *args, **kwargs):
        return None


def second_task(polled: RoundSpec | None) -> tuple[Round, _Behind]:
    session = _Behind(polled)
    rounds = StreamingRounds(session, StreamingConfig(fragments=2, delay_steps=1))
    rounds.plan = SimpleNamespace(names=lambda r: ["w"])
    rounds._use = lambda spec: None
    tasks = rounds.run(torch.nn.Linear(1, 1), None)
    first = next(tasks)
    assert list(first.steps()) == [0, 1, 2, 3]
    return next(tasks), session


def test_a_site_on_time_trains_ahead_into_the_next_round():
    nxt, session = second_task(polled=None)
    assert (nxt.number, nxt.start_step, nxt.merge_pending) == (1, 0, True)
    assert session.submitted == [0] and session.loaded == [0]


def test_a_site_the_job_moved_past_starts_the_newest_task_at_once_from_its_theta():
    nxt, session = second_task(polled=RoundSpec(3, 3, 4, 8, False, "theta-3"))
    assert (nxt.number, nxt.start_step, nxt.merge_pending) == (3, 0, False)
    assert session.submitted == [0] and session.loaded == [0, 3]  # theta_3 whole, nothing merged
