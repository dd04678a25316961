"""Faults of the coordinator: ``kill -9`` while round 1 is open, while it takes the outer step
of round 1, and while it writes the checkpoint of theta_2; then a restart on the same state
folder and port. The sites ride the outage out and re-join by themselves.

The outer step and the checkpoint write last milliseconds for a small model; the job's
strategy (``faults.slow_strategy``) widens them without changing the model: it leaves a marker
file and sleeps before the step, and adds ballast to the checkpointed strategy state.
"""

from __future__ import annotations

from faults.cluster import Cluster

ROUND = 1


def kill_while_round_open(c: Cluster) -> None:
    """Killed while both sites train round 1 (nothing counted yet in it)."""
    c.wait_trained(c.sites[0], ROUND, 2)
    c.kill_coordinator()
    c.restart_coordinator()


def kill_with_one_update_spooled(c: Cluster) -> None:
    """Killed once site-0's round-1 update counted and site-1's is still due."""
    c.relays[1].set_rate(24_000, direction="up")  # site-1's push takes seconds

    def one_in():
        reply = c.status()
        return reply is not None and reply.round.round == ROUND and reply.updates_received == 1

    c.wait_for(one_in, 60, "one round-1 update to count")
    c.kill_coordinator()
    c.relays[1].set_rate(None)
    c.restart_coordinator()


def kill_while_aggregating(c: Cluster) -> None:
    """Killed inside the outer step of round 1 (every update in, no checkpoint yet)."""
    marker = c.markers / f"aggregating-r{ROUND}"
    c.wait_for(marker.exists, 90, "the outer step of round 1", interval=0.01)
    assert not c.checkpoint_path(ROUND).exists(), "round 1 was already checkpointed"
    c.kill_coordinator()
    c.restart_coordinator()


def kill_while_checkpointing(c: Cluster) -> None:
    """Killed while the checkpoint of theta_2 is being written (its temporary folder
    exists, the final one not yet): the restart must replay round 1 from the spool."""
    folder = c.checkpoint_path(ROUND).parent
    name = c.checkpoint_path(ROUND).name

    def writing():
        return any(folder.glob(f".tmp-{name}-*"))

    c.wait_for(writing, 90, "the checkpoint of round 1 to be written", interval=0.002)
    c.kill_coordinator()
    caught = not c.checkpoint_path(ROUND).exists()
    c.restart_coordinator()
    assert caught, "the checkpoint was complete before the kill: the window was missed"


def kill_after_publishing(c: Cluster) -> None:
    """Killed once theta_2 is served (a site fetched it) but before its checkpoint is on disk:
    the restart recomputes the same theta_2 from the checkpoint of theta_1, round 1's close
    record and its spool, and the sites that already train on it go on."""

    def served_not_durable():
        reply = c.status()
        return (
            reply is not None
            and reply.round.version == ROUND + 1
            and not (c.checkpoint_path(ROUND) / "meta.json").exists()
        )

    c.wait_for(served_not_durable, 90, "theta_2 served before its checkpoint", interval=0.002)
    c.kill_coordinator()
    caught = not (c.checkpoint_path(ROUND) / "meta.json").exists()
    c.restart_coordinator()
    assert caught, "the checkpoint of theta_2 was complete before the kill: the window was missed"
