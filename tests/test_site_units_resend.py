"""The agent keeps a counted update and sends the very same bytes again when a restarted
coordinator says it lost its copy (``RoundInfo.update_wanted``); an update for a round the
coordinator has gone back before waits (the fakes of ``test_site_units_agent``, no network)."""

from __future__ import annotations

import grpc
import pytest
from test_site_units_agent import FakeClient, beat, residuals, submit, train_and_push, wait

from site_client.agent.site_agent import AgentConfig, SiteAgent
from site_client.transfer.client import CoordinatorError
from wire.proto import isthmus_pb2 as pb


class ResendClient(FakeClient):
    """Records every payload's bytes; its heartbeat answers ``coordinator_round``."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.coordinator_round = 0

    def push(self, round_number, payload, **kw):
        self.sent.append(b"".join(bytes(d) for _, d in payload.chunks(0, 1 << 20)))
        return super().push(round_number, payload, **kw)

    def heartbeat(self, progress=None, health=None) -> pb.HeartbeatReply:
        return pb.HeartbeatReply(round=self.info(self.coordinator_round, ""))


@pytest.fixture
def site(tmp_path):
    client = ResendClient()
    agent = SiteAgent(AgentConfig("site-0", tmp_path / "run", tmp_path / "shm"), client)
    agent.joined(client.join())
    beat(agent, client.info(0, ""))  # federated
    agent.wan.fetch()
    yield agent, client, tmp_path
    agent.ipc.close()


def wanted(info: pb.RoundInfo) -> pb.RoundInfo:
    info.update_wanted = True
    return info


def test_a_counted_update_is_sent_again_byte_for_byte_when_asked(site) -> None:
    agent, client, tmp = site
    train_and_push(agent, tmp, (0, ""))
    after_first = residuals(agent)
    beat(agent, client.info(0, ""))  # the normal course: nothing to do
    assert agent.wan.work() is None
    beat(agent, wanted(client.info(0, "")))  # the coordinator restarted and lost its copy
    assert agent.wan.work() == "resend"
    agent.wan.resend()
    assert [p["round"] for p in client.pushes] == [0, 0]
    assert client.sent[0] == client.sent[1] and len(client.sent[0]) > 0
    now = residuals(agent)  # sent again, not encoded again: the residuals stay
    assert now.keys() == after_first.keys() and all(now[k].equal(after_first[k]) for k in now)
    assert agent.wan.work() is None  # acted on: not sent a third time on the same reply
    assert wait(agent) == {"ready": False}  # and the trainers are not asked to train it again


def test_the_update_is_held_into_the_next_round_and_let_go_after(site) -> None:
    agent, client, tmp = site
    train_and_push(agent, tmp, (0, ""))
    beat(agent, client.info(1, ""))  # theta_1 served: round 0 may still be taken back
    beat(agent, wanted(client.info(0, "")))
    assert agent.wan.work() == "resend"
    beat(agent, client.info(2, ""))  # round 2 open: theta_1 is checkpointed for good
    beat(agent, wanted(client.info(0, "")))
    assert agent.wan.work() != "resend"
    assert agent.state.book.delivered == {}


def test_a_site_without_the_update_ignores_the_request(tmp_path) -> None:
    client = ResendClient()
    agent = SiteAgent(AgentConfig("site-0", tmp_path / "run", tmp_path / "shm"), client)
    agent.joined(client.join())
    beat(agent, wanted(client.info(0, "")))  # e.g. the agent restarted since it pushed
    assert agent.wan.work() == "fetch"  # the ordinary path: train the round
    agent.ipc.close()


def test_after_the_coordinator_went_back_a_round_the_resend_goes_first_and_the_next_waits(
    site,
) -> None:
    agent, client, tmp = site
    train_and_push(agent, tmp, (0, ""))
    beat(agent, client.info(1, ""))
    agent.wan.fetch()
    assert wait(agent)["round"] == 1
    assert submit(agent, tmp, (1, ""))[0] == {"accepted": True}
    # Restarted, the coordinator is at round 0 again and wants round 0's update back.
    beat(agent, wanted(client.info(0, "")))
    assert agent.wan.work() == "resend"
    agent.wan.resend()
    assert [p["round"] for p in client.pushes] == [0, 0]
    assert agent.wan.work() is None  # round 1's update waits for round 1
    beat(agent, client.info(1, ""))  # the same theta_1: no fetch
    assert agent.wan.work() == "push"
    agent.wan.push()
    assert [p["round"] for p in client.pushes] == [0, 0, 1] and client.fetches == [0, 1]


def test_an_update_refused_as_early_waits_and_is_sent_the_same_later(site) -> None:
    agent, client, tmp = site
    train_and_push(agent, tmp, (0, ""))
    beat(agent, client.info(1, ""))
    agent.wan.fetch()
    wait(agent)
    before = residuals(agent)
    _, path = submit(agent, tmp, (1, ""))
    client.push_error = CoordinatorError(grpc.StatusCode.FAILED_PRECONDITION, "round 1 is not open")
    client.coordinator_round = 0  # it went back before this site heard
    agent.wan.push()
    assert path.exists() and agent.state.book.next_upload().task == (1, "")
    now = residuals(agent)
    assert all(now[k].equal(before[k]) for k in now)  # given back: encoded again later
    assert agent.state.info.round == 0 and agent.wan.work() is None
    client.push_error = None
    beat(agent, client.info(1, ""))
    agent.wan.push()
    assert client.sent[-1] == client.sent[-2] and not path.exists()
    assert agent.state.book.next_upload() is None


def test_a_changed_theta_of_the_same_version_is_fetched_again_whole(site) -> None:
    agent, client, tmp = site
    train_and_push(agent, tmp, (0, ""))
    beat(agent, client.info(1, ""))
    agent.wan.fetch()
    first = agent.state.ready.theta_path
    client.theta_hash = bytes(32)  # round 0 had to close again, differently
    beat(agent, client.info(1, ""))
    assert agent.wan.work() == "fetch"
    agent.wan.fetch()
    assert client.fetches == [0, 1, 1] and agent.state.ready.theta_path != first
    assert agent.state.ready.theta_hash == bytes(32).hex() and agent.wan.work() is None


def test_an_update_trained_from_another_theta_than_the_one_served_is_not_sent_again(site) -> None:
    # A coordinator that took over closed the round before differently: its theta_0 is not
    # the one this update was trained from, so these bytes must not count for its round.
    agent, client, tmp = site
    train_and_push(agent, tmp, (0, ""))
    other = wanted(client.info(0, ""))
    other.theta_hash = bytes(32)
    beat(agent, other)
    assert agent.wan.work() != "resend"
    beat(agent, wanted(client.info(0, "")))  # the theta it was trained from: sent again
    assert agent.wan.work() == "resend"


def test_a_resend_refused_keeps_the_update_for_a_later_ask(site) -> None:
    # The ask may be stale (sent before the first copy counted) and the round closed since:
    # the update counted once and must stay at hand until its round is let go.
    agent, client, tmp = site
    train_and_push(agent, tmp, (0, ""))
    beat(agent, wanted(client.info(0, "")))
    client.push_error = CoordinatorError(grpc.StatusCode.FAILED_PRECONDITION, "round 0 is closed")
    agent.wan.resend()
    assert len(client.sent) == 2 and (0, "") in agent.state.book.delivered
    client.push_error = None
    beat(agent, wanted(client.info(0, "")))  # asked once more: the same bytes go again
    assert agent.wan.work() == "resend"
    agent.wan.resend()
    assert len(client.sent) == 3 and client.sent[2] == client.sent[0]


def test_an_ask_heard_while_the_first_copy_was_pushed_is_dropped_once_it_counts(site) -> None:
    # The coordinator asked (after a takeover, every update of the round is wanted) before
    # this site's first copy counted; once it counted, the ask is out of date.
    agent, client, tmp = site
    client.during_push = lambda: beat(agent, wanted(client.info(0, "")))
    train_and_push(agent, tmp, (0, ""))
    client.during_push = None
    assert agent.wan.work() != "resend" and len(client.sent) == 1
    beat(agent, wanted(client.info(0, "")))  # asked after the count: it is lost after all
    assert agent.wan.work() == "resend"


class _FoldRefusal(grpc.RpcError):
    """What the coordinator's refusal of a late update that folds into a later round carries."""

    def __init__(self, fold: str) -> None:
        self.fold = fold

    def trailing_metadata(self):
        return (("isthmus-fold-round", self.fold),)


