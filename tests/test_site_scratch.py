"""The agent's scratch folder: a starting agent removes what a killed agent of its site left in
shared memory, and never a live agent's folder, another site's, or anything behind a link."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from site_client.agent.scratch import (
    OWNER_FILE,
    Probe,
    claim,
    default_shm_dir,
    is_abandoned,
    pid_of,
    process_start,
    reclaim_abandoned,
)
from site_client.agent.site_agent import AgentConfig, SiteAgent

REPO = Path(__file__).resolve().parent.parent
SITE = "s1"
# A process that makes its scratch folder as an agent does, puts 1 MiB of "theta" in it, says
# where, and waits to be killed.
AGENT = """
import sys, time
from pathlib import Path
from site_client.agent.site_agent import AgentConfig, SiteAgent
from site_client.agent.scratch import default_shm_dir
base, site, run = sys.argv[1:4]
agent = SiteAgent(AgentConfig(site, Path(run), default_shm_dir(site, Path(base))), None)
(agent.cfg.shm_dir / "theta-v3.safetensors").write_bytes(b"\\1" * (1 << 20))
print(agent.cfg.shm_dir, flush=True)
time.sleep(600)
"""


def _agent_process(base: Path, run: Path) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(base), SITE, str(run)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline().strip()
    assert line, f"the agent process exited ({proc.wait()})"
    return proc, Path(line)


def _reaped() -> int:
    """The pid of a process that has exited and been waited for: no process has it now."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_new_agent_removes_what_a_killed_one_left_and_keeps_a_live_ones(tmp_path, caplog):
    base = tmp_path / "b"
    base.mkdir()
    killed, killed_dir = _agent_process(base, tmp_path / "r1")
    live, live_dir = _agent_process(base, tmp_path / "r2")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert (killed_dir / "theta-v3.safetensors").exists()  # nothing of it could clean up
        caplog.set_level(logging.WARNING, logger="isthmus.site")
        agent = SiteAgent(AgentConfig(SITE, tmp_path / "r3", default_shm_dir(SITE, base)), None)
        assert not killed_dir.exists()
        assert (live_dir / "theta-v3.safetensors").exists(), "a live agent's folder was removed"
        assert agent.cfg.shm_dir.is_dir()
        said = [r for r in caplog.records if str(killed_dir) in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text
        freed = int(re.search(r"\((\d+) bytes\) freed", said[0].getMessage()).group(1))
        assert freed >= 1 << 20, caplog.text
        assert str(live_dir) not in caplog.text
        agent.stop(leave=False)
        assert not agent.cfg.shm_dir.exists()
    finally:
        live.kill()
        live.wait(timeout=30)


def _folder(base: Path, site: str, pid: int, owner: bytes | None = None) -> Path:
    d = base / f"isthmus-{site}-{pid}"
    d.mkdir()
    (d / "theta-v1.safetensors").write_bytes(b"\0" * 5000)
    if owner is not None:
        (d / OWNER_FILE).write_bytes(owner)
    return d


def test_reclaim_removes_only_dead_or_reused_pids_of_this_site(tmp_path):
    me, dead = os.getpid(), _reaped()
    start = process_start(me)
    assert start is not None
    gone = _folder(tmp_path, SITE, dead)
    reused = _folder(tmp_path, "s2", me, f"{me} {start + 1}\n".encode())  # my pid, not me
    mine = _folder(tmp_path, "s2", _reaped())  # as if this agent's (kept: it is "keep")
    other_site = _folder(tmp_path, "s1-x", dead)
    assert [r.path for r in reclaim_abandoned(tmp_path, SITE)] == [gone]
    assert other_site.exists() and reused.exists() and mine.exists()
    got = reclaim_abandoned(tmp_path, "s2", keep=mine)
    assert [r.path for r in got] == [reused] and got[0].nbytes >= 5000
    assert mine.exists() and other_site.exists()


def test_reclaim_keeps_a_folder_whose_owner_lock_is_held_or_whose_start_matches(tmp_path):
    me, dead = os.getpid(), _reaped()
    # A live agent in another pid namespace: its pid means nothing here, its lock does.
    elsewhere = tmp_path / f"isthmus-{SITE}-{dead}"
    owner = claim(elsewhere)
    assert b" " in (elsewhere / OWNER_FILE).read_bytes()
    same = _folder(tmp_path, SITE, me, f"{me} {process_start(me)}\n".encode())
    try:
        assert reclaim_abandoned(tmp_path, SITE) == []
        assert elsewhere.exists() and same.exists()
    finally:
        owner.close()
    assert [r.path for r in reclaim_abandoned(tmp_path, SITE)] == [elsewhere]


def test_reclaim_never_follows_a_link(tmp_path):
    base, outside, dead = tmp_path / "b", tmp_path / "outside", _reaped()
    base.mkdir()
    outside.mkdir()
    precious = outside / "precious"
    precious.write_bytes(b"x" * 100)
    link = base / f"isthmus-{SITE}-{dead}"
    link.symlink_to(outside, target_is_directory=True)
    inner = _folder(base, SITE, _reaped())
    (inner / "escape").symlink_to(outside, target_is_directory=True)
    (inner / "file-escape").symlink_to(precious)
    got = reclaim_abandoned(base, SITE)
    assert [r.path for r in got] == [inner]
    assert link.is_symlink() and precious.read_bytes() == b"x" * 100


@pytest.mark.parametrize(
    ("probe", "abandoned"),
    [
        (Probe(alive=False, start=None, recorded=None, held=False), True),
        (Probe(alive=False, start=None, recorded=123, held=False), True),
        (Probe(alive=False, start=None, recorded=None, held=True), False),
        (Probe(alive=True, start=123, recorded=123, held=False), False),
        (Probe(alive=True, start=124, recorded=123, held=False), True),
        (Probe(alive=True, start=124, recorded=123, held=True), False),
        (Probe(alive=True, start=None, recorded=123, held=False), False),
        (Probe(alive=True, start=124, recorded=None, held=False), False),
    ],
)
def test_is_abandoned(probe, abandoned):
    assert is_abandoned(probe) is abandoned


def test_pid_of_reads_only_this_sites_names():
    assert pid_of("isthmus-a-12", "a") == 12
    assert pid_of("isthmus-a-b-12", "a-b") == 12
    for name in (
        "isthmus-a-b-12",
        "isthmus-a-12x",
        "isthmus-a-0",
        "isthmus-a-",
        "isthmus-a-\u0661",
    ):
        assert pid_of(name, "a") is None, name


def test_claim_records_the_owner_and_locks_it(tmp_path):
    folder = tmp_path / "isthmus-s-1"
    owner = claim(folder)
    try:
        pid, start = (folder / OWNER_FILE).read_text().split()
        assert int(pid) == os.getpid() and int(start) == process_start(os.getpid())
        fd = os.open(folder / OWNER_FILE, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.close(fd)
    finally:
        owner.close()
