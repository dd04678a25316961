"""A drained site's agent (no coordinator, no trainers: its state and its answers to the
trainers): the task it owes is still handed out and taken, then the trainers are told to leave;
in shared-data mode units in training are handed back while handed-over updates stay queued;
the final theta still goes out once fetched, and is not fetched for it while it leaves; undrained,
nothing changes; probes go into heartbeats."""

from __future__ import annotations

from site_client.agent.state import AgentConfig, AgentState, Offer
from site_client.agent.trainer_channel import TrainerChannel
from wire.proto import isthmus_pb2 as pb


def _channel(tmp_path) -> tuple[AgentState, TrainerChannel]:
    state = AgentState("site-a")
    cfg = AgentConfig("site-a", tmp_path / "run", tmp_path / "shm", wait_poll_s=0.05)
    (tmp_path / "run").mkdir(parents=True)
    return state, TrainerChannel(state, cfg)


def _offer(round_number: int, finished: bool = False) -> Offer:
    return Offer(round_number, round_number, "/dev/shm/theta", "ab", finished, 4, 3)


def _drain(state: AgentState, info: pb.RoundInfo, reason: str = "bad GPU (operator)") -> None:
    commands = [pb.Command(drain=reason)] if reason else []
    state.heard(info, commands)


def test_federated_the_owed_task_is_trained_then_the_trainers_leave(tmp_path):
    state, channel = _channel(tmp_path)
    info = pb.RoundInfo(round=1, version=1, participant=True)
    state.heard(info, [])
    state.ready = _offer(1)
    _drain(state, info)
    assert state.drained == "bad GPU (operator)"
    task = channel.wait_round({"timeout": 0.05})
    assert task["ready"] and task["round"] == 1 and not task.get("drained")
    assert channel.progress({"round": 1, "step": 2, "loss": 1.0}) == {}  # not cancelled
    channel.submit({"round": 1, "paths": [str(tmp_path / "u.safetensors")], "weight": 1.0})
    assert channel.wait_round({"timeout": 0.05}) == {
        "ready": True,
        "drained": True,
        "finished": False,
    }
    assert list(state.book.pending) == [(1, "")], "the handed-over update is still to push"


def test_a_drained_site_outside_the_round_leaves_at_once_and_stays_drained(tmp_path):
    state, channel = _channel(tmp_path)
    info = pb.RoundInfo(round=2, version=2, participant=False)
    _drain(state, info)
    assert channel.wait_round({"timeout": 0.05})["drained"]
    # A reply without the command (an older heartbeat's, or an undrain while the site leaves)
    # does not call the trainers back: a drained agent leaves; started again, it re-joins.
    _drain(state, info, reason="")
    assert state.drained and channel.wait_round({"timeout": 0.05})["drained"]


def test_a_bad_probe_from_the_trainers_is_dropped_not_sent(tmp_path):
    state, channel = _channel(tmp_path)
    good = {"round": 0, "matmul_gflops": 1.0, "allreduce_gbps": 0.0, "world_size": 1}
    for bad in (
        {**good, "matmul_gflops": float("nan"), "device": "cpu"},
        {**good, "device": "cpu\x1b[2J"},
        {**good},  # no device
    ):
        assert channel.health(bad) == {}
    assert state.health is None


def test_the_final_theta_still_goes_to_a_drained_site(tmp_path):
    state, channel = _channel(tmp_path)
    info = pb.RoundInfo(round=3, version=3, finished=True)
    _drain(state, info)
    state.ready = _offer(3, finished=True)
    reply = channel.wait_round({"timeout": 0.05})
    assert reply["finished"] and not reply.get("drained")


def test_shared_data_units_in_training_are_handed_back_queued_updates_stay(tmp_path):
    state, channel = _channel(tmp_path)
    first = pb.RoundInfo(round=0, version=0, participant=True, data_unit="u0")
    state.heard(first, [])
    state.ready = _offer(0)
    assert channel.wait_round({"timeout": 0.05})["data_unit"] == "u0"
    channel.submit({"round": 0, "data_unit": "u0", "paths": [str(tmp_path / "a")], "weight": 1})
    backup = pb.RoundInfo(round=0, version=0, participant=True, data_unit="u2")
    state.heard(backup, [])
    assert channel.wait_round({"timeout": 0.05})["data_unit"] == "u2"
    _drain(state, backup)
    # The trainers of u2 are told to stop; u0's update, handed over, stays queued.
    assert channel.progress({"round": 0, "data_unit": "u2", "step": 1}) == {"cancel": True}
    assert list(state.book.pending) == [(0, "u0")]
    assert channel.wait_round({"timeout": 0.05})["drained"]


def test_the_newest_probe_goes_into_heartbeats_with_a_growing_seq(tmp_path):
    state, channel = _channel(tmp_path)
    report = {
        "round": 0,
        "matmul_gflops": 42.0,
        "allreduce_gbps": 1.5,
        "world_size": 2,
        "device": "cpu",
        "gpu_errors": [],
    }
    channel.health(report)
    channel.health({**report, "round": 10, "matmul_gflops": 40.0})
    assert state.health.seq == 2 and state.health.round == 10
    assert state.health.matmul_gflops == 40.0 and state.health.world_size == 2


def test_a_drained_site_does_not_fetch_the_final_theta_while_it_leaves(tmp_path):
    """The job may finish while a drained site pushes what it owes: the final theta is not
    fetched for it (its trainers are gone or leaving); an undrained site fetches it."""
    from site_client.agent.wan import WanWorker

    state, channel = _channel(tmp_path)
    wan = WanWorker(state, client=None, cfg=channel.cfg, compression=None, codec_state=None)
    info = pb.RoundInfo(round=3, version=3, finished=True)
    state.heard(info, [])
    assert wan.work() == "fetch"
    _drain(state, info)
    assert wan.work() is None


def test_a_transfer_ended_by_the_site_leaving_is_not_reported_as_its_failure(tmp_path, monkeypatch):
    """The site stops (its trainers failed, say) and leaves while a fetch is under way: the
    fetch then fails with "this site has left the job", a consequence; what the site reports
    stays the cause. A transfer that fails while the site runs is still its failure."""
    from site_client.agent.wan import WanWorker
    from site_client.errors import CoordinatorError

    state, channel = _channel(tmp_path / "leaving")
    wan = WanWorker(state, client=None, cfg=channel.cfg, compression=None, codec_state=None)
    state.heard(pb.RoundInfo(round=3, version=3, finished=True), [])  # the final theta is due

    def fetch_while_the_site_leaves():
        with state.cond:
            state.stopping = True  # SiteAgent.stop, then client.leave
        raise CoordinatorError(None, "fetch: this site has left the job")

    monkeypatch.setattr(wan, "fetch", fetch_while_the_site_leaves)
    wan.loop(0.01)
    assert state.error is None

    state, channel = _channel(tmp_path / "running")
    wan = WanWorker(state, client=None, cfg=channel.cfg, compression=None, codec_state=None)
    state.heard(pb.RoundInfo(round=3, version=3, finished=True), [])  # the final theta is due

    def fetch_fails():
        raise CoordinatorError(None, "fetch: the coordinator refused it")

    monkeypatch.setattr(wan, "fetch", fetch_fails)
    wan.loop(0.01)
    assert state.error == "WAN transfer failed: fetch: the coordinator refused it"
