"""Two FSDP2 trainer processes under a real site agent, against a scripted coordinator.

The site trains unit u0 of round 0; rank 1 stalls at step 2 (fault injection), meanwhile the
coordinator says u0 was committed elsewhere and hands the site a backup copy of u1. Both ranks
must leave u0 at the same step and submit nothing for it, then train u1 from the same theta_0.
Rank 0 is killed during u1; the relaunched trainers resume u1 from the site checkpoint (the
task is still on offer), submit it, and load the final theta.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from coord_harness import REPO

from site_client.agent.site_agent import AgentConfig, SiteAgent
from site_client.checkpoint.local import MANIFEST
from site_client.transfer.client import GlobalState
from wire.digest import state_digest
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import map_tensors, write_tensors

pytestmark = pytest.mark.e2e
H = 6

TRAINER = """
import json, os, sys
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from site_client.trainer.session import SiteSession

torch.set_num_threads(1)
session = SiteSession(backend="gloo", checkpoint_every=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
fully_shard(model, mesh=init_device_mesh("cpu", (session.world_size,)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
out = os.path.join(sys.argv[1], f"rank{session.rank}-restart{session.restart_count}.jsonl")
for rnd in session.rounds(model, opt):
    for step in rnd.steps():
        g = torch.Generator().manual_seed(rnd.data_unit_index * 100 + step)
        model(torch.randn(4, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    record = [rnd.number, rnd.data_unit, rnd.start_step, rnd.completed_steps, rnd.cancelled]
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\\n")
session.close()
"""


def theta(version: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return {k: v.detach() * (1.0 + version) for k, v in model.state_dict().items()}


class ScriptedCoordinator:
    """Round 0 on u0; once the site reports step 2, u0 is cancelled and u1 handed out; after
    the site's push the job is finished (theta_1)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.pushes: list[dict] = []
        self.bytes_sent = self.bytes_received = 0

    def info(self, unit: str) -> pb.RoundInfo:
        return pb.RoundInfo(
            round=0,
            version=0,
            theta_hash=state_digest(theta(0)),
            inner_steps=H,
            total_rounds=1,
            participant=True,
            data_unit=unit,
        )

    def join(self) -> pb.JoinReply:
        return pb.JoinReply(round=self.info("u0"), job_name="units", heartbeat_interval_s=0.05)

    def heartbeat(self, progress=None, health=None) -> pb.HeartbeatReply:
        with self.lock:
            if self.pushes:
                done = pb.RoundInfo(round=1, version=1, total_rounds=1, finished=True)
                return pb.HeartbeatReply(round=done)
            if not self.cancelled and progress is not None and progress.inner_step >= 2:
                self.cancelled = True
                return pb.HeartbeatReply(
                    round=self.info("u1"), commands=[pb.Command(cancel_unit="u0")]
                )
            return pb.HeartbeatReply(round=self.info("u1" if self.cancelled else "u0"))

    def wait_round(self, known, timeout_s) -> pb.WaitRoundReply:
        time.sleep(min(timeout_s, 0.05))
        reply = self.heartbeat()
        return pb.WaitRoundReply(round=reply.round, commands=reply.commands)

    def fetch(self, version, held=None, dest=None) -> GlobalState:
        if held is not None and held.version == version:
            return held
        t = theta(version)
        write_tensors(dest, t)  # as the real one: straight into the trainers' file
        file = map_tensors(dest)
        return GlobalState(version, file.tensors, state_digest(t), dest, file)

    def push(self, round_number, payload, *, hold=None, abort=None, **kw) -> pb.PushReply:
        # As the real one: the update counts once the site's checkpoint of its end is on disk.
        assert hold is not None and hold.wait(60), "the trainers never checkpointed the task"
        keys = sorted({e.name for e in payload.manifest.entries})
        with self.lock:
            self.pushes.append({"round": round_number, "keys": keys, **kw})
        return pb.PushReply(complete=True, message="counted")

    def leave(self, reason="") -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp: Path, agent: SiteAgent, restart: int, faults: str) -> list[subprocess.Popen]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "ISTHMUS_AGENT_SOCKET": str(agent.cfg.shm_dir / "agent.sock"),
        "ISTHMUS_FAULTS": faults,
    }
    procs = []
    for rank in range(2):
        log = open(tmp / f"rank{rank}-restart{restart}.log", "w")  # noqa: SIM115 - the child's
        procs.append(
            subprocess.Popen(
                [sys.executable, str(tmp / "trainer.py"), str(tmp)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def records(tmp: Path, rank: int, restart: int) -> list[list]:
    path = tmp / f"rank{rank}-restart{restart}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # 12 s; the drain e2e cancels units in training
def test_cancel_stops_every_rank_then_a_backup_unit_resumes_after_a_crash(tmp_path) -> None:
    (tmp_path / "trainer.py").write_text(TRAINER)
    coordinator = ScriptedCoordinator()
    agent = SiteAgent(
        AgentConfig("site-0", tmp_path / "run", tmp_path / "shm", wait_poll_s=0.2), coordinator
    )
    agent.start()
    procs: list[subprocess.Popen] = []
    try:
        faults = (
            "site=site-0,round=0,step=2,rank=1,action=stall,seconds=1;"
            "site=site-0,round=0,step=5,rank=0,action=kill"
        )
        procs = launch(tmp_path, agent, 0, faults)
        codes = [p.wait(timeout=120) for p in procs]
        assert codes[0] == -9, (tmp_path / "rank0-restart0.log").read_text()[-2000:]
        procs = launch(tmp_path, agent, 1, faults)
        codes = [p.wait(timeout=120) for p in procs]
        logs = [(tmp_path / f"rank{r}-restart1.log").read_text()[-2000:] for r in range(2)]
        assert codes == [0, 0], logs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        agent.stop(leave=True)

    # Both ranks left u0 at the same step, well before its end (rank 1 stalled at step 2 while
    # the cancel came; the stall fired once, not again in u1 of the same round).
    for rank in range(2):
        assert records(tmp_path, rank, 0)[0] == [0, "u0", 0, 3, True]
    # u1 resumed from its step-4 checkpoint after rank 0 was killed at step 5, and finished.
    for rank in range(2):
        assert records(tmp_path, rank, 1) == [[0, "u1", 4, H, False]]
    # Only u1 was pushed, trained from theta_0, with the model's tensors.
    assert [(p["round"], p["data_unit"], p["base_version"]) for p in coordinator.pushes] == [
        (0, "u1", 0)
    ]
    assert (
        coordinator.pushes[0]["keys"] == sorted(theta(0)) and coordinator.pushes[0]["weight"] == H
    )
    # Checkpoints record the unit, and their names sort in the order they were written.
    done = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    extras = [json.loads((p / MANIFEST).read_text())["extra"] for p in done]
    assert [(e["round"], e["unit"], e["step"]) for e in extras] == [(0, 1, 4), (0, 1, H)]
    assert [e["seq"] for e in extras] == [int(p.name[5:]) for p in done]
    final = json.loads((tmp_path / "run" / "final.json").read_text())
    assert final["version"] == 1 and final["theta_hash"] == state_digest(theta(1)).hex()
