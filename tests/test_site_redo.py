"""A task done again: two FSDP2 trainers under a real site agent, against a scripted coordinator.

The checkpoint of a task's end holds the optimiser state without the model (the next theta
replaces it). Round 0 counts; round 1's update is handed over and its end checkpointed, and
then the agent is lost before its push counted (its memory goes; the trainers are killed). A
new agent on the same run folder is handed round 1 again: the trainers resume at its end,
which holds no model to make the update from, so they load the checkpoint before it (round
0's end, momentum included), load theta_1 and train round 1 again. The update pushed then must
be the lost one, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from test_site_units_trainers import TRAINER as UNITS_TRAINER
from test_site_units_trainers import launch, records, theta

from site_client.agent.site_agent import AgentConfig, SiteAgent
from site_client.checkpoint.local import MANIFEST
from site_client.errors import CoordinatorError
from site_client.transfer.client import GlobalState
from wire.digest import state_digest
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import map_tensors, write_tensors

pytestmark = pytest.mark.e2e
H = 4
ROUNDS = 2


def _variant(script: str, *changes: tuple[str, str]) -> str:
    for old, new in changes:
        assert old in script, old
        script = script.replace(old, new)
    return script


# The trainer of ``test_site_units_trainers``: no periodic checkpoints, federated data, and
# momentum (a task done again from the wrong optimiser state gives another update).
TRAINER = _variant(
    UNITS_TRAINER,
    ('SiteSession(backend="gloo", checkpoint_every=2)', 'SiteSession(backend="gloo")'),
    ("SGD(model.parameters(), lr=0.1)", "SGD(model.parameters(), lr=0.1, momentum=0.9)"),
    ("manual_seed(rnd.data_unit_index * 100 + step)", "manual_seed(rnd.number * 100 + step)"),
)


class ScriptedCoordinator:
    """Round ``first`` onwards, one round per push; with ``lose``, the push of that round
    is taken (its bytes kept) and never answered until ``release``, then fails."""

    def __init__(self, first: int, lose: int | None) -> None:
        self.lock = threading.Lock()
        self.round, self.lose = first, lose
        self.pushed: dict[int, bytes] = {}
        self.captured, self.released = threading.Event(), threading.Event()
        self.bytes_sent = self.bytes_received = 0

    def info(self) -> pb.RoundInfo:
        if self.round >= ROUNDS:
            return pb.RoundInfo(round=ROUNDS, version=ROUNDS, total_rounds=ROUNDS, finished=True)
        return pb.RoundInfo(
            round=self.round,
            version=self.round,
            theta_hash=state_digest(theta(self.round)),
            inner_steps=H,
            total_rounds=ROUNDS,
            participant=True,
        )

    def join(self) -> pb.JoinReply:
        return pb.JoinReply(round=self.info(), job_name="redo", heartbeat_interval_s=0.05)

    def heartbeat(self, progress=None, health=None) -> pb.HeartbeatReply:
        with self.lock:
            return pb.HeartbeatReply(round=self.info())

    def wait_round(self, known, timeout_s) -> pb.WaitRoundReply:
        time.sleep(min(timeout_s, 0.05))
        return pb.WaitRoundReply(round=self.heartbeat().round)

    def fetch(self, version, held=None, dest=None) -> GlobalState:
        if held is not None and held.version == version:
            return held
        t = theta(version)
        write_tensors(dest, t)
        file = map_tensors(dest)
        return GlobalState(version, file.tensors, state_digest(t), dest, file)

    def push(self, round_number, payload, *, hold=None, abort=None, **kw) -> pb.PushReply:
        assert hold is not None and hold.wait(60), "the trainers never checkpointed the task"
        data = b"".join(bytes(c) for _, c in payload.chunks(0, 1 << 20))
        with self.lock:
            self.pushed[round_number] = data
        if round_number == self.lose:
            self.captured.set()
            self.released.wait(60)
            raise CoordinatorError(grpc.StatusCode.UNAVAILABLE, "the site is gone")
        with self.lock:
            self.round = round_number + 1
        return pb.PushReply(complete=True, message="counted")

    def leave(self, reason="") -> None:
        pass


def _kill(procs) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)


def test_a_task_whose_update_was_lost_after_its_end_checkpoint_is_trained_again_bit_for_bit(
    tmp_path: Path,
) -> None:
    (tmp_path / "trainer.py").write_text(TRAINER)
    run = tmp_path / "run"
    first = ScriptedCoordinator(first=0, lose=1)
    agent = SiteAgent(AgentConfig("site-0", run, tmp_path / "shm-1", wait_poll_s=0.2), first)
    agent.start()
    procs = launch(tmp_path, agent, 0, "")
    try:
        assert first.captured.wait(120), (tmp_path / "rank0-restart0.log").read_text()[-2000:]
        _kill(procs)  # the site is lost with its update unanswered: nothing of it counted
        first.released.set()
        agent.stop(leave=False)

        ends = sorted((run / "checkpoints").glob("step-*"))
        manifests = [json.loads((p / MANIFEST).read_text()) for p in ends]
        assert [(m["extra"]["round"], m["extra"]["step"]) for m in manifests] == [(0, H), (1, H)]
        assert [m["has_model"] for m in manifests] == [False, False]

        second = ScriptedCoordinator(first=1, lose=None)
        agent = SiteAgent(AgentConfig("site-0", run, tmp_path / "shm-2", wait_poll_s=0.2), second)
        agent.start()
        procs = launch(tmp_path, agent, 1, "")
        codes = [p.wait(timeout=120) for p in procs]
        logs = [(tmp_path / f"rank{r}-restart1.log").read_text() for r in range(2)]
        assert codes == [0, 0], [x[-2000:] for x in logs]
    finally:
        first.released.set()
        _kill(procs)
        agent.stop(leave=False)

    for rank in range(2):
        assert records(tmp_path, rank, 0)[0] == [0, "", 0, H, False]
        # Round 1 again from its first step (not resumed at its end), to its end.
        assert records(tmp_path, rank, 1) == [[1, "", 0, H, False]]
    assert "training the task again from the checkpoint before it" in logs[0]
    assert second.pushed[1] == first.pushed[1]  # the lost update, bit for bit
    assert second.pushed[1] != first.pushed[0]
    final = json.loads((run / "final.json").read_text())
    assert final["version"] == ROUNDS
