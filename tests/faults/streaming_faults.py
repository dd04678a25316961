"""Faults of a streaming job (``[streaming]``, ``site_client.trainer.streaming_rounds``) while a
fragment is in
flight: a site has handed over round 1's fragment and trains on into round 2 before the
coordinator has closed round 1 (it merges fragment 1 of theta_2 before step tau of round 2).

* ``kill_trainer_ahead``: the site's trainer dies (``ISTHMUS_FAULTS``, see ``TRAINER_FAULT``)
  after its first step ahead, before the merge; the launcher restarts it and it resumes from
  the checkpoint of round 1's end, merge pending. Round 1's outer step is made to last seconds
  (``faults.slow_strategy``, which does not change the model) so that it is still open then.
* ``kill_agent_while_pushing_ahead``: the site's whole process is killed while round 1's
  fragment streams up on a slow uplink and its trainer waits ahead, at the merge; the restarted
  site resumes at round 1's end and sends the fragment again.
* ``kill_coordinator_ahead``: the coordinator is killed once site-0's round-1 fragment counted
  and site-0 trains ahead into round 2, while site-1's still streams up; it restarts on the
  same state, and site-0 merges theta_2 when it comes.

All of them train ``STREAMING``: two fragments, tau = 1, H = 8 (4 steps a coordinator round),
a site checkpoint every step. The agent kill found that a checkpoint written ahead, before the
merge, made the restarted site train round 1 again from theta_1 (another model): the trainers
now write none before a pending merge (``site_client.trainer.streaming_rounds``).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

from faults.cluster import Cluster
from faults.site_faults import SLOW_BPS, _pushed, _restart
from faults.spec import JobSpec

ROUND = 1  # the coordinator round whose fragment is in flight
# 4 coordinator rounds of 4 inner steps; the merge is before step 1 of each round after 0. A
# site checkpoint every step: one would fall before the merge (the trainers must skip it).
STREAMING = JobSpec(rounds=2, inner_steps=8, fragments=2, delay_steps=1, checkpoint_every=1)
# After tau steps of round 2, before its merge, site-0's first trainer kills itself.
TRAINER_FAULT = f"site=site-0,round={ROUND + 1},step={STREAMING.delay_steps},action=kill"
# Round 1's outer step sleeps this long: the trainer dies ahead of its close.
SLOW_CLOSE = replace(STREAMING, close_delay_s=4.0, delay_round=ROUND)
# Asynchronous rounds: a round closes once one site is in and 0.3 s have passed; the trainers
# merge when the result is there; a late update folds into a later round of its fragment.
ASYNC = replace(
    STREAMING,
    rounds=3,
    min_sites=1,
    grace_s=0.3,
    merge="when_ready",
    late_discount=0.5,
    max_staleness=2,
)


def kill_trainer_ahead(c: Cluster) -> None:
    """Wait for ``TRAINER_FAULT`` to kill site-0's trainer, check it died ahead of round 1's
    close, and that the launcher started a new one."""
    pid_file = c.sites[0].run_dir / "trainers" / "rank-0.pid"

    def trainer(attempt: int) -> int | None:
        try:
            pid, restart = (int(x) for x in pid_file.read_text().split())
        except (OSError, ValueError):
            return None
        return pid if restart == attempt else None

    first = c.wait_for(lambda: trainer(0), 60, "site-0's trainer to start")
    c.wait_for(lambda: not _alive(first), 90, "site-0's trainer to die at its fault", 0.005)
    c.mark_fault()
    closed = (c.checkpoint_path(ROUND) / "meta.json").exists()
    assert _handed_over(c.sites[0], ROUND), "died before handing round 1's fragment over"
    assert not c.sites[0].reached(ROUND + 1, 1), "died after a checkpoint of round 2"
    assert not closed, "round 1 had closed before the trainer died: no fragment in flight"
    c.wait_for(lambda: trainer(1), 60, "the launcher to restart site-0's trainer")


def _handed_over(site, round_number: int) -> bool:
    """Whether the site's trainers handed over ``round_number``'s update (their timings say
    so; its checkpoint may still be being written, in the background)."""
    path = site.run_dir / "trainer_timings.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    records = [json.loads(line) for line in lines if line.strip()]
    return any(r["kind"] == "handoff" and r.get("round") == round_number for r in records)


def kill_agent_while_pushing_ahead(c: Cluster) -> None:
    """kill -9 of site-0 while its round-1 fragment streams up and its trainer is ahead."""
    site, relay = c.sites[0], c.relays[0]
    c.wait_trained(site, ROUND, 2)
    relay.set_rate(SLOW_BPS, direction="up")
    c.wait_trained(site, ROUND, c.spec.round_steps)  # round 1 handed over
    sent = relay.counters().bytes_up
    c.wait_for(lambda: relay.counters().bytes_up > sent + 8_000, 30, "the push to stream")
    _wait_ahead(c, "site-0")
    reply = c.status()
    assert "site-0" not in _pushed(reply, ROUND), "the fragment counted before the kill"
    _restart(c, 0)


def kill_coordinator_ahead(c: Cluster) -> None:
    """kill -9 of the coordinator once site-0's round-1 fragment counted (it trains ahead)
    and site-1's streams up; restarted on the same state and port."""
    c.relays[1].set_rate(SLOW_BPS, direction="up")

    def site0_counted():
        reply = c.status()
        return (
            reply is not None and reply.round.round == ROUND and _pushed(reply, ROUND) == {"site-0"}
        )

    c.wait_for(site0_counted, 60, "site-0's round-1 fragment alone to count")
    _wait_ahead(c, "site-0")
    c.kill_coordinator()
    c.relays[1].set_rate(None)
    c.restart_coordinator()


def _wait_ahead(c: Cluster, site: str) -> None:
    """Until ``site`` reports training round 2 while the coordinator is still in round 1."""

    def ahead():
        reply = c.status()
        if reply is None or reply.round.round != ROUND:
            return False
        mine = [s for s in reply.sites if s.site == site]
        return bool(mine) and mine[0].progress.round == ROUND + 1

    c.wait_for(ahead, 30, f"{site} to train ahead into round {ROUND + 1}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie until the launcher reaps it: dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_site_async(c: Cluster) -> None:
    """Asynchronous rounds: kill -9 of site-0 once it trained into round 2 (the other site's
    rounds go on without it meanwhile), and start it again on the same run dir: it rejoins at
    the newest round, and whatever it had handed over counts once, on time or late."""
    c.wait_trained(c.sites[0], ROUND + 1, 1)
    _restart(c, 0)
