"""Faults of the coordinator: ``kill -9`` while round 1 is open, while it takes the outer step
of round 1, and while it writes the checkpoint of theta_2; then a restart on the same state
folder and port. The sites ride the outage out and re-join by themselves.

Two of them also damage a spooled update while the coordinator is down (bytes flipped on
disk): the restart must set it aside, ask its site for it again and end on the same model.

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
    caught = kill_after_publishing_before_restart(c)
    c.restart_coordinator()
    assert caught, "the checkpoint of theta_2 was complete before the kill: the window was missed"


def kill_after_publishing_before_restart(c: Cluster) -> bool:
    """Kill once theta_2 is served; whether its checkpoint was not yet on disk then."""

    def served_not_durable():
        reply = c.status()
        return (
            reply is not None
            and reply.round.version == ROUND + 1
            and not (c.checkpoint_path(ROUND) / "meta.json").exists()
        )

    c.wait_for(served_not_durable, 90, "theta_2 served before its checkpoint", interval=0.002)
    c.kill_coordinator()
    return not (c.checkpoint_path(ROUND) / "meta.json").exists()


def damage_spooled(c: Cluster, round_number: int) -> str:
    """Flip bytes in the first spooled update of ``round_number``; returns its name."""
    folder = c.state / "spool" / f"round-{round_number:08d}"
    path = sorted(folder.glob("*.update"))[0]
    data = bytearray(path.read_bytes())
    for i in range(0, len(data), max(len(data) // 7, 1)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return path.stem


def kill_and_damage_a_spooled_update(c: Cluster) -> None:
    """Killed once one round-1 update counted; its spool file is damaged before the restart:
    it must not count, and its site sends it again."""
    c.relays[1].set_rate(24_000, direction="up")

    def one_in():
        reply = c.status()
        return reply is not None and reply.round.round == ROUND and reply.updates_received == 1

    c.wait_for(one_in, 60, "one round-1 update to count")
    c.kill_coordinator()
    damaged = damage_spooled(c, ROUND)
    c.relays[1].set_rate(None)
    c.restart_coordinator()
    assert_set_aside(c, damaged)


def kill_after_publishing_and_damage(c: Cluster) -> None:
    """As ``kill_after_publishing``, and an update the close record names is damaged: the
    round opens again, waits for that update and closes with the same theta_2."""
    caught = kill_after_publishing_before_restart(c)
    damaged = damage_spooled(c, ROUND)
    c.restart_coordinator()
    assert_set_aside(c, damaged)
    assert caught, "the checkpoint of theta_2 was complete before the kill: the window was missed"


def assert_set_aside(c: Cluster, label: str) -> None:
    log = c.coordinator.log_tail(400)
    assert f"spooled update {label} " in log and "asked to send it again" in log, log
