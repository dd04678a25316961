"""The site agent's task bookkeeping, driven by a scripted coordinator (no network, no threads).

Each test plays the agent's threads by hand: heartbeat replies go to ``agent.heard``, the WAN
thread's work to ``agent._fetch`` / ``agent._push``, and the trainers' requests to the IPC
handlers, so every interleaving is exact.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from site_client.agent.site_agent import AgentConfig, SiteAgent
from site_client.agent.tasks import TaskBook, unit_index, unit_name
from site_client.transfer.client import CoordinatorError, GlobalState, PushAborted
from wire.digest import state_digest
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import map_tensors, write_tensors

THETA = {"w": torch.linspace(-1.0, 1.0, 64)}
# top-k keeps an error-feedback residual: a dropped update must give it back.
JOB_TOML = '[compression]\ndefault = { codec = "topk", fraction = 0.1 }\n'


class FakeClient:
    """Serves theta_0 and records pushes; ``push_error`` / ``during_push`` script the outcome."""

    def __init__(self) -> None:
        self.theta_hash = state_digest(THETA)
        self.fetches: list[int] = []
        self.pushes: list[dict] = []
        self.push_error: Exception | None = None
        self.during_push = None
        self.bytes_sent = self.bytes_received = 0

    def info(self, round_number=0, unit="", participant=True, finished=False) -> pb.RoundInfo:
        return pb.RoundInfo(
            round=round_number,
            version=round_number,
            theta_hash=self.theta_hash,
            inner_steps=4,
            total_rounds=3,
            finished=finished,
            participant=participant,
            data_unit=unit,
        )

    def join(self) -> pb.JoinReply:
        return pb.JoinReply(
            round=self.info(unit="u0"),
            job_name="units",
            job_config=JOB_TOML.encode(),
            heartbeat_interval_s=0.05,
        )

    def fetch(self, version, held=None, dest=None) -> GlobalState:
        if held is not None and held.version == version:
            return held
        self.fetches.append(version)
        write_tensors(dest, THETA)  # as the real one: straight into the trainers' file
        file = map_tensors(dest)
        return GlobalState(version, file.tensors, self.theta_hash, dest, file)

    def push(
        self, round_number, payload, *, weight, base_version, data_unit, abort, hold, **_parts
    ):
        # The agent encoded the payload (and moved the residuals) before calling.
        self.pushes.append(
            {
                "round": round_number,
                "unit": data_unit,
                "weight": weight,
                "base_version": base_version,
            }
        )
        if self.during_push is not None:
            self.during_push()
        if abort():
            raise PushAborted("withdrawn")
        if self.push_error is not None:
            raise self.push_error
        return pb.PushReply(complete=True, message="counted")

    def leave(self, reason="") -> None:
        pass


@pytest.fixture
def site(tmp_path):
    client = FakeClient()
    agent = SiteAgent(AgentConfig("site-0", tmp_path / "run", tmp_path / "shm"), client)
    agent.joined(client.join())
    yield agent, client, tmp_path
    agent.ipc.close()


def beat(agent: SiteAgent, info: pb.RoundInfo, *cancel: str) -> None:
    commands = [pb.Command(cancel_unit=u) for u in cancel]
    agent.heard(pb.HeartbeatReply(round=info, commands=commands))


def wait(agent: SiteAgent) -> dict:
    return agent.channel.wait_round({"timeout": 0})


def submit(agent: SiteAgent, tmp: Path, task: tuple[int, str], scale: float = 0.01) -> tuple:
    path = tmp / f"delta-{task[0]}-{task[1] or 'own'}.safetensors"
    save_file({"w": torch.randn(64, generator=torch.Generator().manual_seed(7)) * scale}, path)
    reply = agent.channel.submit({"round": task[0], "data_unit": task[1], "path": str(path)})
    return reply, path


def residuals(agent: SiteAgent) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in agent.codec_state.state_dict().items()}


def train_and_push(agent, tmp, task) -> None:
    """The trainers take the task on offer, hand its update over, and the WAN thread pushes."""
    offer = wait(agent)
    assert offer["ready"] and (offer["round"], offer["data_unit"]) == task
    assert submit(agent, tmp, task)[0] == {"accepted": True}
    assert agent.wan.work() == "push"
    agent.wan.push()


def test_federated_round_is_offered_once_and_pushed_without_a_unit(site) -> None:
    agent, client, tmp = site
    beat(agent, client.info(0, ""))
    assert agent.wan.work() == "fetch"
    agent.wan.fetch()
    offer = wait(agent)
    assert offer["ready"] and offer["round"] == 0 and offer["data_unit"] == ""
    assert offer["inner_steps"] == 4 and load_file(offer["theta_path"])["w"].equal(THETA["w"])
    assert submit(agent, tmp, (0, ""))[0] == {"accepted": True}
    assert wait(agent) == {"ready": False}  # handed over: not offered again while queued
    agent.wan.push()
    assert client.pushes == [{"round": 0, "unit": "", "weight": 1.0, "base_version": 0}]
    assert wait(agent) == {"ready": False} and agent.wan.work() is None
    # A trainer restarted after submitting hands the same round over again: not pushed twice.
    reply, path = submit(agent, tmp, (0, ""))
    assert reply == {"accepted": True, "duplicate": True} and not path.exists()
    assert agent.channel.progress({"round": 0, "step": 4}) == {}
    # The next round needs a fetch, then is offered.
    beat(agent, client.info(1, ""))
    assert agent.wan.work() == "fetch"
    agent.wan.fetch()
    assert wait(agent)["round"] == 1


def test_cancel_while_training_stops_the_trainers_and_refuses_their_update(site) -> None:
    agent, client, tmp = site
    agent.wan.fetch()
    offer = wait(agent)
    assert (offer["round"], offer["data_unit"]) == (0, "u0")
    assert agent.channel.progress({"round": 0, "data_unit": "u0", "step": 1}) == {}
    beat(agent, client.info(0, "u0"), "u0")
    assert agent.channel.progress({"round": 0, "data_unit": "u0", "step": 2}) == {"cancel": True}
    # The same round number on another unit is not affected.
    assert agent.channel.progress({"round": 0, "data_unit": "u3", "step": 2}) == {}
    assert wait(agent) == {"ready": False}  # the cancelled task is not offered again
    reply, path = submit(agent, tmp, (0, "u0"))
    assert reply == {"accepted": True, "cancelled": True} and not path.exists()
    assert agent.wan.work() is None and client.pushes == []


def test_cancel_drops_a_queued_update_and_withdraws_one_being_pushed(site) -> None:
    agent, client, tmp = site
    agent.wan.fetch()
    wait(agent)
    _, path = submit(agent, tmp, (0, "u0"))
    beat(agent, client.info(0, "u0"), "u0")  # before the WAN thread got to it
    assert not path.exists() and agent.wan.work() is None and client.pushes == []

    # A backup unit, cancelled while its push is under way: withdrawn, residuals given back.
    beat(agent, client.info(0, "u4"))
    train_and_push(agent, tmp, (0, "u4"))
    delivered = residuals(agent)
    assert delivered  # top-k left a residual behind
    beat(agent, client.info(0, "u9"))
    wait(agent)
    _, path = submit(agent, tmp, (0, "u9"), scale=1.0)
    client.during_push = lambda: beat(agent, client.info(0, "u9"), "u9")
    agent.wan.push()
    assert [p["unit"] for p in client.pushes] == ["u4", "u9"]
    now = residuals(agent)
    assert now.keys() == delivered.keys() and all(now[k].equal(v) for k, v in delivered.items())
    assert not path.exists() and agent.wan.work() is None and wait(agent) == {"ready": False}


def test_backup_unit_after_delivering_is_trained_from_the_held_theta(site) -> None:
    agent, client, tmp = site
    agent.wan.fetch()
    train_and_push(agent, tmp, (0, "u0"))
    # A heartbeat sent before the push ended still names u0: nothing to do.
    beat(agent, client.info(0, "u0"))
    assert wait(agent) == {"ready": False} and agent.wan.work() is None
    # Then a backup copy of a straggler's unit, same round and theta: no fetch.
    beat(agent, client.info(0, "u7"))
    assert agent.wan.work() is None
    train_and_push(agent, tmp, (0, "u7"))
    assert client.fetches == [0]
    assert [(p["round"], p["unit"], p["base_version"]) for p in client.pushes] == [
        (0, "u0", 0),
        (0, "u7", 0),
    ]
    saved = load_file(str(agent.cfg.run_dir / "codec_state.safetensors"))
    assert all(saved[k].equal(v) for k, v in residuals(agent).items())  # kept for good


def test_already_exists_lost_race_restores_residuals_and_is_done(site, caplog) -> None:
    agent, client, tmp = site
    agent.wan.fetch()
    train_and_push(agent, tmp, (0, "u0"))
    delivered = residuals(agent)
    client.push_error = CoordinatorError(
        grpc.StatusCode.ALREADY_EXISTS, "push: unit u6 of round 0 committed by site-2"
    )
    beat(agent, client.info(0, "u6"))
    with caplog.at_level("INFO", logger="isthmus.site"):
        train_and_push(agent, tmp, (0, "u6"))
    now = residuals(agent)
    assert now.keys() == delivered.keys() and all(now[k].equal(v) for k, v in delivered.items())
    assert "lost the race" in caplog.text and "committed by site-2" in caplog.text
    assert wait(agent) == {"ready": False} and agent.wan.work() is None
    # The delivered update's residuals are what is on disk for a restart.
    saved = load_file(str(agent.cfg.run_dir / "codec_state.safetensors"))
    assert all(saved[k].equal(v) for k, v in delivered.items())


def test_a_shared_task_ends_when_a_later_round_opens_but_a_federated_one_is_still_sent(
    site,
) -> None:
    agent, client, tmp = site
    agent.wan.fetch()
    wait(agent)
    beat(agent, client.info(1, "u3"))  # round 0 closed without this site's u0
    assert agent.channel.progress({"round": 0, "data_unit": "u0", "step": 2}) == {"cancel": True}
    reply, path = submit(agent, tmp, (0, "u0"))
    assert reply == {"accepted": True, "cancelled": True} and not path.exists()
    assert agent.wan.work() == "fetch"  # theta_1 for u3; nothing to push
    # Queued when the next round opens: dropped unpushed.
    agent.wan.fetch()
    wait(agent)
    _, path = submit(agent, tmp, (1, "u3"))
    beat(agent, client.info(2, "u8"))
    assert not path.exists() and agent.wan.work() == "fetch" and client.pushes == []
    # Federated: a late update is still sent (the strategy may fold it into the next round).
    beat(agent, client.info(2, ""))
    agent.wan.fetch()
    wait(agent)
    _, path = submit(agent, tmp, (2, ""))
    beat(agent, client.info(3, ""))
    assert agent.channel.progress({"round": 2, "data_unit": "", "step": 4}) == {}
    assert agent.wan.work() == "push"
    agent.wan.push()
    assert [(p["round"], p["unit"]) for p in client.pushes] == [(2, "")]


def test_a_task_never_handed_out_is_refused(site) -> None:
    agent, client, tmp = site
    agent.wan.fetch()
    with pytest.raises(ValueError, match="round 0 unit u9 is not a task"):
        submit(agent, tmp, (0, "u9"))


def test_a_malformed_unit_from_the_coordinator_stops_the_site(site) -> None:
    agent, client, tmp = site
    agent.wan.fetch()
    beat(agent, client.info(0, "unit-3"))
    assert "malformed data unit 'unit-3'" in agent.error
    with pytest.raises(RuntimeError, match="malformed"):
        wait(agent)


def test_cancel_does_not_reach_a_later_reassignment_of_the_name() -> None:
    book = TaskBook()
    book.issue((2, "u3"), 2)
    book.cancel("u3", known_round=2)
    assert book.is_cancelled((2, "u3")) and book.is_cancelled((1, "u3"))
    assert not book.is_cancelled((3, "u3")) and not book.is_cancelled((2, ""))


def test_a_new_round_leaves_the_push_under_way_to_the_coordinator() -> None:
    book = TaskBook()
    for task in [(0, "u1"), (0, "u2")]:
        book.issue(task, 0)
        assert book.submit(task, f"/x/{task[1]}", 1.0) == "accepted"
    assert book.start_upload().task == (0, "u1")
    dropped = book.advance(1)
    # The queued one is dropped; the one being pushed may be what closed the round: it goes on.
    assert [u.task for u in dropped] == [(0, "u2")]
    assert not book.next_upload().aborted and book.next_upload().task == (0, "u1")
    assert book.advance(1) == [] and book.advance(0) == []  # rounds only move forward
    # A cancel of the unit being pushed does withdraw it: another copy won.
    dropped, aborted = book.cancel("u1", known_round=1)
    assert dropped == [] and aborted is book.next_upload() and aborted.aborted
    book.end_upload(aborted)
    assert book.next_upload() is None and book.done((0, "u1")) and not book.pushing


def test_unit_names_round_trip_and_malformed_ones_are_refused() -> None:
    assert [unit_index(u) for u in ("", "u0", "u17")] == [None, 0, 17]
    assert [unit_name(i) for i in (None, -1, 0, 17)] == ["", "", "u0", "u17"]
    for bad in ("u", "u-1", "u01", "x3", "u3 ", "u" + "9" * 19):
        with pytest.raises(ValueError, match="malformed data unit"):
            unit_index(bad)


def test_restarted_trainers_train_again_what_was_not_checkpointed() -> None:
    """An update whose checkpoint never reached disk is withdrawn when the launcher restarts
    the trainers (it would wait for ever); a checkpointed one goes on."""
    book = TaskBook()
    for task in [(0, ""), (1, ""), (2, "")]:
        book.issue(task, task[0])
        assert book.submit(task, f"/x/{task[0]}", 1.0) == "accepted"
    book.checkpointed((1, ""))
    pushing = book.start_upload()
    assert pushing.task == (0, "")
    dropped = book.trainers_restarted()
    assert [u.task for u in dropped] == [(2, "")]
    assert pushing.aborted and pushing.redo and book.next_upload() is pushing
    book.end_upload(pushing)  # withdrawn, not counted: to be trained again
    assert not book.done((0, "")) and not book.done((2, "")) and book.done((1, ""))
    assert not book.pushing and book.next_upload().task == (1, "")
    # The new trainers hand both over again; they are queued as any update is.
    assert book.submit((0, ""), "/x/0b", 1.0) == "accepted"
    assert book.submit((2, ""), "/x/2b", 1.0) == "accepted"