def _later(fold: str) -> CoordinatorError:
    error = CoordinatorError(grpc.StatusCode.FAILED_PRECONDITION, f"folds into round {fold}")
    error.__cause__ = _FoldRefusal(fold)
    return error


def test_a_late_update_waits_for_its_fold_round_while_the_next_goes_on_time(site) -> None:
    agent, client, tmp = site
    wait(agent)
    _, late = submit(agent, tmp, (0, ""))
    before = residuals(agent)
    client.push_error = _later("2")  # round 0 closed without it; round 1 syncs another fragment
    beat(agent, client.info(1, ""))
    agent.wan.push()
    book = agent.state.book
    assert late.exists() and book.pending[(0, "")].fold_round == 2
    now = residuals(agent)
    assert all(now[k].equal(before[k]) for k in now)  # given back: encoded again then
    client.push_error = None
    agent.wan.fetch()
    assert wait(agent)["round"] == 1
    submit(agent, tmp, (1, ""))
    assert agent.wan.work() == "push"  # round 1's own update does not wait behind it
    agent.wan.push()
    assert [p["round"] for p in client.pushes] == [0, 1]
    assert agent.wan.work() != "push"  # round 0's waits for round 2
    beat(agent, client.info(2, ""))
    assert book.next_upload(agent.state.info).task == (0, "")
    agent.wan.push()
    assert [p["round"] for p in client.pushes] == [0, 1, 0] and not late.exists()
    assert book.pending == {}


def test_a_fold_round_that_is_no_round_number_is_not_taken_for_one() -> None:
    from site_client.transfer.push import fold_round

    assert fold_round(_later("2")) == 2
    for bad in ("", "-1", "2.5", "two"):
        assert fold_round(_later(bad)) is None
